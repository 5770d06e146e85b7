"""The K/V stack of the depth-first walk and the attention of one unit against it.

Per layer, a preallocated K and V buffer (model dtype) holds the current root path's keys/values
by depth, followed by the running unit's own; a matching fp32 buffer accumulates the gradient
with respect to every slot. A unit's attention (``_UnitAttention``):

- forward: writes the unit's own K/V into its slots (no concatenation, no copy of the prefix).
  With FlashAttention it runs as two partial attentions merged by log-sum-exp
  (``attention/partial.py``): every query against the cached prefix, read in place from the
  stack as one dense rectangle, and each node against its in-unit ancestors and itself (a small
  varlen gather). The rectangle, and a one-node unit's causal block, go to cuDNN's fused
  attention where it runs (``partial.dense_kernels``: head_dim 128, blocks of 64+ rows). The
  reference backends attend over slots ``[0, depth + tokens)`` with a mask.
- backward: adds the prefix part of dK/dV into the gradient buffer (the ancestors consume it when
  they are popped) and returns, for the unit's own K/V, the kernel's gradient plus what its
  descendants accumulated in its slots — the gradient of the cached K/V fed into the owning node's
  backward, here without a separate autograd root, so it survives HF gradient checkpointing (the
  recomputed forward rewrites the same values, the backward runs once).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from .._device import upload
from ..attention.backends import masked_attention, to_varlen
from ..attention.buckets import _power_of_two
from ..attention.kept import KeptAttention
from ..attention.metadata import tree_visibility
from ..attention.partial import PARTIAL_KERNELS, dense_kernels, dense_shape_seen, merge_partials
from ..forest import PrefixForest
from .buckets import padded_unit_layout
from .plan import Unit, unit_layout


class KVStack:
    """Per-layer K/V buffers ``[slots, Hkv, D]`` and fp32 gradient buffers (lazy allocation).

    Gradients only ever wait in the slots of *pushed* nodes (a group's own K/V gradients stay
    inside its autograd graph), so the gradient buffers cover ``grad_slots`` ≤ ``slots``: the
    deepest pushed path, not the largest group hanging below it.
    """

    def __init__(self, num_layers: int, slots: int, grad_slots: int) -> None:
        self.slots = slots
        self.grad_slots = grad_slots
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.dk: list[torch.Tensor | None] = [None] * num_layers
        self.dv: list[torch.Tensor | None] = [None] * num_layers
        # the sequence kernels of mixer layers (``trl_tree.engine.mixers``), keyed by the kernel's call in its
        # layer (``KernelCall.key``): each convolution's inputs by depth and their gradients, and each scan's
        # state at the end of every pushed node, keyed (kernel, depth)
        self.conv: dict[Hashable, torch.Tensor] = {}
        self.dconv: dict[Hashable, torch.Tensor] = {}
        self.states: dict[tuple[Hashable, int], torch.Tensor] = {}
        self.state_grads: dict[tuple[Hashable, int], torch.Tensor] = {}

    def buffers(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[slots, heads, dim]`` K and V of ``layer`` by depth (V's head dim may differ from K's: latent
        attention without its value padded)."""
        if self.k[layer] is None:
            self.k[layer] = key.new_zeros((self.slots, *key.shape[1:]))
            self.v[layer] = value.new_zeros((self.slots, *value.shape[1:]))
        return self.k[layer], self.v[layer]

    def conv_buffer(self, kernel: Hashable, like: torch.Tensor) -> torch.Tensor:
        """``[slots, C]``: a convolution's inputs by depth (``mixers/conv.py``)."""
        if kernel not in self.conv:
            self.conv[kernel] = like.new_zeros((self.slots, *like.shape[1:]))
        return self.conv[kernel]

    def conv_grad_buffer(self, kernel: Hashable) -> torch.Tensor:
        if kernel not in self.dconv:
            self.dconv[kernel] = torch.zeros(self.grad_slots, *self.conv[kernel].shape[1:], dtype=torch.float32,
                                             device=self.conv[kernel].device)
        return self.dconv[kernel]

    def release(self) -> None:
        """Drop every buffer (the walk is over)."""
        n = len(self.k)
        self.k, self.v, self.dk, self.dv = [None] * n, [None] * n, [None] * n, [None] * n
        self.conv, self.dconv = {}, {}
        self.states, self.state_grads = {}, {}

    def grad_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.dk[layer] is None:
            k, v = self.k[layer], self.v[layer]
            self.dk[layer] = torch.zeros((self.grad_slots, *k.shape[1:]), dtype=torch.float32, device=k.device)
            self.dv[layer] = torch.zeros((self.grad_slots, *v.shape[1:]), dtype=torch.float32, device=v.device)
        return self.dk[layer], self.dv[layer]

    # ------------------------------------------------ a stack kept between walks (``dfs/graphs.py``)
    def allocated(self, grads: bool) -> bool:
        """Every layer's K/V buffers exist (a walk has run on the stack), and with ``grads`` its
        gradient buffers (a walk with a backward has)."""
        return all(b is not None for b in (*self.k, *self.v, *((*self.dk, *self.dv) if grads else ())))

    def zero_grads(self) -> None:
        """Empty every gradient slot: a walk that stopped half-way may have left gradients there
        (a complete walk consumes each one at its owner's pop)."""
        grads = [g for g in (*self.dk, *self.dv) if g is not None]
        if grads:
            torch._foreach_zero_(grads)

    def saved_grads(self, slots: int) -> list[torch.Tensor]:
        """A copy of the gradient slots ``[0, slots)`` of every layer (dK then dV)."""
        slots = min(slots, self.grad_slots)
        return [g[:slots].clone() for g in (*self.dk, *self.dv)]

    def restore_grads(self, saved: list[torch.Tensor]) -> None:
        """Put back what :meth:`saved_grads` copied."""
        for g, s in zip((*self.dk, *self.dv), saved):
            g[: s.shape[0]].copy_(s)


@dataclass(eq=False)
class UnitAttentionMetadata:
    """What the attention of one unit needs; travels as the tree kwarg of ``model(...)``."""

    #: not the unit's layout (``graphs._layout_signature``): its stack, call counter, lazily built
    #: kernels and masks, and whether a graph replays it
    NOT_LAYOUT: ClassVar[tuple[str, ...]] = ("stack", "calls", "pairs", "_mask", "_windowed", "graphed", "kept",
                                             "_conv")

    backend: str
    stack: KVStack
    depth: int  # prefix slots [0, depth)
    num_tokens: int  # the unit's tokens = queries
    max_depth: int
    #: leading own rows whose slots hold their descendants' K/V gradients (``plan.Unit.pushed_tokens``)
    pushed_tokens: int
    input_ids: torch.Tensor  # [1, n]
    position_ids: torch.Tensor  # [1, n]
    kv_local: torch.Tensor | None  # per node, its in-unit key rows (unit-relative); None: each node only itself
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor  # segments of kv_local
    max_seqlen_q: int
    max_seqlen_k: int
    prefix_cu_q: torch.Tensor  # [0, n]: all queries, one segment
    prefix_cu_k: torch.Tensor  # [0, depth]
    subtree_end: torch.Tensor  # [n] unit-relative, for the explicit mask of the reference backends
    one_segment: bool = False  # the unit is one node: its own part is a single causal segment
    # a unit padded to buckets (``dfs/buckets.py``): ``depth`` and ``num_tokens`` are the padded
    # counts, the real depth is ``prefix_cu_k[1]`` (device data)
    own_slots: torch.Tensor | None = None  # [n] the stack slots of the unit's own K/V; None: [depth, depth + n)
    prefix_valid: torch.Tensor | None = None  # [depth] bool: prefix slots below the real depth
    kv_scatter: torch.Tensor | None = None  # [len(kv_local)]: where the own keys' gradients go (row n: dropped)
    graphed: bool = False  # replayed from a CUDA graph (``dfs/graphs.py``): dense shapes need no sightings
    #: a forward with grad keeps each layer's attention output for the checkpointed recompute
    #: (``attention/kept.py``), where the memory model lets the unit hold it (``GroupBudget.keeps_attention``)
    keep_attention: bool = False
    kept: KeptAttention | None = field(default=None, repr=False)  # this forward's kept outputs
    calls: int = 0
    pairs: tuple | None = field(default=None, repr=False)  # (own, prefix) kernel pairs, chosen at the first layer
    _mask: torch.Tensor | None = field(default=None, repr=False)
    _windowed: dict = field(default_factory=dict, repr=False)  # window -> windowed_paths
    #: the mixers' tables (``trl_tree.engine.mixers``): convolution sources by (kernel, low), scan segments, host layout
    _conv: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build_all(cls, forest: PrefixForest, units: list[Unit], stack: KVStack, backend: str,
                  device: torch.device, layouts: list[dict] | None = None,
                  keeps: list[bool] | None = None) -> list[UnitAttentionMetadata]:
        """Every unit's metadata from two uploads (int64 and int32) made before any compute;
        ``layouts``: the units' ``plan.unit_layout`` where the caller has them already; ``keeps``:
        per unit, whether it keeps its attention outputs for the recompute."""
        if layouts is None:
            layouts = [unit_layout(forest, u) for u in units]
        return cls._from_layouts(layouts, units, forest.max_depth, stack, backend, device, keeps)

    @classmethod
    def build_padded(cls, forest: PrefixForest, units: list[Unit], stack: KVStack, backend: str,
                     device: torch.device, layouts: list[dict], rows_src: list[np.ndarray],
                     rows_targets: list[np.ndarray], keeps: list[bool] | None = None
                     ) -> tuple[list[UnitAttentionMetadata], list[torch.Tensor], list[torch.Tensor]]:
        """Every unit padded to buckets (``dfs/buckets.py``): ``(metas, src, targets)`` from the units'
        exact ``layouts`` (``plan.unit_layout``) and their scored rows, ``rows_src`` and
        ``rows_targets`` (unit-relative sources, target tokens)."""
        layouts = [padded_unit_layout(layout, u, s, t)
                   for layout, u, s, t in zip(layouts, units, rows_src, rows_targets)]
        metas = cls._from_layouts(layouts, units, _power_of_two(forest.max_depth), stack, backend, device, keeps)
        rows = upload([a for layout in layouts for a in (layout["src"], layout["targets"])], torch.int64, device)
        return metas, rows[0::2], rows[1::2]

    @classmethod
    def _from_layouts(cls, layouts: list[dict], units: list[Unit], max_depth: int, stack: KVStack, backend: str,
                      device: torch.device, keeps: list[bool] | None = None) -> list[UnitAttentionMetadata]:
        padded = "own_slots" in layouts[0]
        long_arrays, int_arrays = [], []
        for layout, unit in zip(layouts, units):
            long_arrays += [layout["tokens"], layout["position_ids"], layout["subtree_end"], layout["kv_local"]]
            if padded:
                scatter = layout["kv_scatter"]
                long_arrays += [layout["own_slots"], scatter if scatter is not None else np.zeros(0, np.int64)]
            n = layout["tokens"].shape[0]
            int_arrays += [layout["cu_seqlens_q"], layout["cu_seqlens_k"], np.array([0, n]),
                           np.array([0, layout.get("real_depth", unit.depth)])]
        longs = upload(long_arrays, torch.int64, device)
        ints = upload(int_arrays, torch.int32, device)
        per = 6 if padded else 4
        metas = []
        for i, (layout, unit) in enumerate(zip(layouts, units)):
            tokens, positions, subtree_end, kv_local = longs[per * i : per * i + 4]
            cu_q, cu_k, prefix_cu_q, prefix_cu_k = ints[4 * i : 4 * i + 4]
            n = tokens.shape[0]
            own_only = layout.get("own_only", kv_local.shape[0] == n)  # n rows: each node sees only itself
            depth = layout.get("depth", unit.depth)
            extra = {}
            if padded:
                own_slots, scatter = longs[per * i + 4 : per * i + 6]
                extra = {"own_slots": own_slots, "kv_scatter": None if own_only else scatter,
                         "prefix_valid": torch.arange(depth, device=device) < prefix_cu_k[1:]}
            metas.append(cls(
                backend=backend, stack=stack, depth=depth, num_tokens=n, max_depth=max_depth,
                pushed_tokens=layout.get("pushed_tokens", unit.pushed_tokens), input_ids=tokens.unsqueeze(0),
                position_ids=positions.unsqueeze(0), keep_attention=bool(keeps[i]) if keeps is not None else False,
                kv_local=None if own_only else kv_local,
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                max_seqlen_q=int(layout["max_seqlen_q"]), max_seqlen_k=int(layout["max_seqlen_k"]),
                prefix_cu_q=prefix_cu_q, prefix_cu_k=prefix_cu_k, subtree_end=subtree_end,
                one_segment=len(layout["cu_seqlens_q"]) == 2 and own_only, **extra,
            ))
            if not padded:  # the unit's node layout on the host, for a recurrent mixer's segments (no sync)
                metas[-1]._conv["host_layout"] = (layout["cu_seqlens_q"], layout["cu_seqlens_k"],
                                                  None if own_only else layout["kv_local"])
        return metas

    def dense_mask(self, window: int | None = None) -> torch.Tensor:
        """``[n, depth + n]``: every query sees the whole prefix, and the tree rule inside the unit; with
        a sliding ``window`` only keys less than ``window`` deeper than the query (prefix slot j holds
        depth j)."""
        if self._mask is None:
            inner = tree_visibility(self.subtree_end)
            prefix = (inner.new_ones(self.num_tokens, self.depth) if self.prefix_valid is None
                      else self.prefix_valid.expand(self.num_tokens, self.depth))  # padded: the real depth's slots
            self._mask = torch.cat([prefix, inner], dim=1)
        if window is None:
            return self._mask
        depth_q = self.position_ids[0]
        depth_k = torch.cat([torch.arange(self.depth, device=depth_q.device), depth_q])
        return self._mask & (depth_q[:, None] - depth_k[None, :] < window)

    def windowed_paths(self, window: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Per node of the unit, the slots of its root path that its queries can see through ``window``
        (prefix slots from ``depth(first query) - window + 1``, then its in-unit path), in depth order:
        ``(slot index, cu_seqlens_k, max_seqlen_k)`` for one varlen call with the kernel's own window."""
        cached = self._windowed.get(window)
        if cached is None:
            d = self.depth
            cu_q = self.cu_seqlens_q.tolist()
            cu_k = self.cu_seqlens_k.tolist()
            depths = self.position_ids[0].tolist()
            own = self.kv_local.tolist() if self.kv_local is not None else list(range(self.num_tokens))
            index, bounds = [], [0]
            for j in range(len(cu_q) - 1):
                start = min(max(0, depths[cu_q[j]] - window + 1), d)
                rows = list(range(start, d)) + [d + r for r in own[cu_k[j] : cu_k[j + 1]]]
                index += rows
                bounds.append(bounds[-1] + len(rows))
            device = self.position_ids.device
            cached = (torch.tensor(index, dtype=torch.long, device=device),
                      torch.tensor(bounds, dtype=torch.int32, device=device),
                      max(b - a for a, b in zip(bounds, bounds[1:])))
            self._windowed[window] = cached
        return cached

    def attend(self, module, query, key, value, scaling: float, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise ValueError(f"{type(module).__name__} has no layer_idx; the depth-first walk needs it to find its K/V")
        out = _UnitAttention.apply(to_varlen(query), to_varlen(key), to_varlen(value), sinks, self, int(layer),
                                   scaling, (window, softcap), module)
        return out.unsqueeze(0)


def _reference_attention(meta: UnitAttentionMetadata, q, k_all, v_all, scaling, variants=(None, None, None)):
    """Explicit-mask attention in varlen layout (``[n, H, D]`` queries, ``[slots, Hkv, D]`` keys);
    ``variants``: (window, softcap, sinks)."""
    window, softcap, sinks = variants
    out = masked_attention(
        q.transpose(0, 1).unsqueeze(0), k_all.transpose(0, 1).unsqueeze(0), v_all.transpose(0, 1).unsqueeze(0),
        meta.dense_mask(window), scaling, meta.backend, softcap, sinks,
    )
    return out[0]


def _kernel_pairs(meta: UnitAttentionMetadata, q: torch.Tensor):
    """(own part, prefix part) kernel pairs: the cached prefix is one dense rectangle and a
    one-node unit one causal block — both run on the dense pair (cuDNN) where it runs here and
    has seen the shape before (``partial.dense_shape_seen``: cuDNN plans every new shape), or in
    a graphed unit (planned once at the capture, as the packed call's replayed blocks). Chosen
    at the unit's first layer, so every layer, the recompute and the backward use the same pairs."""
    if meta.pairs is None:
        varlen = PARTIAL_KERNELS[meta.backend]
        n, d = meta.num_tokens, meta.depth
        model = (*q.shape[1:], str(q.dtype))
        g = meta.graphed
        own = dense_kernels(meta.backend, q.device, q.dtype, q.shape[-1], n, n, g) if meta.one_segment else None
        # a padded unit's prefix is bounded by the kernel's cu_seqlens_k: the varlen kernel's, not a dense block
        prefix = (dense_kernels(meta.backend, q.device, q.dtype, q.shape[-1], n, d, g)
                  if d and meta.prefix_valid is None else None)
        # a captured graph plans its shapes once, at the capture, and replays them
        if own is not None and not g and not dense_shape_seen(meta.backend, ("unit", n, *model)):
            own = None
        if prefix is not None and not g and not dense_shape_seen(meta.backend, ("prefix", n, d, *model)):
            prefix = None
        meta.pairs = (own or varlen, prefix or varlen)
    return meta.pairs


def _own_rows(meta: UnitAttentionMetadata, x: torch.Tensor) -> torch.Tensor:
    """The unit's own keys (or values) node after node: each node's in-unit ancestors and itself."""
    return x if meta.kv_local is None else x.index_select(0, meta.kv_local)


def _own_slots(meta: UnitAttentionMetadata, buf: torch.Tensor) -> torch.Tensor:
    """The unit's own rows of a stack buffer (K, V or their gradients)."""
    d, n = meta.depth, meta.num_tokens
    return buf[d : d + n] if meta.own_slots is None else buf.index_select(0, meta.own_slots)


def _pushed_slots(meta: UnitAttentionMetadata, buf: torch.Tensor) -> torch.Tensor:
    """The rows of a gradient buffer where the unit's pushed tokens collected their descendants' K/V
    gradients."""
    d, m = meta.depth, meta.pushed_tokens
    return buf[d : d + m] if meta.own_slots is None else buf.index_select(0, meta.own_slots[:m])


def _zero_pushed_slots(meta: UnitAttentionMetadata, buf: torch.Tensor) -> None:
    """Empty the pushed tokens' gradient slots, once consumed."""
    d, m = meta.depth, meta.pushed_tokens
    if meta.own_slots is None:
        buf[d : d + m] = 0
    else:
        buf.index_fill_(0, meta.own_slots[:m], 0)


def _with_descendant_grads(meta: UnitAttentionMetadata, own: torch.Tensor, slots: torch.Tensor,
                           dtype: torch.dtype) -> torch.Tensor:
    """The own K (or V) gradient plus what descendants left in the pushed tokens' fp32 slots, in
    ``dtype``: summed at fp32 precision, rounded once."""
    m = meta.pushed_tokens
    if m >= own.shape[0]:  # a pushed node: every row
        return (slots + own).to(dtype)  # fp32: the model-dtype gradient is promoted inside the add
    out = own.to(dtype)  # a merged pop: its node's rows, then its group's (nothing waits in those)
    out[:m] = slots + own[:m]
    return out


def _reference_keys(meta: UnitAttentionMetadata, buf: torch.Tensor) -> torch.Tensor:
    """The prefix slots then the unit's own rows: the keys (or values) of the reference backends."""
    d, n = meta.depth, meta.num_tokens
    return buf[: d + n] if meta.own_slots is None else torch.cat([buf[:d], _own_slots(meta, buf)])


def _add_prefix_grads(meta: UnitAttentionMetadata, gk: torch.Tensor, gv: torch.Tensor, dk: torch.Tensor,
                      dv: torch.Tensor) -> None:
    """Add the prefix part's K/V gradients into the ancestors' slots; a padded unit's rows past its
    real depth are undefined (the kernel does not write keys past ``cu_seqlens_k``) and are dropped."""
    d = meta.depth
    if meta.prefix_valid is not None:
        keep = meta.prefix_valid[:, None, None]
        dk, dv = dk.masked_fill(~keep, 0), dv.masked_fill(~keep, 0)
    gk[:d] += dk
    gv[:d] += dv


def _own_key_grads(meta: UnitAttentionMetadata, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A gathered key row's gradients summed per own row in fp32 (``kv_scatter``: a padded unit's
    unread gather entries go to a row past the end, dropped)."""
    n = like.shape[0]
    index = meta.kv_local if meta.kv_scatter is None else meta.kv_scatter
    out = torch.zeros((n + (meta.kv_scatter is not None), *like.shape[1:]), dtype=torch.float32, device=like.device)
    return out.index_add_(0, index, rows.float())[:n]


class _UnitAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, meta: UnitAttentionMetadata, layer: int, scaling: float, variants=(None, None),
                module: object = None):
        kb, vb = meta.stack.buffers(layer, k, v)
        d, n = meta.depth, meta.num_tokens
        if meta.own_slots is None:
            kb[d : d + n] = k
            vb[d : d + n] = v
        else:  # padded: the real depth is device data
            kb.index_copy_(0, meta.own_slots, k)
            vb.index_copy_(0, meta.own_slots, v)
        ctx.meta, ctx.layer, ctx.scaling, ctx.variants = meta, layer, scaling, (*variants, sinks)
        window = variants[0]
        if meta.backend not in PARTIAL_KERNELS:
            out = _reference_attention(meta, q, _reference_keys(meta, kb), _reference_keys(meta, vb), scaling,
                                       ctx.variants)
            ctx.save_for_backward(q, out)
            return out
        if window is not None:  # each node against the windowed slots of its path (``windowed_paths``)
            if meta.own_slots is not None:
                raise ValueError("a sliding window's unit is never padded to buckets (its units run eagerly)")
            index, cu_k, max_k = meta.windowed_paths(window)
            varlen = PARTIAL_KERNELS[meta.backend][0]
            out, lse, state = varlen(q, kb.index_select(0, index), vb.index_select(0, index), meta.cu_seqlens_q, cu_k,
                                     meta.max_seqlen_q, max_k, True, scaling, window=window)
            ctx.states = (state, None)
            ctx.save_for_backward(q, out, lse)
            return out
        kept = meta.kept  # kept outputs: attention/kept.py
        entry = kept.recomputed(meta.calls, module) if kept is not None else None
        if entry is not None:  # the checkpointed recompute: what the forward computed (its K/V are written above)
            out, lse, ctx.states = entry
            if out.shape != q.shape:
                raise RuntimeError(f"kept attention output {tuple(out.shape)} does not match the recomputed queries "
                                   f"{tuple(q.shape)}; the checkpointed forward ran another unit")
            ctx.save_for_backward(q, out, lse)
            return out
        own_pair, prefix_pair = _kernel_pairs(meta, q)
        out, lse, own_state = own_pair[0](q, _own_rows(meta, k), _own_rows(meta, v), meta.cu_seqlens_q,
                                          meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k, True, scaling)
        prefix_state = None
        if d:
            out_p, lse_p, prefix_state = prefix_pair[0](q, kb[:d], vb[:d], meta.prefix_cu_q, meta.prefix_cu_k, n, d,
                                                        False, scaling)
            out, lse = merge_partials(out_p, lse_p, out, lse)
        ctx.states = (own_state, prefix_state)
        if kept is not None:
            kept.keep_from_forward(meta.calls, module, (out.detach(), lse, ctx.states))
        ctx.save_for_backward(q, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        meta, layer = ctx.meta, ctx.layer
        d, n = meta.depth, meta.num_tokens
        kb, vb = meta.stack.k[layer], meta.stack.v[layer]
        gk, gv = meta.stack.grad_buffers(layer)
        window = ctx.variants[0]
        d_sinks = [None]  # the sinks' gradient (reference backends only take sinks)
        if meta.backend in PARTIAL_KERNELS and window is not None:
            q, out, lse = ctx.saved_tensors
            index, cu_k, max_k = meta.windowed_paths(window)
            varlen_bwd = PARTIAL_KERNELS[meta.backend][1]
            dq, dkg, dvg = varlen_bwd(grad_out, q, kb.index_select(0, index), vb.index_select(0, index), out, lse,
                                      ctx.states[0], meta.cu_seqlens_q, cu_k, meta.max_seqlen_q, max_k, True,
                                      ctx.scaling, window=window)
            # a slot gathered for several nodes: its gradients summed in fp32, then split prefix / own
            dk_all = torch.zeros((d + n, *kb.shape[1:]), dtype=torch.float32, device=q.device).index_add_(
                0, index, dkg.float())
            dv_all = torch.zeros_like(dk_all).index_add_(0, index, dvg.float())
            gk[:d] += dk_all[:d]
            gv[:d] += dv_all[:d]
            dk_own, dv_own = dk_all[d:], dv_all[d:]
        elif meta.backend in PARTIAL_KERNELS:
            q, out, lse = ctx.saved_tensors
            own_pair, prefix_pair = _kernel_pairs(meta, q)
            own_state, prefix_state = ctx.states
            k_own, v_own = _own_slots(meta, kb), _own_slots(meta, vb)
            dq, dk_rows, dv_rows = own_pair[1](grad_out, q, _own_rows(meta, k_own), _own_rows(meta, v_own), out, lse,
                                            own_state, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
                                            meta.max_seqlen_k, True, ctx.scaling)
            if meta.kv_local is None:  # each key row is its own node's: nothing to sum
                dk_own, dv_own = dk_rows, dv_rows
            else:  # a key row gathered for several nodes: sum its gradients in fp32
                dk_own, dv_own = _own_key_grads(meta, dk_rows, k_own), _own_key_grads(meta, dv_rows, v_own)
            if d:
                dq_p, dk_p, dv_p = prefix_pair[1](grad_out, q, kb[:d], vb[:d], out, lse, prefix_state, meta.prefix_cu_q,
                                            meta.prefix_cu_k, n, d, False, ctx.scaling)
                dq = dq + dq_p  # summed at fp32 precision, rounded once (bf16 arithmetic's opmath): no cast kernels
                _add_prefix_grads(meta, gk, gv, dk_p, dv_p)
        else:
            q, _ = ctx.saved_tensors
            window, softcap, sinks = ctx.variants
            with torch.enable_grad():
                q_ = q.detach().requires_grad_()
                k_all = _reference_keys(meta, kb).detach().requires_grad_()
                v_all = _reference_keys(meta, vb).detach().requires_grad_()
                s_ = sinks.detach().requires_grad_() if sinks is not None else None
                ref = _reference_attention(meta, q_, k_all, v_all, ctx.scaling, (window, softcap, s_))
                inputs = (q_, k_all, v_all) if s_ is None else (q_, k_all, v_all, s_)
                dq, dk_all, dv_all, *d_sinks = torch.autograd.grad(ref, inputs, grad_out)
            _add_prefix_grads(meta, gk, gv, dk_all[:d], dv_all[:d])
            dk_own, dv_own = dk_all[d:], dv_all[d:]
        if meta.pushed_tokens:  # own K/V: the kernel's gradient plus what descendants left in the fp32 slots
            dk_own = _with_descendant_grads(meta, dk_own, _pushed_slots(meta, gk), q.dtype)
            dv_own = _with_descendant_grads(meta, dv_own, _pushed_slots(meta, gv), q.dtype)
            _zero_pushed_slots(meta, gk)  # consumed: free for the next node pushed there
            _zero_pushed_slots(meta, gv)
        return (dq, dk_own.to(q.dtype), dv_own.to(q.dtype), (d_sinks[0] if d_sinks else None), None, None, None, None,
                None)
