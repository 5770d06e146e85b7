"""Spreading whole trees over ranks by their cost (DESIGN, "Distributed"; issue 20, step 2).

A tree's cost is what its step runs, in FLOPs (``cost_model.step_flops``): its unique tokens
through the layer stack, its scored predictions through the LM head, and Σ visible keys over its
unique tokens through attention — so two groups of equal token counts that branch at different
depths cost differently — plus a fixed per-call overhead. Three ways to cut a list of trees into
``bins`` sets, each returned as lists of tree indices:

* :func:`longest_processing_time` — heaviest first onto the lightest bin (LPT, as verl balances
  sequence lengths);
* :func:`largest_differencing` — Karmarkar–Karp's k-way largest differencing method;
* :func:`contiguous_ranges` — runs of the trees in their given (depth-first) order under a cost
  limit found by binary search (AREAL-DTA's way; keeps neighbouring trees, which may share
  prefixes, together).

:func:`balance` runs all three and keeps the one with the lowest :func:`imbalance` (max over mean
bin cost). Only who computes what changes: the update is a sum over trees either way.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from ..engine.cost_model import StepCost, step_flops
from ..engine.forest import PrefixForest

METHODS = ("lpt", "kk", "contiguous")


def tree_cost(forest: PrefixForest, config, score_from: int | Sequence[int] | None = None,
              gradient_checkpointing: bool = True, call_overhead: float = 0.0) -> float:
    """FLOPs of one forward+backward of ``forest`` for a model of ``config``, plus ``call_overhead``."""
    cost = StepCost(forest.num_unique_tokens, forest.scoring_plan(score_from).num_predictions,
                    forest.sum_visible_keys())
    return step_flops(cost, config, gradient_checkpointing) + call_overhead


def imbalance(costs: Sequence[float], bins: Sequence[Sequence[int]]) -> float:
    """Max over mean of the bins' total costs (1.0: perfectly even; empty bins count as 0)."""
    totals = [sum(costs[i] for i in b) for b in bins]
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean > 0 else 1.0


def _check(costs: Sequence[float], bins: int) -> None:
    if not isinstance(bins, int) or isinstance(bins, bool) or bins < 1:
        raise ValueError(f"bins must be a positive int, got {bins!r}")
    if any(c < 0 for c in costs):
        raise ValueError("costs must be non-negative")


def longest_processing_time(costs: Sequence[float], bins: int) -> list[list[int]]:
    """Heaviest tree first, each onto the bin with the least cost so far (ties: the lower index)."""
    _check(costs, bins)
    heap = [(0.0, b) for b in range(bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        total, b = heapq.heappop(heap)
        out[b].append(i)
        heapq.heappush(heap, (total + costs[i], b))
    return [sorted(b) for b in out]


def largest_differencing(costs: Sequence[float], bins: int) -> list[list[int]]:
    """Karmarkar–Karp for ``bins`` sets: every tree starts as a partial partition (itself, and
    ``bins - 1`` empty sets); the two partitions with the largest spread are merged, the heaviest
    set of one with the lightest of the other, until one partition is left."""
    _check(costs, bins)
    if not costs:
        return [[] for _ in range(bins)]
    heap = []
    for i, c in enumerate(costs):
        sets = [(float(c), [i])] + [(0.0, []) for _ in range(bins - 1)]
        heapq.heappush(heap, (-float(c), i, sets))
    counter = len(costs)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda s: -s[0])
        b = sorted(b, key=lambda s: s[0])
        merged = sorted(((x[0] + y[0], x[1] + y[1]) for x, y in zip(a, b)), key=lambda s: -s[0])
        spread = merged[0][0] - merged[-1][0]
        heapq.heappush(heap, (-spread, counter, merged))
        counter += 1
    return [sorted(s[1]) for s in heap[0][2]]


def contiguous_ranges(costs: Sequence[float], bins: int) -> list[list[int]]:
    """The trees in their given order, cut into at most ``bins`` runs whose largest total is as
    small as a binary search over the limit finds (60 halvings: exact to float rounding)."""
    _check(costs, bins)

    def cut(limit: float) -> list[list[int]] | None:
        runs: list[list[int]] = [[]]
        total = 0.0
        for i, c in enumerate(costs):
            if c > limit:
                return None
            if runs[-1] and total + c > limit:
                runs.append([])
                total = 0.0
            runs[-1].append(i)
            total += c
        return runs if len(runs) <= bins else None

    lo, hi = max(costs, default=0.0), float(sum(costs))
    best = cut(hi) or [list(range(len(costs)))]
    for _ in range(60):
        if hi - lo <= 1e-12 * max(hi, 1.0):
            break
        mid = (lo + hi) / 2
        runs = cut(mid)
        if runs is None:
            lo = mid
        else:
            hi, best = mid, runs
    return best + [[] for _ in range(bins - len(best))]


_PARTITIONERS = {"lpt": longest_processing_time, "kk": largest_differencing, "contiguous": contiguous_ranges}


def balance(costs: Sequence[float], bins: int, method: str = "best") -> tuple[list[list[int]], str, float]:
    """``(bins of tree indices, the method used, its imbalance)``; ``method="best"`` tries every one
    of :data:`METHODS` and keeps the lowest imbalance (the first listed on a tie)."""
    if method != "best" and method not in _PARTITIONERS:
        raise ValueError(f"method must be 'best' or one of {METHODS}, got {method!r}")
    names = METHODS if method == "best" else (method,)
    results = [(imbalance(costs, parts), n, parts) for n in names for parts in [_PARTITIONERS[n](costs, bins)]]
    value, name, parts = min(results, key=lambda r: r[0])
    return parts, name, value
