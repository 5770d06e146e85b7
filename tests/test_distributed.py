"""Two CPU processes under ``accelerate launch``: gradient synchronisation in packed and dfs mode, and
with CUDA graphs (their CPU stand-in), where the trainer averages the gradients by hand."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from trainer_harness import save_tiny_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One ``accelerate launch`` of ``ddp_check.py`` (GRPO, then PPO); its output directory."""
    out = tmp_path_factory.mktemp("ddp")
    checkpoint = save_tiny_checkpoint(out / "tiny")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           os.path.join(ROOT, "examples/accelerate/cpu_2proc.yaml"), os.path.join(ROOT, "tests/ddp_check.py"),
           checkpoint, str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_two_processes_agree_and_dfs_and_graphs_equal_packed(launched):
    tmp_path = launched
    runs = {(m, r): torch.load(tmp_path / f"{m}_rank{r}.pt") for m in ("packed", "dfs", "graphs") for r in (0, 1)}
    for rank in (0, 1):
        assert int(runs[("graphs", rank)].pop("captures")) > 0, "the graphed run captured nothing"
    for mode in ("packed", "dfs", "graphs"):
        for name, p in runs[(mode, 0)].items():
            assert torch.equal(p, runs[(mode, 1)][name]), f"{mode}: ranks disagree on {name}"
    for mode in ("dfs", "graphs"):
        for name, p in runs[("packed", 0)].items():
            q = runs[(mode, 0)][name]
            assert torch.allclose(p, q, rtol=0, atol=1e-9), f"{mode} differs from packed on {name}"


def test_ppo_two_processes_agree_and_the_tree_equals_untreed(launched):
    """Policy and critic: ranks agree (the critic's gradients averaged by hand, a critic adapter kept
    out of DDP's buckets) and the tree's update is the untreed one (float64)."""
    tmp_path = launched
    runs = {(m, r): torch.load(tmp_path / f"{m}_rank{r}.pt") for m in ("separate-off", "separate-packed",
                                                                      "separate-dfs", "adapter-off", "adapter-packed")
            for r in (0, 1)}
    for (run, rank), params in runs.items():
        if rank == 1:
            for name, p in params.items():
                assert torch.equal(p, runs[(run, 0)][name]), f"{run}: ranks disagree on {name}"
    for kind, modes in (("separate", ("packed", "dfs")), ("adapter", ("packed",))):
        ref = runs[(f"{kind}-off", 0)]
        for mode in modes:
            for name, p in runs[(f"{kind}-{mode}", 0)].items():
                assert torch.allclose(p, ref[name], rtol=1e-9, atol=1e-9), f"{kind}-{mode} differs from off on {name}"
