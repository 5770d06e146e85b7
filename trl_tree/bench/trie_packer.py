"""TRL 1.16's experimental trie packer (``trl.experimental.async_grpo.packing``) as a benchmark path.

TRL's async GRPO trainer folds a rank's samples into a prefix trie (``TreeRow``: a node is keyed on
its token *and* the next one, so the trie forks one token early and every packed position has one
label), forwards the unique tokens once with its ``tree_fa3`` attention (each segment against its
gathered root path, FlashAttention-3 varlen from the Hub) and scores the packed positions with
TRL's fused LM head, gathering one log-prob per loss term. The GPU machines cannot fetch that
kernel, so here its ``flash_attn_varlen_func`` is PyTorch's FA2 varlen (the kernels of
``attention/partial.py``; the math reference on a CPU) — the same substitution the reference
timings in the issue used. Everything else is TRL's own code: its trie, its layout, its attention
function, its loss gather. The trie is built and packed once, outside the timed step (the tree
paths' forests are prebuilt too; their per-step metadata is inside).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence

import torch

from ..engine.attention.partial import PARTIAL_KERNELS, math_partial_backward, math_partial_forward


def _kernel_pair(q: torch.Tensor):
    return PARTIAL_KERNELS["torch_flash"] if q.is_cuda else (math_partial_forward, math_partial_backward)


class _VarlenAttention(torch.autograd.Function):
    """``flash_attn_varlen_func`` semantics on PyTorch's FA2 kernels (math reference off CUDA)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool):
        forward, _ = _kernel_pair(q)
        out, lse, state = forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (state, max_q, max_k, causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        state, max_q, max_k, causal, scale = ctx.args
        _, backward = _kernel_pair(q)
        dq, dk, dv = backward(grad_out, q, k, v, out, lse, state, cu_q, cu_k, max_q, max_k, causal, scale)
        return dq, dk, dv, None, None, None, None, None, None


class _TorchVarlenKernel:
    """Stands in for the Hub kernel object ``packing._flash_attn()`` returns."""

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                               causal=True, window_size=(-1, -1), **_):
        if tuple(window_size) != (-1, -1):
            raise ValueError("the trie packer benchmark runs full attention only (no sliding window)")
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        return _VarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                      float(scale), bool(causal))


def trie_packer_available() -> bool:
    """Whether this TRL has the experimental trie packer (TRL 1.16's ``async_grpo``)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        return importlib.util.find_spec("trl.experimental.async_grpo.packing") is not None
    except ImportError:  # no trl.experimental at all
        return False


def install_varlen_stand_in():
    """Answer TRL's ``packing._flash_attn()`` (which fetches the Hub FA3 kernel, out of reach here)
    with :class:`_TorchVarlenKernel`; returns TRL's ``packing`` module."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.async_grpo import packing

    packing._flash_attn = lambda: _TorchVarlenKernel
    return packing


def _packing():
    packing = install_varlen_stand_in()
    packing.register_tree_attention()
    return packing


def trie_packer_step(model: torch.nn.Module, seqs: Sequence[Sequence[int]], advantages: torch.Tensor,
                     score_from: int, n_terms: int) -> Callable[[], float]:
    """One GRPO-style step through TRL's trie packer on ``seqs``: loss ``-Σ w_i·logp / n_terms`` over
    every token from ``score_from`` on, backward (gradients accumulate). ``model`` must carry TRL's
    fused LM head (``add_fused_lm_head``), as in TRL's trainers."""
    packing = _packing()
    row = packing.TreeRow()
    for i, s in enumerate(seqs):
        ids = torch.as_tensor(list(s), dtype=torch.long)
        mask = torch.zeros_like(ids)
        mask[score_from:] = 1
        row.add({"input_ids": ids, "completion_mask": mask, "old_log_probs": torch.zeros(len(ids)),
                 "advantage": float(advantages[i]), "group_id": 0})
    device = next(model.parameters()).device
    packed = {k: v.to(device) for k, v in row.pack().items()}
    max_q, max_k = packed["tree_max_seqlens"].tolist()
    kwargs = {"tree_kv_index": packed["tree_kv_index"], "tree_cu_seqlens_q": packed["tree_cu_seqlens_q"],
              "tree_cu_seqlens_k": packed["tree_cu_seqlens_k"], "tree_max_seqlen_q": max_q, "tree_max_seqlen_k": max_k}
    config = model.config

    def step() -> float:
        original = config._attn_implementation
        config._attn_implementation = packing.TREE_ATTENTION  # what TRL's async trainer sets on its model
        try:
            out = model(input_ids=packed["input_ids"].unsqueeze(0), position_ids=packed["position_ids"].unsqueeze(0),
                        shift_labels=packed["shift_labels"].unsqueeze(0), fused_lm_head=True, use_cache=False, **kwargs)
            log_probs = out.log_probs.flatten()[packed["token_index"]]
            loss = -(log_probs * packed["advantages"]).sum() / n_terms
            loss.backward()
        finally:
            config._attn_implementation = original
        return float(loss.detach())

    step.num_forwarded = int(packed["input_ids"].numel())  # type: ignore[attr-defined]
    return step
