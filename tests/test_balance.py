"""Spreading whole trees over ranks (``trl_tree.distributed.balance``): valid partitions, the known
bounds, the cost's attention term, and ``balance`` keeping the most even of the three methods."""

from __future__ import annotations

import itertools
import random

import pytest

from trl_tree.engine.forest import PrefixForest
from trl_tree.data.tiny import shaped_config
from trl_tree.distributed.balance import (
    METHODS,
    balance,
    contiguous_ranges,
    imbalance,
    largest_differencing,
    longest_processing_time,
    tree_cost,
)

PARTITIONERS = {"lpt": longest_processing_time, "kk": largest_differencing, "contiguous": contiguous_ranges}


def _optimal_max(costs, bins):
    best = float("inf")
    for labels in itertools.product(range(bins), repeat=len(costs)):
        totals = [0.0] * bins
        for c, b in zip(costs, labels):
            totals[b] += c
        best = min(best, max(totals))
    return best


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("bins", [1, 2, 3, 5])
def test_every_tree_lands_in_exactly_one_bin(name, bins):
    rng = random.Random(bins)
    costs = [rng.uniform(1, 100) for _ in range(11)]
    parts = PARTITIONERS[name](costs, bins)
    assert len(parts) == bins
    assert sorted(i for p in parts for i in p) == list(range(len(costs)))


def test_contiguous_runs_keep_the_order_and_find_the_even_cut():
    costs = [8, 7, 6, 5, 4]
    parts = contiguous_ranges(costs, 2)
    assert parts == [[0, 1], [2, 3, 4]] and imbalance(costs, parts) == 1.0
    for p in contiguous_ranges([3, 1, 4, 1, 5, 9, 2, 6], 3):
        assert p == list(range(p[0], p[0] + len(p))) if p else True


@pytest.mark.parametrize("seed", range(6))
def test_lpt_within_its_bound_and_best_never_worse_than_any(seed):
    rng = random.Random(seed)
    costs = [rng.randint(1, 50) for _ in range(rng.randint(4, 8))]
    bins = rng.choice([2, 3])
    opt = _optimal_max(costs, bins)
    lpt = max(sum(costs[i] for i in p) for p in longest_processing_time(costs, bins))
    assert lpt <= (4 / 3 - 1 / (3 * bins)) * opt + 1e-9  # Graham's bound
    parts, name, value = balance(costs, bins)
    assert name in METHODS and value == imbalance(costs, parts)
    assert all(value <= imbalance(costs, PARTITIONERS[n](costs, bins)) + 1e-12 for n in METHODS)
    assert max(sum(costs[i] for i in p) for p in parts) >= opt - 1e-9


def test_karmarkar_karp_gives_the_textbook_answer_and_balance_the_even_one():
    costs = [4, 5, 6, 7, 8]
    parts = largest_differencing(costs, 2)
    assert sorted(sum(costs[i] for i in p) for p in parts) == [14, 16]  # KK's known answer (optimum 15/15)
    _, name, value = balance(costs, 2)
    assert (name, value) == ("contiguous", 1.0)


def test_cost_sees_where_a_tree_branches():
    """Equal unique tokens, different branch depths: the deeper tree attends over more keys."""
    deep = PrefixForest.from_sequences([[1] * 290 + [2] * 10, [1] * 290 + [3] * 10])
    shallow = PrefixForest.from_sequences([[1] * 10 + [2] * 150, [1] * 10 + [3] * 150])
    assert deep.num_unique_tokens == shallow.num_unique_tokens == 310
    config = shaped_config("0.5b")
    assert tree_cost(deep, config) > tree_cost(shallow, config)
    assert tree_cost(deep, config, call_overhead=5.0) == tree_cost(deep, config) + 5.0


def test_bad_input():
    with pytest.raises(ValueError, match="bins must be a positive int"):
        longest_processing_time([1.0], 0)
    with pytest.raises(ValueError, match="non-negative"):
        largest_differencing([1.0, -2.0], 2)
    with pytest.raises(ValueError, match="method must be"):
        balance([1.0], 2, method="random")
