"""Moving many small index arrays to the device in one copy, without stalling the GPU.

``torch.from_numpy(x).to("cuda")`` from ordinary (pageable) memory makes PyTorch wait for the
stream to drain after the copy: the CPU stops queueing kernels until the GPU has finished all
earlier work. A depth-first walk needs about ten index arrays per unit; uploaded one by one
between units, each upload would drain the queue and leave the GPU idle while Python launches
the next unit. Here all of them travel in one pinned, non-blocking copy made before the first
kernel, and each array is a view of that buffer.

The pinned host memory is a pool of staging buffers kept across calls (``StagingPool``), not a
``pin_memory()`` per upload: ``pin_memory()`` of a few hundred KiB (``is_pinned``'s pointer query,
or a fresh page-locked block) cost a large part of a replayed small model's host time before its
first kernel (docs/benchmarks/notes.md §18). A buffer is written
again only once the copy that last read it has finished (its CUDA event), so an upload never
waits for the GPU unless every buffer in the pool is still in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import torch

_NUMPY_OF = {torch.int64: np.int64, torch.int32: np.int32}

#: staging buffers per device at most; past that, an upload waits for the oldest copy to finish
STAGING_BUFFERS = 16
#: smallest staging buffer (bytes): the walk's per-unit uploads all fit one
STAGING_MIN_BYTES = 1 << 16


class _Slot:
    """One pinned host buffer and the event recorded after the copy that last read it."""

    __slots__ = ("host", "done")

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.done = None


class StagingPool:
    """Pinned host buffers reused round-robin by the uploads to one device.

    ``allocate(nbytes)`` makes a host byte buffer (pinned, on a GPU machine); ``new_event()`` an
    object with ``record()``, ``query()`` and ``synchronize()`` (a ``torch.cuda.Event``). The tests
    pass stand-ins for both to check that a buffer still being read is never written.
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor], new_event: Callable[[], object],
                 capacity: int = STAGING_BUFFERS) -> None:
        self.allocate, self.new_event, self.capacity = allocate, new_event, capacity
        self.slots: deque[_Slot] = deque()

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        """A power of two in size: a pool that grows, grows a few times only."""
        return self.allocate(max(STAGING_MIN_BYTES, 1 << max(0, nbytes - 1).bit_length()))

    def _sized(self, slot: _Slot, nbytes: int) -> _Slot:
        if slot.host.numel() < nbytes:
            slot.host = self._new_buffer(nbytes)
        return slot

    def acquire(self, nbytes: int) -> _Slot:
        """A buffer of at least ``nbytes`` that no pending copy reads."""
        for _ in range(len(self.slots)):
            slot = self.slots[0]
            self.slots.rotate(-1)
            if slot.done is None or slot.done.query():
                return self._sized(slot, nbytes)
        if len(self.slots) < self.capacity:
            slot = _Slot(self._new_buffer(nbytes))
            self.slots.append(slot)
            return slot
        slot = self.slots[0]  # every buffer in flight: wait for the oldest copy
        self.slots.rotate(-1)
        slot.done.synchronize()
        return self._sized(slot, nbytes)

    def release(self, slot: _Slot) -> None:
        """Mark ``slot`` as read by the copy just queued (the event completes with that copy)."""
        slot.done = self.new_event()
        slot.done.record()


class _StreamEvent:
    """A CUDA event recorded on the device's current stream (where ``upload`` queues its copy)."""

    __slots__ = ("event", "device")

    def __init__(self, device: torch.device) -> None:
        self.event, self.device = torch.cuda.Event(), device

    def record(self) -> None:
        self.event.record(torch.cuda.current_stream(self.device))

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


_POOLS: dict[torch.device, StagingPool] = {}


def _cuda_pool(device: torch.device) -> StagingPool:
    pool = _POOLS.get(device)
    if pool is None:
        pool = _POOLS[device] = StagingPool(
            lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), lambda: _StreamEvent(device))
    return pool


def upload(arrays: Sequence[np.ndarray], dtype: torch.dtype, device: torch.device,
           pool: StagingPool | None = None) -> list[torch.Tensor]:
    """``[torch.as_tensor(a, dtype=dtype, device=device) for a in arrays]`` as one copy.

    Returns views of one device buffer, shaped like the inputs; ``dtype`` is an integer dtype.
    ``pool``: the staging buffers to copy through (default: the device's own, on CUDA; none on
    the CPU, where the arrays are copied directly).
    """
    if dtype not in _NUMPY_OF:
        raise ValueError(f"upload takes int64 or int32 arrays, got {dtype}")
    if not arrays:
        return []
    parts = [np.asarray(a, dtype=_NUMPY_OF[dtype]).reshape(-1) for a in arrays]
    sizes = [p.size for p in parts]
    if pool is None and device.type == "cuda":
        pool = _cuda_pool(device)
    if pool is None:
        buffer = torch.from_numpy(np.concatenate(parts)).to(device)
    else:
        nbytes = sum(sizes) * dtype.itemsize
        slot = pool.acquire(nbytes)
        host = slot.host[:nbytes].view(dtype)
        np.concatenate(parts, out=host.numpy())
        # pinned + non_blocking: the copy is queued on the stream, the CPU goes on launching
        buffer = host.to(device, non_blocking=True, copy=True)  # copy: never a view of the staging buffer
        pool.release(slot)
    return [part.view(np.asarray(a).shape) for part, a in zip(buffer.split(sizes), arrays)]
