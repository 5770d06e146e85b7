"""TRL's async GRPO packed row read back as sequences, so the tree engine can answer its loss.

TRL 1.16's async GRPO (``trl.experimental.async_grpo``) packs each rank's samples into a trie row
(``packing.TreeRow.pack``): the unique tokens in depth-first pre-order, each segment's root path in
``tree_kv_index`` (bounds ``tree_cu_seqlens_k``), the segments' own rows (``tree_cu_seqlens_q``),
and per packed position the next token it is trained to predict (``shift_labels``, -100 where
none). Its loss reads the fused head's ``log_probs`` and ``entropy`` at those positions.

The engine takes sequences. Every root-to-leaf path of the row is one (a sample ends on a leaf:
the trie keys a sample's last token on ``None``, which nothing extends; equal samples share their
leaf). A labelled position is scored on one leaf below it — every sample through a node agrees on
the next token, since the trie keys a node on its token and the next — so each labelled position is
one term here, as it is one row of stock's head; stock's loss then gathers it once per sample that
shares it (``token_index``), unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TrieRow:
    """One rank's packed row as sequences: leaf ``l``'s root path is ``tokens[starts[l] :
    starts[l] + lengths[l]]`` (``sequences[l]``); labelled packed position ``labelled[i]`` is scored on
    leaf ``leaf[i]`` at prediction index ``depth[i]`` (``log p(sequences[l][depth + 1] |
    sequences[l][: depth + 1])``). The paths are kept end to end in one array, so that laying them
    out costs no Python loop over tokens (this runs on every micro-batch, before its first kernel)."""

    tokens: np.ndarray
    lengths: np.ndarray
    labelled: np.ndarray
    leaf: np.ndarray
    depth: np.ndarray
    num_positions: int

    @classmethod
    def from_packed(cls, input_ids, position_ids, shift_labels, kv_index, cu_seqlens_q, cu_seqlens_k,
                    who: str = "the tree") -> TrieRow:
        """From one rank's unpadded row (1-D tensors or arrays as ``TreeRow.pack`` returns them).
        Refuses a row whose labels are not the next token of their leaf (a layout this reading does
        not describe), with the position: never a wrong number."""
        ids, pos, labels, kv, cu_q, cu_k = (np.asarray(_host(x), dtype=np.int64) for x in
                                            (input_ids, position_ids, shift_labels, kv_index, cu_seqlens_q,
                                             cu_seqlens_k))
        n = ids.shape[0]
        seg_len, path_len = np.diff(cu_q), np.diff(cu_k)
        if cu_q[-1] != n or (path_len < seg_len).any() or kv.shape[0] != cu_k[-1]:
            raise ValueError(f"{who}: the packed row's segments do not cover its {n} tokens")
        segment_of = np.repeat(np.arange(seg_len.shape[0]), seg_len)
        child = path_len > seg_len  # its path enters it from a parent segment's last row
        parent_last = kv[cu_k[1:][child] - seg_len[child] - 1]
        inner = np.zeros(seg_len.shape[0], dtype=bool)
        inner[segment_of[parent_last]] = True
        leaves = np.flatnonzero(~inner)
        paths = [kv[cu_k[s] : cu_k[s + 1]] for s in leaves]
        # the leaves' root paths end to end: path l's entry d at starts[l] + d
        lengths = path_len[leaves]
        starts = np.zeros(leaves.shape[0], dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        owner = np.repeat(np.arange(leaves.shape[0]), lengths)
        flat = np.concatenate(paths) if paths else np.zeros(0, dtype=np.int64)
        if not np.array_equal(pos[flat], np.arange(flat.shape[0]) - starts[owner]):
            raise ValueError(f"{who}: a packed root path does not run through depths 0, 1, 2, ...")
        rows, first = np.unique(flat, return_index=True)  # each position's first leaf below it
        leaf_of = np.full(n, -1, dtype=np.int64)
        leaf_of[rows] = owner[first]
        labelled = np.flatnonzero(labels != -100)
        leaf, depth = leaf_of[labelled], pos[labelled]
        on_path = (leaf >= 0) & (depth + 1 < lengths[np.maximum(leaf, 0)])
        following = ids[flat[np.where(on_path, starts[np.maximum(leaf, 0)] + depth + 1, 0)]]
        wrong = np.flatnonzero(~on_path | (following != labels[labelled]))
        if wrong.size:
            p = int(labelled[wrong[0]])
            raise ValueError(f"{who}: packed position {p} is trained to predict token {int(labels[p])}, which is not "
                             "the next token of its path")
        return cls(ids[flat], lengths, labelled, leaf, depth, n)

    @property
    def sequences(self) -> list[list[int]]:
        """Each leaf's root path as a list of token ids."""
        return [part.tolist() for part in np.split(self.tokens, np.cumsum(self.lengths)[:-1])]

    def padded_batch(self, pad_token_id: int, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """The leaves as a right-padded batch with labels only where a packed position is scored
        (``labels[l, d + 1]``): what ``SFTRows.from_batch`` and TRL's fused head take."""
        width = int(self.lengths.max())
        mask = np.arange(width)[None, :] < self.lengths[:, None]
        input_ids = np.full(mask.shape, pad_token_id, dtype=np.int64)
        input_ids[mask] = self.tokens  # row-major order is the paths' order end to end
        labels = np.full(mask.shape, -100, dtype=np.int64)
        labels[self.leaf, self.depth + 1] = input_ids[self.leaf, self.depth + 1]
        return {name: torch.from_numpy(t).to(device) for name, t in
                (("input_ids", input_ids), ("attention_mask", mask.astype(np.int64)), ("labels", labels))}

    def to_packed(self, grid: torch.Tensor) -> torch.Tensor:
        """A ``(leaves, width - 1)`` per-prediction grid (the fused head's layout for the padded batch)
        as stock's ``(1, positions)`` row: each labelled position's value, zero elsewhere;
        differentiable."""
        index = torch.from_numpy(self.labelled).to(grid.device)
        leaf, depth = (torch.from_numpy(x).to(grid.device) for x in (self.leaf, self.depth))
        out = grid.new_zeros(self.num_positions).index_put((index,), grid[leaf, depth])
        return out.unsqueeze(0)


def _host(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
