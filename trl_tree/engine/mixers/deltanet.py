"""The delta rule's chunked kernels over a prefix tree: transformers' ``torch_chunk_gated_delta_rule``
(gated DeltaNet: Qwen3-Next, Qwen3.5 dense and MoE, OLMo-hybrid) and ``chunk_kimi_delta_attention``
(Kimi Delta Attention: Kimi-Linear, a decay per key channel instead of per head).

Both take ``query, key [1, n, Hk, dk]``, ``value [1, n, Hv, dv]``, the log-decay ``g`` (``[1, n,
Hv]`` or ``[1, n, Hv, dk]``) and ``beta [1, n, Hv]``, and a state ``[Hv, dk, dv]`` per sequence. The
original kernel (or the flash-linear-attention kernel transformers routes it to) runs each level of
the tree's nodes as a right-padded batch, each node from its parent's final state (``scan.py``).

Padding that leaves the state alone: a padded row has ``k = 0`` (its L2 norm stays 0), ``v = 0``,
``beta = 0`` (no write) and ``g = 0`` (no decay) — the kernels' own padding to a whole chunk.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import torch

from .scan import carried_state, hand_on, scan_segments, segments_of


def tree_delta_rule(call, original, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, chunk_size: int | None = None, initial_state: torch.Tensor | None = None,
                    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, **kwargs):
    """The kernel over the tree call's row; returns ``(out [1, n, Hv, dv], final state or None)`` as
    the kernel does. The call's other keyword arguments (a packed batch's ``cu_seqlens``) describe a
    padded batch the tree replaces and are not passed on."""
    if initial_state is not None:
        raise ValueError("a tree call carries no cache: the delta rule starts from each node's parent's state")
    meta, kernel = call.meta, call.key("scan")
    extra = {} if chunk_size is None else {"chunk_size": chunk_size}

    def scan(q, k, v, g_, beta_, initial):
        return original(q, k, v, g=g_, beta=beta_, initial_state=initial, output_final_state=True,
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **extra)

    heads, dk, dv = value.shape[2], key.shape[-1], value.shape[-1]
    zero = value.new_zeros(heads, dk, dv, dtype=torch.float32)
    out, final = scan_segments(segments_of(meta), [query[0], key[0], value[0], g[0], beta[0]], scan,
                               carried_state(meta, kernel, value), zero)
    out = hand_on(meta, kernel, out, final)
    return out.unsqueeze(0), (final.unsqueeze(0) if output_final_state else None)


class _Float64Torch(types.ModuleType):
    """``torch`` as a modeling module sees it, with ``float32`` meaning float64."""

    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def float64_kernels(model: torch.nn.Module) -> Iterator[None]:
    """The modeling modules of ``model``'s layers compute their kernels in float64 where they cast to
    float32. transformers' delta-rule kernels compute in fp32 whatever the model's dtype, and their
    rounding moves with where chunks begin (a tree's node starts chunks of its own): an exactness
    check of the tree against the untreed model in float64 runs them so (tests, ``bench.check_gpu``)."""
    modules = {sys.modules[type(m).__module__] for m in model.modules()
               if type(m).__module__.startswith("transformers.models.")}
    saved = {module: module.torch for module in modules if getattr(module, "torch", None) is torch}
    try:
        for module in saved:
            module.torch = _Float64Torch("torch")
        yield
    finally:
        for module, original in saved.items():
            module.torch = original
