"""Depth-first walk vs packed vs TRL's padded path: time and peak memory (GPU, bf16).

    python -m trl_tree.bench.dfs [--size 1.5b] [--workload grpo|agentic|all] [--out dfs.json]
    python -m trl_tree.bench.dfs --size 7b --largest 139   # the largest tree each mode trains (no GPU)

Workloads: the GRPO group of ``bench.packed`` (G=16, prompt 2048, completion 512) and a deep
agentic tree (4.8k-token system prompt and a shared first turn, then turns branching at tool
calls, 16 trajectories of 8.65k tokens, T/U ≈ 9.4). ``longest_single`` is TRL's path on the
longest sequence alone: the memory the DFS target is measured against (≤ 1.2×). ``dfs`` groups
sibling subtrees as the memory model allows (``cost_model.GroupBudget``); ``dfs nodes`` caps
groups at the longest node (``memory_budget=0``: the walk's smallest calls without chunking).
Each dfs row also records its number of model calls and the model's estimate of its largest unit.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from .. import PrefixForest, TreeOptions, tree_backward
from ..engine.cost_model import GroupBudget
from ..engine.dfs.plan import plan_walk
from ..data.tiny import SHAPED_SIZES, grpo_group
from .common import add_kernels_arg, bench_model, dump, environment, padded_step, time_cuda


def agentic_tree(vocab: int, system: int = 4800, first_turn: int = 2400, turns=(600, 400, 300, 150),
                 seed: int = 0) -> list[list[int]]:
    """Trajectories sharing a system prompt and a first turn, branching in two at each later turn."""
    rng = np.random.default_rng(seed)
    paths = [rng.integers(0, vocab, system + first_turn).tolist()]
    for length in turns:
        paths = [p + rng.integers(0, vocab, length).tolist() for p in paths for _ in range(2)]
    return paths


def walk_shape(forest: PrefixForest, score_from: int, config, path: str, graphs: bool = False) -> dict:
    """Model calls of a benchmarked walk and the memory model's estimate of its largest group,
    planned as ``tree_backward`` plans it (bf16, gradient checkpointing; ``graphs``: replayed units,
    which recompute pushed nodes)."""
    keep_graph = path != "dfs recompute" and not graphs
    chunk = 1024 if path == "dfs chunk 1024" else None
    scoring = forest.scoring_plan(score_from)
    budget = GroupBudget.for_forest(forest, config, True, keep_graph,
                                    memory_budget=0 if path == "dfs nodes" else None, scoring=scoring)
    plan = plan_walk(forest, scoring, chunk, None if chunk else budget, merge_pops=not keep_graph)
    # groups, and pops that took a group along
    largest = max(budget.unit_bytes(u.num_tokens, u.depth) for u in plan.units if u.num_tokens > u.pushed_tokens)
    return {"calls": plan.num_calls, "estimated_largest_group_gib": round(largest / 2**30, 3),
            "estimated_longest_single_gib": round(budget.reference / 2**30, 3) if path != "dfs nodes" else None}


#: bytes per parameter a training step holds besides activations: bf16 weights, their gradients and
#: AdamW's two moment buffers (kept in the parameters' dtype by torch.optim.AdamW)
TRAINING_BYTES_PER_PARAMETER = 8


def largest_trees(config, memory_gib: float, scales=None) -> list[dict]:
    """The W7 family scaled by ``f`` (system prompt and every turn ``f`` times as long; 64 leaves, T/U
    12.2 at every scale): for each ``f``, the memory model's activation estimate of the packed call
    (gradient checkpointing, attention outputs kept) and of the walk (its bound: one forward+backward
    of the longest path, plus the K/V stack with gradient slots for the pushed path), and whether each
    fits ``memory_gib`` less ``TRAINING_BYTES_PER_PARAMETER`` per parameter. The largest fitting
    ``f`` per mode is the largest tree it trains; the suite's measured peaks on W6/W7 check the model."""
    from ..engine.cost_model import ActivationModel
    from .workloads import SCALE_SYSTEM, SCALE_TURNS

    params = _parameters(config)
    free = memory_gib * 2**30 - params * TRAINING_BYTES_PER_PARAMETER
    packed_model = ActivationModel.of(config, True, keep_attention=True)
    walk_model = ActivationModel.of(config, True)
    system, turns = SCALE_SYSTEM, SCALE_TURNS
    rows = []
    for f in scales or (0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8):
        path = round(f * (system + sum(n for n, _ in turns)))
        unique = round(f * (system + sum(n * 2 ** (i + 1) for i, (n, _) in enumerate(turns))))
        leaves = 2 ** len(turns)
        scored = path - round(f * system)
        packed = packed_model.call(unique, leaves * scored, True)
        walk = walk_model.single_sequence(path, scored) + walk_model.stack(path, path, False)
        rows.append({"scale": f, "path_tokens": path, "T": leaves * path, "U": unique,
                     "T_over_U": round(leaves * path / unique, 2),
                     "packed_gib": round(packed / 2**30, 1), "packed_fits": packed <= free,
                     "dfs_gib": round(walk / 2**30, 1), "dfs_fits": walk <= free})
    return rows


def _parameters(config) -> int:
    """Parameter count of a Qwen2-shaped decoder (embeddings and LM head untied when the config says so)."""
    from ..engine.cost_model import layer_weights

    h = config.hidden_size
    embed = config.vocab_size * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return config.num_hidden_layers * (layer_weights(config) + 2 * h) + embed  # + the two norms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1.5b", choices=SHAPED_SIZES)
    parser.add_argument("--workload", default="all", choices=("grpo", "agentic", "all"))
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", default=None, help="write per-kernel tables of the tree paths here")
    parser.add_argument("--largest", type=float, default=None, metavar="GIB",
                        help="no GPU run: print the memory model's largest W7-shaped tree each mode trains in GIB "
                        "of GPU memory (weights, gradients and AdamW states counted), for --size")
    add_kernels_arg(parser)
    args = parser.parse_args(argv)
    if args.largest is not None:
        from ..data.tiny import shaped_config

        rows = largest_trees(shaped_config(args.size), args.largest)
        dump(args.out, {"size": args.size, "memory_gib": args.largest, "rows": rows})
        return 0
    model = bench_model(args.size, args.kernels)
    config = model.config

    workloads = {}
    if args.workload in ("grpo", "all"):
        workloads["grpo_g16_p2048_c512"] = (grpo_group(2048, 512, 16, config.vocab_size, seed=0), 2048)
    if args.workload in ("agentic", "all"):
        workloads["agentic_16x8650"] = (agentic_tree(config.vocab_size), 4800)
    results = []
    for name, (seqs, score_from) in workloads.items():
        forest = PrefixForest.from_sequences(seqs)
        T, U = forest.num_tokens, forest.num_unique_tokens
        adv = torch.from_numpy(np.random.default_rng(1).standard_normal(len(seqs))).float().cuda()
        n_terms = sum(len(s) - score_from for s in seqs)

        def token_loss(lp, seq_idx, pos):
            return -lp * adv[seq_idx] / n_terms

        def padded(batch_seqs, batch_adv):
            base = padded_step(model, batch_seqs, batch_adv, score_from, n_terms)

            def step():
                model.zero_grad(set_to_none=False)  # in place: see time_cuda
                base()
            return step

        def tree(mode, **kw):
            def step():
                model.zero_grad(set_to_none=False)
                tree_backward(model, seqs, token_loss, mode, score_from=score_from, options=TreeOptions(**kw))
            return step

        longest = int(np.argmax([len(s) for s in seqs]))
        paths = {
            "trl_padded": padded(seqs, adv),
            "longest_single": padded([seqs[longest]], adv[longest : longest + 1]),
            "packed": tree("packed"),
            "dfs": tree("dfs"),  # keeps pushed nodes' graphs: the model uses gradient checkpointing
            "dfs nodes": tree("dfs", memory_budget=0),
            "dfs recompute": tree("dfs", keep_graph=False),
            "dfs chunk 1024": tree("dfs", chunk_size=1024),
        }
        rows = []
        for path, fn in paths.items():
            torch.cuda.empty_cache()
            try:
                ms, peak, act = time_cuda(fn, warmup=1, iters=args.iters,
                                          reset=lambda: model.zero_grad(set_to_none=True))
                rows.append({"path": path, "ms": round(ms, 1), "peak_gib": round(peak, 3),
                             "activation_peak_gib": round(act, 3)})
            except torch.OutOfMemoryError:
                rows.append({"path": path, "error": "out of memory"})
            print(name, rows[-1], flush=True)
        if args.profile:
            from .packed import profile_steps

            profile_steps(f"{args.profile}.{name}.txt", {k: v for k, v in paths.items() if k in ("packed", "dfs")})
        base = next(r for r in rows if r["path"] == "trl_padded")
        single = next(r for r in rows if r["path"] == "longest_single")
        for r in rows:
            if "ms" in r and "ms" in base:
                r["speedup"] = round(base["ms"] / r["ms"], 3) if r["path"] != "longest_single" else None
                r["peak_over_longest_single"] = round(r["peak_gib"] / single["peak_gib"], 3) if "peak_gib" in single else None
                if "activation_peak_gib" in single:
                    r["activation_peak_over_longest_single"] = round(
                        r["activation_peak_gib"] / single["activation_peak_gib"], 3)
        for r in rows:
            if r["path"].startswith("dfs") and "ms" in r:
                r.update(walk_shape(forest, score_from, config, r["path"]))
        results.append({"workload": name, "T": T, "U": U, "T_over_U": round(T / U, 3), "max_depth": forest.max_depth,
                        "num_sequences": len(seqs), "rows": rows})
        print(f"\n{name}: T={T} U={U} T/U={T / U:.2f} longest={forest.max_depth}")
        for r in rows:
            print(f"  {r}")
    dump(args.out, {"environment": environment(args.kernels), "model": f"Qwen2.5-{args.size}-shaped (random init), bf16, "
                    "gradient checkpointing", "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
