"""The prefix forest: a compressed trie of one micro-batch's sequences and its packed layout.

Why a radix tree built from *sorted* sequences: sorted order is the trie's depth-first leaf order,
so only neighbours' longest common prefixes are needed (one vectorised comparison each) and the
nodes come out almost in pre-order; no per-token dictionary walk. 64 sequences of 4k tokens build
in a few milliseconds.

The packed layout lays the unique tokens out in DFS pre-order with position id = depth, so every
node's subtree is one contiguous range and attention visibility is the single rule
``k <= q < subtree_end[k]``. For varlen FlashAttention each node is one query segment whose keys
are its root path (ancestors + own tokens), gathered through ``kv_index``; the key of a node's
path is exactly the packed indices of any sequence that ends at it, so sequences reuse it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from ._inputs import SequenceLike, normalize_score_from, normalize_sequences


def trie_key(sequence) -> bytes:
    """A sort key that orders token sequences as a trie's leaves (lexicographically, a prefix before
    its extensions): big-endian fixed-width bytes compare as the ids do, and compare in C (memcmp)."""
    return np.asarray(sequence, dtype=np.int64).astype(">i8").tobytes()


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens the id arrays ``a`` and ``b`` share."""
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass(frozen=True)
class ScoringPlan:
    """Which unique predictions a call needs and how to spread them back over the sequences.

    ``pred_dst[p]`` is the packed index of the token predicted by row ``p``; its hidden state
    comes from ``pred_src[p]`` (for a fork token, several rows share one source). ``gather[n]``
    is the row answering the n-th wanted (sequence, position) pair, in sequence order;
    ``counts[i]`` how many of those belong to sequence ``i``.
    """

    pred_src: np.ndarray
    pred_dst: np.ndarray
    gather: np.ndarray
    counts: np.ndarray
    seq_idx: np.ndarray
    pos: np.ndarray

    @property
    def num_predictions(self) -> int:
        return int(self.pred_dst.shape[0])

    @property
    def num_terms(self) -> int:
        return int(self.gather.shape[0])


@dataclass(eq=False)
class PrefixForest:
    """Compressed trie of token sequences with the packed layout the tree engine runs on.

    Build with :meth:`from_sequences`. Arrays are numpy (built on CPU, moved to a device by the
    engine once per call). Node arrays are indexed by node id in DFS pre-order, token arrays by
    packed index.
    """

    tokens: np.ndarray  # [U] token id of each unique token, DFS pre-order
    position_ids: np.ndarray  # [U] depth of each token (0 for a root's first token)
    subtree_end: np.ndarray  # [U] packed end (exclusive) of the subtree of the token's node
    parent_index: np.ndarray  # [U] packed index of the previous token on the path, -1 at a root
    node_start: np.ndarray  # [N] packed index of the node's first token
    node_length: np.ndarray  # [N] tokens in the node
    node_depth: np.ndarray  # [N] depth of the node's first token
    node_parent: np.ndarray  # [N] parent node id, -1 for a root
    node_num_children: np.ndarray  # [N]
    kv_index: np.ndarray  # [sum(node_depth + node_length)] per node: packed indices of its root path
    cu_seqlens_q: np.ndarray  # [N + 1] int32, query segment bounds (nodes)
    cu_seqlens_k: np.ndarray  # [N + 1] int32, key segment bounds (root paths) inside kv_index
    seq_lengths: np.ndarray  # [S] tokens per input sequence
    seq_end_node: np.ndarray  # [S] node at which each sequence ends
    _source_device: torch.device | None = field(default=None, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sequences(cls, seqs: Sequence[SequenceLike], share_prefixes: bool = True) -> PrefixForest:
        """Build the forest of ``seqs`` (lists of ints, 1-D integer tensors or numpy arrays).

        Sequences may repeat, be prefixes of each other or share nothing. Raises ``ValueError`` /
        ``TypeError`` for empty input, empty sequences or non-integer ids. ``share_prefixes=False``
        makes every sequence its own root (padding-free packing without sharing: a baseline).
        """
        arrays, device = normalize_sequences(seqs)
        return cls._build(arrays, device, share_prefixes)

    @classmethod
    def _build(cls, arrays: list[np.ndarray], device: torch.device | None, share_prefixes: bool = True) -> PrefixForest:
        n = len(arrays)
        # Any total order in which sequences sharing a prefix are contiguous and a prefix precedes
        # its extensions is a DFS leaf order; ``trie_key`` gives one.
        keys = [trie_key(a) for a in arrays]
        order = sorted(range(n), key=keys.__getitem__)

        # Node table, in creation order. A node is (source sequence, start depth, end depth).
        src: list[int] = []
        start: list[int] = []
        end: list[int] = []
        parent: list[int] = []
        children: list[list[int]] = []
        ending: list[list[int]] = []  # sequences ending at each node

        def new_node(seq: int, s: int, e: int, par: int) -> int:
            src.append(seq)
            start.append(s)
            end.append(e)
            parent.append(par)
            children.append([])
            ending.append([])
            if par >= 0:
                children[par].append(len(src) - 1)
            return len(src) - 1

        roots: list[int] = []
        stack: list[int] = []  # the previous sequence's path
        prev: np.ndarray | None = None
        for seq in order:
            cur = arrays[seq]
            if prev is None or not share_prefixes:
                lcp = 0
            else:
                m = min(prev.shape[0], cur.shape[0])
                diff = np.flatnonzero(prev[:m] != cur[:m])
                lcp = int(diff[0]) if diff.size else m
            while stack and start[stack[-1]] >= lcp:
                stack.pop()
            if stack and end[stack[-1]] > lcp:
                # split the top node at lcp: the lower part keeps children and ending sequences
                top = stack[-1]
                low = new_node(src[top], lcp, end[top], -1)
                parent[low] = top
                children[low], children[top] = children[top], [low]
                for c in children[low]:
                    parent[c] = low
                ending[low], ending[top] = ending[top], []
                end[top] = lcp
            if cur.shape[0] > lcp:
                node = new_node(seq, lcp, cur.shape[0], stack[-1] if stack else -1)
                if not stack:
                    roots.append(node)
                stack.append(node)
            ending[stack[-1]].append(seq)
            prev = cur

        # Pre-order numbering. Children were appended in sorted order except split-off lower
        # halves, which are always the first child; both orders are lexicographic.
        num_nodes = len(src)
        preorder: list[int] = []
        todo = list(reversed(roots))
        while todo:
            v = todo.pop()
            preorder.append(v)
            todo.extend(reversed(children[v]))
        new_id = np.empty(num_nodes, dtype=np.int64)
        new_id[np.asarray(preorder, dtype=np.int64)] = np.arange(num_nodes)

        pre = np.asarray(preorder, dtype=np.int64)
        n_depth = np.asarray(start, dtype=np.int64)[pre]
        n_len = np.asarray(end, dtype=np.int64)[pre] - n_depth
        old_parent = np.asarray(parent, dtype=np.int64)[pre]
        n_parent = np.where(old_parent >= 0, new_id[np.maximum(old_parent, 0)], -1)
        tokens = np.concatenate([arrays[src[v]][start[v] : end[v]] for v in preorder])
        seq_end_node = np.empty(n, dtype=np.int64)
        for v in range(num_nodes):
            for s in ending[preorder[v]]:
                seq_end_node[s] = v
        seq_lengths = np.asarray([a.shape[0] for a in arrays], dtype=np.int64)
        return cls._from_nodes(tokens, n_depth, n_len, n_parent, seq_end_node, seq_lengths, device)

    @classmethod
    def _from_nodes(
        cls,
        tokens: np.ndarray,
        n_depth: np.ndarray,
        n_len: np.ndarray,
        n_parent: np.ndarray,
        seq_end_node: np.ndarray,
        seq_lengths: np.ndarray,
        device: torch.device | None,
    ) -> PrefixForest:
        """Every layout array from a node table in pre-order (nodes hold consecutive packed tokens)."""
        num_nodes = n_len.shape[0]
        n_children = np.bincount(n_parent[n_parent >= 0], minlength=num_nodes).astype(np.int64)
        n_packed_start = np.zeros(num_nodes, dtype=np.int64)
        np.cumsum(n_len[:-1], out=n_packed_start[1:])
        U = int(n_len.sum())
        node_of_token = np.repeat(np.arange(num_nodes), n_len)
        offset_in_node = np.arange(U) - n_packed_start[node_of_token]
        position_ids = n_depth[node_of_token] + offset_in_node

        # subtree end of a node: pre-order makes it the start of the next node that is not a descendant;
        # computed bottom-up as max over children (reverse pre-order visits children before parents).
        n_sub_end = n_packed_start + n_len
        for v in range(num_nodes - 1, 0, -1):
            p = n_parent[v]
            if p >= 0 and n_sub_end[v] > n_sub_end[p]:
                n_sub_end[p] = n_sub_end[v]
        subtree_end = n_sub_end[node_of_token]

        # previous token on the path: inside a node the token before; a node's first token is
        # predicted from its parent's last token (the fork token)
        parent_index = np.arange(U, dtype=np.int64) - 1
        safe_parent = np.maximum(n_parent, 0)
        parent_last = np.where(n_parent >= 0, n_packed_start[safe_parent] + n_len[safe_parent] - 1, -1)
        parent_index[n_packed_start] = parent_last

        # root path of every node = parent's path + own range (this is the varlen key list)
        paths: list[np.ndarray] = [None] * num_nodes  # type: ignore[list-item]
        for v in range(num_nodes):
            own = np.arange(n_packed_start[v], n_packed_start[v] + n_len[v], dtype=np.int64)
            p = n_parent[v]
            paths[v] = own if p < 0 else np.concatenate((paths[p], own))
        kv_index = np.concatenate(paths)
        cu_q = np.zeros(num_nodes + 1, dtype=np.int32)
        np.cumsum(n_len, out=cu_q[1:])
        cu_k = np.zeros(num_nodes + 1, dtype=np.int32)
        np.cumsum(n_depth + n_len, out=cu_k[1:])

        return cls(
            tokens=tokens,
            position_ids=position_ids,
            subtree_end=subtree_end,
            parent_index=parent_index,
            node_start=n_packed_start,
            node_length=n_len,
            node_depth=n_depth,
            node_parent=n_parent,
            node_num_children=n_children,
            kv_index=kv_index,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            seq_lengths=seq_lengths,
            seq_end_node=seq_end_node,
            _source_device=device,
        )

    def split_nodes(self, max_length: int) -> PrefixForest:
        """The same forest with every node longer than ``max_length`` cut into a chain of chunks.

        Packed order, tokens and sequences are unchanged; only the node table (and so the varlen
        segments) changes. The depth-first walk uses it for chunked backprop.
        """
        if not isinstance(max_length, (int, np.integer)) or isinstance(max_length, bool) or max_length < 1:
            raise ValueError(f"chunk size must be a positive int, got {max_length!r}")
        pieces = -(-self.node_length // max_length)  # ceil
        if int(pieces.max()) == 1:
            return self
        first_piece = np.zeros(self.num_nodes + 1, dtype=np.int64)
        np.cumsum(pieces, out=first_piece[1:])
        total = int(first_piece[-1])
        owner = np.repeat(np.arange(self.num_nodes), pieces)
        k = np.arange(total) - first_piece[owner]
        depth = self.node_depth[owner] + k * max_length
        length = np.minimum(max_length, self.node_length[owner] - k * max_length)
        last_piece = first_piece[1:] - 1
        orig_parent = self.node_parent[owner]
        parent = np.where(k > 0, np.arange(total) - 1, np.where(orig_parent >= 0, last_piece[np.maximum(orig_parent, 0)], -1))
        return type(self)._from_nodes(
            self.tokens, depth, length, parent, last_piece[self.seq_end_node], self.seq_lengths, self._source_device
        )

    # ------------------------------------------------------------------ statistics
    @property
    def num_sequences(self) -> int:
        return int(self.seq_lengths.shape[0])

    @property
    def num_nodes(self) -> int:
        return int(self.node_start.shape[0])

    @property
    def num_tokens(self) -> int:
        """T: tokens over all sequences, shared ones counted once per sequence."""
        return int(self.seq_lengths.sum())

    @property
    def num_unique_tokens(self) -> int:
        """U: tokens in the forest (what the packed pass runs)."""
        return int(self.tokens.shape[0])

    @property
    def dedup_ratio(self) -> float:
        """T / U, the ceiling of the speed-up for the layer stack."""
        return self.num_tokens / self.num_unique_tokens

    @property
    def max_depth(self) -> int:
        """Length of the longest sequence (the deepest root-to-node path)."""
        return int(self.seq_lengths.max())

    @property
    def max_seqlen_q(self) -> int:
        return int(self.node_length.max())

    @property
    def max_seqlen_k(self) -> int:
        return int((self.node_depth + self.node_length).max())

    @property
    def num_roots(self) -> int:
        return int((self.node_parent < 0).sum())

    @property
    def fork_index(self) -> np.ndarray:
        """Packed indices of fork tokens: last tokens of nodes with more than one child."""
        forks = np.flatnonzero(self.node_num_children > 1)
        return self.node_start[forks] + self.node_length[forks] - 1

    def sum_visible_keys(self) -> int:
        """Σ over unique queries of the keys each attends to (attention FLOPs ∝ this)."""
        return int((self.position_ids + 1).sum())

    # ------------------------------------------------------------------ per-sequence maps
    @cached_property
    def seq_offsets(self) -> np.ndarray:
        out = np.zeros(self.num_sequences + 1, dtype=np.int64)
        np.cumsum(self.seq_lengths, out=out[1:])
        return out

    @cached_property
    def seq_packed_index(self) -> np.ndarray:
        """[T] packed index of every (sequence, position), sequences concatenated in input order.

        A sequence is the root path of the node it ends at, which is that node's key list.
        """
        starts = self.cu_seqlens_k[self.seq_end_node].astype(np.int64)
        lengths = self.seq_lengths
        rel = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(self.seq_offsets[:-1], lengths)
        return self.kv_index[np.repeat(starts, lengths) + rel]

    @cached_property
    def multiplicity(self) -> np.ndarray:
        """[U] how many sequences contain each unique token (what it weighs in a mean over all tokens)."""
        return np.bincount(self.seq_packed_index, minlength=self.num_unique_tokens).astype(np.int64)

    def packed_index(self, seq: int) -> np.ndarray:
        """Packed index of each token of sequence ``seq``."""
        return self.seq_packed_index[self.seq_offsets[seq] : self.seq_offsets[seq + 1]]

    def sequence(self, seq: int) -> list[int]:
        """Token ids of sequence ``seq`` read back from the forest."""
        return self.tokens[self.packed_index(seq)].tolist()

    def scoring_plan(self, score_from: int | Sequence[int] | None = None) -> ScoringPlan:
        """Unique predictions needed to return log-probs of tokens ``seqs[i][score_from[i]:]``.

        Every wanted token of every sequence is mapped to a packed index; each packed index is
        predicted once, from its ``parent_index`` hidden state, however many sequences contain it.
        """
        first = normalize_score_from(score_from, self.seq_lengths.tolist())
        lengths = self.seq_lengths
        counts = lengths - first
        rel = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(self.seq_offsets[:-1], lengths)
        wanted = rel >= np.repeat(first, lengths)
        dst_of_term = self.seq_packed_index[wanted]
        needed = np.zeros(self.num_unique_tokens, dtype=bool)
        needed[dst_of_term] = True
        pred_dst = np.flatnonzero(needed)
        row_of = np.full(self.num_unique_tokens, -1, dtype=np.int64)
        row_of[pred_dst] = np.arange(pred_dst.shape[0])
        seq_idx = np.repeat(np.arange(self.num_sequences), counts)
        pos = rel[wanted] - 1  # prediction index j: log p(seq[j + 1] | seq[: j + 1])
        return ScoringPlan(
            pred_src=self.parent_index[pred_dst],
            pred_dst=pred_dst,
            gather=row_of[dst_of_term],
            counts=counts,
            seq_idx=seq_idx,
            pos=pos,
        )

    def __repr__(self) -> str:
        return (
            f"PrefixForest(num_sequences={self.num_sequences}, num_nodes={self.num_nodes}, "
            f"num_tokens={self.num_tokens}, num_unique_tokens={self.num_unique_tokens}, "
            f"dedup_ratio={self.dedup_ratio:.3f}, max_depth={self.max_depth})"
        )
