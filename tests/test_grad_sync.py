"""The trainers' by-hand gradient averaging (``distributed/grad_sync.py``): bounded buckets, one dtype
per bucket, results equal to the one-flat-buffer average. Ranks are stood in for by an all-reduce
that adds the other ranks' gradients; the real collective runs in ``test_distributed.py``."""

from __future__ import annotations

import pytest
import torch

from trl_tree.distributed.grad_sync import average_gradients, gradient_buckets


def _params(shapes_dtypes, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape, dtype in shapes_dtypes:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = torch.randn(shape, generator=g).to(dtype)
        params.append(p)
    return params


class FakeAllReduce:
    """Sums the tensor with the same-position tensors of other ranks, taken in call order."""

    def __init__(self, others: list[list[torch.Tensor]]):
        self.others, self.calls = others, []

    def __call__(self, t: torch.Tensor) -> None:
        k = len(self.calls)
        self.calls.append((t.numel() * t.element_size(), t.dtype))
        for other in self.others:
            t.add_(other[k])


SHAPES = [((64, 32), torch.float32), ((32,), torch.float32), ((128, 64), torch.bfloat16), ((16,), torch.float32),
          ((256, 64), torch.float32), ((8, 8), torch.bfloat16)]


def test_buckets_bounded_one_dtype_each_and_in_order():
    grads = [p.grad for p in _params(SHAPES)]
    buckets = gradient_buckets(grads, bucket_bytes=16 * 1024)
    assert sorted(id(g) for b in buckets for g in b) == sorted(id(g) for g in grads)
    for b in buckets:
        assert len({(g.dtype, g.device) for g in b}) == 1
        if len(b) > 1:
            assert sum(g.numel() * g.element_size() for g in b) <= 16 * 1024
    big = [b for b in buckets if any(g.numel() == 256 * 64 for g in b)]
    assert big == [[grads[4]]]  # 64 KiB: over the bound, on its own
    for b in buckets:  # within a bucket, the gradients keep their order
        idx = [next(i for i, g in enumerate(grads) if g is x) for x in b]
        assert idx == sorted(idx)


def test_average_equals_flat_average_for_any_bucket_size():
    ranks = [_params(SHAPES, seed=s) for s in range(3)]
    expected = [sum(r[i].grad.float() for r in ranks) / 3 for i in range(len(SHAPES))]
    for bucket_bytes in (1, 100, 16 * 1024, 1 << 30):
        params = _params(SHAPES, seed=0)
        others = [gradient_buckets([p.grad.clone() for p in _params(SHAPES, seed=s)], bucket_bytes) for s in (1, 2)]
        flat_others = [[_flat(b) for b in bs] for bs in others]
        reduce = FakeAllReduce(flat_others)
        average_gradients(params, 3, all_reduce=reduce, bucket_bytes=bucket_bytes)
        for p, e in zip(params, expected):
            tol = 1e-6 if p.dtype == torch.float32 else 2e-2
            torch.testing.assert_close(p.grad.float(), e, rtol=tol, atol=tol)
            assert p.grad.dtype == p.dtype
        assert max(size for size, _ in reduce.calls) <= max(bucket_bytes, 256 * 64 * 4)


def _flat(bucket):
    return torch.cat([g.reshape(-1) for g in bucket]) if len(bucket) > 1 else bucket[0]


def test_one_bucket_is_one_collective_and_large_gradients_are_reduced_in_place():
    params = _params([((1024, 64), torch.float32), ((4,), torch.float32), ((4,), torch.float32)])
    before = params[0].grad
    ptr = before.data_ptr()
    reduce = FakeAllReduce([])
    average_gradients(params, 2, all_reduce=reduce, bucket_bytes=1024)
    assert len(reduce.calls) == 2  # the 256 KiB gradient alone, the two small ones together
    assert params[0].grad.data_ptr() == ptr


def test_parameters_without_gradients_are_skipped_and_bad_arguments_refused():
    params = _params([((4,), torch.float32)])
    params.append(torch.nn.Parameter(torch.zeros(3)))  # no .grad
    reduce = FakeAllReduce([])
    average_gradients(params, 1, all_reduce=reduce)
    assert len(reduce.calls) == 1
    with pytest.raises(ValueError, match="num_processes"):
        average_gradients(params, 0, all_reduce=reduce)
    with pytest.raises(ValueError, match="bucket_bytes"):
        gradient_buckets([params[0].grad], bucket_bytes=0)


def test_a_large_non_contiguous_gradient_goes_through_a_copy_and_is_averaged():
    p = torch.nn.Parameter(torch.zeros(64, 32))
    p.grad = torch.randn(32, 64).t()  # not contiguous
    expected = p.grad.clone() * 3 / 2
    reduce = FakeAllReduce([[p.grad.clone().reshape(-1) * 2]])
    average_gradients([p], 2, all_reduce=reduce, bucket_bytes=1024)
    assert len(reduce.calls) == 1
    torch.testing.assert_close(p.grad, expected)


# ---------------------------------------------------------------------- overlapped, on two processes
def test_overlapped_average_equals_the_average_wherever_it_is_armed():
    """Two gloo processes (``grad_overlap_check.py``), three backward passes per step: armed before
    the last (the overlap: bit for bit ``average_gradients``'s), before the first (every bucket
    leaves early; what later passes add is reduced apart and added: equal up to rounding), never
    (``finish`` alone), and a parameter only one rank trains (the others count as zeros; one no
    rank trains keeps None); the ranks agree."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "grad_overlap_check.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_overlapped_averager_does_not_keep_the_model_alive():
    """Its hooks live on the parameters, where the garbage collector does not look: they must not
    hold the averager, or a finished trainer's averager and every parameter it lists stay in
    memory (seen as one model's worth more at each mode of a multi-GPU bench)."""
    import gc
    import weakref

    from trl_tree.distributed.grad_sync import GradientAverager

    model = torch.nn.Linear(4, 4)
    averager = GradientAverager(model.parameters(), 2, all_reduce=lambda t, async_op=False: None)
    alive = [weakref.ref(x) for x in (model, model.weight, averager)]
    model(torch.randn(2, 4)).sum().backward()
    del model, averager
    gc.collect()
    assert [ref() is None for ref in alive] == [True, True, True]
