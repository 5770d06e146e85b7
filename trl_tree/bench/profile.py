"""Where a step's GPU time goes: the torch profiler's kernels, summed by kind and tabled.

The FLOP limit says how fast a tree step could be; this says what it spends instead. Kernels are
sorted into kinds by name — matrix multiplies (cuBLAS/nvjet/CUTLASS), attention
(FlashAttention, cuDNN's fused attention), elementwise/reduction/copy kernels (norms, RoPE,
activations, casts, gathers, scatters), NCCL communication and the rest — so a tree step and TRL's can be compared
kind by kind (``python -m trl_tree.bench.suite --profile FILE``).
"""

from __future__ import annotations

import bisect
import re
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager

import torch

#: kernel-name patterns per kind, tried in this order (cuDNN's attention kernels carry "sm90" too)
KINDS = (
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|sdpa|attention", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|s\d+_tensorop|sm\d+_", re.I)),
    ("elementwise", re.compile(r"at::native|elementwise|vectorized|reduce|index|copy|cat|scatter|gather|fill"
                               r"|memset|memcpy|triton", re.I)),
)


def kernel_events(prof) -> list:
    """The record's GPU events that are kernels, copies and memsets: the CPU's ranges
    (``record_function``, the optimizer's step) are mirrored on the GPU's timeline as annotations
    spanning their kernels, and counting them would count those kernels twice."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False)]


def profile_step(step: Callable[[], object]):
    """The profiler's record of one call of ``step`` (CUDA activity only), synchronised."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return prof


def kind_of(kernel_name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(kernel_name):
            return kind
    return "other"


def gpu_ms_by_kind(prof) -> dict[str, float]:
    """Milliseconds of kernel time per kind (and ``total``, ``kernels``: launches) in one record."""
    out = {kind: 0.0 for kind, _ in KINDS} | {"other": 0.0}
    launches = 0
    for event in kernel_events(prof):
        launches += 1
        out[kind_of(event.name)] += event.device_time_total / 1e3
    out = {k: round(v, 2) for k, v in out.items()}
    out["total"] = round(sum(v for k, v in out.items()), 2)
    out["kernels"] = launches
    return out


def gpu_busy(step: Callable[[], object]) -> tuple[float, int]:
    """(ms of kernel time, kernels launched) in one step."""
    kinds = gpu_ms_by_kind(profile_step(step))
    return kinds["total"], kinds["kernels"]


def kernel_table(prof, rows: int = 30) -> str:
    """The profiler's per-kernel table, heaviest first."""
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=90)


#: the CUDA runtime calls that make the host wait for the GPU
HOST_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
#: the ranges the package marks (``torch.profiler.record_function``): where the host is when the GPU idles
RANGE_PREFIX = "trl_tree."


def gpu_timeline(prof, gaps: int = 25, min_gap_ms: float = 0.05) -> dict:
    """Where a profiled step leaves the GPU idle, and where the host is meanwhile (``timeline``
    on the record's kernels, CPU events and the package's ranges; {} without kernels)."""
    host = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CPU]
    kernels = [(e.time_range.start, e.time_range.end) for e in kernel_events(prof)]
    return timeline(kernels, host, gaps, min_gap_ms)


def timeline(kernels: list[tuple[float, float]], host: list[tuple[float, float, str]], gaps: int = 25,
             min_gap_ms: float = 0.05) -> dict:
    """GPU busy and idle time over a record (µs intervals: ``kernels`` on any stream, ``host`` the
    CPU events with their names), and where the host is while the GPU idles.

    A step whose GPU time is far below its wall time is bound by the host (launches, Python,
    synchronisations), and a fixed host cost shows as idle gaps: the kernels' busy time is the
    union of their intervals over every stream; each gap is charged to the innermost package range
    (``trl_tree.*``) open at its middle, so the table says which part of the step starves the GPU."""
    if not kernels:
        return {}
    kernels = sorted(kernels)
    ranges = sorted(h for h in host if h[2].startswith(RANGE_PREFIX))
    begin = min([h[0] for h in host] + [kernels[0][0]])
    end = max([h[1] for h in host] + [max(k[1] for k in kernels)])
    busy, idle, cursor = 0.0, [], begin
    for start, stop in kernels:
        if start > cursor:
            idle.append((cursor, start))
        busy += max(0.0, stop - max(start, cursor))
        cursor = max(cursor, stop)
    if end > cursor:
        idle.append((cursor, end))

    def where(t: float) -> str:
        open_ = [r for r in ranges if r[0] <= t <= r[1]]
        return max(open_, key=lambda r: r[0])[2] if open_ else "(outside the package's ranges)"

    by_range: dict[str, float] = {}
    for a, b in idle:
        at = where((a + b) / 2)
        by_range[at] = by_range.get(at, 0.0) + (b - a) / 1e3
    longest = sorted(idle, key=lambda g: g[0] - g[1])[:gaps]
    return {"wall_ms": round((end - begin) / 1e3, 3), "gpu_busy_ms": round(busy / 1e3, 3),
            "gpu_idle_ms": round(sum(b - a for a, b in idle) / 1e3, 3),
            "idle_by_range_ms": {k: round(v, 3) for k, v in sorted(by_range.items(), key=lambda kv: -kv[1])},
            "range_cpu_ms": _range_totals(ranges),
            "longest_gaps": [{"at_ms": round((a - begin) / 1e3, 3), "ms": round((b - a) / 1e3, 3),
                              "in": where((a + b) / 2)} for a, b in longest if (b - a) / 1e3 >= min_gap_ms]}


def _range_totals(ranges) -> dict[str, dict]:
    totals: dict[str, dict] = {}
    for start, stop, name in ranges:
        t = totals.setdefault(name, {"calls": 0, "ms": 0.0})
        t["calls"] += 1
        t["ms"] = round(t["ms"] + (stop - start) / 1e3, 2)
    return totals


def host_syncs(prof) -> dict:
    """The step's host synchronisations (the runtime calls in ``HOST_SYNCS``): how many, the host's
    time in them, and per operator that made them (the innermost CPU operator around the call on its
    thread) how many — what makes the host wait, so that its launches cannot run ahead of the GPU.
    :func:`sync_stacks` says from where in Python."""
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    by_thread: dict[int, list] = {}
    for e in cpu:
        if not e.name.startswith(("cuda", "cu")):
            by_thread.setdefault(e.thread, []).append(e)
    for events in by_thread.values():
        events.sort(key=lambda e: e.time_range.start)
    starts = {t: [e.time_range.start for e in events] for t, events in by_thread.items()}
    total, ms, by_op = 0, 0.0, {}
    for e in cpu:
        if not e.name.startswith(HOST_SYNCS) or "Async" in e.name:
            continue
        total, ms = total + 1, ms + e.cpu_time_total / 1e3
        events, op = by_thread.get(e.thread, []), "(none)"
        i = bisect.bisect_right(starts.get(e.thread, []), e.time_range.start) - 1
        while i >= 0 and i >= len(events) - 100_000:
            candidate = events[i]
            if candidate.time_range.end >= e.time_range.end:
                op = candidate.name
                break
            i -= 1
        by_op[op] = by_op.get(op, 0) + 1
    return {"count": total, "ms": round(ms, 2), "by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1]))}


#: the message of ``torch.cuda.set_sync_debug_mode("warn")``
_SYNC_WARNING = "synchronizing CUDA operation"


@contextmanager
def sync_stacks(frames: int = 8):
    """Count the host synchronisations made inside the block by their Python stack (the innermost
    ``frames`` frames of the package, TRL, transformers, Accelerate and torch), through torch's sync
    debug mode — without the profiler's stack tracing, which would slow the step it explains. Yields
    the ``Counter`` it fills (keys: tuples of ``"path:line function"``). Synchronisations that
    torch's C++ makes outside its checked helpers (some of NCCL's) are not seen: compare the count
    with :func:`host_syncs`'s."""
    counts: Counter = Counter()
    cuda = torch.cuda.is_available()

    def record(message, *_):
        stack = [f for f in traceback.extract_stack() if "/warnings.py" not in f.filename and f.filename != __file__]
        kept = [f"{_short(f.filename)}:{f.lineno} {f.name}" for f in stack if _short(f.filename) != f.filename]
        counts[tuple(kept[-frames:])] += 1

    previous = torch.cuda.get_sync_debug_mode() if cuda else None
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning
        warnings.showwarning = lambda message, *rest: record(message, *rest) if _SYNC_WARNING in str(message) \
            else shown(message, *rest)
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(previous)


def _short(path: str) -> str:
    """``path`` from its package on (``trl_tree/...``, ``trl/...``, ``torch/...``), or unchanged where
    it is in none of the packages whose frames explain a synchronisation."""
    for package in ("trl_tree/", "trl/", "transformers/", "accelerate/", "torch/", "peft/"):
        at = path.rfind("/" + package)
        if at >= 0:
            return path[at + 1 :]
    return path


def top_stacks(counts: Counter, rows: int = 40) -> list[dict]:
    """:func:`sync_stacks`'s counts, most first, for a JSON record."""
    return [{"count": n, "stack": list(stack)} for stack, n in counts.most_common(rows)]
