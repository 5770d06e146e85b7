"""Tree metadata on the model's device: what the attention backends read during a forward.

One object travels through ``model(..., trl_tree_attention=meta)`` to every attention call. It is
built once per forest and device; masks that only some backends need (a dense mask for the
reference backends, a flex ``BlockMask``) are built lazily on first use and then reused by every
layer and by the gradient-checkpointing recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..forest import PrefixForest

#: keyword argument of ``model(...)`` that carries a :class:`TreeAttentionMetadata`
TREE_KWARG = "trl_tree_attention"


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

    @classmethod
    def from_forest(cls, forest: PrefixForest, device: torch.device, backend: str) -> TreeAttentionMetadata:
        def to(x, dtype):
            return torch.from_numpy(x).to(device=device, dtype=dtype, non_blocking=True)

        return cls(
            backend=backend,
            num_tokens=forest.num_unique_tokens,
            max_depth=forest.max_depth,
            subtree_end=to(forest.subtree_end, torch.int64),
            position_ids=to(forest.position_ids, torch.int64).unsqueeze(0),
            cu_seqlens_q=to(forest.cu_seqlens_q, torch.int32),
            cu_seqlens_k=to(forest.cu_seqlens_k, torch.int32),
            kv_index=to(forest.kv_index, torch.int64),
            max_seqlen_q=forest.max_seqlen_q,
            max_seqlen_k=forest.max_seqlen_k,
        )

    def attend(self, module, query, key, value, scaling: float) -> torch.Tensor:
        """Tree attention of the packed forest with the chosen backend, ``[1, U, H, D]``."""
        from .backends import TREE_ATTENTION

        return TREE_ATTENTION[self.backend](query, key, value, self, scaling)

    def dense_mask(self) -> torch.Tensor:
        """[U, U] bool: query q sees key k iff ``k <= q < subtree_end[k]`` (reference backends)."""
        mask = self._cache.get("dense")
        if mask is None:
            mask = tree_visibility(self.subtree_end)
            self._cache["dense"] = mask
        return mask

    def block_mask(self):
        """flex_attention ``BlockMask`` from the ``subtree_end`` rule, built once per forest."""
        bm = self._cache.get("block_mask")
        if bm is None:
            from torch.nn.attention.flex_attention import create_block_mask

            n = self.num_tokens
            # the mask_mod may be evaluated on padded indices past U; clamp keeps the lookup in range
            subtree_end = self.subtree_end

            def tree_mask(b, h, q_idx, kv_idx):
                return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx.clamp(max=n - 1)])

            # compiled on CUDA so the mask is never materialised as [U, U]
            bm = create_block_mask(
                tree_mask, None, None, n, n, device=subtree_end.device, _compile=subtree_end.is_cuda
            )
            self._cache["block_mask"] = bm
        return bm
