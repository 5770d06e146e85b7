"""FlashAttention-4's kernels compiled ahead, off the training step: a variant that is not built yet
runs on PyTorch's FA2 kernels meanwhile.

Why: FA4 compiles a kernel (CuTe DSL, seconds each) the first time a call needs a variant — per
causal flag, window, GQA packing and the tile/split choices its heuristics make from the call's
shapes — so a step whose micro-batch first meets a layout waits for the compiler, wherever in the
epoch that is (on a fresh machine the first step waits for several kernels, and a step deep in an
epoch for a variant its data meets first there; docs/limitations.md). Which variants a run meets depends on its data; FA4's heuristics read
the device and the shapes, so a list derived from the configuration would miss some and go stale
with FA4's releases. So the variants are not guessed: every FA4 call first runs with FA4's compile
caches *guarded* — a lookup that misses in memory and in FA4's disk cache raises instead of
compiling (:class:`NotCompiled`) before any kernel of the call is launched. On a miss the call runs
on the fallback pair (PyTorch's FA2 varlen kernels, ``partial.PARTIAL_KERNELS["torch_flash"]``:
the same contract, built into PyTorch, exact attention like FA4's), and a worker process compiles
that very call — the same shapes, strides, dtypes and sequence boundaries, so FA4 derives the same
compile key — into FA4's disk cache. A later call finds it there (a load, milliseconds) and runs FA4.

Workers are long-lived processes (``python -m trl_tree.engine.attention.fa4_ahead``, one call's
description per line on stdin), not threads: the DSL's compile is Python that would hold the
training loop's GIL, and a process started this way never re-runs the user's training script.
One call per signature (:func:`signature`: not the token counts) is in flight at a time: calls of
every length share FA4's varlen kernels. A variant a worker could not make findable (its key
differed, the worker failed) is compiled in the step, as without this module, after
:data:`MAX_TRIES` tries. Off with ``TRL_TREE_FA4_COMPILE_AHEAD=0`` (and where
FA4's disk cache is off, which the workers need to hand kernels over); never for CUDA graphs'
warm-ups and capture (:func:`compiling_in_place`), which must run the kernels they record.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)

#: FA4's own disk cache keeps compiled kernels across runs, and hands the workers' kernels over to
#: the training process; it is off unless this variable is set, and the tree sets it (``setdefault``:
#: a user's ``0`` keeps it off) before FA4 is imported.
PERSISTENT_CACHE_VARIABLE = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
#: set to 0 to compile every FA4 variant in the step that first needs it
ENABLE_VARIABLE = "TRL_TREE_FA4_COMPILE_AHEAD"
#: how many worker compiles one signature (:func:`signature`) gets before its variants are compiled in the step
MAX_TRIES = 8


def _window(window: int | None) -> dict:
    """A causal sliding window in FA4's arguments: the query's row and ``window - 1`` rows back."""
    return {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}


def fwd_call(interface, q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
             window: int | None = None):
    """FA4's varlen forward as the tree calls it (``fa4.fa4_partial_forward`` and the workers here)."""
    return interface._flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                     max_seqlen_k=max_k, softmax_scale=scale, causal=causal, return_lse=True,
                                     **_window(window))


def bwd_call(interface, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool,
             scale: float, window: int | None = None):
    """FA4's varlen backward as the tree calls it (``grad_out`` and ``lse`` contiguous)."""
    return interface._flash_attn_bwd(q, k, v, out, grad_out, lse, scale, causal, 0.0, cu_seqlens_q=cu_q,
                                     cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, **_window(window))


class NotCompiled(Exception):
    """An FA4 call needs a kernel that is neither in memory nor in FA4's disk cache."""


class _Guard(threading.local):
    active = False
    inline = False


_guard = _Guard()


class GuardedCache:
    """FA4's compile cache (``JITCache`` / ``JITPersistentCache``) with a lookup that raises
    :class:`NotCompiled` on a miss while :func:`guarded` is active; everything else is the cache's."""

    def __init__(self, inner):
        self.inner = inner

    @property
    def cache(self) -> dict:  # the in-memory dict ``fa4._jit_caches`` counts
        return self.inner.cache

    def __contains__(self, key) -> bool:
        if key in self.inner:  # memory, then FA4's disk cache (loaded into memory when found there)
            return True
        if _guard.active:
            raise NotCompiled
        return False

    def __getitem__(self, key):
        return self.inner[key]

    def __setitem__(self, key, fn) -> None:
        self.inner[key] = fn

    def __getattr__(self, name):
        return getattr(self.inner, name)


def guard_caches(interface) -> int:
    """Wrap every compile cache of FA4's interface module in :class:`GuardedCache` (once); returns
    how many are guarded."""
    guarded = 0
    for value in list(vars(interface).values()):
        cache = getattr(value, "compile_cache", None)
        if cache is None:
            continue
        if not isinstance(cache, GuardedCache):
            value.compile_cache = GuardedCache(cache)
        guarded += 1
    return guarded


@contextmanager
def guarded():
    """FA4 calls in this block raise :class:`NotCompiled` instead of compiling."""
    previous, _guard.active = _guard.active, True
    try:
        yield
    finally:
        _guard.active = previous


@contextmanager
def compiling_in_place():
    """FA4 calls in this block compile what they need in the call, as without this module: CUDA
    graphs' warm-ups and capture (``engine/graphs.py``), where the warm-up must run — and so load —
    the very kernels the capture records, and a capture cannot wait on a variant compiling elsewhere."""
    previous, _guard.inline = _guard.inline, True
    try:
        yield
    finally:
        _guard.inline = previous


def enabled() -> bool:
    """On unless ``TRL_TREE_FA4_COMPILE_AHEAD=0`` or FA4's disk cache (the hand-over) is off."""
    return os.environ.get(ENABLE_VARIABLE, "1") != "0" and os.environ.get(PERSISTENT_CACHE_VARIABLE) == "1"


#: counters since the last :func:`take_stats`: calls that ran the fallback, variants handed to workers,
#: worker compiles finished (and their seconds, in the workers)
_stats = {"fallback_calls": 0, "submitted": 0, "compiled": 0, "worker_seconds": 0.0}
_tries: dict[tuple, int] = {}
_pending: dict[tuple, Future] = {}
_inline: set[tuple] = set()
_queue: queue.Queue | None = None
_lock = threading.Lock()
_start_lock = threading.Lock()
#: marks a worker's replies among whatever else the compiler prints on its standard output
REPLY = "@@trl_tree.fa4_ahead"


def take_stats() -> dict:
    """What happened since the last call: ``fallback_calls``, ``submitted``, ``compiled``,
    ``worker_seconds`` (the workers' own time, not the step's), and ``pending`` variants."""
    with _lock:
        taken = dict(_stats)
        for key in ("fallback_calls", "submitted", "compiled"):
            _stats[key] = 0
        _stats["worker_seconds"] = 0.0
        taken["pending"] = sum(not f.done() for f in _pending.values())
    return taken


def _workers() -> int:
    """Parallel compiles: FA4's compile is one core's work; leave most cores to the training
    processes of this host."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(4, (os.cpu_count() or 2) // (2 * local)))


def describe(kind: str, tensors: dict[str, torch.Tensor], cu_q: torch.Tensor, cu_k: torch.Tensor,
             options: dict) -> dict:
    """What a worker needs to repeat an FA4 call: each tensor's shape, strides and dtype, the
    sequence boundaries (read from the device: a synchronisation, once per variant handed over),
    and the call's other arguments."""
    device = next(iter(tensors.values())).device
    index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
    return {"kind": kind, "device": index,
            "tensors": {name: {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).split(".")[-1]}
                        for name, t in tensors.items()},
            "cu_q": cu_q.tolist(), "cu_k": cu_k.tolist(), "options": options}


def signature(kind: str, tensors: dict[str, torch.Tensor], options: dict) -> tuple:
    """A variant as this module tells them apart, without reading the device and without the
    token counts (FA4's varlen kernels take those at run time): every tensor's dtype, its sizes
    but the tokens', whether it is contiguous; the causal flag and window. FA4's own key may split
    one signature further (tile choices from the longest sequence): a worker's compile then does
    not cover the next call, which is handed over in turn, up to :data:`MAX_TRIES` per signature."""
    def sizes(name: str, t: torch.Tensor) -> tuple:
        return tuple(t.shape[:1]) if name == "lse" else tuple(t.shape[1:])

    return (kind, tuple((n, sizes(n, t), t.dtype, t.is_contiguous()) for n, t in tensors.items()),
            options["causal"], options["window"])


def run(kind: str, call, fallback, tensors: dict[str, torch.Tensor], cu_q: torch.Tensor, cu_k: torch.Tensor,
        options: dict):
    """``call()`` (FA4) when every kernel it needs is built; else ``fallback()``, and the variant
    compiled ahead by a worker. Compiled in the call itself where this module is off, during
    CUDA-graph capture, and for a variant the workers did not make findable."""
    if (not enabled() or _guard.inline
            or (next(iter(tensors.values())).is_cuda and torch.cuda.is_current_stream_capturing())):
        return call()
    try:  # the common case, a built variant: nothing more on the hot path than the guarded lookups
        with guarded():
            return call()
    except NotCompiled:
        pass
    key = signature(kind, tensors, options)
    if key in _inline:  # given up handing it over: compiled here, once
        return call()
    with _lock:
        _stats["fallback_calls"] += 1
        future = _pending.get(key)
        if future is None or future.done():  # none in flight for this signature: hand this call over
            if future is not None and not future.result():
                _tries[key] = MAX_TRIES  # the worker failed: no second try
            if _tries.get(key, 0) >= MAX_TRIES:
                _inline.add(key)
                logger.warning("FlashAttention-4: a %s variant was not found after %d compile(s) off the step; it "
                               "is compiled in the step instead", kind, _tries[key])
                return call()
            _tries[key] = _tries.get(key, 0) + 1
            _stats["submitted"] += 1
            _pending[key] = _submit(describe(kind, tensors, cu_q, cu_k, options))
    try:
        return fallback()
    except (RuntimeError, NotImplementedError, KeyError) as e:  # no FA2 for this call (a head size it lacks)
        _inline.add(key)
        logger.warning("FlashAttention-4: PyTorch's FA2 cannot stand in for a %s variant while it compiles (%s); "
                       "it is compiled in the step", kind, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return call()


def _submit(spec: dict) -> Future:
    """Queue ``spec`` for the workers; its future says whether it was compiled. The workers are
    long-lived processes (each imports FA4 once), each fed by a daemon thread: an exiting training
    process never waits for them, and a worker ends when its standard input closes."""
    global _queue
    with _start_lock:
        if _queue is None:
            _queue = queue.Queue()
            for i in range(_workers()):
                threading.Thread(target=_feed_worker, args=(_queue,), name=f"fa4-compile-ahead-{i}", daemon=True).start()
    future: Future = Future()
    _queue.put((spec, future))
    return future


def _feed_worker(jobs: queue.Queue) -> None:
    """One worker process's feeder: sends it each spec and waits for its reply line."""
    worker = None
    while True:
        spec, future = jobs.get()
        started, ok = time.perf_counter(), False
        try:
            if worker is None or worker.poll() is not None:
                worker = subprocess.Popen([sys.executable, "-m", __name__, "--serve"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
            worker.stdin.write(json.dumps(spec) + "\n")
            worker.stdin.flush()
            for line in worker.stdout:
                if line.startswith(REPLY):
                    ok = line[len(REPLY):].strip().startswith("ok")
                    if not ok:
                        logger.warning("FlashAttention-4: compiling a %s variant off the step failed:%s",
                                       spec["kind"], line[len(REPLY):].rstrip()[4:])
                    break
        except OSError as e:
            logger.warning("FlashAttention-4: a compile worker could not be run (%s)", e)
            worker = None
        with _lock:
            _stats["compiled"] += ok
            _stats["worker_seconds"] += time.perf_counter() - started
        future.set_result(ok)


def serve() -> None:
    """A worker: compile each spec read from standard input, one reply line each, until it closes."""
    for line in sys.stdin:
        try:
            compile_spec(json.loads(line))
            reply = "ok"
        except Exception as e:  # reported to the training process, which then compiles in the step
            reply = "fail " + " ".join(f"{type(e).__name__}: {e}".split())[:300]
        print(REPLY, reply, flush=True)


def compile_spec(spec: dict) -> None:
    """In a worker: build tensors like the call's and run FA4 on them, which compiles its kernels
    and exports them to FA4's disk cache (the values are zeros: only the kernels are kept)."""
    import importlib

    os.environ.setdefault(PERSISTENT_CACHE_VARIABLE, "1")
    interface = importlib.import_module("flash_attn.cute.interface")
    device = torch.device("cuda", spec["device"])
    torch.cuda.set_device(device)

    def made(name: str) -> torch.Tensor:
        t = spec["tensors"][name]
        return torch.empty_strided(t["shape"], t["stride"], dtype=getattr(torch, t["dtype"]), device=device).zero_()

    cu_q = torch.tensor(spec["cu_q"], dtype=torch.int32, device=device)
    cu_k = torch.tensor(spec["cu_k"], dtype=torch.int32, device=device)
    options = spec["options"]
    if spec["kind"] == "fwd":
        fwd_call(interface, made("q"), made("k"), made("v"), cu_q, cu_k, **options)
    else:
        bwd_call(interface, made("grad_out"), made("q"), made("k"), made("v"), made("out"), made("lse"), cu_q,
                     cu_k, **options)
    torch.cuda.synchronize(device)


if __name__ == "__main__":
    serve()
