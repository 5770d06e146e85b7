"""The K/V stack of the depth-first walk and the attention of one unit against it.

Per layer, a preallocated K and V buffer (model dtype) holds the current root path's keys/values
by depth, followed by the running unit's own; a matching fp32 buffer accumulates the gradient
with respect to every slot. A unit's attention (``_UnitAttention``):

- forward: writes the unit's own K/V into its slots (no concatenation, no copy of the prefix) and
  attends over slots ``[0, depth + tokens)``;
- backward: adds the prefix part of dK/dV into the gradient buffer (the ancestors consume it when
  they are popped) and returns, for the unit's own K/V, the kernel's gradient plus what its
  descendants accumulated in its slots — the gradient of the cached K/V fed into the owning node's
  backward, here without a separate autograd root, so it survives HF gradient checkpointing (the
  recomputed forward rewrites the same values, the backward runs once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..attention.backends import flash_varlen_backward, flash_varlen_forward, masked_attention, to_varlen
from ..attention.metadata import tree_visibility


class KVStack:
    """Per-layer K/V buffers ``[slots, Hkv, D]`` and their fp32 gradient buffers (lazy allocation)."""

    def __init__(self, num_layers: int, slots: int) -> None:
        self.slots = slots
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.dk: list[torch.Tensor | None] = [None] * num_layers
        self.dv: list[torch.Tensor | None] = [None] * num_layers

    def buffers(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is None:
            shape = (self.slots, *like.shape[1:])
            self.k[layer] = like.new_zeros(shape)
            self.v[layer] = like.new_zeros(shape)
        return self.k[layer], self.v[layer]

    def grad_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.dk[layer] is None:
            self.dk[layer] = torch.zeros(self.k[layer].shape, dtype=torch.float32, device=self.k[layer].device)
            self.dv[layer] = torch.zeros_like(self.dk[layer])
        return self.dk[layer], self.dv[layer]


@dataclass(eq=False)
class UnitAttentionMetadata:
    """What the attention of one unit needs; travels as the tree kwarg of ``model(...)``."""

    backend: str
    stack: KVStack
    depth: int  # prefix slots [0, depth)
    num_tokens: int  # the unit's tokens = queries
    max_depth: int
    position_ids: torch.Tensor  # [1, n]
    kv_slots: torch.Tensor  # varlen key rows (stack slots) of every node of the unit, node after node
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    subtree_end: torch.Tensor  # [n] unit-relative, for the explicit mask of the reference backends
    calls: int = 0
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def build(cls, layout: dict, stack: KVStack, depth: int, max_depth: int, backend: str, device) -> UnitAttentionMetadata:
        def to(x, dtype):
            return torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=dtype)

        return cls(
            backend=backend,
            stack=stack,
            depth=depth,
            num_tokens=int(layout["tokens"].shape[0]),
            max_depth=max_depth,
            position_ids=to(layout["position_ids"], torch.int64).unsqueeze(0),
            kv_slots=to(layout["kv_slots"], torch.int64),
            cu_seqlens_q=to(layout["cu_seqlens_q"], torch.int32),
            cu_seqlens_k=to(layout["cu_seqlens_k"], torch.int32),
            max_seqlen_q=int(layout["max_seqlen_q"]),
            max_seqlen_k=int(layout["max_seqlen_k"]),
            subtree_end=to(layout["subtree_end"], torch.int64),
        )

    def dense_mask(self) -> torch.Tensor:
        """``[n, depth + n]``: every query sees the whole prefix, and the tree rule inside the unit."""
        if self._mask is None:
            inner = tree_visibility(self.subtree_end)
            self._mask = torch.cat([inner.new_ones(self.num_tokens, self.depth), inner], dim=1)
        return self._mask

    def attend(self, module, query, key, value, scaling: float) -> torch.Tensor:
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise ValueError(f"{type(module).__name__} has no layer_idx; the depth-first walk needs it to find its K/V")
        out = _UnitAttention.apply(to_varlen(query), to_varlen(key), to_varlen(value), self, int(layer), scaling)
        return out.unsqueeze(0)


def _reference_attention(meta: UnitAttentionMetadata, q, k_all, v_all, scaling):
    """Explicit-mask attention in varlen layout (``[n, H, D]`` queries, ``[slots, Hkv, D]`` keys)."""
    out = masked_attention(
        q.transpose(0, 1).unsqueeze(0), k_all.transpose(0, 1).unsqueeze(0), v_all.transpose(0, 1).unsqueeze(0),
        meta.dense_mask(), scaling, meta.backend,
    )
    return out[0]


class _UnitAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, meta: UnitAttentionMetadata, layer: int, scaling: float):
        kb, vb = meta.stack.buffers(layer, k)
        d, n = meta.depth, meta.num_tokens
        kb[d : d + n] = k
        vb[d : d + n] = v
        saved = ()
        if meta.backend == "torch_flash":
            out, saved = flash_varlen_forward(
                q, kb, vb, meta.kv_slots, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k, scaling
            )
        else:
            out = _reference_attention(meta, q, kb[: d + n], vb[: d + n], scaling)
        ctx.save_for_backward(q, out, *saved)
        ctx.meta, ctx.layer, ctx.scaling = meta, layer, scaling
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, out, *saved = ctx.saved_tensors
        meta, layer = ctx.meta, ctx.layer
        d, n = meta.depth, meta.num_tokens
        kb, vb = meta.stack.k[layer], meta.stack.v[layer]
        if meta.backend == "torch_flash":
            dq, dk_all, dv_all = flash_varlen_backward(
                grad_out, q, kb, vb, out, saved, meta.kv_slots, meta.cu_seqlens_q, meta.cu_seqlens_k,
                meta.max_seqlen_q, meta.max_seqlen_k, ctx.scaling,
            )
            dk_all, dv_all = dk_all[: d + n], dv_all[: d + n]
        else:
            with torch.enable_grad():
                q_ = q.detach().requires_grad_()
                k_all = kb[: d + n].detach().requires_grad_()
                v_all = vb[: d + n].detach().requires_grad_()
                ref = _reference_attention(meta, q_, k_all, v_all, ctx.scaling)
                dq, dk_all, dv_all = torch.autograd.grad(ref, (q_, k_all, v_all), grad_out)
            dk_all, dv_all = dk_all.float(), dv_all.float()
        gk, gv = meta.stack.grad_buffers(layer)
        gk[:d] += dk_all[:d]
        gv[:d] += dv_all[:d]
        # own K/V: the kernel's gradient plus what descendants left in these slots; then free them
        dk = (dk_all[d:] + gk[d : d + n]).to(q.dtype)
        dv = (dv_all[d:] + gv[d : d + n]).to(q.dtype)
        gk[d : d + n] = 0
        gv[d : d + n] = 0
        return dq, dk, dv, None, None, None
