"""FSDP2 (``fully_shard``) on two CPU processes over gloo.

The engine's own backward (``tests/fsdp_check.py`` under torchrun), under each mixed-precision
policy Accelerate sets: gradients equal the unsharded average, parameters are gathered once per
micro-step and reduced once per optimizer step however many calls ran. The trainers with their
model prepared by Accelerate's FSDP2 (``tests/fsdp_trainer_check.py`` under ``accelerate launch``
with ``examples/accelerate/fsdp2.yaml``): every tree mode the docs list for FSDP2 trains the update
one unwrapped process trains, in float64 to 1e-5 and under ``mixed_precision: bf16`` within the
bf16 rule of stock's own error."""

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


def launch_fsdp2_check(tmp_path, processes: int = 2, *mode: str, timeout: int = 600, family: str = "qwen2"):
    """``tests/fsdp_trainer_check.py`` under ``accelerate launch`` with ``examples/accelerate/fsdp2.yaml``
    on ``processes`` CPU processes (``mode``: its entry, e.g. ``ppo``), on a tiny checkpoint of ``family``
    saved in ``tmp_path``; returns the checkpoint and the finished launch (its exit checked)."""
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny", family)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), "--config_file",
           os.path.join(ROOT, "examples/accelerate/fsdp2.yaml"), "--num_processes", str(processes),
           os.path.join(ROOT, "tests/fsdp_trainer_check.py"), checkpoint, str(tmp_path), *mode]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return checkpoint, done


def _worst(result: dict) -> float:
    return max(result["errors"].values())


def test_fsdp2_walk_gathers_once_and_reduces_once_under_mixed_precision(tmp_path):
    """Every policy Accelerate's FSDP2 sets (none; bf16 parameters with an fp32 reduction, forward
    inputs cast or not; and fp32 parameters over fp64 storage, which runs the same casts at fp32
    tolerances): packed, packed cut into calls, the walk and FSDP2's own one-pass backward; and the
    same gathered block by block on calls that differ between the ranks (lined up by stand-in calls),
    the unsharded layer bytes never above two blocks'."""
    out = tmp_path / "fsdp.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "tests/fsdp_check.py"), str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = torch.load(out)
    for policy in ("none", "fp32-params", "bf16", "bf16-no-cast"):
        for run in ("packed", "budget", "dfs"):
            r = results[(policy, run)]
            assert r["sharded"] == "DTensor", "the model was not sharded"
            assert r["gathers"] == 2 * r["groups"], f"{policy}/{run}: {r['gathers']} all-gathers for {r['groups']} x 2"
            assert r["reduce_scatters"] == r["groups"], f"{policy}/{run}: {r['reduce_scatters']} reductions"
            # FSDP2's end-of-backward steps run directly: the reduction gathers nothing, inside the gathered
            # block (the trainers' way) or after it
            assert r["reduce_gathers"] == 0, f"{policy}/{run}: {r['reduce_gathers']} gathers to reduce"
        for run in ("packed-reduced-gathered", "dfs-reduced-gathered"):
            r = results[(policy, run)]
            assert r["gathers"] == 2 * r["groups"] and r["reduce_scatters"] == r["groups"], (policy, run, r)
            assert r["reduce_gathers"] == 0, f"{policy}/{run}: {r['reduce_gathers']} gathers to reduce"
            assert r["sharded"] == "DTensor"
        if policy in ("none", "bf16"):  # gathered block by block, on calls that differ between the ranks
            for run in ("block-packed", "block-budget", "block-dfs"):
                r = results[(policy, run)]
                assert r["sharded"] == "DTensor"
                # one block gathered at a time, and at most the next one prefetched beside it
                assert r["peak_bytes"] <= 2 * r["block_bytes"] < r["blocks"] * r["block_bytes"], (policy, run, r)
                assert r["gathers"] > 2 * r["groups"], f"{policy}/{run}: held whole ({r['gathers']} all-gathers)"
                worst = _worst(r)
                bound = 1.5 * _worst(results[(policy, "untreed-two")]) if policy == "bf16" else 1e-5
                assert worst <= bound, f"{policy}/{run}: gradients differ from the unsharded fp64 average by {worst:.2e}"
            # the ranks' calls differ (rank 1 cuts its rows into two calls; the walks' units differ): lined up
            assert results[(policy, "block-budget")]["standins"] > 0
            assert results[(policy, "block-dfs")]["standins"] > 0
        # the fallback (a torch whose FSDP2 lacks those steps): a one-token forward gathers each group once
        r = results[(policy, "packed-reduced-by-backward")]
        assert r["reduce_scatters"] == r["groups"] and r["reduce_gathers"] == r["groups"], (policy, r)
        assert results[(policy, "one-pass")]["sharded_after"] == "DTensor"
        for run, untreed in (("packed", "two"), ("budget", "two"), ("dfs", "two"), ("one-pass", "one"),
                             ("packed-reduced-gathered", "two"), ("dfs-reduced-gathered", "two"),
                             ("packed-reduced-by-backward", "two")):
            worst = _worst(results[(policy, run)])
            if policy.startswith("bf16"):  # DESIGN's bf16 rule, against the untreed bf16 path's own error
                bound = 1.5 * _worst(results[(policy, f"untreed-{untreed}")])
            else:  # float64 or float32 compute; TRL's LM head rounds through fp32
                bound = 1e-5
            assert worst <= bound, f"{policy}/{run}: gradients differ from the unsharded fp64 average by {worst:.2e}"


def test_trainer_under_accelerate_fsdp2_trains_the_one_process_update(tmp_path):
    """Accelerate's FSDP2 (per-layer and root ``fully_shard``, its bf16 policy and autocast) around
    TreeGRPOTrainer: packed, packed under a token budget, dfs, and windows in both modes; groups
    straddle the two processes. The ranks agree; the update equals one unwrapped process's (float64)
    to 1e-5; under bf16 its error against that is at most 1.5x stock TRL's under the same FSDP2.
    Then TreeDPOTrainer and TreeAsyncGRPOTrainer, packed and dfs, against stock DPOTrainer and
    AsyncGRPOTrainer under the same FSDP2 (float64, 1e-5)."""
    import ddp_check
    import fsdp_trainer_check
    from safetensors.torch import load_file

    checkpoint, done = launch_fsdp2_check(tmp_path, 2)
    one = torch.load(tmp_path / f"win-{ddp_check.train_window_run(checkpoint, str(tmp_path), 'grpo', None, 'off', 'auto')}"
                     f"-p1_rank0.pt")["params"]
    start = load_file(os.path.join(checkpoint, "model.safetensors"))

    def error(params: dict) -> float:  # the worst parameter's update error against one process's
        worst = 0.0
        for name, p in params.items():
            want = one[name] - start[name].double()
            worst = max(worst, ((p.double() - start[name].double() - want).norm() / want.norm()).item())
        return worst

    def load(name: str) -> dict:
        two = [torch.load(tmp_path / f"win-{name}-p2_rank{r}.pt") for r in (0, 1)]
        assert two[0]["distributed_type"] == "FSDP" and two[0]["sharded"], f"{name}: not run under FSDP2"
        for param, p in two[0]["params"].items():
            assert torch.equal(p, two[1]["params"][param]), f"{name}: ranks disagree on {param}"
        return two[0]

    for precision, runs in (("fsdp", fsdp_trainer_check.RUNS), ("fsdp-bf16", fsdp_trainer_check.BF16_RUNS)):
        stock = error(load(f"grpo-off-auto-{precision}")["params"])
        for algo, mode, window, extra, tag in runs:
            run = load("-".join(x for x in (algo, mode, window, precision, tag) if x))
            bound = 1e-5 if precision == "fsdp" else 1.5 * stock
            assert error(run["params"]) <= bound, f"{precision} {mode}/{window}/{tag}: {error(run['params']):.2e}"
            if tag.startswith("budget"):
                assert max(run["metrics"]["tree/calls"]) > 1, "the token budget cut nothing"
            if mode != "off":  # tree_gather: 'auto' holds the model whole on a CPU; 'block' gathers block by block
                assert run["metrics"]["tree/gather_block"] == [float(tag.endswith("block"))] * len(
                    run["metrics"]["tree/gather_block"]), f"{precision} {mode}/{window}/{tag}: gathered otherwise"
    # DPO and async GRPO under the same FSDP2 (float64): packed and dfs give stock's FSDP2 update
    for algo, checkpoint_dir in (("dpo", "dpo_tiny"), ("async", "async_tiny")):
        start = load_file(os.path.join(tmp_path, checkpoint_dir, "model.safetensors"))
        runs = {(m, r): torch.load(tmp_path / f"fsdp-{algo}-{m}_rank{r}.pt") for m in ("off", "packed", "dfs")
                for r in (0, 1)}
        stock = runs[("off", 0)]["params"]
        assert runs[("off", 0)]["distributed_type"] == "FSDP"
        for mode in ("packed", "dfs"):
            got = runs[(mode, 0)]["params"]
            for name, p in got.items():
                assert torch.equal(p, runs[(mode, 1)]["params"][name]), f"{algo} {mode}: ranks disagree on {name}"
            for name, p in stock.items():
                want = p.double() - start[name].double()
                err = float((got[name].double() - start[name].double() - want).norm() / want.norm().clamp(min=1e-30))
                assert err < 1e-5, f"{algo} {mode} under FSDP2: {name}'s update differs from stock's by {err:.2e}"


def test_ppo_under_accelerate_fsdp2_trains_the_one_process_update(tmp_path):
    """TreePPOTrainer under Accelerate's FSDP2, every critic kind: a separate value model sharded as
    Accelerate shards the policy, a head on the policy's trunk, a critic adapter on a LoRA policy;
    the untreed step, packed and dfs, per micro-step and in accumulation windows. The ranks agree
    and the update of policy and critic equals one unwrapped process's untreed update (float64, 1e-5);
    under bf16 mixed precision the tree's error against that is at most 1.5x the untreed step's
    under the same FSDP2. A saved sharded critic is written whole, equal to the trained one."""
    import ddp_check
    import fsdp_trainer_check

    checkpoint, done = launch_fsdp2_check(tmp_path, 2, "ppo")
    ones = {}
    for critic, mode, window, extra, tag in fsdp_trainer_check.PPO_RUNS:
        if critic not in ones:
            name = ddp_check.train_window_run(checkpoint, str(tmp_path), "ppo", critic, "off", "auto", **extra)
            ones[critic] = torch.load(tmp_path / f"win-{name}-p1_rank0.pt")
        one = ones[critic]
        run = "-".join(x for x in ("ppo", critic, mode, window, "fsdp", tag) if x)
        two = [torch.load(tmp_path / f"win-{run}-p2_rank{r}.pt") for r in (0, 1)]
        assert two[0]["distributed_type"] == "FSDP" and two[0]["sharded"], f"{run}: not run under FSDP2"
        assert set(two[0]["params"]) == set(one["params"]), f"{run}: trained other parameters than one process"
        assert any(n.startswith("critic.") for n in one["params"])
        for name, p in two[0]["params"].items():
            assert torch.equal(p, two[1]["params"][name]), f"{run}: ranks disagree on {name}"
            want = one["params"][name].double() - one["start"][name].double()
            got = p.double() - two[0]["start"][name].double()
            assert torch.equal(two[0]["start"][name], one["start"][name]), f"{run}: {name} started elsewhere"
            err = float((got - want).norm() / want.norm().clamp(min=1e-30))
            assert err < 1e-5, f"{run}: {name}'s update differs from one process's by {err:.2e}"

    def bf16_error(run: str) -> float:  # the whole update's error against one process's fp32 update
        got = torch.load(tmp_path / f"win-{run}-p2_rank0.pt")
        num = sum(float(((got["params"][n].double() - got["start"][n].double())
                         - (one["params"][n].double() - one["start"][n].double())).norm() ** 2) for n in one["params"])
        den = sum(float((one["params"][n].double() - one["start"][n].double()).norm() ** 2) for n in one["params"])
        return (num / den) ** 0.5

    one = torch.load(tmp_path / "win-{}-p1_rank0.pt".format(ddp_check.train_window_run(
        checkpoint, str(tmp_path), "ppo", "separate", "off", "auto", tag="1step-fp32", max_steps=1,
        dtype=torch.float32)))
    stock = bf16_error("ppo-separate-off-auto-fsdp-bf16")
    tree = bf16_error("ppo-separate-packed-accumulation-fsdp-bf16")
    assert tree <= 1.5 * stock, f"bf16 under FSDP2: the tree's update error {tree:.2e} against stock's {stock:.2e}"
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "ppo-separate-packed-accumulation-fsdp-bf16" / "final" / "critic.safetensors")
    trained = torch.load(tmp_path / "win-ppo-separate-packed-accumulation-fsdp-bf16-p2_rank0.pt")["params"]
    critic = [p for n, p in trained.items() if n.startswith("critic.")]
    for p in critic:  # every trained critic tensor is in the file, whole (not a rank's shard)
        assert any(t.shape == p.shape and torch.equal(t.to(p.dtype), p) for t in saved.values()), tuple(p.shape)
    assert (tmp_path / "ppo-separate-packed-accumulation-fsdp-bf16" / "final" / "value_model" / "config.json").is_file()


def test_fsdp2_window_cuts_its_one_tree_until_every_rank_owns_a_piece(tmp_path):
    """Four processes under FSDP2 and one prompt group per optimizer step: placed whole, the window's
    one tree would leave three ranks without one, where its calls would gather and reduce the
    sharded model on the owner only and the ranks would wait for each other forever. Under FSDP2
    the placement cuts the tree until every rank owns a piece (no fallback to the micro-steps' own
    trees, which the log would name): GRPO (dfs) and PPO (a head on the trunk, packed; a separate
    value model, dfs — held whole, and gathered block by block with the four ranks' calls lined up)
    finish, the ranks agree, and the update is one process's (float64, 1e-5)."""
    import ddp_check
    import fsdp_trainer_check

    checkpoint, done = launch_fsdp2_check(tmp_path, 4, "idle", timeout=300)
    assert "without a tree under FSDP2" not in done.stderr
    for algo, critic, mode, extra, tag in fsdp_trainer_check.IDLE_RANK_RUNS:
        extra = {k: v for k, v in extra.items() if k != "tree_gather"}  # one process: nothing to gather
        name = ddp_check.train_window_run(checkpoint, str(tmp_path), algo, critic, "off", "auto", rows=4,
                                          gradient_accumulation_steps=1, **extra)
        one = torch.load(tmp_path / f"win-{name}-p1_rank0.pt")
        run = "-".join(x for x in (algo, critic, mode, "accumulation", tag) if x)
        four = [torch.load(tmp_path / f"win-{run}-p4_rank{r}.pt") for r in range(4)]
        assert four[0]["sharded"]
        assert four[0]["metrics"]["tree/gather_block"][-1] == float(tag.endswith("block")), f"{run}: gathering"
        _assert_ranks_train_one_process_update(run, four, one)


def _assert_ranks_train_one_process_update(run: str, ranks: list[dict], one: dict) -> None:
    """Every rank ends with the same parameters, and their update is one process's (float64, 1e-5)."""
    for param, p in ranks[0]["params"].items():
        for other in ranks[1:]:
            assert torch.equal(p, other["params"][param]), f"{run}: ranks disagree on {param}"
        want = one["params"][param].double() - one["start"][param].double()
        err = float((p.double() - ranks[0]["start"][param].double() - want).norm() / want.norm().clamp(min=1e-30))
        assert err < 1e-5, f"{run}: {param}'s update differs from one process's by {err:.2e}"


def test_a_hybrid_under_accelerate_fsdp2_block_by_block_trains_the_one_process_update(tmp_path):
    """Qwen3.5 (gated DeltaNet layers beside attention) prepared by Accelerate's FSDP2 — whose wrap policy
    refused the model before (it lists a vision block it does not hold) — and gathered block by block:
    the stand-in calls run the hybrid's layers too. Packed in a window and the walk per micro-step; the
    ranks agree and the update is one unwrapped process's (float64, the delta rule too; 1e-5)."""
    import ddp_check
    import fsdp_trainer_check
    from trl_tree.data.tiny import tiny_model
    from trl_tree.engine.mixers.deltanet import float64_kernels

    checkpoint, _ = launch_fsdp2_check(tmp_path, 2, "hybrid", family="qwen3_5")
    with float64_kernels(tiny_model("qwen3_5")):  # as the launch runs them (fsdp_trainer_check.main_hybrid)
        name = ddp_check.train_window_run(checkpoint, str(tmp_path), "grpo", None, "off", "auto")
    one = torch.load(tmp_path / f"win-{name}-p1_rank0.pt")
    for algo, mode, window, extra, tag in fsdp_trainer_check.HYBRID_RUNS:
        run = "-".join((algo, mode, window, "fsdp", tag))
        two = [torch.load(tmp_path / f"win-{run}-p2_rank{r}.pt") for r in (0, 1)]
        assert two[0]["distributed_type"] == "FSDP" and two[0]["sharded"], f"{run}: not run under FSDP2"
        assert two[0]["metrics"]["tree/gather_block"][-1] == 1.0, f"{run}: not gathered block by block"
        assert set(two[0]["params"]) == set(one["params"])
        _assert_ranks_train_one_process_update(run, two, one)


def test_ppo_under_fsdp2_on_one_process_trains_the_separate_critic(tmp_path):
    """One process under ``fsdp2.yaml``: the separate value model is sharded (over one rank) and its
    gradients wait, unreduced, for the step's one reduction — which must run with one process too, or
    the critic never receives them. Policy and critic train one unwrapped process's update (float64,
    1e-5), per micro-step (dfs), in an accumulation window (packed) and in the untreed step."""
    import ddp_check
    import fsdp_trainer_check

    checkpoint, _ = launch_fsdp2_check(tmp_path, 1, "ppo_one")
    name = ddp_check.train_window_run(checkpoint, str(tmp_path), "ppo", "separate", "off", "auto")
    one = torch.load(tmp_path / f"win-{name}-p1_rank0.pt")
    for critic, mode, window in fsdp_trainer_check.PPO_ONE_PROCESS_RUNS:
        run = torch.load(tmp_path / f"win-ppo-{critic}-{mode}-{window}-fsdp1p-p1_rank0.pt")
        assert run["distributed_type"] == "FSDP" and run["sharded"], f"{mode}/{window}: not run under FSDP2"
        assert set(run["params"]) == set(one["params"])
        for n, p in run["params"].items():
            want = one["params"][n].double() - one["start"][n].double()
            got = p.double() - run["start"][n].double()
            assert want.norm() > 0, n
            err = float((got - want).norm() / want.norm())
            assert err < 1e-5, f"{mode}/{window}: {n}'s update differs from one unwrapped process's by {err:.2e}"
