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

import weakref
from collections.abc import Callable, Iterable, Sequence

import torch

from ..engine._profiling import profiled

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


class GradientAverager:
    """Averages the gradients of ``params`` over processes, overlapped with the backward that makes
    them final, as DDP's reducer does for its own forward.

    ``arm()`` just before the last backward of an optimizer step (``backward_hooks``): each bucket
    of gradients moves into one flat buffer that the parameters' ``.grad`` then view into (one
    bucket's copy at a time, the old tensors freed; a parameter without a gradient yet gets a zeroed
    view), so the last backward accumulates into the buffers in place. Each parameter's
    post-accumulate hook marks it ready; a bucket whose parameters are all ready is all-reduced
    asynchronously, in bucket order, while the backward goes on, and its parameters let go of the
    buffer (``.grad`` None). ``flush()`` launches the buckets not launched yet; ``finish()`` (the
    step's synchronisation point) flushes, waits for all, and divides by the number of processes —
    the sums ``average_gradients`` takes, so the update is the same. Where an armed call was not
    the last to touch a gradient, what it accumulated after its bucket left is a tensor of its own:
    ``finish`` reduces those too (for a
    bucket where any rank has one; the ranks agree on which through one small all-reduce of flags)
    and adds them, so the result never depends on where the arming landed, only the overlap does.

    Buckets follow the parameters in reverse order (the backward's: last layers first), each of one
    device and dtype, ``bucket_bytes`` at most (DDP's default size). A parameter without a gradient
    on this rank enters the sums as zeros; one that no rank has a gradient for keeps ``None``, as
    the optimizer then skips it. The buffers are not kept between steps: the optimizer's
    ``zero_grad`` frees them with the gradients.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], num_processes: int,
                 bucket_bytes: int = 25 * 2**20, all_reduce: Callable | None = None,
                 launch_in_backward: bool = True):
        if num_processes < 1:
            raise ValueError(f"num_processes must be at least 1, got {num_processes}")
        self.params = [p for p in params if p.requires_grad]
        self.num_processes = num_processes
        #: False: the armed backward only accumulates into the buckets, and ``flush`` launches every
        #: all-reduce after it — none beside the backward's kernels, all of them during whatever
        #: follows it before ``finish`` (a one-pass window's later micro-steps)
        self.launch_in_backward = launch_in_backward
        self._all_reduce = all_reduce
        index = {id(p): i for i, p in enumerate(self.params)}
        self.buckets = [[index[id(p)] for p in bucket]
                        for bucket in gradient_buckets(list(reversed(self.params)), bucket_bytes)]
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self.armed = False
        #: of the last step: buckets launched during the backward (overlapped), topped up after, in all
        self.last_step = {"overlapped": 0, "again": 0, "buckets": len(self.buckets)}
        self._flat: list[torch.Tensor] = []
        self._waiting: list[set[int]] = []
        self._full: set[int] = set()  # buckets whose gradients are all final, not launched yet
        self._next = 0  # buckets launch in index order: the next one to go
        self._launched: dict[int, object] = {}
        self._present: set[int] = set()
        self._late: set[int] = set()
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]

    def _reduce(self, tensor: torch.Tensor, async_op: bool):
        reduce = self._all_reduce if self._all_reduce is not None else torch.distributed.all_reduce
        return reduce(tensor, async_op=async_op)

    def _hook(self, i: int):
        # a weak reference: a parameter's hooks are not seen by the garbage collector, so a strong
        # one would keep this averager, and through it every parameter, alive after the trainer
        averager = weakref.ref(self)

        def ready(param: torch.nn.Parameter) -> None:
            owner = averager()
            if owner is None or not owner.armed:
                return  # not the step's last backward
            owner._present.add(i)
            b = owner.bucket_of[i]
            if b in owner._launched:  # accumulated after its bucket left: a tensor of its own (finish adds it)
                owner._late.add(b)
                return
            if not owner.launch_in_backward:
                return  # flush() launches every bucket
            waiting = owner._waiting[b]
            waiting.discard(i)  # a set: a gradient accumulated twice counts once
            if not waiting:
                owner._full.add(b)
                owner._launch_in_order()
        ready.skippable_in_replay = True  # a replayed backward skips it: finish() then launches the bucket
        return ready

    def _parts(self, b: int) -> list[torch.Tensor]:
        params = [self.params[i] for i in self.buckets[b]]
        return [part.view_as(p) for p, part in zip(params, self._flat[b].split([p.numel() for p in params]))]

    @profiled("trl_tree.grad_sync.arm")
    def arm(self) -> None:
        """From now on, a parameter whose gradient is accumulated is final: reduce its bucket once full."""
        if self.armed:
            return
        self.armed = True
        self._waiting = [set(bucket) for bucket in self.buckets]
        self._launched, self._present, self._late, self._flat = {}, set(), set(), []
        self._full, self._next = set(), 0
        for b, bucket in enumerate(self.buckets):
            first = self.params[bucket[0]]
            empty = all(self.params[i].grad is None for i in bucket)  # the usual case: zero_grad set them None
            self._flat.append((torch.zeros if empty else torch.empty)(
                sum(self.params[i].numel() for i in bucket), dtype=first.dtype, device=first.device))
            for i, part in zip(bucket, self._parts(b)):
                p = self.params[i]
                if p.grad is None:
                    if not empty:
                        part.zero_()
                elif p.grad.dtype != part.dtype:
                    raise ValueError(f"GradientAverager: a {p.grad.dtype} gradient of a {p.dtype} parameter; the "
                                     "buckets hold the parameters' dtype")
                else:
                    self._present.add(i)
                    part.copy_(p.grad)
                p.grad = part  # the last backward accumulates here, in place

    def _launch_in_order(self) -> None:
        """Launch the full buckets that are next in index order. Every rank then issues its
        all-reduces in the same order whatever order its gradients became final in (a tied weight's
        bucket is final early; a rank that owns no tree launches all of them in ``flush``), as
        collectives on one process group must be; DDP's reducer keeps the same rule."""
        while self._next in self._full:
            self._full.discard(self._next)
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        for i, part in zip(self.buckets[b], self._parts(b)):
            p = self.params[i]
            if p.grad is not None and p.grad.data_ptr() != part.data_ptr():  # set anew since arm()
                part.copy_(p.grad)
            p.grad = None  # the buffer is the collective's now; a later accumulation is a tensor of its own
        self._launched[b] = self._reduce(self._flat[b], async_op=True)

    @profiled("trl_tree.grad_sync.flush")
    def flush(self) -> None:
        """Launch every bucket not launched yet, in order, without waiting: called right after the
        step's last backward on every rank (on a rank that ran none too), so that all ranks issue
        this averager's all-reduces at the same point, before another averager's (a PPO critic's)
        and before ``finish``'s small flag all-reduce. What is accumulated later is reduced apart."""
        if not self.params:
            return
        self.arm()
        for b in range(self._next, len(self.buckets)):
            self._launch(b)
        self._next, self._full = len(self.buckets), set()

    @profiled("trl_tree.grad_sync.wait")
    def finish(self) -> None:
        """Launch what is left, wait, and leave every gradient averaged (a view into its bucket)."""
        if not self.params:
            return
        self.arm()  # an unarmed step: every bucket now, as average_gradients would
        overlapped = len(self._launched)
        self.flush()  # the rest, in order
        # which parameters any rank has a gradient for, and which buckets any rank accumulated into late
        flags = torch.zeros(len(self.params) + len(self.buckets), dtype=torch.int32, device=self._flat[0].device)
        flags[sorted(self._present)] = 1
        flags[[len(self.params) + b for b in sorted(self._late)]] = 1
        self._reduce(flags, async_op=False)
        flags = flags.tolist()
        present, late = flags[: len(self.params)], flags[len(self.params):]
        for b in range(len(self.buckets)):
            work = self._launched[b]
            if work is not None:
                work.wait()
            if late[b]:  # what was accumulated after the bucket left, summed over the ranks and added
                extra = torch.cat([(self.params[i].grad if self.params[i].grad is not None
                                    else torch.zeros_like(self.params[i])).reshape(-1) for i in self.buckets[b]])
                self._reduce(extra, async_op=False)
                self._flat[b].add_(extra)
        torch._foreach_div_(self._flat, self.num_processes)  # one launch for every bucket
        for b in range(len(self.buckets)):
            for i, part in zip(self.buckets[b], self._parts(b)):
                self.params[i].grad = part if present[i] else None  # none anywhere: the optimizer skips it
        self.last_step = {"overlapped": overlapped, "again": sum(1 for x in late if x), "buckets": len(self.buckets)}
        self.armed = False
        self._launched, self._flat = {}, []

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
