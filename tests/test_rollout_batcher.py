"""The async trainer's opt-in batcher (``tree_batcher='rollouts'``): whole rollouts per rank,
arrival order, budget, balance, oversize samples — against TRL's own ``TokenBudgetBatcher``."""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np
import pytest

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl.experimental.async_grpo.async_grpo_trainer import TokenBudgetBatcher  # noqa: E402

from trl_tree.data.tiny import tiny_config  # noqa: E402
from trl_tree.distributed.balance import imbalance  # noqa: E402
from trl_tree.trainers.asynchronous.rollout_batcher import RolloutBatcher, flop_cost  # noqa: E402


def stream(groups: int = 24, seed: int = 0, oversize: set[int] = frozenset()) -> list[dict]:
    """Groups of 4 rollouts of free lengths sharing a prompt of free length; in the groups of
    ``oversize`` one rollout is 300 tokens long."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(2, 1000, int(rng.integers(4, 40))).tolist()
        for r in range(4):
            n = 300 if (g in oversize and r == 0) else int(rng.integers(2, 30))
            ids = prompt + rng.integers(2, 1000, n).tolist()
            mask = np.zeros(len(ids), np.int64)
            mask[len(prompt):] = 1
            out.append({"input_ids": np.asarray(ids), "completion_mask": mask, "group_id": g, "uid": (g, r)})
    return out


COST = flop_cost(tiny_config("qwen2"), True)


def batches(batcher) -> list[list]:
    return list(iter(batcher))


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_whole_rollouts_within_budget_in_arrival_order(ranks):
    samples = stream()
    metrics = defaultdict(list)
    out = batches(RolloutBatcher(samples, ranks, 300, metrics, COST))
    seen = [s["uid"] for mb in out for row in mb for s in row.samples]
    assert len(seen) == len(set(seen))  # each sample once
    assert len(seen) > len(samples) * 0.6  # the stream's end waits for a full micro-batch, as stock's
    position = {s["uid"]: i for i, s in enumerate(samples)}
    last_group = max(g for g, _ in seen)
    assert {s["uid"] for s in samples if s["group_id"] < last_group - 3} <= set(seen)  # nothing left behind
    for mb in out:
        assert len(mb) == ranks and all(row.samples for row in mb)
        for row in mb:
            assert len(row.tokens) <= 300 and row.trained <= 300
        # a group that fits one rank is on one rank
        where = defaultdict(set)
        for r, row in enumerate(mb):
            for s in row.samples:
                where[s["group_id"]].add(r)
        assert all(len(w) == 1 for w in where.values())
    # micro-batches follow arrival order: a micro-batch's first sample arrived no later than the next one's
    firsts = [min(position[s["uid"]] for row in mb for s in row.samples) for mb in out]
    assert firsts == sorted(firsts)
    assert not metrics["batch/dropped_oversize_total"]


def test_ranks_are_balanced_better_than_trl_batcher():
    """On the same stream, the rows' costs (FLOPs of their tries) are closer to even than TRL's
    sample-by-sample placement leaves them, and no group is split over ranks."""
    samples = stream(groups=64, seed=3)
    ours = batches(RolloutBatcher(samples, 4, 400, defaultdict(list), COST))
    theirs = batches(TokenBudgetBatcher(samples, 4, 400, defaultdict(list)))

    def mean_imbalance(out):
        return float(np.mean([imbalance([COST(row) for row in mb], [[i] for i in range(len(mb))]) for mb in out]))

    def split_groups(out):  # (micro-batch, group) pairs on more than one rank
        return sum(len({(r, s["group_id"]) for r, row in enumerate(mb) for s in row.samples})
                   - len({s["group_id"] for row in mb for s in row.samples}) for mb in out)

    assert mean_imbalance(ours) < mean_imbalance(theirs)
    assert split_groups(ours) == 0


def test_oversize_samples_dropped_or_kept_alone():
    samples = stream(groups=12, oversize={2, 7})
    dropped = defaultdict(list)
    out = batches(RolloutBatcher(samples, 2, 160, dropped, COST))
    lengths = [len(s["input_ids"]) for mb in out for row in mb for s in row.samples]
    assert max(lengths) <= 160 and len(dropped["batch/dropped_oversize_total"]) == 2  # as stock drops them

    kept = defaultdict(list)
    out = batches(RolloutBatcher(samples, 2, 160, kept, COST, keep_oversize=True))
    assert not kept["batch/dropped_oversize_total"]
    alone = [row for mb in out for row in mb if len(row.tokens) > 160]
    assert len(alone) == 2 and all(len(mb) == 2 and all(r.samples for r in mb) for mb in out)
    for row in alone:  # a row of its own: its rollout's samples within its longest (+ a token per sample of it)
        assert len({s["group_id"] for s in row.samples}) == 1 and len(row.tokens) <= max(map(len, (
            s["input_ids"] for s in row.samples))) + 4
    # the rest of an oversize sample's group still trains, within the budget on other rows
    uids = {s["uid"] for mb in out for row in mb for s in row.samples}
    assert {(2, r) for r in range(4)} <= uids
