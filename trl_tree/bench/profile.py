"""Where a step's GPU time goes: the torch profiler's kernels, summed by kind and tabled.

The FLOP limit says how fast a tree step could be; this says what it spends instead. Kernels are
sorted into kinds by name — matrix multiplies (cuBLAS/nvjet/CUTLASS), attention
(FlashAttention, cuDNN's fused attention), elementwise/reduction/copy kernels (norms, RoPE,
activations, casts, gathers, scatters), NCCL communication and the rest — so a tree step and TRL's can be compared
kind by kind (``python -m trl_tree.bench.suite --profile FILE``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

#: kernel-name patterns per kind, tried in this order (cuDNN's attention kernels carry "sm90" too)
KINDS = (
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|sdpa|attention", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|s\d+_tensorop|sm\d+_", re.I)),
    ("elementwise", re.compile(r"at::native|elementwise|vectorized|reduce|index|copy|cat|scatter|gather|fill"
                               r"|memset|memcpy|triton", re.I)),
)


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
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
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
