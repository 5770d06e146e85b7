"""Averaging the trainable gradients over processes by hand, in buckets of bounded size.

Why by hand: the tree engine's backward does not run through DDP's forward (the two-pass backward
of the trainers; replayed CUDA graphs, whose backward cannot run DDP's hooks), so DDP's reducer
never sees those gradients and the trainer averages them itself at each synchronising step.

Why buckets: averaging through one flat copy of every gradient costs a second copy of all of them
at once (2 bytes per parameter in bf16) on top of the step's own peak. Buckets of
``BUCKET_BYTES`` (DDP reduces in buckets too, 25 MiB by default) bound that to one bucket, and a
contiguous gradient at least that large is reduced where it lies, with no copy. Each bucket holds
one device and dtype: a flat concatenation of mixed dtypes (fp32 adapters next to bf16 weights)
would be promoted and each gradient rounded on the way back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

#: most bytes one bucket of concatenated gradients holds
BUCKET_BYTES = 64 * 2**20


def gradient_buckets(grads: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """``grads`` cut into buckets, in order within each (device, dtype): a bucket takes gradients
    until the next would pass ``bucket_bytes``; a gradient that large on its own is the only one of
    its bucket (``average_gradients`` reduces it in place if it is contiguous, else through a copy)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    open_buckets: dict[tuple, tuple[list[torch.Tensor], int]] = {}
    buckets: list[list[torch.Tensor]] = []
    for g in grads:
        size = g.numel() * g.element_size()
        if size >= bucket_bytes:
            buckets.append([g])
            continue
        key = (g.device, g.dtype)
        bucket, used = open_buckets.get(key, (None, 0))
        if bucket is None or used + size > bucket_bytes:
            bucket, used = [], 0
            buckets.append(bucket)
        bucket.append(g)
        open_buckets[key] = (bucket, used + size)
    return buckets


def average_gradients(params: Iterable[torch.nn.Parameter], num_processes: int,
                      all_reduce: Callable[[torch.Tensor], object] | None = None,
                      bucket_bytes: int = BUCKET_BYTES) -> None:
    """Replace each parameter's ``.grad`` by its mean over ``num_processes`` (summed by
    ``all_reduce``, ``torch.distributed.all_reduce`` by default, then divided — what the trainers
    did with one flat buffer, bucket by bucket). Every rank must pass the same parameters with
    gradients, in the same order: the buckets are the collective calls."""
    if num_processes < 1:
        raise ValueError(f"num_processes must be at least 1, got {num_processes}")
    reduce = all_reduce if all_reduce is not None else torch.distributed.all_reduce
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in gradient_buckets(grads, bucket_bytes):
        if len(bucket) == 1 and bucket[0].is_contiguous():
            reduce(bucket[0])
            bucket[0].div_(num_processes)
            continue
        flat = torch.cat([g.reshape(-1) for g in bucket])
        reduce(flat)
        flat.div_(num_processes)
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))
