"""Recurrent scans (gated DeltaNet, Mamba-2, Mamba-1) over a prefix tree: each node starts from its
parent's final state.

Why it is exact: a recurrent mixer's state after a token is a function of the token's root path
alone, so the state at the end of a node is the same for every sequence through it and is
computed once; each child continues from it, as the untreed scan of any of those sequences
would at that position. Only the chunking of the floating-point sums differs (a node's scan
starts its chunks at the node), as between any two chunk sizes.

How: a call's nodes are *segments* — each its rows in the call and where its initial state comes
from: another segment of the same call, the state the call starts from (a walk unit below a
pushed node), or zero (a root). Segments run level by level (parents before children), each
level as one right-padded batch through the mixer's own chunked kernel with per-segment initial
states. The mixer hands in per-token inputs whose zero padding leaves the state unchanged (a zero
key, value, step ``dt`` or ``beta``, and a zero log-decay): the final state of a padded row is
its segment's.

The depth-first walk keeps, per layer, the final state of every pushed node on its stack (keyed
by the depth where the node ends), as it keeps K/V: a unit starts from the state at its depth
(:func:`carried_state`) and, in its backward, adds that state's gradient into the stack
(``_CarriedState``); the pushed node's own unit hands its final state on (:func:`hand_on`) and,
when it is popped, takes the gradient its subtree left there into its own backward
(``_HandedState``) — the protocol of the K/V stack (``dfs/stack.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .._device import upload
from ..attention.metadata import TreeAttentionMetadata
from .conv import index_rows

ZERO, CARRIED = -2, -1  # a segment's initial state: zero (a root), the state the call starts from


@dataclass
class Segments:
    """A call's nodes as scan segments, grouped in levels (every parent in an earlier level)."""

    rows: list[torch.Tensor]  # per level [B, L]: the call's rows of each segment, right-padded with row n
    real: list[torch.Tensor]  # per level: flat positions of the real rows in [B * L]
    sources: list[torch.Tensor]  # per level, per segment: its initial state's place in the pool (see scan)
    order: torch.Tensor  # the levels' real rows, concatenated, put back in call order

    @classmethod
    def build(cls, starts: np.ndarray, lengths: np.ndarray, parent: np.ndarray, device: torch.device) -> Segments:
        """Segments from each node's first row, length and parent (an earlier node, ``CARRIED`` or
        ``ZERO``)."""
        n_nodes = len(starts)
        level = np.zeros(n_nodes, np.int64)
        for i in range(n_nodes):
            if parent[i] >= 0:
                if parent[i] >= i:
                    raise ValueError("a segment's parent must come before it (pre-order)")
                level[i] = level[parent[i]] + 1
        num_rows = int(lengths.sum())
        pool_at = np.zeros(n_nodes, np.int64)  # a node's final state's place in the pool: after ZERO, CARRIED
        filled = 2
        arrays, sizes = [], []
        for lv in range(int(level.max()) + 1 if n_nodes else 0):
            nodes = np.flatnonzero(level == lv)
            width = int(lengths[nodes].max())
            steps = np.arange(width)
            rows = np.where(steps[None, :] < lengths[nodes][:, None], starts[nodes][:, None] + steps[None, :],
                            num_rows)
            real = np.flatnonzero(rows.reshape(-1) < num_rows)
            p = parent[nodes]
            source = np.where(p == ZERO, 0, np.where(p == CARRIED, 1, pool_at[np.maximum(p, 0)]))
            pool_at[nodes] = filled + np.arange(len(nodes))
            filled += len(nodes)
            arrays += [rows, real, source]
            sizes.append(rows.reshape(-1)[real])
        order = np.empty(num_rows, np.int64)
        if sizes:
            order[np.concatenate(sizes)] = np.arange(num_rows)
        tensors = upload(arrays + [order], torch.int64, device)
        return cls(rows=tensors[0:-1:3], real=tensors[1:-1:3], sources=tensors[2:-1:3], order=tensors[-1])


def _call_cache(meta) -> dict:
    """Where a tree call's metadata keeps the mixers' tables (packed forest or walk unit)."""
    return meta._cache if isinstance(meta, TreeAttentionMetadata) else meta._conv


def segments_of(meta) -> Segments:
    """The segments of a tree call (built once per call's metadata, on the host, one upload): the
    packed forest's nodes, or a walk unit's nodes below its stack."""
    cache = _call_cache(meta)
    seg = cache.get("segments")
    if seg is None:
        seg = _packed_segments(meta) if isinstance(meta, TreeAttentionMetadata) else _unit_segments(meta)
        cache["segments"] = seg
    return seg


def _parents(cu_q: np.ndarray, cu_k: np.ndarray, path: np.ndarray | None, rootward: int) -> np.ndarray:
    """Each node's parent: the node whose last row is the row before the node's first on its path
    (``path``: rows of each node's path, ``cu_k`` segmenting it; None: each node's path is itself)."""
    q_len = np.diff(cu_q)
    parent = np.full(len(q_len), rootward, np.int64)
    if path is None:
        return parent
    path_len = np.diff(cu_k)
    inner = np.flatnonzero(path_len > q_len)
    before = path[cu_k[inner + 1] - q_len[inner] - 1]  # the row before each node's first, on its path
    owner = np.searchsorted(cu_q, before, side="right") - 1
    if np.any(cu_q[owner + 1] - 1 != before):
        raise ValueError("a node hangs off the middle of another: the forest is not a radix tree of the sequences")
    parent[inner] = owner
    return parent


def _host_layout(meta, path: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(cu_q, cu_k, path)`` of the call's nodes: kept on the host when the metadata was built (the
    walk's units, a packed forest), else read back from the device (one sync per call)."""
    host = _call_cache(meta).get("host_layout")
    if host is None:
        host = (meta.cu_seqlens_q.cpu().numpy(), meta.cu_seqlens_k.cpu().numpy(),
                path.cpu().numpy() if path is not None else None)
    cu_q, cu_k, nodes_path = host
    return cu_q.astype(np.int64), cu_k.astype(np.int64), nodes_path


def _packed_segments(meta: TreeAttentionMetadata) -> Segments:
    cu_q, cu_k, path = _host_layout(meta, meta.kv_index)
    parent = _parents(cu_q, cu_k, path, ZERO)
    return Segments.build(cu_q[:-1], np.diff(cu_q), parent, meta.kv_index.device)


def _unit_segments(meta) -> Segments:
    cu_q, cu_k, path = _host_layout(meta, meta.kv_local)
    parent = _parents(cu_q, cu_k, path, CARRIED if meta.depth else ZERO)
    if meta.pushed_tokens and (cu_q[1] != meta.pushed_tokens or parent[0] >= 0):
        raise ValueError(f"a pushed unit's first node must be its pushed node ({meta.pushed_tokens} tokens), "
                         f"got {cu_q[1]}")
    return Segments.build(cu_q[:-1], np.diff(cu_q), parent, meta.position_ids.device)


def scan_segments(seg: Segments, inputs: list[torch.Tensor], scan: Callable, carried: torch.Tensor | None,
                  zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``scan`` over the segments: ``inputs`` are per-row tensors ``[n, ...]`` whose zero rows
    leave the state unchanged; ``scan(*padded [B, L, ...], initial [B, *S]) -> (out [B, L, ...],
    final [B, *S])``; ``carried``: the state the call starts from (None: zero); ``zero``: a zero
    state ``[*S]``. Returns the outputs ``[n, ...]`` in call order and the first segment's final
    state."""
    padded_inputs = [torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in inputs]
    pool = [zero[None], (carried if carried is not None else zero)[None]]
    outs, first = [], None
    # index_select, not advanced indexing: its backward is an index_add, where indexing's sorts the indices
    for rows, real, sources in zip(seg.rows, seg.real, seg.sources):
        initial = torch.cat(pool).index_select(0, sources)
        out, final = scan(*(index_rows(x, rows) for x in padded_inputs), initial)
        outs.append(out.flatten(0, 1).index_select(0, real))
        pool.append(final)
        if first is None:
            first = final[0]
    return torch.cat(outs).index_select(0, seg.order), first


# --------------------------------------------------------------------------- the walk's state stack
def carried_state(meta, layer: int, anchor: torch.Tensor) -> torch.Tensor | None:
    """The state a walk unit starts from: the final state of the pushed node at its depth (None at
    the root). ``anchor``: a tensor of the unit's graph that carries the state's gradient back."""
    if isinstance(meta, TreeAttentionMetadata) or not meta.depth:
        return None
    key = (layer, meta.depth)
    state = meta.stack.states[key]
    if torch.is_grad_enabled() and anchor.requires_grad:
        return _CarriedState.apply(anchor, state, meta.stack, key)
    return state


def hand_on(meta, layer: int, out: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """A pushed unit keeps its node's ``final`` state on the stack for the node's subtree; ``out``
    (the layer's output) comes back carrying the state's gradient into the node's backward."""
    if isinstance(meta, TreeAttentionMetadata) or not meta.pushed_tokens:
        return out
    key = (layer, meta.depth + meta.pushed_tokens)
    meta.stack.states[key] = final.detach()
    if torch.is_grad_enabled() and final.requires_grad:
        return _HandedState.apply(out, final, meta.stack, key)
    return out


class _CarriedState(torch.autograd.Function):
    """The stack's state as an input of the unit; its gradient goes into the stack (fp32) for the
    pushed node that owns it."""

    @staticmethod
    def forward(ctx, anchor, state, stack, key):
        ctx.stack, ctx.key = stack, key
        return state.clone()

    @staticmethod
    def backward(ctx, grad):
        grads = ctx.stack.state_grads
        if ctx.key in grads:
            grads[ctx.key] += grad.float()
        else:  # a copy: later units add into it in place, and autograd may still hold ``grad``
            grads[ctx.key] = grad.to(torch.float32, copy=True)
        return None, None, None, None


class _HandedState(torch.autograd.Function):
    """Identity on the layer's output whose backward also hands the node's final state the gradient
    its subtree left on the stack (taking it off)."""

    @staticmethod
    def forward(ctx, out, final, stack, key):
        ctx.stack, ctx.key, ctx.dtype = stack, key, final.dtype
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        left = ctx.stack.state_grads.pop(ctx.key, None)
        return grad, (left.to(ctx.dtype) if left is not None else None), None, None
