"""mode="dfs": the depth-first walk equals the untreed computation and the packed mode (fp32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_grads_close, assert_logps_close, grads_of, weighted_loss
from hypothesis import given, settings
from hypothesis import strategies as st
from test_exactness import WORKLOADS

from trl_tree import PrefixForest, TreeOptions, tree_backward, tree_logprobs
from trl_tree.engine.attention import backends
from trl_tree.engine.cost_model import ActivationModel, GroupBudget
from trl_tree.engine.dfs.plan import plan_walk
from trl_tree.engine.reference import untreed_backward, untreed_logprobs
from trl_tree.data.tiny import random_tree, tiny_model


def deep_tree(levels: int = 7, vocab: int = 96, seed: int = 0) -> list[list[int]]:
    """Trajectories branching at every level (a binary tree ``levels`` deep, turns of 2-5 tokens)."""
    rng = np.random.default_rng(seed)
    paths = [rng.integers(0, vocab, 6).tolist()]
    for level in range(levels):
        paths = [p + rng.integers(0, vocab, int(rng.integers(2, 6))).tolist() for p in paths for _ in range(2)]
        if level % 3 == 2:  # some trajectories stop early: sequences ending at inner nodes
            paths.append(paths[0][: len(paths[0]) - 1])
    return paths[:40]


def check_dfs(model, seqs, backend="sdpa", chunk_size=None, keep_graph=False, score_from=None, memory_budget=None):
    ref = untreed_logprobs(model, seqs, score_from=score_from)
    opts = TreeOptions(attn_backend=backend, chunk_size=chunk_size, memory_budget=memory_budget, keep_graph=keep_graph)
    assert_logps_close(tree_logprobs(model, seqs, "dfs", options=opts, score_from=score_from), ref)
    model.zero_grad(set_to_none=True)
    loss = tree_backward(model, seqs, weighted_loss, "dfs", options=opts, score_from=score_from)
    g_dfs = grads_of(model)
    model.zero_grad(set_to_none=True)
    loss_packed = tree_backward(model, seqs, weighted_loss, mode="packed", attn_backend=backend,
                                score_from=score_from)
    g_packed = grads_of(model)
    model.zero_grad(set_to_none=True)
    loss_ref = untreed_backward(model, seqs, weighted_loss, score_from=score_from)
    g_ref = grads_of(model)
    model.zero_grad(set_to_none=True)
    assert loss == pytest.approx(loss_ref, rel=1e-5, abs=1e-5)
    assert loss == pytest.approx(loss_packed, rel=1e-5, abs=1e-5)
    assert_grads_close(g_dfs, g_ref)
    assert_grads_close(g_dfs, g_packed)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_part1_workloads(qwen2, workload, backend):
    check_dfs(qwen2, WORKLOADS[workload], backend)


@pytest.mark.parametrize("chunk_size", [1, 3, 7])
@pytest.mark.parametrize("keep_graph", [False, True])
def test_chunks_cut_nodes_at_odd_places(qwen2, chunk_size, keep_graph):
    check_dfs(qwen2, WORKLOADS["grpo_group"] + WORKLOADS["prefix_of_another"], chunk_size=chunk_size,
              keep_graph=keep_graph)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_deep_tree(qwen2, chunk_size):
    seqs = deep_tree()
    forest = PrefixForest.from_sequences(seqs)
    depth = np.zeros(forest.num_nodes, dtype=int)
    for v, p in enumerate(forest.node_parent):
        depth[v] = depth[p] + 1 if p >= 0 else 1
    assert depth.max() >= 6
    check_dfs(qwen2, seqs, chunk_size=chunk_size, score_from=[3] * len(seqs))


def test_gradient_checkpointing():
    """HF gradient checkpointing (TRL's default) re-runs each layer in backward: the prefix must survive."""
    for reentrant in (True, False):
        model = tiny_model("llama")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        check_dfs(model, deep_tree(levels=6, seed=1), chunk_size=4)
        check_dfs(model, deep_tree(levels=6, seed=1), chunk_size=4, keep_graph=True)


def test_peft_lora():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("qwen3"), LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"],
                                                           init_lora_weights=False))
    check_dfs(model, WORKLOADS["multi_level"], chunk_size=5)


def test_entropy(qwen2):
    seqs = WORKLOADS["multi_level"]
    logps, ents = tree_logprobs(qwen2, seqs, mode="dfs", return_entropy=True, temperature=0.8, chunk_size=4)
    ref_logps, ref_ents = untreed_logprobs(qwen2, seqs, return_entropy=True, temperature=0.8)
    assert_logps_close(logps, ref_logps)
    assert_logps_close(ents, ref_ents)
    assert not any(lp.requires_grad for lp in logps)


def test_walk_plan_is_depth_first_and_bounded():
    seqs = deep_tree()
    forest = PrefixForest.from_sequences(seqs)
    plan = plan_walk(forest, forest.scoring_plan(), chunk_size=4)
    open_units: list[int] = []
    for step in plan.steps:
        unit = plan.units[step.unit]
        if step.op != "pop":
            # a unit's prefix is exactly the pushed nodes on the stack
            assert unit.depth == sum(plan.units[u].num_tokens for u in open_units)
            assert unit.num_tokens <= 4
        if step.op == "push":
            open_units.append(step.unit)
        elif step.op == "pop":
            assert open_units.pop() == step.unit
    assert not open_units
    assert plan.stack_size <= forest.max_depth + 4
    covered = sorted((u.start, u.end) for u, s in zip(plan.units, plan.units))
    assert covered[0][0] == 0 and all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    assert covered[-1][1] == forest.num_unique_tokens


def test_split_nodes_keeps_the_forest():
    seqs = random_tree(12, 20, max_len=15, seed=3)
    forest = PrefixForest.from_sequences(seqs)
    for size in (1, 2, 5):
        split = forest.split_nodes(size)
        assert int(split.node_length.max()) <= size
        assert np.array_equal(split.tokens, forest.tokens) and np.array_equal(split.subtree_end, forest.subtree_end)
        assert np.array_equal(split.parent_index, forest.parent_index)
        assert all(split.sequence(i) == s for i, s in enumerate(seqs))


@settings(max_examples=20, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=10), min_size=1, max_size=8),
    st.sampled_from([None, 1, 2, 5]),
    st.booleans(),
)
def test_random_forests(qwen2, seqs, chunk_size, keep_graph):
    check_dfs(qwen2, seqs, chunk_size=chunk_size, keep_graph=keep_graph)


def test_auto_mode_picks_from_the_memory_budget(qwen2):
    from trl_tree.engine.cost_model import choose_mode, estimate_bytes

    seqs = deep_tree()
    forest = PrefixForest.from_sequences(seqs)
    config = qwen2.config
    packed_bytes = estimate_bytes(config, forest.num_unique_tokens, False)
    assert choose_mode(forest, config, packed_bytes, False).mode == "packed"
    small = choose_mode(forest, config, packed_bytes // 3, False)
    assert small.mode == "dfs" and small.chunk_size < forest.num_unique_tokens
    assert small.estimated_bytes <= packed_bytes // 3
    # a larger budget never gets a smaller chunk (fewer, larger calls when memory allows)
    chunks = [choose_mode(forest, config, packed_bytes * f // 10, False).chunk_size or 10**9 for f in range(2, 11)]
    assert chunks == sorted(chunks)
    # exact whichever it picks
    for budget in (packed_bytes, packed_bytes // 3):
        qwen2.zero_grad(set_to_none=True)
        tree_backward(qwen2, seqs, weighted_loss, mode="auto", memory_budget=budget)
        g = grads_of(qwen2)
        qwen2.zero_grad(set_to_none=True)
        untreed_backward(qwen2, seqs, weighted_loss)
        assert_grads_close(g, grads_of(qwen2))
        assert_logps_close(tree_logprobs(qwen2, seqs, mode="auto", memory_budget=budget), untreed_logprobs(qwen2, seqs))
    qwen2.zero_grad(set_to_none=True)


@pytest.fixture(params=[False, True], ids=["varlen", "dense"])
def split_attention_on_cpu(request, monkeypatch):
    """The dfs FlashAttention path (prefix rectangle + own tree, log-sum-exp merge, two partial
    backwards) run on the CPU with the math kernels of ``attention/partial.py``; ``dense``: the
    prefix rectangle and one-node units through the dense slot, as cuDNN runs them on a GPU."""
    from trl_tree.engine.attention import partial

    math = (partial.math_partial_forward, partial.math_partial_backward)
    monkeypatch.setitem(partial.PARTIAL_KERNELS, "math", math)
    if request.param:
        monkeypatch.setitem(partial.DENSE_KERNELS, "math", (partial.math_dense_forward, partial.math_dense_backward))
        monkeypatch.setattr(partial, "DENSE_MIN_ROWS", 1)
    monkeypatch.setattr(backends, "resolve_dfs_backend", lambda requested, device, dtype, **_: "math")


@pytest.mark.parametrize("chunk_size", [None, 3, 7])
def test_split_attention_path(qwen2, split_attention_on_cpu, chunk_size):
    check_dfs(qwen2, deep_tree(), chunk_size=chunk_size, score_from=[3] * len(deep_tree()))
    check_dfs(qwen2, WORKLOADS["grpo_group"] + WORKLOADS["prefix_of_another"], chunk_size=chunk_size)


def test_split_attention_under_checkpointing(split_attention_on_cpu):
    model = tiny_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    check_dfs(model, deep_tree(levels=6, seed=1), chunk_size=4)  # keep_graph False
    check_dfs(model, deep_tree(levels=6, seed=1), chunk_size=4, keep_graph=None)  # auto: kept


def _spy_plans(monkeypatch) -> list:
    """Every walk plan the engine makes from now on."""
    from trl_tree.engine.dfs import walk

    plans = []
    original = walk.plan_walk

    def spying(*args, **kwargs):
        plans.append(original(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(walk, "plan_walk", spying)
    return plans


# chunks of 31 tokens: each 12-token prompt is pushed, its six 6-token completions go 3 + 3, and the
# pop takes the prompt and the first three (30 tokens)
@pytest.mark.parametrize("seqs,chunk_size", [(WORKLOADS["grpo_group"], 31), (deep_tree(), 7)],
                         ids=["grpo", "deep-tree"])
def test_merged_pops_match_the_untreed_model(qwen2, split_attention_on_cpu, monkeypatch, seqs, chunk_size):
    """A pop that recomputes its node together with the node's first group of children: the group's
    queries see the node as an in-unit ancestor, and the node's K/V gradient is what the unit's own
    keys got plus what the other groups left in its stack slots."""
    plans = _spy_plans(monkeypatch)
    check_dfs(qwen2, seqs, chunk_size=chunk_size)
    merged = [p for p in plans if p.merged]
    assert merged, "no pop was merged"
    pops = [p.units[s.unit] for p in merged for s in p.steps if s.op == "pop"]
    assert any(u.num_tokens > u.pushed_tokens for u in pops)


def test_padded_walks_merge_only_short_nodes():
    """``merge_long_nodes=False`` (walks padded to buckets): a pop takes its first group along only
    where the group's nodes gather no more of the node's keys than the group has tokens."""
    from trl_tree.data.tiny import grpo_group

    short = PrefixForest.from_sequences(grpo_group(4, 12, 6, 96, seed=1))  # groups of 3 x 12: 3 x 4 keys gathered
    long_ = PrefixForest.from_sequences(grpo_group(12, 6, 6, 96, seed=1))  # groups of 3 x 6: 3 x 12 keys gathered
    for forest, chunk, merged_when_short_only in ((short, 41, True), (long_, 31, False)):
        scoring = forest.scoring_plan()
        assert plan_walk(forest, scoring, chunk, merge_pops=True).merged
        assert plan_walk(forest, scoring, chunk, merge_pops=True, merge_long_nodes=False).merged == merged_when_short_only


def test_walk_units_keep_their_attention_for_the_recompute(monkeypatch):
    """Under gradient checkpointing a unit keeps its attention outputs from the forward, so the
    recompute in its backward runs no attention kernel: exact, fewer kernel calls, nothing left kept."""
    from trl_tree.engine.attention import kept as kept_module
    from trl_tree.engine.attention import partial

    forwards = [0]
    taken = [0]

    def counting(*args, **kwargs):
        forwards[0] += 1
        return partial.math_partial_forward(*args, **kwargs)

    original_take = kept_module.KeptAttention.take

    def take(self, module):
        entry = original_take(self, module)
        taken[0] += entry is not None
        return entry

    monkeypatch.setitem(partial.PARTIAL_KERNELS, "math", (counting, partial.math_partial_backward))
    monkeypatch.setattr(backends, "resolve_dfs_backend", lambda requested, device, dtype, **_: "math")
    monkeypatch.setattr(kept_module.KeptAttention, "take", take)
    model = tiny_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    seqs = deep_tree(levels=5, seed=2)
    model.zero_grad(set_to_none=True)
    untreed_backward(model, seqs, weighted_loss)
    ref = grads_of(model)
    # 0.7 of one sequence's footprint: pushed nodes, groups and merged pops, the larger groups too
    # large to keep their attention (``GroupBudget.keeps_attention``)
    forest = PrefixForest.from_sequences(seqs)
    budget = int(0.7 * ActivationModel.of(model.config, True, 4).single_sequence(forest.max_depth))
    plans = _spy_plans(monkeypatch)
    counts = {}
    for keep in (False, True):
        forwards[0] = taken[0] = 0
        model.zero_grad(set_to_none=True)
        tree_backward(model, seqs, weighted_loss, mode="dfs", keep_graph=False, keep_attention=keep,
                      memory_budget=budget)
        assert_grads_close(grads_of(model), ref)
        counts[keep] = (forwards[0], taken[0])
    assert counts[False][1] == 0 and counts[True][1] > 0
    assert counts[True][0] < counts[False][0]
    keeps = [GroupBudget.for_forest(forest, model.config, True, False, 4, budget).keeps_attention(u.num_tokens, u.depth)
             for u in plans[-1].units if u.scored]
    assert plans[-1].merged and any(keeps) and not all(keeps)


def test_keep_graph_must_be_a_bool_or_none(qwen2):
    with pytest.raises(TypeError, match="keep_graph"):
        tree_backward(qwen2, WORKLOADS["grpo_group"], weighted_loss, mode="dfs", keep_graph="yes")


def _count_walk_forwards(monkeypatch) -> list[int]:
    from trl_tree.engine.dfs import walk

    calls = [0]
    original = walk.tree_forward

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(walk, "tree_forward", counting)
    return calls


@pytest.mark.parametrize("checkpointing", [False, True])
def test_keep_graph_default_follows_gradient_checkpointing(monkeypatch, checkpointing):
    """keep_graph=None keeps pushed nodes' graphs (no second forward of them) exactly when the model
    checkpoints its layers; otherwise every pop is a forward, and those that take their node's first
    group along (merged pops) save that group's call."""
    model = tiny_model("llama")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    seqs = deep_tree(levels=6, seed=1)
    forest = PrefixForest.from_sequences(seqs)
    unmerged = plan_walk(forest, forest.scoring_plan(), chunk_size=4)
    plan = plan_walk(forest, forest.scoring_plan(), chunk_size=4, merge_pops=not checkpointing)
    pushes = sum(1 for s in plan.steps if s.op == "push")
    assert pushes > 0
    calls = _count_walk_forwards(monkeypatch)
    tree_backward(model, seqs, weighted_loss, mode="dfs", chunk_size=4)
    if checkpointing:
        assert calls[0] == plan.num_calls == unmerged.num_calls
    else:
        assert plan.merged
        assert calls[0] == len(plan.steps) < unmerged.num_calls + pushes


def test_lm_head_weight_gradient_taken_once_per_walk(qwen2, monkeypatch):
    """Units score against a constant head; one call after the walk differentiates the weight
    (TRL's kernel allocates a full-size fp32 weight-gradient buffer per differentiated call)."""
    from trl_tree.engine import lm_head

    trainable_calls = []
    original = lm_head.ChunkedLogProbFunction

    class Counting:
        @staticmethod
        def apply(hidden, weight, *args):
            trainable_calls.append(weight.requires_grad)
            return original.apply(hidden, weight, *args)

    monkeypatch.setattr(lm_head, "ChunkedLogProbFunction", Counting)
    seqs = deep_tree()
    forest = PrefixForest.from_sequences(seqs)
    assert plan_walk(forest, forest.scoring_plan(), chunk_size=4).num_calls > 1
    check_dfs(qwen2, seqs, chunk_size=4)  # exact, with the deferred head
    trainable_calls.clear()
    qwen2.zero_grad(set_to_none=True)
    tree_backward(qwen2, seqs, weighted_loss, mode="dfs", chunk_size=4)
    qwen2.zero_grad(set_to_none=True)
    assert trainable_calls.count(True) == 1 and len(trainable_calls) > 2


def test_walk_runs_its_prefix_and_one_node_units_dense(qwen2, monkeypatch):
    """With a dense pair registered, the cached prefix (a non-causal rectangle) and one-node units
    (a causal block as long as its keys) go through it; in-unit trees stay varlen."""
    from trl_tree.engine.attention import partial

    monkeypatch.setitem(partial.PARTIAL_KERNELS, "math", (partial.math_partial_forward, partial.math_partial_backward))
    calls = []

    def counting(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        calls.append((causal, q.shape[0], k.shape[0], cu_q.numel()))
        return partial.math_dense_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)

    monkeypatch.setitem(partial.DENSE_KERNELS, "math", (counting, partial.math_dense_backward))
    monkeypatch.setattr(partial, "DENSE_MIN_ROWS", 2)  # one-token units stay varlen (cuDNN refuses 1 x 1)
    monkeypatch.setattr(backends, "resolve_dfs_backend", lambda requested, device, dtype, **_: "math")
    seqs = WORKLOADS["grpo_group"]
    assert_logps_close(tree_logprobs(qwen2, seqs, mode="dfs", chunk_size=6), untreed_logprobs(qwen2, seqs))
    assert any(not causal for causal, *_ in calls) and any(causal for causal, *_ in calls)
    assert all(n_seg == 2 for *_, n_seg in calls)  # one segment each
    assert all(nq == nk for causal, nq, nk, _ in calls if causal)
    assert all(min(nq, nk) >= 2 for _, nq, nk, _ in calls)


def test_planned_dense_pairs_wait_for_a_shape_s_third_sighting(qwen2, monkeypatch):
    """A dense pair that plans each new shape (cuDNN, ``partial.PLANNED_DENSE``) runs a unit's prefix
    and block only for shapes seen ``DENSE_AT_SIGHTING - 1`` times before — free-length rollouts,
    where no shape repeats, never pay a plan — and keeps one choice across the unit's layers,
    recompute and backward. Exact both ways."""
    from trl_tree.engine.attention import partial

    monkeypatch.setitem(partial.PARTIAL_KERNELS, "math", (partial.math_partial_forward, partial.math_partial_backward))
    calls = []

    def counting(*args):
        calls.append(args[7])
        return partial.math_dense_forward(*args)

    monkeypatch.setitem(partial.DENSE_KERNELS, "math", (counting, partial.math_dense_backward))
    monkeypatch.setattr(partial, "DENSE_MIN_ROWS", 2)
    monkeypatch.setattr(partial, "PLANNED_DENSE", {"math"})
    monkeypatch.setattr(partial, "_DENSE_SHAPES", type(partial._DENSE_SHAPES)())
    monkeypatch.setattr(backends, "resolve_dfs_backend", lambda requested, device, dtype, **_: "math")
    seqs = [list(range(1, 9)) + [20 + i] * (3 + i) for i in range(3)]  # units of distinct shapes
    ref = untreed_logprobs(qwen2, seqs)
    assert_logps_close(tree_logprobs(qwen2, seqs, mode="dfs", chunk_size=6), ref)
    first = len(calls)
    for _ in range(partial.DENSE_AT_SIGHTING - 1):
        calls.clear()
        assert_logps_close(tree_logprobs(qwen2, seqs, mode="dfs", chunk_size=6), ref)
    assert len(calls) > first and len(calls) % qwen2.config.num_hidden_layers == 0
    model = tiny_model("llama")
    model.zero_grad(set_to_none=True)
    untreed_backward(model, seqs, weighted_loss)
    expected = grads_of(model)
    for _ in range(partial.DENSE_AT_SIGHTING):  # unseen, then seen: the backward agrees with the forward's choice
        model.zero_grad(set_to_none=True)
        tree_backward(model, seqs, weighted_loss, mode="dfs", chunk_size=6)
        assert_grads_close(grads_of(model), expected)
