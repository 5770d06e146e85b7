"""DeepSpeed ZeRO-2 and ZeRO-3 on two CPU processes (DeepSpeed's CPU accelerator over gloo): every
tree mode of GRPO (per micro-step, under a token budget, in accumulation windows), PPO (each critic
kind), RLOO, SFT and DPO trains the update one process trains (GRPO, PPO: fp64 weights under
DeepSpeed's fp32 master copy) or stock's under the same DeepSpeed config (RLOO, SFT, DPO), the ranks
agree, and the gradients are reduced once per optimizer step (``trl_tree/distributed/deepspeed.py``).
Under ZeRO-3 the parameter persistence threshold is 0, so the tiny model's parameters are partitioned
as a large model's are."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import free_port
from sft_harness import save_sft_checkpoint
from trainer_harness import save_tiny_checkpoint

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow  # launches of several processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRPO = ("off-auto", "packed-micro_step", "packed-micro_step-budget", "dfs-micro_step", "packed-accumulation",
        "dfs-accumulation")


def zero_config(tmp_path, stage: int, processes: int = 2, **extra) -> str:
    """An Accelerate config for DeepSpeed ZeRO-``stage`` on ``processes`` processes; ZeRO-3 partitions
    every parameter (persistence threshold 0, no prefetch); ``extra``: more DeepSpeed config blocks."""
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0,
                    stage3_gather_16bit_weights_on_model_save=True)
    ds = {"zero_optimization": zero, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"}, **extra}
    (tmp_path / f"zero{stage}.json").write_text(json.dumps(ds))
    config = tmp_path / f"zero{stage}.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
                      f"  deepspeed_config_file: {tmp_path / f'zero{stage}.json'}\n  zero3_init_flag: {stage == 3}\n"
                      f"num_machines: 1\nnum_processes: {processes}\nmachine_rank: 0\n")
    return str(config)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """GRPO's runs on one process, no DeepSpeed: the update the launches must give."""
    out = tmp_path_factory.mktemp("one")
    checkpoint = save_tiny_checkpoint(out / "tiny")
    save_tiny_checkpoint(out / "hybrid_tiny", "qwen3_5")
    save_sft_checkpoint(out / "sft_tiny")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    code = ("import sys; sys.path.insert(0, 'tests'); import ddp_check, deepspeed_check\n"
            f"deepspeed_check.save_value_model({checkpoint!r})\n"
            "for mode, window, extra, tag in deepspeed_check.GRPO_RUNS:\n"
            f"    ddp_check.train_window_run({checkpoint!r}, {str(out)!r}, 'grpo', None, mode, window, tag=tag, **extra)\n"
            "for spec in deepspeed_check.PPO_RUNS:\n"
            f"    deepspeed_check.ppo_run({checkpoint!r}, {str(out)!r}, *spec[:4], False)\n"
            f"deepspeed_check.main_idle({checkpoint!r}, {str(out)!r})\n"
            f"deepspeed_check.main_hybrid({checkpoint!r}, {str(out)!r}, {{'flushes': 0}}, (('off', 'auto'),))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, checkpoint, str(out / "sft_tiny")


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def launched(request, reference, tmp_path_factory):
    """One launch of ``deepspeed_check.py`` under ZeRO-2 or ZeRO-3; its output directory."""
    out = tmp_path_factory.mktemp(f"zero{request.param}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()),
           "--config_file", zero_config(out, request.param), os.path.join(ROOT, "tests/deepspeed_check.py"),
           reference[1], reference[2], str(out), *STAGE_PARTS[request.param]]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return request.param, out, reference[0]


#: what each stage's launch runs: ZeRO-3 everything; ZeRO-2 (whose paths GRPO's runs and PPO's critic
#: kinds already cover) without the untreed/dfs separate critic, the resumed run and RLOO
STAGE_PARTS = {2: ("grpo", "ppo-core", "offline"), 3: ("grpo", "ppo", "rloo", "offline", "hybrid")}


def _worst(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_grpo_every_tree_mode_under_zero_trains_the_one_process_update(launched):
    stage, out, one = launched
    for run in [f"grpo-{r}" for r in GRPO]:
        ref = torch.load(one / f"win-{run}-p1_rank0.pt")
        ranks = [torch.load(out / f"win-{run}-p2_rank{r}.pt") for r in (0, 1)]
        assert ranks[0]["distributed_type"] == "DEEPSPEED"
        assert _worst(ranks[0]["params"], ranks[1]["params"]) == 0.0, f"ZeRO-{stage} {run}: the ranks disagree"
        update = _worst(ref["params"], ref["start"])
        # DeepSpeed steps an fp32 master copy of the fp64 weights: stock's own error is that rounding
        assert _worst(ranks[0]["params"], ref["params"]) <= 1e-4 * update, f"ZeRO-{stage} {run}"
        flushes = torch.load(out / f"flushes-{run}.pt")["flushes"]
        # the tree's gradients stay local through the step and are reduced once per optimizer step (2);
        # stock (tree_mode='off') reduces in DeepSpeed's own hooks
        assert flushes == (0 if run.endswith("off-auto") else 2), f"ZeRO-{stage} {run}: {flushes} reductions"
    metrics = torch.load(out / "win-grpo-dfs-accumulation-p2_rank0.pt")["metrics"]
    assert metrics["tree/dedup_ratio"][0] > 1.5 and "tree/rank_imbalance" in metrics, "no window ran"


def test_a_hybrid_under_zero3_trains_the_one_process_update(launched):
    """Qwen3.5 (gated DeltaNet layers beside attention) under ZeRO-3, its parameters partitioned and held
    whole for the step's calls: packed in a window and the walk per micro-step train one process's
    stock update (the delta rule in float64 on both sides), reduced once per optimizer step."""
    import deepspeed_check

    stage, out, one = launched
    if "hybrid" not in STAGE_PARTS[stage]:
        pytest.skip("ZeRO-3's launch runs the hybrid (the stage that partitions its parameters)")
    ref = torch.load(one / "win-grpo-off-auto-hybrid-p1_rank0.pt")
    update = _worst(ref["params"], ref["start"])
    for mode, window in deepspeed_check.HYBRID_RUNS:
        run = f"grpo-{mode}-{window}-hybrid"
        ranks = [torch.load(out / f"win-{run}-p2_rank{r}.pt") for r in (0, 1)]
        assert ranks[0]["distributed_type"] == "DEEPSPEED"
        assert _worst(ranks[0]["params"], ranks[1]["params"]) == 0.0, f"ZeRO-{stage} {run}: the ranks disagree"
        assert set(ranks[0]["params"]) == set(ref["params"])
        assert _worst(ranks[0]["params"], ref["params"]) <= 1e-4 * update, f"ZeRO-{stage} {run}"
        assert torch.load(out / f"flushes-{run}.pt")["flushes"] == 2, f"ZeRO-{stage} {run}: reductions"


PPO = ("separate-off-auto", "separate-packed-accumulation", "separate-dfs-micro_step", "shared-packed-micro_step",
       "adapter-dfs-accumulation-lora")


def test_ppo_every_critic_kind_under_zero_trains_the_one_process_update(launched):
    """PPO's critic in the policy's engine (joined while DeepSpeed builds it): a separate value model,
    a head on the trunk, a critic adapter; untreed, packed and dfs, per micro-step and in windows."""
    import deepspeed_check

    stage, out, one = launched
    core = {"-".join(x for x in (kind, mode, window, "lora" if lora else "") if x)
            for kind, mode, window, lora, _ in deepspeed_check.PPO_CORE}
    for run in [f"ppo-{r}" for r in PPO if stage == 3 or r in core]:
        ref = torch.load(one / f"win-{run}-p1_rank0.pt")
        ranks = [torch.load(out / f"win-{run}-p2_rank{r}.pt") for r in (0, 1)]
        assert ranks[0]["distributed_type"] == "DEEPSPEED"
        assert _worst(ranks[0]["params"], ranks[1]["params"]) == 0.0, f"ZeRO-{stage} {run}: the ranks disagree"
        assert any(k.startswith("critic.") for k in ref["params"]), "no critic parameter compared"
        update = _worst(ref["params"], ref["start"])
        assert _worst(ranks[0]["params"], ref["params"]) <= 1e-4 * update, f"ZeRO-{stage} {run}"
        flushes = torch.load(out / f"flushes-{run}.pt")["flushes"]
        assert flushes == 2, f"ZeRO-{stage} {run}: {flushes} reductions for 2 optimizer steps"
    if stage == 3:  # resumed from a DeepSpeed checkpoint (the critic's optimizer state in the engine's)
        full = torch.load(out / "win-ppo-separate-packed-accumulation-full-p2_rank0.pt")
        resumed = torch.load(out / "win-ppo-separate-packed-accumulation-resumed-p2_rank0.pt")
        assert _worst(full["params"], resumed["params"]) <= 1e-6 * _worst(full["params"], full["start"]), "resumed"
    # saved as under DDP: the policy alone in its files, the critic whole beside it
    from safetensors.torch import load_file

    final = out / "ppo-separate-packed-accumulation" / "final"
    policy = load_file(str(final / "model.safetensors"))
    assert not [k for k in policy if "trl_tree_joined" in k], "the critic was saved inside the policy"
    critic = load_file(str(final / "critic.safetensors"))
    trained = torch.load(out / "win-ppo-separate-packed-accumulation-p2_rank0.pt")["params"]
    head = critic["model.score.weight"].double()
    assert head.numel() > 0 and any(torch.equal(head, v.double()) for k, v in trained.items()
                                    if k.startswith("critic.") and v.shape == head.shape), "the saved critic"


@pytest.mark.parametrize("family", ["sft", "dpo", "rloo"])
def test_trainers_under_zero_train_stock_update(launched, family):
    """SFT, DPO and RLOO (on generated rollouts) against their stock TRL trainer in the same launch."""
    stage, out, _ = launched
    if family not in STAGE_PARTS[stage] and family == "rloo":
        pytest.skip("RLOO runs under ZeRO-3 only (its ZeRO-2 path is GRPO's, checked above)")
    stock = torch.load(out / f"{family}_stock_rank0.pt")
    for mode in ("packed", "dfs"):
        if family == "rloo":
            assert torch.load(out / f"rloo_{mode}_completions_rank0.pt") == torch.load(
                out / "rloo_stock_completions_rank0.pt"), "RLOO: the runs did not train on the same rollouts"
        ranks = [torch.load(out / f"{family}_{mode}_rank{r}.pt") for r in (0, 1)]
        flushes = ranks[0]["flushes"]
        assert flushes == 2, f"ZeRO-{stage} {family} {mode}: {flushes} reductions for 2 optimizer steps"
        assert _worst(ranks[0]["params"], ranks[1]["params"]) == 0.0, f"ZeRO-{stage} {family} {mode}: ranks disagree"
        worst = _worst(ranks[0]["params"], stock["params"])
        assert worst <= 1e-5, f"ZeRO-{stage} {family} {mode} differs from stock by {worst:.2e}"


@pytest.mark.parametrize("stage, example", [(3, "grpo_tree.py --mode dfs"), (2, "sft_tree.py --mode dfs"),
                                            (3, "ppo_tree.py --mode packed --steps 3"), (2, "dpo_tree.py --mode dfs")])
def test_examples_run_under_the_shipped_deepspeed_configs(stage, example):
    """An example as a user launches it with ``examples/accelerate/deepspeed_zero{2,3}.yaml`` (two CPU
    processes; the configs' bf16 turned off, as the examples train in fp32 on a CPU)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()),
           "--config_file", os.path.join(ROOT, f"examples/accelerate/deepspeed_zero{stage}.yaml"),
           "--num_processes", "2", "--mixed_precision", "no", os.path.join(ROOT, "examples", example.split()[0]),
           *example.split()[1:], *([] if "--steps" in example else ["--steps", "2"])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "processes 2" in done.stdout, done.stdout[-2000:]


def test_zero3_window_that_leaves_ranks_without_a_tree(reference, tmp_path):
    """Four processes, one prompt group per optimizer step: a window gives the tree to one rank and
    none to the others. Under ZeRO-3 the owners alone call the model, so nothing in those calls may
    be collective (ZeRO-3's start-of-forward hook checks the ranks' step with one: it is removed
    while the model is held whole); every rank reduces, zeros where it has no gradient. The update
    is one process's."""
    one, checkpoint, _ = reference
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()),
           "--config_file", zero_config(tmp_path, 3, processes=4), os.path.join(ROOT, "tests/deepspeed_check.py"),
           checkpoint, "-", str(tmp_path), "idle"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for mode in ("dfs", "packed"):
        ref = torch.load(one / f"win-grpo-{mode}-accumulation-idle-p1_rank0.pt")
        update = _worst(ref["params"], ref["start"])
        for rank in range(4):
            run = torch.load(tmp_path / f"win-grpo-{mode}-accumulation-idle-p4_rank{rank}.pt")
            assert run["metrics"]["tree/rank_imbalance"][0] >= 2.0, "every rank had a tree: nothing was idle"
            assert _worst(run["params"], ref["params"]) <= 1e-4 * update, f"{mode}, rank {rank}"


def test_bench_models_are_built_whole_under_a_zero3_config():
    """A benchmark's modes build their random model outside ZeRO-3's ``zero.Init`` (the same weights
    in every mode of a launch), and the launch's ZeRO-3 config is back afterwards."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    from trl_tree.bench.common import built_whole

    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        assert is_deepspeed_zero3_enabled()
        with built_whole():
            assert not is_deepspeed_zero3_enabled()
        assert is_deepspeed_zero3_enabled()
    finally:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        del config
    with built_whole():  # no DeepSpeed config: nothing to do
        assert not is_deepspeed_zero3_enabled()



def test_ppo_refuses_a_deepspeed_config_that_builds_its_own_optimizer(reference, tmp_path):
    """DeepSpeed would build that optimizer over the policy's parameters alone, leaving the critic
    untrained: refused at construction, naming the block to remove."""
    _, checkpoint, _ = reference
    optimizer = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()),
           "--config_file", zero_config(tmp_path, 2, processes=1, **optimizer),
           os.path.join(ROOT, "tests/deepspeed_check.py"), checkpoint, "-", str(tmp_path), "refuse"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REFUSED" in done.stdout and "'optimizer' block" in done.stdout, done.stdout[-2000:]
