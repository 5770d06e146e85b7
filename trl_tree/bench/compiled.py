"""Eager against compiled decoder layers (``trl_tree.compile_layers``), in one process.

    python -m trl_tree.bench.compiled [--size 0.5b] [--workloads W1,W4] [--paths trl_padded,packed,dfs]

For each workload and path, the step with the modeling file's eager layers and then with every
layer's attention module, MLP and norms compiled by Inductor (``dynamic=True``), on the same model
and rollouts: median ms (CUDA events), the first compiled step's seconds, activation peak, GPU-busy
milliseconds and kernel count (profiler), and the packed tree's gradient difference between the two
(relative norm; bf16 kernels fused differently). What it answers: where compiling pays — a
GPU-bound step gets faster by fusing elementwise kernels; a host-bound one (the tree on small
models) trades fewer launches for the compiled graphs' own host overhead.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from ..engine.compile import compile_layers, uncompile_layers
from ..data.tiny import SHAPED_SIZES
from .common import bench_model, environment, parameter_grads, relative_difference, step_paths, time_cuda
from .profile import gpu_busy
from .workloads import suite_workloads

PATHS = ("trl_padded", "packed", "dfs")


def _write(path: str | None, size: str, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"environment": environment(), "size": size, "rows": rows}, f, indent=2)
            f.write("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="0.5b", choices=SHAPED_SIZES)
    parser.add_argument("--workloads", default="W1,W4")
    parser.add_argument("--paths", default="trl_padded,packed,dfs", help=f"any of {', '.join(PATHS)}")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    wanted = args.paths.split(",")
    unknown = sorted(set(wanted) - set(PATHS))
    if unknown:
        parser.error(f"unknown paths {unknown}; choose from {', '.join(PATHS)}")
    model = bench_model(args.size)
    rows = []
    for w in suite_workloads(model.config.vocab_size):
        if w.name not in args.workloads.split(","):
            continue
        advantages = torch.from_numpy(np.random.default_rng(0).standard_normal(len(w.sequences))).float().cuda()
        steps = step_paths(model, w.sequences, w.score_from, advantages)
        packed_grads = {}
        for layers in ("eager", "compiled"):
            (compile_layers if layers == "compiled" else uncompile_layers)(model)
            for name in wanted:
                step = steps[name]
                model.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                start = time.perf_counter()
                step()
                torch.cuda.synchronize()
                first = time.perf_counter() - start
                if name == "packed":
                    packed_grads[layers] = parameter_grads(model)
                ms, _, act = time_cuda(step, iters=args.iters, reset=lambda: model.zero_grad(set_to_none=True))
                busy, kernels = gpu_busy(step)
                model.zero_grad(set_to_none=True)
                row = {"workload": w.name, "path": name, "layers": layers, "ms": round(ms, 2),
                       "first_step_s": round(first, 1), "activation_peak_gib": round(act, 3),
                       "gpu_busy_ms": round(busy, 1), "kernels": kernels}
                rows.append(row)
                print(row, flush=True)
                _write(args.out, args.size, rows)  # partial results survive a timeout
        if len(packed_grads) == 2:
            diff = relative_difference(packed_grads["eager"], packed_grads["compiled"])
            rows.append({"workload": w.name, "packed_grad_difference_compiled_vs_eager": round(diff, 4)})
            print(rows[-1], flush=True)
            _write(args.out, args.size, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
