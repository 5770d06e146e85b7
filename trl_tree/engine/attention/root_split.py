"""Packed tree attention split at the roots: one dense rectangle per root plus short node paths.

Why: a long shared root (a GRPO prompt, an agent's system prompt) is read by every node of its
tree. Run as varlen over root paths, each node gathers the root's K/V rows again (and scatters
their gradients back in fp32), and the root's rectangle is computed in tiles of the node's own
length — half-empty 128-row tiles for a 60-token tool result. Split at the root, the same
attention is two partial attentions over disjoint keys, merged by log-sum-exp
(``attention/partial.py``):

- *rectangle*: every query below a root against the root's keys — one dense, non-causal segment
  per root (queries ``[root_end, subtree_end)``, keys ``[root_start, root_end)``: no gather when
  there is one root);
- *paths*: each node against its root path minus the root (causal, bottom-right aligned: the
  node's queries are still the last keys of its trimmed path); a root against itself.

When the forest is one tree and the dense kernel (cuDNN) runs, the root's causal block and its
rectangle are one call: every packed query against the root's keys, the causal mask aligned
top-left (the root's rows see the keys up to their own, the rows below see them all).

Every query sees the same keys as before, exactly once: the result is exact, only the order of
the floating-point sums changes (as between any two attention kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._device import upload
from ..forest import PrefixForest


@dataclass(frozen=True)
class RootSplitLayout:
    """Index arrays of the split (host side; ``TreeAttentionMetadata`` uploads them)."""

    path_kv_index: np.ndarray  # per node, its root path minus the root (a root: its own tokens)
    path_cu_seqlens_k: np.ndarray  # [N + 1] int32 segments of path_kv_index (queries: the forest's cu_seqlens_q)
    path_max_seqlen_k: int
    rect_q_rows: np.ndarray  # packed indices of every query below a split root, root after root
    rect_k_rows: np.ndarray  # packed indices of those roots' tokens
    rect_cu_seqlens_q: np.ndarray  # [R + 1] int32
    rect_cu_seqlens_k: np.ndarray  # [R + 1] int32
    rect_max_seqlen_q: int
    rect_max_seqlen_k: int
    rect_node_lengths: np.ndarray  # query rows of each node below a split root (the unsplit kernel's segments)
    rect_node_root_lengths: np.ndarray  # the length of that node's root
    root_rows: int | None  # R when the forest is one tree: packed rows [0, R) are its root
    nodes_cu_seqlens_q: np.ndarray  # one tree: segments of the non-root nodes' queries, rows [R, U) from 0
    nodes_cu_seqlens_k: np.ndarray  # ... and of their keys: path_kv_index[R:]
    nodes_max_seqlen_q: int
    nodes_max_seqlen_k: int
    #: one tree: the non-root nodes' key rows, counted from row R (they never reach into the root,
    #: so their gathers and gradient sums cover rows [R, U) only)
    nodes_kv_index: np.ndarray

    @property
    def rect_q_span(self) -> tuple[int, int] | None:
        """``(start, stop)`` when the rectangle's queries are one contiguous packed range (a slice, no gather)."""
        return _span(self.rect_q_rows)

    @property
    def rect_k_span(self) -> tuple[int, int] | None:
        return _span(self.rect_k_rows)

    @classmethod
    def from_forest(cls, forest: PrefixForest) -> RootSplitLayout | None:
        """The split of ``forest``, or None when no root has children (nothing to split)."""
        parent = forest.node_parent
        is_root = parent < 0
        ids = np.arange(parent.shape[0])
        # pre-order: a node's root is the last root at or before it
        root = np.maximum.accumulate(np.where(is_root, ids, -1))
        root_len = forest.node_length[root]
        root_start = forest.node_start[root]
        root_end = root_start + root_len
        split_roots = np.flatnonzero(is_root & (forest.node_num_children > 0))
        if split_roots.size == 0:
            return None

        skip = np.where(is_root, 0, root_len)  # leading path entries that are the root's tokens
        seg_len = (forest.cu_seqlens_k[1:] - forest.cu_seqlens_k[:-1]).astype(np.int64)
        keep_len = seg_len - skip
        starts = forest.cu_seqlens_k[:-1].astype(np.int64) + skip
        path_kv_index = forest.kv_index[_ranges(starts, keep_len)]
        path_cu_k = np.zeros(ids.shape[0] + 1, dtype=np.int32)
        np.cumsum(keep_len, out=path_cu_k[1:])

        sub_end = forest.subtree_end[root_start[split_roots]]
        q_len = sub_end - root_end[split_roots]
        k_len = root_len[split_roots]
        rect_cu_q = np.zeros(split_roots.size + 1, dtype=np.int32)
        np.cumsum(q_len, out=rect_cu_q[1:])
        rect_cu_k = np.zeros(split_roots.size + 1, dtype=np.int32)
        np.cumsum(k_len, out=rect_cu_k[1:])
        one_tree = int(is_root.sum()) == 1  # then node 0 is the root, its path segment the first R entries
        R = int(forest.node_length[0]) if one_tree else None
        return cls(
            path_kv_index=path_kv_index,
            path_cu_seqlens_k=path_cu_k,
            path_max_seqlen_k=int(keep_len.max()),
            rect_q_rows=_ranges(root_end[split_roots], q_len),
            rect_k_rows=_ranges(root_start[split_roots], k_len),
            rect_cu_seqlens_q=rect_cu_q,
            rect_cu_seqlens_k=rect_cu_k,
            rect_max_seqlen_q=int(q_len.max()),
            rect_max_seqlen_k=int(k_len.max()),
            rect_node_lengths=forest.node_length[~is_root].astype(np.int64),
            rect_node_root_lengths=root_len[~is_root].astype(np.int64),
            root_rows=R,
            nodes_cu_seqlens_q=(forest.cu_seqlens_q[1:] - R).astype(np.int32) if one_tree else np.zeros(0, np.int32),
            nodes_cu_seqlens_k=(path_cu_k[1:] - R).astype(np.int32) if one_tree else np.zeros(0, np.int32),
            nodes_max_seqlen_q=int(forest.node_length[1:].max()) if one_tree else 0,
            nodes_max_seqlen_k=int(keep_len[1:].max()) if one_tree else 0,
            nodes_kv_index=path_kv_index[R:] - R if one_tree else np.zeros(0, np.int64),
        )


    def rectangle_pairs(self) -> int:
        """(query, key) pairs of the rectangles: the attention the split runs in full tiles."""
        q = np.diff(self.rect_cu_seqlens_q).astype(np.int64)
        k = np.diff(self.rect_cu_seqlens_k).astype(np.int64)
        return int((q * k).sum())

    def rectangle_tile_waste(self, tile: int) -> float:
        """Share of the rectangles' work that per-node tiles of ``tile`` query rows would waste unsplit:
        each query row below a root, padded up to its node's tiles, reads the root's keys."""
        rows = self.rect_node_lengths
        padded = -(-rows // tile) * tile
        keys = self.rect_node_root_lengths
        return float(((padded - rows) * keys).sum() / max(1, int((rows * keys).sum())))

    def to_device(self, device: torch.device) -> RootSplit:
        longs = upload([self.path_kv_index, self.rect_q_rows, self.rect_k_rows, self.nodes_kv_index], torch.int64,
                       device)
        ints = upload([self.path_cu_seqlens_k, self.rect_cu_seqlens_q, self.rect_cu_seqlens_k,
                       self.nodes_cu_seqlens_q, self.nodes_cu_seqlens_k], torch.int32, device)
        return RootSplit(
            path_kv_index=longs[0], path_cu_seqlens_k=ints[0], path_max_seqlen_k=self.path_max_seqlen_k,
            rect_cu_seqlens_q=ints[1], rect_cu_seqlens_k=ints[2], rect_max_seqlen_q=self.rect_max_seqlen_q,
            rect_max_seqlen_k=self.rect_max_seqlen_k, queries=_Rows(self.rect_q_span, longs[1]),
            keys=_Rows(self.rect_k_span, longs[2]), root_rows=self.root_rows,
            nodes_cu_seqlens_q=ints[3], nodes_cu_seqlens_k=ints[4], nodes_max_seqlen_q=self.nodes_max_seqlen_q,
            nodes_max_seqlen_k=self.nodes_max_seqlen_k, nodes_kv_index=longs[3],
        )


@dataclass(frozen=True)
class _Rows:
    """A set of packed rows: a slice when contiguous (a view, no kernel), else an index."""

    span: tuple[int, int] | None
    index: torch.Tensor

    def take(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if self.span is not None:
            return x.narrow(dim, self.span[0], self.span[1] - self.span[0])
        return x.index_select(dim, self.index)

    def put(self, x: torch.Tensor, values: torch.Tensor, dim: int = 0) -> None:
        """``x[rows] = values`` in place."""
        if self.span is not None:
            x.narrow(dim, self.span[0], self.span[1] - self.span[0]).copy_(values)
        else:
            x.index_copy_(dim, self.index, values)

    def add(self, x: torch.Tensor, values: torch.Tensor) -> None:
        """``x[rows] += values`` in place (rows are distinct; ``values`` cast to ``x``'s dtype)."""
        if self.span is not None:
            x[self.span[0] : self.span[1]] += values
        else:
            x.index_add_(0, self.index, values.to(x.dtype))


@dataclass(frozen=True)
class RootSplit:
    """The split on the model's device, read by the packed FlashAttention function."""

    path_kv_index: torch.Tensor
    path_cu_seqlens_k: torch.Tensor
    path_max_seqlen_k: int
    rect_cu_seqlens_q: torch.Tensor
    rect_cu_seqlens_k: torch.Tensor
    rect_max_seqlen_q: int
    rect_max_seqlen_k: int
    queries: _Rows  # every query below a split root
    keys: _Rows  # those roots' tokens
    root_rows: int | None = None  # one tree: its root is packed rows [0, R)
    nodes_cu_seqlens_q: torch.Tensor | None = None
    nodes_cu_seqlens_k: torch.Tensor | None = None
    nodes_max_seqlen_q: int = 0
    nodes_max_seqlen_k: int = 0
    nodes_kv_index: torch.Tensor | None = None  # one tree: the nodes' key rows from row R


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for each (s, n)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(np.asarray(starts, dtype=np.int64), lengths) + np.arange(total, dtype=np.int64) - offsets


def _span(rows: np.ndarray) -> tuple[int, int] | None:
    if rows.size and int(rows[-1]) - int(rows[0]) + 1 == rows.size and (rows.size == 1 or np.all(np.diff(rows) == 1)):
        return int(rows[0]), int(rows[-1]) + 1
    return None
