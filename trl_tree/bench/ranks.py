"""How evenly whole trees spread over ranks, and what TRL's row slicing costs the tree (CPU only).

    python -m trl_tree.bench.ranks [--size 1.5b] [--ranks 2,4,8] [--groups-per-rank 4] [--out ranks.json]

For each suite shape (GRPO groups W1–W3 with free-length completions and prompts, uniform in
[half, full]; the agentic tree W4 with free-length turns), a generation batch of
``groups-per-rank × ranks`` trees is built and:

* balanced over the ranks by estimated cost (``trainers.balance``: FLOPs of unique tokens, scored
  predictions and Σ visible keys) with LPT, Karmarkar–Karp and contiguous DFS-order ranges —
  max/mean cost per rank (the issue's target: ≤ 1.05);
* cut as TRL cuts it — contiguous slices of rows, one per rank, with the rows of a group in a
  row — when the slice is not a multiple of the group: per-rank T/U then (tokens ÷ unique tokens),
  against whole groups per rank.
"""

from __future__ import annotations

import argparse

import numpy as np

from ..engine.forest import PrefixForest
from ..data.tiny import SHAPED_SIZES, shaped_config
from ..distributed.balance import METHODS, balance, imbalance, tree_cost
from .common import dump

SHAPES = {"W1": (2048, 512, 16), "W2": (1024, 1024, 8), "W3": (256, 1024, 8)}


def free_groups(prompt: int, completion: int, group: int, count: int, vocab: int, rng) -> list[list[list[int]]]:
    """``count`` GRPO groups: prompt and completion lengths uniform in [half, full]."""
    out = []
    for _ in range(count):
        p = rng.integers(0, vocab, int(rng.integers(prompt // 2, prompt + 1))).tolist()
        out.append([p + rng.integers(0, vocab, int(rng.integers(completion // 2, completion + 1))).tolist()
                    for _ in range(group)])
    return out


def free_agentic(count: int, vocab: int, rng, system: int = 4800,
                 turns=((60, 1), (60, 2), (150, 1), (200, 2), (60, 3))) -> list[list[list[int]]]:
    """``count`` agentic trees (W4's branching), each turn's length uniform in [half, full]."""
    out = []
    for _ in range(count):
        paths = [rng.integers(0, vocab, system).tolist()]
        for length, branch in turns:
            paths = [p + rng.integers(0, vocab, int(rng.integers(length // 2, length + 1))).tolist()
                     for p in paths for _ in range(branch)]
        out.append(paths)
    return out


def sliced_ratio(trees: list[list[list[int]]], ranks: int) -> tuple[float, float]:
    """(min, mean) per-rank T/U when the rows, tree after tree, are cut into ``ranks`` equal
    contiguous slices (TRL's split of a generation batch), ``rows % ranks == 0`` assumed."""
    rows = [r for t in trees for r in t]
    per = len(rows) // ranks
    ratios = [PrefixForest.from_sequences(rows[k * per : (k + 1) * per]).dedup_ratio for k in range(ranks)]
    return min(ratios), float(np.mean(ratios))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1.5b", choices=SHAPED_SIZES)
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--groups-per-rank", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    config = shaped_config(args.size)
    vocab = 1000  # token ids only shape the sharing; a small vocabulary keeps the forests cheap
    results = []
    for ranks in [int(r) for r in args.ranks.split(",")]:
        rng = np.random.default_rng(args.seed + ranks)
        count = args.groups_per_rank * ranks
        shapes = {name: free_groups(p, c, g, count, vocab, rng) for name, (p, c, g) in SHAPES.items()}
        shapes["W4"] = free_agentic(count, vocab, rng)
        for name, trees in shapes.items():
            forests = [PrefixForest.from_sequences(t) for t in trees]
            costs = [tree_cost(f, config) for f in forests]  # every token scored: the head term a little high
            row = {"shape": name, "ranks": ranks, "trees": count}
            for method in METHODS:
                row[f"imbalance_{method}"] = round(balance(costs, ranks, method)[2], 4)
            row["imbalance_best"] = min(row[f"imbalance_{m}"] for m in METHODS)
            row["imbalance_unbalanced"] = round(imbalance(costs, [list(range(k, count, ranks)) for k in range(ranks)]), 4)
            whole = float(np.mean([f.dedup_ratio for f in forests]))
            # 1.5 groups' rows per rank (TRL's slice not a multiple of the group): groups straddle two ranks
            lo, mean = sliced_ratio(trees[: 3 * ranks // 2], ranks) if ranks % 2 == 0 else (float("nan"),) * 2
            row |= {"T_over_U_whole_trees": round(whole, 3), "T_over_U_sliced_min": round(lo, 3),
                    "T_over_U_sliced_mean": round(mean, 3)}
            results.append(row)
            print(row, flush=True)
    dump(args.out, {"model": f"Qwen2.5-{args.size}-shaped FLOP costs", "groups_per_rank": args.groups_per_rank,
                    "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
