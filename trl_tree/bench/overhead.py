"""Host-side cost of one training step: is the GPU waiting for Python?

    python -m trl_tree.bench.overhead [--size 0.5b] [--workloads W1,W3] [--out overhead.txt]

For each path (TRL padded, packed tree, packed tree replaying CUDA graphs, dfs walk, TRL's trie
packer where TRL has it) on the suite's workloads: the step's wall time,
the GPU's busy time (sum of kernel times from the profiler) and the number of kernel launches,
then a cProfile table of the host's Python time by function. On small models the tree paths are
bound by launches and Python rather than by FLOPs; this says by how much, and where.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np
import torch

from ..data.tiny import SHAPED_SIZES
from .common import add_kernels_arg, bench_model, step_paths
from .profile import gpu_busy
from .trie_packer import trie_packer_available, trie_packer_step
from .workloads import suite_workloads


def wall(step, iters: int = 5) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))


def python_profile(step, rows: int = 25) -> str:
    prof = cProfile.Profile()
    prof.enable()
    step()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="0.5b", choices=SHAPED_SIZES)
    parser.add_argument("--workloads", default="W1,W3")
    parser.add_argument("--out", default=None, help="also write the cProfile tables here")
    add_kernels_arg(parser)
    args = parser.parse_args(argv)
    model = bench_model(args.size, args.kernels)
    report = []
    for w in suite_workloads(model.config.vocab_size):
        if w.name not in args.workloads.split(","):
            continue
        seqs, P = w.sequences, w.score_from
        adv = torch.ones(len(seqs), device="cuda")
        paths = step_paths(model, seqs, P, adv)
        if trie_packer_available():  # TRL's experimental tree packing: launches against ours
            paths["trl_trie_packer"] = trie_packer_step(model, seqs, adv, P, sum(len(s) - P for s in seqs))
        for name, step in paths.items():
            try:
                for _ in range(2):  # warm-up (allocator, Triton autotuning, compiling; the graphs capture at the 2nd)
                    step()
            except Exception as e:  # e.g. TRL's packer under compiled layers: say so, time the rest
                report.append(f"{args.size} {args.kernels} {w.name} {name}: failed: {type(e).__name__}: {e}"[:500])
                print(report[-1], flush=True)
                model.zero_grad(set_to_none=True)
                continue
            ms = wall(step)
            busy, launches = gpu_busy(step)
            line = (f"{args.size} {args.kernels} {w.name} {name}: wall {ms:.1f} ms, GPU busy {busy:.1f} ms ({busy / ms:.0%}), "
                    f"{launches} kernels")
            print(line, flush=True)
            report.append(line)
            if args.out and name != "trl_padded":
                report.append(python_profile(step))
            model.zero_grad(set_to_none=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
