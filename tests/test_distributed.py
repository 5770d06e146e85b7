"""Two CPU processes under ``accelerate launch``: gradient synchronisation in packed and dfs mode, and
with CUDA graphs (their CPU stand-in), where the trainer averages the gradients by hand; trees
placed over ranks by accumulation windows give the update one process gives on the same data."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import free_port
from trainer_harness import save_tiny_checkpoint

pytestmark = pytest.mark.slow  # launches of several processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_ddp_check(out, processes: int = 2, *extra: str, timeout: int = 600) -> None:
    """``accelerate launch`` of ``ddp_check.py`` on ``processes`` CPU processes over gloo, with a
    tiny checkpoint saved in ``out`` first (``extra``: its arguments after the checkpoint and ``out``)."""
    checkpoint = save_tiny_checkpoint(out / "tiny")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()),
           "--num_processes", str(processes), "--config_file", os.path.join(ROOT, "examples/accelerate/cpu_2proc.yaml"),
           os.path.join(ROOT, "tests/ddp_check.py"), checkpoint, str(out), *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One ``accelerate launch`` of ``ddp_check.py`` (GRPO, then PPO); its output directory."""
    out = tmp_path_factory.mktemp("ddp")
    launch_ddp_check(out)
    return out


def test_sft_two_processes_agree_and_the_tree_equals_stock(launched):
    """TreeSFTTrainer under DDP: packed (DDP's hooks) and dfs (gradients averaged by hand) give stock
    SFTTrainer's update on both ranks; the grouped sampler trains every rank on as many tokens."""
    runs = {(m, r): torch.load(launched / f"sft_{m}_rank{r}.pt") for m in ("stock", "packed", "dfs", "groups")
            for r in (0, 1)}
    for mode in ("stock", "packed", "dfs", "groups"):
        for name, p in runs[(mode, 0)].items():
            assert torch.equal(p, runs[(mode, 1)][name]), f"{mode}: ranks disagree on {name}"
    stock = runs[("stock", 0)]
    for mode in ("packed", "dfs"):
        for name, p in stock.items():
            q = runs[(mode, 0)][name]
            assert torch.allclose(p.double(), q.double(), rtol=1e-6, atol=1e-9), f"{mode} differs from stock on {name}"
    assert int(runs[("groups", 0)]["tokens"]) > 0


def test_dpo_two_processes_agree_and_the_tree_equals_stock(launched):
    """TreeDPOTrainer under DDP (packed: the tree inside DDP's forward; dfs and CUDA graphs: past it,
    the gradients averaged by hand): stock DPOTrainer's update on both ranks."""
    modes = ("stock", "packed", "dfs", "graphs")
    runs = {(m, r): torch.load(launched / f"dpo_{m}_rank{r}.pt") for m in modes for r in (0, 1)}
    for mode in modes:
        for name, p in runs[(mode, 0)].items():
            assert torch.equal(p, runs[(mode, 1)][name]), f"{mode}: ranks disagree on {name}"
    for mode in modes[1:]:
        for name, p in runs[("stock", 0)].items():
            q = runs[(mode, 0)][name]
            # the fused head computes in fp32 inside either way: the updates agree to ~1e-7 of their size
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), f"{mode} differs from stock on {name}"


def test_async_two_processes_agree_and_the_tree_equals_stock(launched):
    """TreeAsyncGRPOTrainer under DDP, packed and dfs: stock AsyncGRPOTrainer's update on both ranks
    (fp32; the same stream, TRL's batcher dealing one row per rank)."""
    modes = ("stock", "packed", "dfs")
    runs = {(m, r): torch.load(launched / f"async_{m}_rank{r}.pt") for m in modes for r in (0, 1)}
    for mode in modes:
        for name, p in runs[(mode, 0)].items():
            assert torch.equal(p, runs[(mode, 1)][name]), f"{mode}: ranks disagree on {name}"
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(launched / "async_tiny")
    before = {n: p.detach() for n, p in initial.named_parameters()}
    assert max(float((p - before[n]).abs().max()) for n, p in runs[("stock", 0)].items()) > 1e-4  # it trained
    for mode in ("packed", "dfs"):
        for name, p in runs[("stock", 0)].items():
            q = runs[(mode, 0)][name]
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), f"{mode} differs from stock on {name}"


def test_two_processes_agree_and_dfs_and_graphs_equal_packed(launched):
    """Packed, dfs, packed graphs and the walk's unit graphs (CPU stand-in): ranks agree, all equal packed."""
    tmp_path = launched
    modes = ("packed", "dfs", "graphs", "dfs-graphs")
    runs = {(m, r): torch.load(tmp_path / f"{m}_rank{r}.pt") for m in modes for r in (0, 1)}
    for rank in (0, 1):
        for mode in ("graphs", "dfs-graphs"):  # the walk's units replay under several processes too
            assert int(runs[(mode, rank)].pop("captures")) > 0, f"the {mode} run captured nothing"
    for mode in modes:
        for name, p in runs[(mode, 0)].items():
            assert torch.equal(p, runs[(mode, 1)][name]), f"{mode}: ranks disagree on {name}"
    for mode in ("dfs", "graphs", "dfs-graphs"):
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


def test_windows_two_processes_equal_one_process(launched):
    """Prompt groups straddle the two processes; with ``tree_window='accumulation'`` each is computed
    whole on one rank (log-probs and loss gradients moved between ranks), and every run — GRPO and
    PPO (separate and shared critics), packed and dfs, windows or not — trains the parameters one
    untreed process trains on the same 12 rows per optimizer step (float64; TRL's head rounds
    through fp32)."""
    check_windows_equal_one_process(launched, processes=2, rows=6, imbalance=1.05)
    # whole trees share more than each process's micro-batches did
    def dedup(run):
        return [torch.load(launched / f"win-{run}-p2_rank{r}.pt")["metrics"]["tree/dedup_ratio"][0] for r in (0, 1)]
    assert min(dedup("grpo-packed-accumulation")) > max(dedup("grpo-packed-micro_step")) * 1.3


def check_windows_equal_one_process(directory, processes: int, rows: int, imbalance: float) -> None:
    """``ddp_check.main_windows`` launched on ``processes`` processes into ``directory``: run the
    untreed references on this one process at the same global batch, then check every run — GRPO
    and PPO, packed and dfs, windows or not — for ranks that agree and parameters within 1e-5 of one
    process's (float64; TRL's head rounds through fp32), one plan on every rank whose estimated
    imbalance is at most ``imbalance``, and the window's average on its own communicator."""
    import ddp_check

    ddp_check.main_windows(str(directory / "tiny"), str(directory),
                           [r for r in ddp_check.WINDOW_RUNS if r[2] == "off"], rows=rows)
    for algo, critic, mode, window, tag in [(*r, "") for r in ddp_check.WINDOW_RUNS] + [
            ("grpo", None, "dfs", "accumulation", "twopass")]:
        run = "-".join(x for x in (algo, critic, mode, window, tag) if x)
        ranks = [torch.load(directory / f"win-{run}-p{processes}_rank{r}.pt") for r in range(processes)]
        if mode != "off" and window == "accumulation":  # the separable losses run in one pass unless told not to
            one_pass = critic != "shared" and tag != "twopass"
            assert set(ranks[0]["metrics"]["tree/passes"]) == {1.0 if one_pass else 2.0}, run
        one = torch.load(directory / f"win-{'-'.join(x for x in (algo, critic, 'off-auto') if x)}-p1_rank0.pt")
        for name, p in ranks[0]["params"].items():
            for r in range(1, processes):
                assert torch.equal(p, ranks[r]["params"][name]), f"{run}: ranks 0 and {r} disagree on {name}"
            ref = one["params"][name]
            err = ((p - ref).norm() / ref.norm().clamp(min=1e-30)).item()
            assert err <= 1e-5, f"{run}: {name} differs from one process by {err:.2e}"
        if mode != "off" and window == "accumulation":
            metrics = [t["metrics"] for t in ranks]
            assert all(m["tree/rank_imbalance"] == metrics[0]["tree/rank_imbalance"] for m in metrics)  # one plan
            assert max(metrics[0]["tree/rank_imbalance"]) <= imbalance, (run, metrics[0]["tree/rank_imbalance"])
            if algo == "grpo":  # its reference (beta) and old-policy (2 iterations) passes were placed too
                assert "tree/rank_imbalance_forward" in metrics[0]
            # the window's backward was averaged by hand, on the averages' own communicator
            assert all(t["averagers_on_own_group"] and all(t["averagers_on_own_group"]) for t in ranks), run


@pytest.mark.skipif(os.environ.get("TRL_TREE_EIGHT_PROCESSES") != "1",
                    reason="eight processes take about a minute of this suite's CPU time; TRL_TREE_EIGHT_PROCESSES=1 "
                           "runs it (docs/multi_gpu.md, 'Eight ranks')")
def test_windows_eight_processes_equal_one_process(tmp_path):
    """Eight ranks, one row each per micro-step: four groups of four for eight ranks, so whole trees
    leave half the ranks with nothing to compute — those still join every exchange and the gradient
    average (their all-reduces launched after an empty backward) — and every run trains what one
    process trains on the same 16 rows per optimizer step. The plan's estimated imbalance is the
    busiest rank over the mean: 2 with four of eight ranks busy."""
    launch_ddp_check(tmp_path, 8, "windows", "8", timeout=1200)
    check_windows_equal_one_process(tmp_path, processes=8, rows=8, imbalance=2.1)
