"""PrefixForest: structure, statistics and packed-layout invariants against brute force."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_tree import PrefixForest
from trl_tree.data.tiny import grpo_group, random_tree


def brute_force_check(seqs: list[list[int]], forest: PrefixForest) -> None:
    """Every layout array against a definition computed the slow, obvious way."""
    U = forest.num_unique_tokens
    # statistics
    assert forest.num_sequences == len(seqs)
    assert forest.num_tokens == sum(map(len, seqs))
    prefixes = {tuple(s[: j + 1]) for s in seqs for j in range(len(s))}
    assert U == len(prefixes)  # each unique prefix is one packed token
    assert forest.max_depth == max(map(len, seqs))
    assert forest.dedup_ratio == pytest.approx(forest.num_tokens / U)
    # sequences read back and map onto distinct prefixes
    packed_prefix = {}
    for i, s in enumerate(seqs):
        assert forest.sequence(i) == list(s)
        idx = forest.packed_index(i)
        assert len(idx) == len(s)
        for j, k in enumerate(idx.tolist()):
            key = tuple(s[: j + 1])
            assert packed_prefix.setdefault(k, key) == key
            assert forest.position_ids[k] == j
            assert forest.parent_index[k] == (idx[j - 1] if j else -1)
    assert len(packed_prefix) == U
    # visibility rule k <= q < subtree_end[k]  <=>  prefix(k) is a prefix of prefix(q)
    for q, pq in packed_prefix.items():
        for k, pk in packed_prefix.items():
            ancestor = len(pk) <= len(pq) and pq[: len(pk)] == pk
            assert (k <= q < forest.subtree_end[k]) == ancestor
    # varlen segments: node queries contiguous, keys = root path of the node
    cu_q, cu_k = forest.cu_seqlens_q, forest.cu_seqlens_k
    for n in range(forest.num_nodes):
        start, length = forest.node_start[n], forest.node_length[n]
        assert cu_q[n] == start and cu_q[n + 1] == start + length
        path = forest.kv_index[cu_k[n] : cu_k[n + 1]]
        last = start + length - 1
        assert list(path) == sorted(k for k in packed_prefix if k <= last < forest.subtree_end[k])
    # pre-order: each child starts right after its parent's tokens or after a sibling's subtree
    assert np.all(np.diff(forest.node_start) > 0)
    for n in range(forest.num_nodes):
        p = forest.node_parent[n]
        assert (p < 0) == (forest.node_depth[n] == 0)
        if p >= 0:
            assert forest.node_depth[n] == forest.node_depth[p] + forest.node_length[p]
    # compressed: a non-root node with one child and no sequence ending at it would be mergeable
    ends = set(forest.seq_end_node.tolist())
    for n in range(forest.num_nodes):
        if forest.node_num_children[n] == 1:
            assert n in ends


CASES = {
    "grpo_group": grpo_group(6, 4, 5, 50, seed=3),
    "multi_level": [[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 3, 4, 7, 8], [1, 6], [1, 2, 3, 4, 7, 9]],
    "prefix_of_another": [[4, 5, 6, 7], [4, 5], [4, 5, 6, 7, 8, 9], [4]],
    "duplicates": [[3, 3, 3], [3, 3, 3], [3, 3, 3, 1], [3, 3, 3]],
    "len_1_and_2": [[7], [7, 1], [8], [7], [8, 2]],
    "no_sharing": [[1, 2, 3], [2, 3, 4], [3, 4], [4]],
    "single": [[5, 4, 3, 2, 1]],
    "split_after_children": [[1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 9]],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_layout_matches_brute_force(name):
    seqs = CASES[name]
    brute_force_check(seqs, PrefixForest.from_sequences(seqs))


def test_statistics_of_a_grpo_group():
    forest = PrefixForest.from_sequences(grpo_group(100, 20, 8, 1000, seed=0))
    assert forest.num_tokens == 8 * 120
    assert forest.num_unique_tokens == 100 + 8 * 20
    assert forest.num_nodes == 9
    assert forest.max_depth == 120
    assert forest.fork_index.tolist() == [99]  # the prompt's last token predicts 8 first tokens


def test_fork_token_scored_once_per_child():
    seqs = [[1, 2, 3], [1, 2, 4], [1, 2, 5], [1, 2]]
    forest = PrefixForest.from_sequences(seqs)
    plan = forest.scoring_plan()
    fork = forest.packed_index(0)[1]
    assert forest.fork_index.tolist() == [fork]
    assert (plan.pred_src == fork).sum() == 3  # one row per child, one hidden state
    assert plan.num_predictions == forest.num_unique_tokens - forest.num_roots
    assert plan.num_terms == sum(len(s) - 1 for s in seqs)


def test_duplicates_share_everything():
    forest = PrefixForest.from_sequences([[1, 2, 3]] * 4)
    assert forest.num_unique_tokens == 3 and forest.num_nodes == 1 and forest.dedup_ratio == 4


def test_inputs_as_tensors_and_arrays():
    seqs = CASES["multi_level"]
    a = PrefixForest.from_sequences(seqs)
    b = PrefixForest.from_sequences([torch.tensor(s, dtype=torch.int32) for s in seqs])
    c = PrefixForest.from_sequences([np.asarray(s, dtype=np.uint16) for s in seqs])
    d = PrefixForest.from_sequences(torch.tensor([[1, 2, 3], [1, 2, 4]]))
    for f in (b, c):
        assert np.array_equal(a.tokens, f.tokens) and np.array_equal(a.seq_packed_index, f.seq_packed_index)
    assert d.num_unique_tokens == 4


def test_share_prefixes_false_is_plain_packing():
    seqs = CASES["grpo_group"]
    forest = PrefixForest.from_sequences(seqs, share_prefixes=False)
    assert forest.num_unique_tokens == forest.num_tokens and forest.num_nodes == len(seqs)
    assert all(forest.sequence(i) == s for i, s in enumerate(seqs))


def test_scoring_plan_score_from():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2]]
    forest = PrefixForest.from_sequences(seqs)
    plan = forest.scoring_plan([3, 3, 2])
    assert plan.counts.tolist() == [1, 1, 0]
    assert plan.num_predictions == 2  # tokens 4 and 5 only; the shared prompt is not scored
    assert plan.pos.tolist() == [2, 2] and plan.seq_idx.tolist() == [0, 1]


def test_shared_trained_token_scored_once():
    # two trajectories sharing an assistant turn [5, 6]: its predictions are computed once
    seqs = [[1, 5, 6, 7], [1, 5, 6, 8]]
    plan = PrefixForest.from_sequences(seqs).scoring_plan()
    assert plan.num_terms == 6 and plan.num_predictions == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=9), min_size=1, max_size=12))
def test_random_forests_property(seqs):
    brute_force_check(seqs, PrefixForest.from_sequences(seqs))


def test_random_trees_property():
    for seed in range(5):
        seqs = random_tree(20, 5, max_len=12, seed=seed)
        brute_force_check(seqs, PrefixForest.from_sequences(seqs))


def test_build_is_fast():
    """64 sequences of 4k tokens (a 3k shared prompt) build well under 50 ms (measured ~7 ms)."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 150_000, 3072)
    seqs = [torch.from_numpy(np.concatenate([prompt, rng.integers(0, 150_000, 1024)])) for _ in range(64)]
    PrefixForest.from_sequences(seqs)
    best = min(_timed(lambda: PrefixForest.from_sequences(seqs).scoring_plan()) for _ in range(3))
    assert best < 0.25, f"building took {best * 1e3:.1f} ms"  # generous: CI machines are slow and shared


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
