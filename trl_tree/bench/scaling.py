"""Predicted step time and scaling efficiency past one machine (CPU only): stock TRL and the tree
(trees per accumulation window), the gradient average overlapped with the backward or not.

    python -m trl_tree.bench.scaling [--gpus 1,2,4,8,16,32] [--gpus-per-node 8] [--node-gbps 400]
                                     [--rows-per-gpu 16 | --rows 128] [--check] [--out scaling.json]

Why a model: a user who outgrows one host wants to know what the tree keeps at 2 × 8 or 4 × 8 GPUs
before renting them. The model is built from what one host measures and is checked against it
(``--check``: 1, 2 and 4 GPUs) before it is trusted past it. Its parts, GRPO W1 (groups of 16,
prompt 2,048, completions uniform in 256–512) at 1.5B by default:

* **Compute per rank.** The tree's step on one rank is ``fixed + FLOPs / rate``: FLOPs of the
  trees the rank owns (``cost_model.step_flops``; one pass, gradient checkpointing), ``rate`` and
  ``fixed`` fitted to two one-GPU measurements (a window of 64 rows, and the 16 rows one rank of
  four gets). ``fixed`` is what a step pays whatever its rows (per-call kernel launches, the
  model-sized weight-gradient work). Stock TRL's step is linear in its rows (padded micro-batches,
  each row computed whole).
* **Placement.** Whole trees on ranks by cost (``trainers.balance``); where there are fewer trees
  than ranks each tree is cut into equal pieces, each paying its prompt again (as the window does).
* **Gradient all-reduce.** Two-level ring: inside a node over NVLink (``--nvlink-gbs``, the
  bucketed all-reduce's effective rate; its default is the rate docs/benchmarks/notes.md §30
  measured in 25 MiB buckets), across nodes at
  ``--node-gbps`` per node (all of a node's NICs), ``2(n-1)/n · G`` bytes per level for a gradient
  of ``G`` bytes.
* **Overlap.** Overlapped, what outlasts the last backward shows (the tree: its window's whole
  backward, three quarters of its compute; stock under DDP: its last micro-step's backward), and
  at least ``--exposed-share`` of the all-reduce even where the backward outlasts it: measured on
  one host, the overlapped all-reduce still cost the step about half its own time (the ranks
  reach each bucket at different times and the waiting ranks' kernels share the GPU with their
  backward; the step's end waited for it). Fitted to the four-GPU step, checked on the two-GPU one.
  Not overlapped, all of it.
* **The window's exchanges.** A fixed number of small collectives per step at ``--latency-ms``
  each (``--node-latency-ms`` across nodes).

Efficiency is the one-GPU time of the same global batch over ``gpus ×`` the step. The defaults are
the 4 × H200 figures of docs/benchmarks/multi_gpu_4x_h200.json; measured constants of another setup
go in through the flags.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np

from ..engine.cost_model import layer_weights, step_flops
from ..engine.model_parts import head_dim_of, kv_heads_of
from ..data.tiny import SHAPED_SIZES, shaped_config
from ..distributed.balance import balance
from ..distributed.window import group_step_cost
from .common import dump

#: GRPO W1 on one 4 x H200 host, 1.5B (docs/benchmarks/multi_gpu_4x_h200.json): ms per optimizer step
#: at 64 rows on 1, 2 and 4 GPUs (stock TRL, trees per window), and the tree on one GPU at 16 rows
MEASURED_64_ROWS = {1: (7908.1, 1251.7), 2: (4338.4, 695.8), 4: (2230.0, 402.3)}
MEASURED_TREE_16_ROWS = 330.1
#: collectives a window issues per optimizer step in distributed/window.py's one-pass path: the token
#: ids (an object all-gather: sizes, then data), the loss constants out, the log-probs home
WINDOW_COLLECTIVES = 4
BACKWARD_SHARE = 0.75  # of a step's compute under gradient checkpointing: recompute and 2x backward of 4


@dataclass(frozen=True)
class Workload:
    prompt: int = 2048
    completion: tuple[int, int] = (256, 512)
    group: int = 16


@dataclass(frozen=True)
class Network:
    gpus_per_node: int = 8
    nvlink_gbs: float = 45.0  # effective GB/s of the bucketed all-reduce inside a node
    node_gbps: float = 400.0  # Gb/s per node across nodes
    latency_ms: float = 0.66  # one small collective inside a node (the window's, measured)
    node_latency_ms: float = 2.0  # across nodes
    bucket_mib: float = 25.0
    exposed_share: float = 0.57  # of an overlapped all-reduce, what the step shows (fitted: 4 GPUs above)


def parameter_bytes(config, bytes_per_value: int = 2) -> int:
    """The gradient's size: every weight of a Qwen2-shaped model (tied embeddings), in bf16: each
    layer's matrices (``cost_model.layer_weights``), its q/k/v biases and two norms, the embedding
    and the final norm."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    kv = kv_heads_of(config) * head_dim_of(config)
    per_layer = layer_weights(config) + (h + 2 * kv) + 2 * h
    return bytes_per_value * (vocab * h + layers * per_layer + h)


def tree_flops(config, prompt: int, completions: list[int]) -> float:
    """One tree's (or piece's) forward and backward: the prompt once, each completion on top (the
    window's own cost, ``window.group_step_cost``)."""
    return step_flops(group_step_cost(prompt, completions), config, gradient_checkpointing=True)


def all_reduce_ms(grad_bytes: int, gpus: int, net: Network) -> float:
    """The two-level ring's time for one gradient all-reduce over ``gpus`` GPUs."""
    inside = min(gpus, net.gpus_per_node)
    nodes = math.ceil(gpus / net.gpus_per_node)
    t = 2 * (inside - 1) / inside * grad_bytes / (net.nvlink_gbs * 1e9) if inside > 1 else 0.0
    if nodes > 1:
        t += 2 * (nodes - 1) / nodes * grad_bytes / (net.node_gbps / 8 * 1e9)
    return 1e3 * t


class ScalingModel:
    """The model's constants, fitted once to the one-GPU measurements."""

    def __init__(self, size: str = "1.5b", workload: Workload = Workload(), net: Network = Network(),
                 stock_ms_per_row: float | None = None, tree_64: float | None = None, tree_16: float | None = None,
                 seed: int = 0) -> None:
        self.config, self.workload, self.net, self.seed = shaped_config(size), workload, net, seed
        self.grad_bytes = parameter_bytes(self.config)
        mean = [int(np.mean(workload.completion))] * workload.group
        one_group = tree_flops(self.config, workload.prompt, mean)
        t64 = MEASURED_64_ROWS[1][1] if tree_64 is None else tree_64
        t16 = MEASURED_TREE_16_ROWS if tree_16 is None else tree_16
        groups_64 = 64 // workload.group
        self.ms_per_flop = (t64 - t16) / ((groups_64 - 1) * one_group)
        self.fixed_ms = t16 - one_group * self.ms_per_flop
        self.stock_ms_per_row = MEASURED_64_ROWS[1][0] / 64 if stock_ms_per_row is None else stock_ms_per_row

    def _pieces(self, rows: int, gpus: int) -> list[float]:
        """FLOPs of every unit the window places: whole trees, or equal pieces where trees are fewer
        than ranks (free completion lengths, drawn once per call)."""
        w = self.workload
        rng = np.random.default_rng(self.seed + rows)
        groups = max(rows // w.group, 1)
        cut = max(math.ceil(gpus / groups), 1)
        units = []
        for _ in range(groups):
            lengths = rng.integers(w.completion[0], w.completion[1] + 1, w.group).tolist()
            for k in range(cut):
                piece = lengths[k * w.group // cut:(k + 1) * w.group // cut]
                if piece:
                    units.append(tree_flops(self.config, w.prompt, piece))
        return units

    def step(self, gpus: int, rows: int) -> dict:
        """Predicted ms per optimizer step at ``gpus`` GPUs for a global batch of ``rows``."""
        net = self.net
        units = self._pieces(rows, gpus)
        bins, _, worst = balance(units, gpus)
        busiest_flops = max(sum(units[u] for u in b) for b in bins)
        compute = self.fixed_ms + busiest_flops * self.ms_per_flop
        ar = all_reduce_ms(self.grad_bytes, gpus, net)  # 0 on one GPU, as the bucket's tail
        bucket_tail = all_reduce_ms(int(net.bucket_mib * 2**20), gpus, net)
        nodes = math.ceil(gpus / net.gpus_per_node)
        exchange = WINDOW_COLLECTIVES * (net.node_latency_ms if nodes > 1 else net.latency_ms) if gpus > 1 else 0.0
        backward = BACKWARD_SHARE * (compute - self.fixed_ms)
        tree_overlapped = compute + exchange + max(ar - backward, net.exposed_share * ar, bucket_tail)
        tree_after = compute + exchange + ar
        stock_compute = self.stock_ms_per_row * rows / gpus
        micro_steps = max(rows // (2 * gpus), 1)  # per_device_train_batch_size 2, as measured
        stock = stock_compute + max(ar - BACKWARD_SHARE * stock_compute / micro_steps, net.exposed_share * ar,
                                    bucket_tail)
        one_tree = self.fixed_ms + sum(self._pieces(rows, 1)) * self.ms_per_flop
        one_stock = self.stock_ms_per_row * rows
        return {
            "gpus": gpus, "nodes": nodes, "rows": rows, "units": len(units), "imbalance": round(worst, 3),
            "compute_ms": round(compute, 1), "all_reduce_ms": round(ar, 1), "exchange_ms": round(exchange, 1),
            "tree_ms": round(tree_overlapped, 1), "tree_not_overlapped_ms": round(tree_after, 1),
            "stock_ms": round(stock, 1),
            "efficiency_tree": round(one_tree / (gpus * tree_overlapped), 3),
            "efficiency_tree_not_overlapped": round(one_tree / (gpus * tree_after), 3),
            "efficiency_stock": round(one_stock / (gpus * stock), 3),
            "speedup_over_stock": round(stock / tree_overlapped, 2),
        }


def check(model: ScalingModel) -> list[dict]:
    """The model beside the measurements it must reproduce before it is trusted: 64 rows on 1, 2, 4 GPUs."""
    out = []
    for gpus, (stock, tree) in MEASURED_64_ROWS.items():
        row = model.step(gpus, 64)
        out.append({"gpus": gpus, "tree_ms": row["tree_ms"], "tree_measured_ms": tree,
                    "tree_error": round(row["tree_ms"] / tree - 1, 3), "stock_ms": row["stock_ms"],
                    "stock_measured_ms": stock, "stock_error": round(row["stock_ms"] / stock - 1, 3)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1.5b", choices=SHAPED_SIZES)
    parser.add_argument("--gpus", default="1,2,4,8,16,32")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--node-gbps", type=float, default=400.0, help="inter-node bandwidth per node, Gb/s")
    parser.add_argument("--nvlink-gbs", type=float, default=45.0,
                        help="effective all-reduce rate inside a node, GB/s (measured in 25 MiB buckets)")
    parser.add_argument("--node-latency-ms", type=float, default=2.0, help="one small collective across nodes")
    parser.add_argument("--exposed-share", type=float, default=0.57,
                        help="share of an overlapped gradient all-reduce the step still shows (fitted on one host)")
    parser.add_argument("--rows-per-gpu", type=int, default=16, help="global batch = this x GPUs (weak scaling)")
    parser.add_argument("--rows", type=int, default=None, help="a fixed global batch instead (strong scaling)")
    parser.add_argument("--check", action="store_true", help="also print the model beside the 1/2/4-GPU measurements")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    net = Network(gpus_per_node=args.gpus_per_node, nvlink_gbs=args.nvlink_gbs, node_gbps=args.node_gbps,
                  node_latency_ms=args.node_latency_ms, exposed_share=args.exposed_share)
    model = ScalingModel(args.size, net=net)
    results = {"fit": {"fixed_ms": round(model.fixed_ms, 1), "gflop_per_ms": round(1e-9 / model.ms_per_flop, 1),
                       "stock_ms_per_row": round(model.stock_ms_per_row, 1),
                       "gradient_gib": round(model.grad_bytes / 2**30, 2)}}
    if args.check:
        results["check"] = check(model)
        for row in results["check"]:
            print("check", row, flush=True)
    results["predicted"] = []
    for gpus in [int(g) for g in args.gpus.split(",")]:
        row = model.step(gpus, args.rows if args.rows else args.rows_per_gpu * gpus)
        results["predicted"].append(row)
        print(row, flush=True)
    dump(args.out, {"model": f"Qwen2.5-{args.size}-shaped, GRPO W1, trees per window, one pass", "network": vars(args),
                    "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
