"""The depth-first walk's group sizing: the activation model, the balanced grouping and that
walks planned with them stay exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dfs import check_dfs, deep_tree

from trl_tree import PrefixForest
from trl_tree.bench.workloads import suite_workloads
from trl_tree.engine.cost_model import ActivationModel, GroupBudget
from trl_tree.engine.dfs.plan import _balanced_groups, _greedy_groups, plan_walk
from trl_tree.data.tiny import shaped_config, tiny_model


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=0, max_size=30), st.integers(50, 200))
def test_balanced_groups_are_as_few_as_greedy_and_no_larger(sizes, budget):
    sizes = np.asarray(sizes, dtype=np.int64)
    run = list(range(len(sizes)))
    greedy = _greedy_groups(run, sizes, budget) if run else []
    groups = _balanced_groups(run, sizes, budget)
    assert [c for g in groups for c in g] == run  # consecutive, in order, nothing lost
    assert len(groups) == len(greedy)
    load = [int(sizes[g].sum()) for g in groups]
    assert all(x <= budget for x in load)
    if groups:
        assert max(load) <= max(int(sizes[g].sum()) for g in greedy)
        assert max(load) >= -(-int(sizes.sum()) // len(groups))  # nobody can beat the average


def test_balanced_groups_split_evenly():
    sizes = np.full(16, 512)
    assert [len(g) for g in _balanced_groups(list(range(16)), sizes, 7000)] == [8, 8]
    assert [len(g) for g in _balanced_groups(list(range(16)), sizes, 8192)] == [16]


def test_group_budget_fits_the_reference_and_shrinks_with_depth():
    config = shaped_config("1.5b")
    model = ActivationModel.of(config, gradient_checkpointing=True)
    budget = GroupBudget(model, reference=model.single_sequence(2560), keep_graph=True, floor=0)
    depths = [0, 512, 2048, 8192]
    tokens = [budget(d) for d in depths]
    assert tokens == sorted(tokens, reverse=True) and tokens[0] > 2560  # no weight gradient: room to spare
    for d, n in zip(depths, tokens):
        assert model.unit(n, d, True) <= budget.reference < model.unit(n + 1, d, True)
    # the floor (the longest node) wins when the model would allow less
    assert GroupBudget(model, reference=0, keep_graph=True, floor=300)(0) == 300
    # a caller's memory budget replaces the reference
    forest = PrefixForest.from_sequences(suite_workloads(config.vocab_size)[0].sequences)
    small = GroupBudget.for_forest(forest, config, True, True, memory_budget=model.unit(1000, 2048, True))
    assert small(2048) == 2048  # 1000 fits, but never below the longest node (the 2048-token prompt)


def test_walk_unit_floor_only_ever_enlarges_units():
    """``unit_floor`` (a share of the GPU, ``walk_unit_floor``) raises the reference where the longest
    sequence needs less and leaves it where it needs more; the CPU has none."""
    import torch

    from trl_tree.engine.cost_model import walk_unit_floor

    assert walk_unit_floor(torch.device("cpu")) is None
    config = shaped_config("1.5b")
    forest = PrefixForest.from_sequences(suite_workloads(config.vocab_size)[0].sequences)  # W1: 16 x 2560
    bound = GroupBudget.for_forest(forest, config, True, False)
    assert GroupBudget.for_forest(forest, config, True, False, unit_floor=None).reference == bound.reference
    assert GroupBudget.for_forest(forest, config, True, False, unit_floor=1).reference == bound.reference
    floored = GroupBudget.for_forest(forest, config, True, False, unit_floor=4 * 2**30)  # 5% of an 80 GiB card
    assert floored.reference == 4 * 2**30 > bound.reference
    assert floored(2048) >= 16 * 512 > bound(2048)  # W1's completions in one unit below the prompt, not several
    # a caller's budget still rules
    assert GroupBudget.for_forest(forest, config, True, False, memory_budget=5, unit_floor=4 * 2**30).reference == 5


def test_activation_model_matches_the_h200_measurements():
    """Estimates against activation peaks measured on the H200 (docs/benchmarks): TRL's step on
    W1's longest sequence (2,560 tokens, 512 scored: 0.913 / 1.571 / 3.626 GiB) within 5%, and a
    0.5B walk with all 16 completions in one group below the 2,048-token prompt (1.19 GiB)."""
    for size, measured_gib in (("0.5b", 0.913), ("1.5b", 1.571), ("7b", 3.626)):
        estimate = ActivationModel.of(shaped_config(size), True).single_sequence(2560, 512) / 2**30
        assert estimate == pytest.approx(measured_gib, rel=0.05), size
    group = ActivationModel.of(shaped_config("0.5b"), True).unit(16 * 512, 2048, keep_graph=True) / 2**30
    assert group == pytest.approx(1.19, rel=0.05)


def test_grpo_group_of_16_runs_in_fewer_calls():
    """W1 (G=16, prompt 2048, completion 512): the prompt is pushed and the 16 completions run in
    two balanced groups of 8 (was 4 groups of 4, capped by the longest node); one group of 16
    would exceed the longest sequence's footprint (1.19 vs 0.91 GiB measured at 0.5B)."""
    for size in ("0.5b", "1.5b", "7b"):
        config = shaped_config(size)
        w1 = suite_workloads(config.vocab_size)[0]
        forest = PrefixForest.from_sequences(w1.sequences)
        scoring = forest.scoring_plan(w1.score_from)
        budget = GroupBudget.for_forest(forest, config, True, True, scoring=scoring)
        plan = plan_walk(forest, scoring, None, budget)
        assert plan.num_calls == 3, size
        assert plan_walk(forest, scoring, None).num_calls == 5
        assert [u.num_tokens for u in plan.units if not u.pushed] == [8 * 512, 8 * 512]
        assert budget.model.unit(16 * 512, 2048, True) > budget.reference


def test_planned_units_fit_the_model():
    model = tiny_model("qwen2")
    seqs = deep_tree()
    forest = PrefixForest.from_sequences(seqs)
    budget = GroupBudget.for_forest(forest, model.config, False, False, dtype_bytes=4)
    plan = plan_walk(forest, forest.scoring_plan(), None, budget)
    for unit in plan.units:
        if not unit.pushed:
            fits = budget.unit_bytes(unit.num_tokens, unit.depth) <= budget.reference
            assert fits or unit.num_tokens <= budget.floor


@pytest.mark.parametrize("fraction", [0.0, 0.3, 1.0, 10.0])
def test_memory_budget_sizes_groups_and_stays_exact(qwen2, fraction):
    """Log-probs (forward-only walk) and gradients against the untreed model and packed mode."""
    seqs = deep_tree(levels=5, seed=2)
    forest = PrefixForest.from_sequences(seqs)
    reference = ActivationModel.of(qwen2.config, False, 4).single_sequence(forest.max_depth)
    check_dfs(qwen2, seqs, memory_budget=int(reference * fraction))


def test_default_grouping_under_checkpointing_is_exact():
    model = tiny_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    check_dfs(model, deep_tree(levels=6, seed=3), keep_graph=None)


def test_forward_only_walks_take_larger_groups():
    """``tree_logprobs`` keeps no graph: under the same bound its groups are far larger (every
    suite GRPO group and agentic tree fits one call) and each planned unit fits the reference."""
    config = shaped_config("0.5b")
    for w in suite_workloads(config.vocab_size):
        forest = PrefixForest.from_sequences(w.sequences)
        scoring = forest.scoring_plan(w.score_from)
        fwd = GroupBudget.for_forest(forest, config, True, False, scoring=scoring, forward_only=True)
        bwd = GroupBudget.for_forest(forest, config, True, False, scoring=scoring)
        assert fwd(0) > bwd(0) and fwd(2048) > bwd(2048)
        plan = plan_walk(forest, scoring, None, fwd)
        assert plan.num_calls <= plan_walk(forest, scoring, None, bwd).num_calls
        for u in plan.units:
            assert fwd.unit_bytes(u.num_tokens, u.depth) <= fwd.reference or u.num_tokens <= fwd.floor



def test_w7_family_and_the_largest_trees_each_mode_trains():
    """W7 is built only when named, and scaled keeps its shape (T/U fixed, paths scaled); the memory
    model's largest trees agree with what the H200 measured at 7B (docs/benchmarks/suite_long_h200.json):
    W7 ran out of memory packed and trained in dfs, and so did W7 scaled by 2."""
    from trl_tree.bench.dfs import largest_trees

    assert "W7" not in {w.name for w in suite_workloads(100)}
    (quarter,) = suite_workloads(100, {"W7"}, 0.25)
    forest = PrefixForest.from_sequences(quarter.sequences)
    assert forest.max_depth == 8000 and abs(forest.num_tokens / forest.num_unique_tokens - 12.19) < 0.01
    rows = {r["scale"]: r for r in largest_trees(shaped_config("7b"), 139)}
    assert not rows[1]["packed_fits"] and rows[1]["dfs_fits"] and rows[2]["dfs_fits"]
    assert rows[0.5]["packed_fits"]
    fits = [r["dfs_fits"] for r in rows.values()]
    assert fits == sorted(fits, reverse=True)  # a larger tree never fits where a smaller one did not
