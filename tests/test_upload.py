"""Index uploads (``trl_tree.engine._device``): one copy per call, through pinned buffers reused only once
the copy that last read them has finished."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trl_tree.engine._device import STAGING_MIN_BYTES, StagingPool, upload

CPU = torch.device("cpu")


class FakeEvent:
    """Stands in for a CUDA event: pending until the test finishes it (or someone waits on it)."""

    def __init__(self, log: list) -> None:
        self.finished, self.log = False, log

    def record(self) -> None:
        self.log.append(("record", self))

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.log.append(("wait", self))
        self.finished = True


def fake_pool(capacity: int = 3):
    log: list = []
    allocated: list[int] = []

    def allocate(nbytes: int) -> torch.Tensor:
        allocated.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)

    return StagingPool(allocate, lambda: FakeEvent(log), capacity), log, allocated


ARRAYS = [np.arange(7).reshape(7), np.array([[3, -1], [5, 9]]), np.zeros(0, dtype=np.int64), np.array([2**40])]


@pytest.mark.parametrize("through_pool", [False, True], ids=["direct", "staged"])
def test_upload_equals_one_tensor_per_array(through_pool):
    pool = fake_pool()[0] if through_pool else None
    for dtype in (torch.int64, torch.int32):
        arrays = ARRAYS if dtype == torch.int64 else ARRAYS[:3]
        got = upload(arrays, dtype, CPU, pool=pool)
        assert len(got) == len(arrays)
        for g, a in zip(got, arrays):
            assert g.dtype == dtype and g.shape == a.shape
            torch.testing.assert_close(g, torch.as_tensor(a, dtype=dtype), rtol=0, atol=0)
    assert upload([], torch.int64, CPU, pool=pool) == []


def test_upload_refuses_other_dtypes():
    with pytest.raises(ValueError, match="int64 or int32"):
        upload([np.zeros(3)], torch.float32, CPU)


def test_staged_uploads_never_alias_the_staging_buffer():
    pool, _, _ = fake_pool(capacity=1)
    first = upload([np.arange(5)], torch.int64, CPU, pool=pool)[0]
    pool.slots[0].done.finished = True  # the buffer may be written again
    upload([np.arange(100, 105)], torch.int64, CPU, pool=pool)
    torch.testing.assert_close(first, torch.arange(5), rtol=0, atol=0)


def test_a_buffer_in_flight_is_never_handed_out():
    pool, log, allocated = fake_pool(capacity=2)
    a = pool.acquire(100)
    pool.release(a)
    b = pool.acquire(100)  # a's copy is pending: a second buffer
    assert b is not a and len(allocated) == 2
    pool.release(b)
    a.done.finished = True
    assert pool.acquire(100) is a  # finished: reused, nothing allocated
    assert len(allocated) == 2
    pool.release(a)
    c = pool.acquire(100)  # both in flight, the pool full: wait for the oldest, reuse it
    assert ("wait", b.done) in log or ("wait", a.done) in log
    assert c in (a, b) and c.done.finished
    assert len(allocated) == 2


def test_buffers_grow_to_powers_of_two():
    pool, _, allocated = fake_pool(capacity=1)
    slot = pool.acquire(10)
    assert slot.host.numel() == STAGING_MIN_BYTES
    pool.release(slot)
    slot.done.finished = True
    big = pool.acquire(3 * STAGING_MIN_BYTES)
    assert big is slot and big.host.numel() == 4 * STAGING_MIN_BYTES
    assert allocated == [STAGING_MIN_BYTES, 4 * STAGING_MIN_BYTES]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs a CUDA device")
def test_cuda_uploads_through_the_device_pool():
    device = torch.device("cuda")
    outs = [upload([np.arange(i, i + 1000), np.array([i])], torch.int64, device) for i in range(40)]
    torch.cuda.synchronize()
    for i, (x, y) in enumerate(outs):
        assert x.is_cuda and int(x[0]) == i and int(x[-1]) == i + 999 and int(y[0]) == i
