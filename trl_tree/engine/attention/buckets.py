"""Packed layouts padded to buckets, so that micro-batches of different lengths share a CUDA graph.

Why: a captured graph replays one *layout* — token, segment, key and prediction counts and the
kernels' maximum lengths (``trl_tree.engine.graphs``). GRPO completions have free lengths, so no two
micro-batches have the same layout and nothing would ever replay. Rounded up to buckets of
1/8 octave (at most 12.5% more of each, ~6% on average), micro-batches of similar size get the
same padded layout and replay one pair of graphs.

Counts go up by 1/8 octave; the kernels' maximum segment lengths up to a power of two (they only
size the kernels' grids). How the padding stays exact: the forest's own segments are kept as they
are (whole root paths through the varlen kernel; the root split is not used, its dense blocks'
shapes would be more numbers to bucket). Pad tokens come after the forest's tokens and form segments of their own —
single-row segments to fill the segment count, and one last segment that takes the remaining pad
rows and as many keys as the key count needs (its first pad row repeated, then its own rows:
causal attention over finite values). Every real query sees exactly its keys; pad rows are finite
(no empty segment, whose output rows the kernel would leave unwritten) and receive no gradient;
padded predictions read a pad row and are cut off before the loss. Pad rows cost their share of
compute: that is the price of a replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._device import upload
from ..forest import PrefixForest
from .metadata import TreeAttentionMetadata

#: bucket steps per octave: a count is rounded up to a multiple of 2^(⌊log2 n⌋ - 3)
STEPS_PER_OCTAVE = 8


def bucket(n: int) -> int:
    """The smallest bucket ≥ ``n``: exact up to 2·STEPS_PER_OCTAVE, then STEPS_PER_OCTAVE steps per
    octave (100 → 104, 10,241 → 11,264)."""
    if n <= 2 * STEPS_PER_OCTAVE:
        return max(int(n), 1)
    step = 1 << (int(n).bit_length() - STEPS_PER_OCTAVE.bit_length())
    return -(-int(n) // step) * step


def _power_of_two(n: int) -> int:
    """Maximum segment lengths round up to a power of two: the kernels only size their grids by
    them (blocks past a segment's end return at once), so a coarse bound costs little and makes
    more layouts share a bucket."""
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclass(frozen=True)
class BucketedLayout:
    """Host arrays of a forest's packed layout padded to buckets (see the module docstring)."""

    tokens: np.ndarray  # [U_b] int64: the forest's tokens, then pad tokens (0)
    position_ids: np.ndarray  # [U_b]
    subtree_end: np.ndarray  # [U_b]: a pad row is its own subtree
    kv_index: np.ndarray  # [K_b]
    cu_seqlens_q: np.ndarray  # [N_b + 1] int32
    cu_seqlens_k: np.ndarray  # [N_b + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    pred_src: np.ndarray  # [P_b]: pad predictions read the first pad row
    targets: np.ndarray  # [P_b]: pad targets are token 0
    num_predictions: int  # P, the real predictions: the first P rows of the scores

    @classmethod
    def pad(cls, forest: PrefixForest, pred_src: np.ndarray, targets: np.ndarray) -> BucketedLayout:
        """``forest``'s layout with its predictions ``pred_src`` → ``targets``, padded to buckets."""
        U, N, K, P = forest.num_unique_tokens, forest.num_nodes, int(forest.kv_index.shape[0]), len(pred_src)
        n_pad = bucket(N + 1) - N  # ≥ 1 pad segment, each with ≥ 1 row
        pad_q = bucket(U + n_pad) - U
        pad_k = bucket(K + pad_q) - K
        last_q, last_k = pad_q - (n_pad - 1), pad_k - (n_pad - 1)  # the last pad segment; last_k ≥ last_q
        rows = U + np.arange(pad_q)
        first_last = U + n_pad - 1  # the last pad segment's first row
        kv_pad = np.concatenate([rows[: n_pad - 1], np.full(last_k - last_q, first_last), rows[n_pad - 1 :]])
        q_lens = np.concatenate([np.ones(n_pad - 1, np.int64), [last_q]])
        k_lens = np.concatenate([np.ones(n_pad - 1, np.int64), [last_k]])
        positions = np.concatenate([np.zeros(n_pad - 1, np.int64), np.arange(last_q)])
        P_b = bucket(max(P, 1))
        return cls(
            tokens=np.concatenate([forest.tokens, np.zeros(pad_q, np.int64)]),
            position_ids=np.concatenate([forest.position_ids, positions]),
            subtree_end=np.concatenate([forest.subtree_end, rows + 1]),
            kv_index=np.concatenate([forest.kv_index, kv_pad]),
            cu_seqlens_q=np.concatenate([forest.cu_seqlens_q, U + np.cumsum(q_lens)]).astype(np.int32),
            cu_seqlens_k=np.concatenate([forest.cu_seqlens_k, K + np.cumsum(k_lens)]).astype(np.int32),
            max_seqlen_q=_power_of_two(max(forest.max_seqlen_q, int(last_q))),
            max_seqlen_k=_power_of_two(max(forest.max_seqlen_k, int(last_k))),
            pred_src=np.concatenate([pred_src, np.full(P_b - P, U, np.int64)]),
            targets=np.concatenate([targets, np.zeros(P_b - P, np.int64)]),
            num_predictions=P,
        )

    def to_device(self, device: torch.device, backend: str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, TreeAttentionMetadata]:
        """``(tokens, pred_src, targets, metadata)`` on ``device`` (one copy per dtype)."""
        tokens, pred_src, targets, subtree_end, positions, kv_index = upload(
            [self.tokens, self.pred_src, self.targets, self.subtree_end, self.position_ids, self.kv_index],
            torch.int64, device)
        cu_q, cu_k = upload([self.cu_seqlens_q, self.cu_seqlens_k], torch.int32, device)
        meta = TreeAttentionMetadata(
            backend=backend, num_tokens=int(self.tokens.shape[0]), max_depth=self.max_seqlen_k,
            subtree_end=subtree_end, position_ids=positions.unsqueeze(0), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
            kv_index=kv_index, max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k)
        meta._cache["host_subtree_end"] = self.subtree_end  # the reference backends' spans: no sync while capturing
        return tokens, pred_src, targets, meta
