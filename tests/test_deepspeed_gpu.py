"""DeepSpeed ZeRO-2 and ZeRO-3 on two GPUs against DDP on the same GPUs, in fp32 over NCCL: the check
that tests/test_deepspeed.py runs on CPU processes, on DeepSpeed's CUDA engine. Skipped without two GPUs
(CI has none); run it through the device tool, with DeepSpeed installed there as
``../shared/gpu/deepspeed.sh``'s header says:

    TRL_TREE_GPU_CHECK_OUT=docs/benchmarks/zero_update_check_2x_h200.json \\
        python -m pytest -p no:cacheprovider -n 0 tests/test_deepspeed_gpu.py

Three launches of ``tests/deepspeed_check.py`` (DDP, ZeRO-2, ZeRO-3; ZeRO-3 partitions every
parameter: persistence threshold 0) run every trainer and tree mode it holds — GRPO untreed,
packed, packed under a token budget, dfs, per micro-step and in windows; PPO with each critic kind and
a run resumed from a checkpoint; RLOO, SFT and DPO, stock and the tree's modes — and every ZeRO run's
trained parameters must equal the DDP run's to 1e-4 of the DDP update (max-abs), the ranks agreeing
and DeepSpeed's reduction running once per optimizer step. ``TRL_TREE_GPU_CHECK_OUT``: where the
per-run figures are written as JSON (the committed result).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two GPUs (run through the device tool)")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-4  # of the DDP update, max-abs: the bound for fp32 on the GPU
ENGINES = ("ddp", "zero2", "zero3")
PARTS = ("grpo", "ppo", "rloo", "offline")


def ddp_config(path) -> str:
    """Accelerate's DDP over the host's first two GPUs, fp32."""
    config = path / "ddp.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: 1\n"
                      "num_processes: 2\nmachine_rank: 0\nmixed_precision: 'no'\ngpu_ids: all\n")
    return str(config)


def run_launches(base, gpu: bool = True) -> dict:
    """Each engine's launch of ``deepspeed_check.py`` on the same checkpoints, under ``base``: engine ->
    (output directory, seconds). ``gpu=False``: on two CPU processes (the harness's own trial run)."""
    import time

    from deepspeed_check import save_value_model
    from sft_harness import save_sft_checkpoint
    from test_deepspeed import zero_config
    from trainer_harness import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(base / "tiny")
    save_value_model(checkpoint)
    sft_checkpoint = save_sft_checkpoint(base / "sft_tiny")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "TRL_TREE_CHECK_GPU": str(int(gpu))}
    dirs = {}
    for engine in ENGINES:
        out = base / engine
        out.mkdir()
        if engine == "ddp":
            config = ddp_config(out) if gpu else os.path.join(ROOT, "examples/accelerate/cpu_2proc.yaml")
        else:
            config = zero_config(out, int(engine[-1]))
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()),
               "--config_file", config, os.path.join(ROOT, "tests/deepspeed_check.py"), checkpoint, sft_checkpoint,
               str(out), *PARTS]
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert done.returncode == 0, f"{engine}: {done.stderr[-4000:]}"
        dirs[engine] = (out, round(time.perf_counter() - start, 1))
    return dirs


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    pytest.importorskip("deepspeed")
    return run_launches(tmp_path_factory.mktemp("gpu"))


def _worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max((a[k].double().cpu() - b[k].double().cpu()).abs().max().item() for k in a)


def _runs(directory) -> list[str]:
    """The runs a launch wrote: ``win-<run>-p2`` (GRPO, PPO) and ``<family>_<mode>`` (RLOO, SFT, DPO)."""
    return sorted(name[: -len("_rank0.pt")] for name in os.listdir(directory)
                  if name.endswith("_rank0.pt") and "_completions" not in name)


def _flushes(directory, run: str, saved: dict) -> int | None:
    """DeepSpeed's step reductions in ``run`` (None where the launch did not count them)."""
    if "flushes" in saved:
        return int(saved["flushes"])
    path = directory / f"flushes-{run[len('win-'):-len('-p2')]}.pt"
    return int(torch.load(path)["flushes"]) if path.exists() else None


def compare(launches) -> dict:
    """Every run of the DDP launch against the same run under ZeRO-2 and ZeRO-3."""
    ddp_dir = launches["ddp"][0]
    results = {}
    for run in _runs(ddp_dir):
        ddp = [torch.load(ddp_dir / f"{run}_rank{r}.pt") for r in (0, 1)]
        update = _worst(ddp[0]["params"], ddp[0]["start"])
        row = {"ddp_update_max_abs": update, "ddp_ranks_agree": _worst(ddp[0]["params"], ddp[1]["params"]) == 0.0}
        for engine in ENGINES[1:]:
            out = launches[engine][0]
            zero = [torch.load(out / f"{run}_rank{r}.pt") for r in (0, 1)]
            entry = {"ranks_agree": _worst(zero[0]["params"], zero[1]["params"]) == 0.0,
                     "flushes": _flushes(out, run, zero[0])}
            if run.startswith("rloo_"):  # generated rollouts: compared where both engines sampled the same rows
                same = torch.load(out / f"{run}_completions_rank0.pt") == torch.load(
                    ddp_dir / f"{run}_completions_rank0.pt")
                entry["same_rollouts_as_ddp"] = same
                if not same:
                    row[engine] = entry
                    continue
            error = _worst(zero[0]["params"], ddp[0]["params"])
            entry |= {"max_abs_diff": error, "over_update": error / update if update else float("inf")}
            row[engine] = entry
        family, _, mode = run.partition("_")
        if not run.startswith("win-") and mode != "stock":  # the tree against stock TRL in the same launch, each engine
            for engine in ENGINES:
                out = launches[engine][0]
                tree, stock = (torch.load(out / f"{name}_rank0.pt") for name in (run, f"{family}_stock"))
                if family == "rloo" and torch.load(out / f"{run}_completions_rank0.pt") != torch.load(
                        out / f"{family}_stock_completions_rank0.pt"):
                    row.setdefault("stock_rollouts_differ", []).append(engine)
                    continue
                row.setdefault("over_update_vs_stock", {})[engine] = _worst(tree["params"], stock["params"]) / update
        results[run] = row
    return results


def _expected_flushes(run: str) -> int:
    """One reduction per optimizer step (two) where the tree trains; DeepSpeed's own hooks reduce
    stock's and GRPO's untreed step (PPO runs every mode through the one reduction)."""
    stock = run.endswith("_stock") or run.startswith("win-grpo-off")
    return 0 if stock else 2


def test_zero_updates_equal_the_ddp_update_on_two_gpus(launches):
    results = compare(launches)
    out = os.environ.get("TRL_TREE_GPU_CHECK_OUT")
    if out:
        from trl_tree.bench.common import environment

        with open(out, "w") as f:
            json.dump({"about": __doc__.strip(), "tolerance_over_update": TOLERANCE, "environment": environment(),
                       "launch_seconds": {e: launches[e][1] for e in ENGINES}, "runs": results}, f, indent=1)
    assert len(results) >= 20, sorted(results)
    failures = []
    for run, row in results.items():
        if not row["ddp_ranks_agree"]:
            failures.append(f"{run}: the DDP ranks disagree")
        if row.get("stock_rollouts_differ"):
            failures.append(f"{run}: sampled other rollouts than stock RLOO under {row['stock_rollouts_differ']}")
        for engine in ENGINES[1:]:
            entry = row[engine]
            if not entry["ranks_agree"]:
                failures.append(f"{run} {engine}: the ranks disagree")
            if "over_update" in entry and entry["over_update"] > TOLERANCE:
                failures.append(f"{run} {engine}: {entry['over_update']:.2e} of the update")
            if entry["flushes"] is not None and entry["flushes"] != _expected_flushes(run):
                failures.append(f"{run} {engine}: {entry['flushes']} step reductions")
        for engine, over in row.get("over_update_vs_stock", {}).items():
            if over > TOLERANCE:
                failures.append(f"{run} {engine}: {over:.2e} of the update from stock's")
    compared = sum("over_update" in row[e] for row in results.values() for e in ENGINES[1:])
    assert compared >= 2 * (len(results) - 3), f"only {compared} comparisons"  # RLOO may sample other rows
    assert not failures, failures
