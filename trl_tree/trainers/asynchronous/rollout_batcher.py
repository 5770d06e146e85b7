"""The async trainer's opt-in batcher (``tree_batcher="rollouts"``): whole rollouts per rank,
micro-batches balanced by what their trees cost.

TRL 1.16's ``TokenBudgetBatcher`` places the stream's samples one at a time, each into the open row
of least attention load that still fits ``token_budget``; a group can so end up on several ranks
(each forwarding its shared prompt again), the rows' costs are balanced only as far as arrival order
allows, and a sample longer than the budget is dropped. This batcher keeps each rollout — the
samples of one ``group_id``, which arrive together: TRL's worker enqueues a group once it is scored
— as one unit, and

* closes a micro-batch once the units waiting fill every rank's budget, taking them in arrival
  order (no sample waits behind later ones, so staleness is what stock's would be);
* places them heaviest first onto the rank of least cost where they fit (LPT), the cost being the
  step's FLOPs for the unit's trie (``cost_model.step_flops``: unique tokens through the layers,
  trained tokens through the head, visible keys through attention — as ``tree_window`` balances);
* cuts a unit longer than the budget between its samples, in their order (neighbours share most);
* gives a sample longer than the budget a row of its own where ``keep_oversize`` (the depth-first
  walk bounds memory by a path, not by the row), shared with the samples of its rollout that fit in
  its length (a multi-turn rollout's earlier turns, its own prefixes), and otherwise drops it as
  stock does, counted in the same metric.

Only which samples share a row changes; each sample's loss terms are its own either way (with the
trainer's ``loss_normalization="window"`` the update does not depend on the cut at all).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from trl.experimental.async_grpo.packing import TreeRow

logger = logging.getLogger(__name__)

Sample = dict[str, Any]


def row_of(samples: Iterable[Sample]) -> TreeRow:
    """A fresh trie row holding ``samples`` in their order."""
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    return row


def flop_cost(config, gradient_checkpointing: bool) -> Callable[[TreeRow], float]:
    """A row's cost in FLOPs for a model of ``config`` (``cost_model.step_flops`` of its trie)."""
    from ...engine.cost_model import StepCost, step_flops

    def cost(row: TreeRow) -> float:
        return step_flops(StepCost(len(row.tokens), row.trained, row.load), config, gradient_checkpointing)

    return cost


class RolloutBatcher(torch.utils.data.IterableDataset):
    """Micro-batches of ``num_processes`` rows (lists of :class:`TreeRow`, as TRL's collator takes)
    from ``dataset``'s sample stream; see the module docstring."""

    def __init__(self, dataset: Iterable[Sample], num_processes: int, token_budget: int, metrics: dict,
                 cost: Callable[[TreeRow], float], keep_oversize: bool = False):
        if token_budget <= 0:
            raise ValueError(f"tree_batcher='rollouts' needs token_budget > 0, got {token_budget}")
        self.dataset = dataset
        self.num_processes = num_processes
        self.token_budget = token_budget
        self.metrics = metrics
        self.cost = cost
        self.keep_oversize = keep_oversize

    def __iter__(self) -> Iterator[list[TreeRow]]:
        pending: list[TreeRow] = []  # closed units' pieces (each a row of its own), in arrival order
        current: list[Sample] = []
        for sample in self.dataset:
            if current and sample["group_id"] != current[0]["group_id"]:
                pending.extend(self._pieces(current))
                current = []
                yield from self._ready(pending)
            current.append(sample)
        # like stock's batcher, an ended stream's last partial micro-batch is not trained

    def _pieces(self, unit: list[Sample]) -> list[TreeRow]:
        """``unit`` cut between samples, in their order, into runs that fit the budget. A sample over
        the budget is dropped as stock drops it, or (``keep_oversize``) raises its rollout's budget
        to its own length: the walk's memory is bounded by its longest path, and the rollout's earlier
        turns (prefixes of it) add next to nothing to the piece that holds it."""
        pieces: list[TreeRow] = []
        if not self.keep_oversize:
            kept = []
            for sample in unit:
                if len(sample["input_ids"]) > self.token_budget:
                    logger.warning(f"Dropping a rollout sample of {len(sample['input_ids'])} tokens that exceeds "
                                   f"token_budget={self.token_budget}. Raise token_budget, or train it with "
                                   "tree_mode='dfs' and tree_batcher='rollouts'.")
                    self.metrics["batch/dropped_oversize_total"].append(1.0)
                else:
                    kept.append(sample)
            unit = kept
        # over the budget, a piece may hold the rollout's longest sample, plus the one token per sample
        # that TRL's trie adds where a sample ends inside another (it forks one token early)
        longest = max((len(s["input_ids"]) for s in unit), default=0)
        limit = self.token_budget if longest <= self.token_budget else longest + len(unit)
        piece = TreeRow()
        for sample in unit:
            if piece.samples and not piece.fits(sample, limit):
                pieces.append(piece)
                piece = TreeRow()
            piece.add(sample)
        if piece.samples:
            pieces.append(piece)
        return pieces

    def _ready(self, pending: list[TreeRow]) -> Iterator[list[TreeRow]]:
        """Micro-batches while the waiting pieces fill every rank's budget (taken from ``pending``)."""
        capacity = self.num_processes * self.token_budget
        while len(pending) >= self.num_processes and sum(len(p.tokens) for p in pending) >= capacity:
            chosen = self._choose(pending)
            if chosen is None:
                return
            placed = {i for rank in chosen for i in rank}
            rows = [row_of(s for i in sorted(rank) for s in pending[i].samples) for rank in chosen]
            pending[:] = [piece for i, piece in enumerate(pending) if i not in placed]
            yield rows

    def _choose(self, pieces: list[TreeRow]) -> list[list[int]] | None:
        """Which waiting pieces each rank takes: in arrival order, each onto the rank of least cost
        where it fits (the oldest always finds an empty rank, so nothing waits forever); then the
        pieces so chosen re-dealt heaviest first (LPT), where that fits too. ``None`` when a rank
        would forward nothing (wait for more samples)."""
        weights = [self.cost(piece) for piece in pieces]
        first = self._deal(pieces, weights, range(len(pieces)))
        if first is None:
            return None
        chosen = sorted(i for rank in first for i in rank)
        lpt = self._deal(pieces, weights, sorted(chosen, key=lambda i: (-weights[i], i)))
        if lpt is not None and sum(map(len, lpt)) == len(chosen):
            return lpt
        return first

    def _deal(self, pieces: list[TreeRow], weights: list[float], order) -> list[list[int]] | None:
        """Pieces in ``order``, each onto the rank of least cost where it fits (counting no sharing
        between pieces: different rollouts share little); an oversize piece only onto an empty rank
        and alone."""
        ranks = range(self.num_processes)
        chosen: list[list[int]] = [[] for _ in ranks]
        costs, tokens, trained = [0.0 for _ in ranks], [0 for _ in ranks], [0 for _ in ranks]
        alone = [False for _ in ranks]
        for i in order:
            piece = pieces[i]
            oversize = len(piece.tokens) > self.token_budget  # headed by a sample kept over the budget
            fits = [r for r in ranks if not chosen[r]] if oversize else [
                r for r in ranks if not alone[r] and tokens[r] + len(piece.tokens) <= self.token_budget
                and trained[r] + piece.trained <= self.token_budget]
            if not fits:
                continue
            r = min(fits, key=lambda r: (costs[r], r))
            chosen[r].append(i)
            costs[r] += weights[i]
            tokens[r] += len(piece.tokens)
            trained[r] += piece.trained
            alone[r] = oversize
        return chosen if all(chosen) else None
