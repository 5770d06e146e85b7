"""Tree metadata on the model's device: what the attention backends read during a forward.

One object travels through ``model(..., trl_tree_attention=TreeCall(meta))`` to every attention call. It is
built once per forest and device; masks that only some backends need (a dense mask for the
reference backends, a flex ``BlockMask``) are built lazily on first use and then reused by every
layer and by the gradient-checkpointing recompute.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._device import upload
from ..forest import PrefixForest
from .kept import KeptAttention
from .partial import PARTIAL_KERNELS, dense_shape_seen
from .root_split import RootSplit, RootSplitLayout

#: keyword argument of ``model(...)`` that carries a :class:`TreeCall`
TREE_KWARG = "trl_tree_attention"


class TreeCall:
    """The handle a forward's metadata travels in: neither a dataclass nor a container.

    Why: wrappers rebuild what they recognise in a forward's arguments. FSDP2's mixed-precision
    policy casts forward inputs through ``torch.distributed.utils._apply_to_tensors``, which copies
    every dataclass (``dataclasses.replace``) and dict it meets, at the root and again at each
    wrapped decoder layer; the layers then counted their calls and cached their masks on copies,
    and the engine saw "0 of N layers". An opaque object passes through every such traversal as
    itself, so all layers (and the checkpointed recompute) share the one metadata object.
    """

    __slots__ = ("meta",)

    def __init__(self, meta: Any) -> None:
        self.meta = meta

    def __repr__(self) -> str:
        return f"TreeCall({type(self.meta).__name__})"


#: split when per-node tiles would waste at least this share of all attention work on the rectangles
ROOT_SPLIT_MIN_WASTE = 0.1
#: with a dense kernel (cuDNN): split when the dense blocks are at least this share of the attention
ROOT_SPLIT_MIN_DENSE_SHARE = 0.75
#: query rows per FlashAttention-2 tile (forward, head_dim 64-128): a node's rows are padded to it
FLASH_QUERY_TILE = 128


def use_root_split(forest: PrefixForest, layout: RootSplitLayout, dense: bool = False) -> bool:
    """Whether splitting at the roots pays (measured on H200, ``docs/benchmarks/notes.md`` §12).

    Unsplit, each node computes its share of the root's rectangle in tiles of ``FLASH_QUERY_TILE``
    query rows: a 60-token tool result fills half a tile, a 512-token completion fills four. Split,
    each rectangle is one segment, at the price of more kernels and a log-sum-exp merge. With FA2
    alone the split won only where nodes are short (agentic trees, whose tiles waste much of the
    attention work) and lost on GRPO groups with long completions, so split when the removed
    waste is a good share. With a dense kernel (``dense``: cuDNN, faster than FA2 on dense blocks)
    the rectangle and the root's causal block of a single tree run dense: split when those blocks
    are most of the attention (the thresholds and their measurements: notes §12). Never for roots
    shorter than a tile (nothing worth a second kernel).
    """
    if layout.rect_max_seqlen_k < FLASH_QUERY_TILE:
        return False
    total = forest.sum_visible_keys()
    if dense and layout.rect_q_span is not None:
        R = layout.root_rows or 0
        return layout.rectangle_pairs() + R * (R + 1) // 2 >= ROOT_SPLIT_MIN_DENSE_SHARE * total
    waste = layout.rectangle_tile_waste(FLASH_QUERY_TILE) * layout.rectangle_pairs()
    return waste >= ROOT_SPLIT_MIN_WASTE * total


def _split_choice(forest: PrefixForest, backend: str, root_split: bool | None, dense: bool,
                  dense_key: tuple | None) -> tuple[RootSplitLayout | None, bool]:
    """The root split to run (host arrays, or None) and whether its blocks take the dense pair
    (see :meth:`TreeAttentionMetadata.from_forest`)."""
    layout = None
    if backend in PARTIAL_KERNELS and root_split is not False:
        layout = RootSplitLayout.from_forest(forest)
        if layout is not None and dense and dense_key is not None:
            dense = dense_shape_seen(backend, ("split", forest.num_unique_tokens, layout.root_rows,
                                               layout.rect_max_seqlen_q, layout.rect_max_seqlen_k, *dense_key))
        if layout is not None and root_split is None and not use_root_split(forest, layout, dense):
            layout = None
    return layout, dense


def tree_ranges(subtree_end: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of each tree of a packed forest: in DFS pre-order a tree's root comes first
    and its subtree ends where the next tree's root begins."""
    ranges, start, n = [], 0, len(subtree_end)
    while start < n:
        end = max(int(subtree_end[start]), start + 1)  # a root's subtree holds at least the root
        ranges.append((start, end))
        start = end
    return ranges


#: neighbouring trees are attended together while their span stays within this many tokens (or the
#: largest tree's): a span's cost is its square, and many one-token trees (a bucket's padding)
#: would otherwise be as many calls
SPAN_TOKENS = 256


def tree_spans(subtree_end: np.ndarray) -> list[tuple[int, int]]:
    """The ranges the reference backends attend one at a time: whole trees (:func:`tree_ranges`),
    neighbours merged while the span stays within ``SPAN_TOKENS`` or the largest tree's length."""
    ranges = tree_ranges(subtree_end)
    limit = max([SPAN_TOKENS] + [end - start for start, end in ranges])
    spans: list[tuple[int, int]] = []
    for start, end in ranges:
        if spans and end - spans[-1][0] <= limit:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


def tree_visibility(subtree_end: torch.Tensor) -> torch.Tensor:
    """``[n, n]`` bool: query q sees key k iff ``k <= q < subtree_end[k]`` (packed DFS pre-order)."""
    idx = torch.arange(subtree_end.shape[0], device=subtree_end.device)
    return (idx[None, :] <= idx[:, None]) & (idx[:, None] < subtree_end[None, :])


@dataclass(eq=False)
class DenseCausalBatch:
    """Marker for a ``(B, L)`` batch of unshared rows run through the model's own causal attention.

    Carried like tree metadata, so the dispatcher still refuses what the tree could not compute
    exactly (the same errors whatever the batch looks like) and counts the layers it served.
    """

    max_depth: int  # L
    calls: int = 0


@dataclass(eq=False)
class TreeAttentionMetadata:
    """Packed-layout tensors of one forest on one device, plus the chosen attention backend."""

    backend: str
    num_tokens: int  # U
    max_depth: int
    subtree_end: torch.Tensor  # [U] int64
    position_ids: torch.Tensor  # [1, U] int64
    cu_seqlens_q: torch.Tensor  # [N + 1] int32
    cu_seqlens_k: torch.Tensor  # [N + 1] int32
    kv_index: torch.Tensor  # [sum of path lengths] int64
    max_seqlen_q: int
    max_seqlen_k: int
    calls: int = 0  # attention calls served (checked against the layer count after a forward)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    root_split: RootSplit | None = None  # see attention/root_split.py (FlashAttention backends)
    #: the split's single-segment blocks may run on the dense pair (``partial.dense_kernels``): decided
    #: once when built, so that a captured CUDA graph's layout signature says which kernels it holds
    dense: bool = False
    kept: KeptAttention | None = None  # outputs kept for the checkpointed recompute (attention/kept.py)

    @classmethod
    def from_forest(cls, forest: PrefixForest, device: torch.device, backend: str,
                    root_split: bool | None = None, dense: bool = False,
                    dense_key: tuple | None = None) -> TreeAttentionMetadata:
        """Upload the forest's layout (two copies, ``_device.upload``). ``root_split``: split the
        attention at the roots (True), never (False), or where it pays (None, :func:`use_root_split`;
        ``dense``: whether a dense kernel will run the single-segment parts); only backends with
        partial kernels (``attention/partial.py``, i.e. ``torch_flash``) run it; the split's blocks then
        run on the dense pair only where ``dense``. ``dense_key`` (the model's heads and dtype): count
        the split's dense shapes under it and take the dense pair only for shapes seen before
        (``partial.dense_shape_seen``: cuDNN plans every new shape); None: no counting (a CUDA graph
        plans its shapes once, at capture)."""
        layout, dense = _split_choice(forest, backend, root_split, dense, dense_key)
        longs = upload([forest.subtree_end, forest.position_ids, forest.kv_index], torch.int64, device)
        ints = upload([forest.cu_seqlens_q, forest.cu_seqlens_k], torch.int32, device)
        meta = cls(
            backend=backend,
            num_tokens=forest.num_unique_tokens,
            max_depth=forest.max_depth,
            subtree_end=longs[0],
            position_ids=longs[1].unsqueeze(0),
            cu_seqlens_q=ints[0],
            cu_seqlens_k=ints[1],
            kv_index=longs[2],
            max_seqlen_q=forest.max_seqlen_q,
            max_seqlen_k=forest.max_seqlen_k,
            root_split=layout.to_device(device) if layout is not None else None,
            dense=dense,
        )
        # the node layout on the host, for a recurrent mixer's segments (``mixers/scan.py``: no sync)
        meta._cache["host_layout"] = (forest.cu_seqlens_q, forest.cu_seqlens_k, forest.kv_index)
        meta._cache["host_subtree_end"] = forest.subtree_end  # the reference backends' spans (``spans``)
        return meta

    def rechosen(self, forest: PrefixForest, root_split: bool | None = None, dense: bool = False,
                 dense_key: tuple | None = None) -> TreeAttentionMetadata:
        """This forest's metadata with its layout choices made again (arguments as in
        :meth:`from_forest`), sharing the arrays already on the device: an eager call after a
        graphed one that did not replay — whose choices (cuDNN at smaller heads, no sighting rule)
        an eager call does not make — uploads nothing again, unless it splits where this did not."""
        layout, dense = _split_choice(forest, self.backend, root_split, dense, dense_key)
        if layout is None:
            split = None
        elif self.root_split is not None:  # the same forest's split: the same arrays
            split = self.root_split
        else:
            split = layout.to_device(self.subtree_end.device)
        layout_keys = ("host_layout", "host_subtree_end", "tree_spans")  # the layout, not a choice
        kept_host = {k: v for k, v in self._cache.items() if k in layout_keys}
        return dataclasses.replace(self, root_split=split, dense=dense, calls=0, _cache=kept_host, kept=None)

    def dense_mask(self, window: int | None = None) -> torch.Tensor:
        """[U, U] bool: query q sees key k iff ``k <= q < subtree_end[k]`` (reference backends), and with
        a sliding ``window`` iff also ``depth(q) - depth(k) < window``."""
        return self.span_mask(0, self.num_tokens, window)

    def spans(self) -> list[tuple[int, int]]:
        """The packed ranges the reference backends attend one at a time (:func:`tree_spans`): whole
        trees, so no query of one sees a key of another. Made on first use, from the host's copy of
        the layout where the metadata was made from one (no sync), so other backends pay nothing."""
        spans = self._cache.get("tree_spans")
        if spans is None:
            host = self._cache.get("host_subtree_end")
            spans = self._cache["tree_spans"] = tree_spans(host if host is not None else
                                                           self.subtree_end.cpu().numpy())
        return spans

    def span_mask(self, start: int, end: int, window: int | None = None) -> torch.Tensor:
        """:meth:`dense_mask` over the range ``[start, end)`` alone (a span of :meth:`spans`: whole
        trees, so it is that mask's block), built once per range and window."""
        key = ("mask", start, end, window)
        mask = self._cache.get(key)
        if mask is None:
            mask = tree_visibility(self.subtree_end[start:end] - start)
            if window is not None:
                depth = self.position_ids[0, start:end]
                mask = mask & (depth[:, None] - depth[None, :] < window)
            self._cache[key] = mask
        return mask

    def block_mask(self, window: int | None = None):
        """flex_attention ``BlockMask`` from the ``subtree_end`` rule (and a sliding ``window`` on the
        depths), built once per forest and window."""
        key = ("block_mask", window)
        bm = self._cache.get(key)
        if bm is None:
            from torch.nn.attention.flex_attention import create_block_mask

            n = self.num_tokens
            # the mask_mod may be evaluated on padded indices past U; clamp keeps the lookup in range
            subtree_end = self.subtree_end
            depth = self.position_ids[0]

            def tree_mask(b, h, q_idx, kv_idx):
                return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx.clamp(max=n - 1)])

            def windowed_tree_mask(b, h, q_idx, kv_idx):
                seen = depth[q_idx.clamp(max=n - 1)] - depth[kv_idx.clamp(max=n - 1)] < window
                return tree_mask(b, h, q_idx, kv_idx) & seen

            # compiled on CUDA so the mask is never materialised as [U, U]
            bm = create_block_mask(
                tree_mask if window is None else windowed_tree_mask, None, None, n, n, device=subtree_end.device,
                _compile=subtree_end.is_cuda,
            )
            self._cache[key] = bm
        return bm
