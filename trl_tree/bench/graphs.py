"""The packed step eager against replayed CUDA graphs (``cuda_graphs=True``), in one process.

    python -m trl_tree.bench.graphs [--size 0.5b] [--workloads W1,W2,W3,W4] [--kernels hf|compiled]
                                    [--dense-heads] [--profile FILE]

For each workload: TRL's padded step (eager, the suite's baseline), the packed tree step eagerly and
the same step replaying the graphs ``trl_tree.engine.graphs`` captures at its second call — median ms (CUDA
events), speed-up over TRL and its fraction of the FLOP limit (DESIGN, "Measuring speed"), GPU-busy
milliseconds and kernel launches (profiler), activation peak, the capturing call's seconds, the
memory the graphs hold (the pool's new segments at capture; the gradient buffers, which serve as the
parameters' ``.grad``) and the graphed gradients' difference from the eager ones. What it answers: how much of the small models' gap to the limit is the host launching
kernels (notes §9, §13, §15) — a replay launches the step's kernels with one call.

``--dense-heads`` (models with head_dim below 128): the graphed step with the split's dense blocks
on cuDNN (``partial.CUDNN_GRAPHED_MIN_HEAD_DIM``, the default) against FA2 varlen (the eager
choice), alternated in rounds in one process, with GPU time by kind of kernel (notes §17);
``--profile FILE`` writes each graphed variant's per-kernel table there.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from .. import PrefixForest
from ..data.tiny import SHAPED_SIZES
from .common import (
    add_kernels_arg,
    bench_model,
    environment,
    parameter_grads,
    relative_difference,
    step_flops,
    step_paths,
    time_cuda,
)
from .profile import gpu_busy, gpu_ms_by_kind, kernel_table, profile_step
from .suite import _costs
from .workloads import suite_workloads


def _write(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")


def compare_dense_heads(model, step, eager_grads, trl_ms: float, limit: float, rounds: int = 3,
                        tables=None, label: str = "") -> dict:
    """The graphed ``step`` with the split's single-segment blocks on cuDNN from head_dim 64 and from
    128 only (i.e. FA2 varlen at 64, as eager calls run), alternated ``rounds`` times (host drift
    cancels): median ms, speed-up and fraction of the limit, GPU ms by kind, gradient difference
    from the eager step's. The choice is in the layout signature, so each variant has its graphs."""
    from ..engine.attention import partial

    reset = lambda: model.zero_grad(set_to_none=True)  # noqa: E731
    chosen = partial.CUDNN_GRAPHED_MIN_HEAD_DIM
    variants = sorted({chosen, partial.CUDNN_MIN_HEAD_DIM})
    times: dict[int, list[float]] = {v: [] for v in variants}
    out = {}
    try:
        for _ in range(rounds):
            for v in variants:
                partial.CUDNN_GRAPHED_MIN_HEAD_DIM = v
                times[v].append(time_cuda(step, iters=5, reset=reset)[0])
        for v in variants:
            partial.CUDNN_GRAPHED_MIN_HEAD_DIM = v
            reset()
            step()
            diff = relative_difference(eager_grads, parameter_grads(model))
            prof = profile_step(step)
            ms = float(np.median(times[v]))
            out[f"cudnn_from_head_dim_{v}"] = {
                "ms": round(ms, 2), "rounds_ms": [round(t, 2) for t in times[v]], "speedup": round(trl_ms / ms, 3),
                "fraction_of_flop_limit": round(trl_ms / ms / limit, 3), "gpu_ms": gpu_ms_by_kind(prof),
                "grad_difference_vs_eager": round(diff, 5)}
            if tables is not None:
                tables.write(f"===== {label} graphed, cuDNN from head_dim {v}: {ms:.1f} ms\n{kernel_table(prof, 40)}\n\n")
    finally:
        partial.CUDNN_GRAPHED_MIN_HEAD_DIM = chosen
        reset()
    return out


def run_workload(model, w, iters: int, dense_heads: bool = False, tables=None) -> dict:
    seqs, P = w.sequences, w.score_from
    forest = PrefixForest.from_sequences(seqs)
    base_cost, tree_cost = _costs(forest, seqs, P)
    limit = step_flops(base_cost, model.config, True) / step_flops(tree_cost, model.config, True,
                                                                   attention_recompute=False)
    advantages = torch.from_numpy(np.random.default_rng(0).standard_normal(len(seqs))).float().cuda()
    steps = step_paths(model, seqs, P, advantages)
    row = {"workload": w.name, "T": forest.num_tokens, "U": forest.num_unique_tokens,
           "T_over_U": round(forest.num_tokens / forest.num_unique_tokens, 3), "flop_limit": round(limit, 3)}
    eager_grads = None
    for name in ("trl_padded", "packed", "packed_graphs"):
        step = steps[name]
        try:
            model.zero_grad(set_to_none=True)
            step()  # packed_graphs: the first sighting runs eagerly
            torch.cuda.synchronize()
            reserved = torch.cuda.memory_reserved()
            start = time.perf_counter()
            step()  # packed_graphs: captures, then replays
            torch.cuda.synchronize()
            second = time.perf_counter() - start
            pool_gib = (torch.cuda.memory_reserved() - reserved) / 2**30  # the graphs' pool: its own segments
            ms, _, act = time_cuda(step, iters=iters, reset=lambda: model.zero_grad(set_to_none=True))
            busy, kernels = gpu_busy(step)
            if name == "packed":  # after the warm-up: the kernels the timed steps ran (cuDNN from a 3rd sighting)
                model.zero_grad(set_to_none=True)
                step()
                eager_grads = parameter_grads(model)
            r = {"ms": round(ms, 2), "second_call_s": round(second, 2), "activation_peak_gib": round(act, 3),
                 "gpu_busy_ms": round(busy, 1), "kernels": kernels}
            if name == "packed_graphs":
                from ..engine.graphs import _RUNNERS

                r["graph_pool_reserved_gib"] = round(pool_gib, 3)
                r["grad_buffers_gib"] = round(sum(b.nbytes for b in _RUNNERS[model].grad_buffers) / 2**30, 3)
                model.zero_grad(set_to_none=True)
                step()  # a replay
                r["grad_difference_vs_eager"] = round(relative_difference(eager_grads, parameter_grads(model)), 5)
            if name != "trl_padded":
                r["speedup"] = round(row["trl_padded"]["ms"] / ms, 3)
                r["fraction_of_flop_limit"] = round(r["speedup"] / limit, 3)
        except Exception as e:  # noqa: BLE001 - recorded, the other paths still run
            r = {"error": f"{type(e).__name__}: {e}"[:500]}
        model.zero_grad(set_to_none=True)
        row[name] = r
        print(w.name, name, r, flush=True)
    if dense_heads and eager_grads is not None and "ms" in row["trl_padded"]:
        row["dense_heads"] = compare_dense_heads(model, steps["packed_graphs"], eager_grads, row["trl_padded"]["ms"],
                                                 limit, tables=tables, label=w.name)
        print(w.name, "dense_heads", row["dense_heads"], flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="0.5b", choices=SHAPED_SIZES)
    parser.add_argument("--workloads", default="W1,W2,W3,W4")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dense-heads", action="store_true",
                        help="also time the graphed step with the split's blocks on cuDNN vs FA2 (head_dim < 128)")
    parser.add_argument("--profile", default=None, help="with --dense-heads: write per-kernel tables here")
    add_kernels_arg(parser)
    args = parser.parse_args(argv)
    model = bench_model(args.size, args.kernels)
    payload = {"environment": environment(args.kernels), "size": args.size, "rows": []}
    tables = open(args.profile, "w") if args.profile else None
    try:
        for w in suite_workloads(model.config.vocab_size):
            if w.name in args.workloads.split(","):
                payload["rows"].append(run_workload(model, w, args.iters, args.dense_heads, tables))
                _write(args.out, payload)  # partial results survive a timeout
    finally:
        if tables is not None:
            tables.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
