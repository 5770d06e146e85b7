"""Run under ``accelerate launch`` with a DeepSpeed config and 2 CPU processes (tests/test_deepspeed.py
does): every tree trainer under ZeRO-2 or ZeRO-3 — DeepSpeed's own engine, optimizer and reduction
over gloo (its CPU accelerator) — on the fixed rollouts and data the DDP checks use.

``deepspeed_check.py CHECKPOINT SFT_CHECKPOINT OUT`` runs GRPO (untreed, packed, packed under a token budget, dfs;
per micro-step and in accumulation windows), PPO (each critic kind: a separate value model, a head
on the policy's trunk, a critic adapter under LoRA), then SFT and DPO (stock and the tree's modes), and
writes each rank's trained parameters (gathered whole under ZeRO-3) and how many times the
engine's one-per-step reduction ran (``flushes``). ``... idle`` (on four processes): windows that
leave ranks without a tree. Under ZeRO-3 the test's config sets the
parameter persistence threshold to 0, so that even the tiny model's parameters are partitioned.
"""

import os
import sys

import torch
from datasets import Dataset

sys.path.insert(0, os.path.dirname(__file__))
import ddp_check  # noqa: E402

#: GRPO: (tree_mode, tree_window, extra config, tag)
GRPO_RUNS = (
    ("off", "auto", {}, ""),
    ("packed", "micro_step", {}, ""),
    ("packed", "micro_step", {"tree_token_budget": 30}, "budget"),
    ("dfs", "micro_step", {}, ""),
    ("packed", "accumulation", {}, ""),
    ("dfs", "accumulation", {}, ""),
)


#: PPO: (critic, tree_mode, tree_window, LoRA, save_model after training)
PPO_RUNS = (
    ("separate", "off", "auto", False, False),
    ("separate", "packed", "accumulation", False, True),
    ("separate", "dfs", "micro_step", False, False),
    ("shared", "packed", "micro_step", False, False),
    ("adapter", "dfs", "accumulation", True, False),
)


def value_model_beside(checkpoint: str) -> str:
    """The separate critic's checkpoint, saved beside the policy's (:func:`save_value_model`)."""
    return os.path.join(os.path.dirname(checkpoint), "value")


def save_value_model(checkpoint: str) -> str:
    """A value model with its head (the policy's backbone, a seeded one-value head): a fresh head
    drawn inside ZeRO-3's ``zero.Init`` takes other random numbers than one drawn without it."""
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(1)
    model = AutoModelForTokenClassification.from_pretrained(checkpoint, num_labels=1, dtype=torch.float64)
    model.save_pretrained(value_model_beside(checkpoint))
    return value_model_beside(checkpoint)


#: under ZeRO-2 (the suite's time): each critic kind once, in windows or per micro-step
PPO_CORE = tuple(spec for spec in PPO_RUNS if (spec[0], spec[1]) != ("separate", "off") and
                 (spec[0], spec[1]) != ("separate", "dfs"))


def ppo_run(checkpoint: str, out_dir: str, critic: str, mode: str, window: str, lora: bool, save: bool) -> str:
    value = {"value_model_path": value_model_beside(checkpoint)} if critic == "separate" else {}
    return ddp_check.train_window_run(checkpoint, out_dir, "ppo", critic, mode, window, lora=lora, save=save,
                                      tag="lora" if lora else "", **value)


#: a window that leaves ranks without a tree (4 rows, one group, on 4 processes): (tree_mode, tag)
IDLE_RUNS = (("dfs", "idle"), ("packed", "idle"))


def main_idle(checkpoint: str, out_dir: str) -> None:
    for mode, tag in IDLE_RUNS:
        ddp_check.train_window_run(checkpoint, out_dir, "grpo", None, mode, "accumulation", tag=tag, rows=4,
                                   gradient_accumulation_steps=1)


def count_flushes() -> dict:
    """Count the step reductions DeepSpeed's ``coalesce_grad_reduction`` runs (its flush at the
    block's exit): one per optimizer step where the tree keeps the gradients local."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    counts = {"flushes": 0}
    for name in ("_flush_coalesced_reduction_zero12", "_flush_coalesced_reduction_zero3"):
        original = getattr(DeepSpeedEngine, name)

        def counted(self, optimizer, _original=original):
            counts["flushes"] += 1
            return _original(self, optimizer)

        setattr(DeepSpeedEngine, name, counted)
    return counts


#: a hybrid (Qwen3.5: gated DeltaNet beside attention), GRPO: (tree_mode, tree_window); its checkpoint is
#: ``hybrid_tiny`` beside the dense one, its delta rule in float64 (``mixers/deltanet.float64_kernels``)
HYBRID_RUNS = (("packed", "accumulation"), ("dfs", "micro_step"))


def hybrid_checkpoint(checkpoint: str) -> str:
    return os.path.join(os.path.dirname(checkpoint), "hybrid_tiny")


def main_hybrid(checkpoint: str, out_dir: str, counts: dict, runs=HYBRID_RUNS) -> None:
    from trl_tree.data.tiny import tiny_model
    from trl_tree.engine.mixers.deltanet import float64_kernels

    with float64_kernels(tiny_model("qwen3_5")):
        for mode, window in runs:
            before = counts["flushes"]
            run = ddp_check.train_window_run(hybrid_checkpoint(checkpoint), out_dir, "grpo", None, mode, window,
                                             tag="hybrid")
            torch.save({"flushes": counts["flushes"] - before}, os.path.join(out_dir, f"flushes-{run}.pt"))


def main_grpo(checkpoint: str, out_dir: str, counts: dict) -> None:
    for mode, window, extra, tag in GRPO_RUNS:
        before = counts["flushes"]
        run = ddp_check.train_window_run(checkpoint, out_dir, "grpo", None, mode, window, tag=tag, **extra)
        torch.save({"flushes": counts["flushes"] - before}, os.path.join(out_dir, f"flushes-{run}.pt"))


def main_ppo(checkpoint: str, out_dir: str, counts: dict, core: bool = False) -> None:
    """PPO's runs (``core``: :data:`PPO_CORE`, without the resumed run)."""
    for spec in PPO_CORE if core else PPO_RUNS:
        before = counts["flushes"]
        run = ppo_run(checkpoint, out_dir, *spec)
        torch.save({"flushes": counts["flushes"] - before}, os.path.join(out_dir, f"flushes-{run}.pt"))
    if not core:
        main_resume(checkpoint, out_dir)


def main_resume(checkpoint: str, out_dir: str) -> None:
    """PPO with a separate critic, checkpointed at every step, then resumed from the first step's
    checkpoint (DeepSpeed's own, with ``critic.safetensors`` beside it): the resumed run must end
    where the uninterrupted one did. One PPO epoch per generation, so the second step's rollouts do
    not depend on the first step's policy."""
    import transformers

    settings = dict(value_model_path=value_model_beside(checkpoint), num_iterations=1)
    run = ddp_check.train_window_run(checkpoint, out_dir, "ppo", "separate", "packed", "accumulation", tag="full",
                                     save_strategy="steps", save_steps=1, **settings)
    original = transformers.Trainer.train

    def resumed(self, *args, **kwargs):
        return original(self, resume_from_checkpoint=os.path.join(out_dir, run, "checkpoint-1"))

    transformers.Trainer.train = resumed
    try:
        ddp_check.train_window_run(checkpoint, out_dir, "ppo", "separate", "packed", "accumulation", tag="resumed",
                                   **settings)
    finally:
        transformers.Trainer.train = original


def main_rloo(checkpoint: str, out_dir: str, counts: dict) -> None:
    """RLOO (stock ``RLOOTrainer``, the tree packed and dfs) under the launch's DeepSpeed config, on
    generated rollouts: one generation serves both optimizer steps (``num_iterations=2``), drawn by
    the same model from the same seed in each run, so the three train on the same rows."""
    from trainer_harness import BASE_ARGS, PROMPTS, reward_a
    from transformers import PreTrainedTokenizerFast
    from trl import RLOOConfig, RLOOTrainer

    from trl_tree import TreeRLOOConfig, TreeRLOOTrainer

    runs = {"rloo_stock": (RLOOTrainer, RLOOConfig, {}), "rloo_packed": (TreeRLOOTrainer, TreeRLOOConfig, {}),
            "rloo_dfs": (TreeRLOOTrainer, TreeRLOOConfig, {"tree_mode": "dfs"})}
    for run, (trainer_cls, config_cls, tree) in runs.items():
        before = counts["flushes"]
        args = config_cls(output_dir=os.path.join(out_dir, run), **{**BASE_ARGS, "per_device_train_batch_size": 4,
                                                                         "use_cpu": not ddp_check.ON_GPU},
                          model_init_kwargs={"dtype": torch.float32}, **tree)
        torch.manual_seed(0)
        trainer = trainer_cls(model=checkpoint, reward_funcs=reward_a, args=args,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                              processing_class=PreTrainedTokenizerFast.from_pretrained(checkpoint))
        start = _whole(trainer)
        trainer.train()
        _save(trainer, out_dir, run, counts, before, start)
        completions = list(trainer._logs["completion"])
        torch.save(completions, os.path.join(out_dir, f"{run}_completions_rank{trainer.accelerator.process_index}.pt"))


def main_refuse(checkpoint: str, out_dir: str) -> None:
    """PPO under a DeepSpeed config with an ``optimizer`` block: prints the refusal (``REFUSED``)."""
    try:
        ppo_run(checkpoint, out_dir, "shared", "packed", "micro_step", False, False)
    except ValueError as err:
        print("REFUSED", err)


def _whole(trainer) -> dict:
    """The model's parameters, whole (gathered under ZeRO-3), on the CPU."""
    with ddp_check.zero3_whole(trainer.model):
        return {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}


def _save(trainer, out_dir: str, run: str, counts: dict, before: int, start: dict) -> None:
    """A run's trained parameters, its starting ones and the step reductions DeepSpeed ran."""
    torch.save({"params": _whole(trainer), "start": start, "flushes": counts["flushes"] - before},
               os.path.join(out_dir, f"{run}_rank{trainer.accelerator.process_index}.pt"))


def main_offline(checkpoint: str, out_dir: str, counts: dict) -> None:
    """SFT (stock, packed, dfs) and DPO (stock, packed, dfs) under the launch's DeepSpeed config, from
    ``checkpoint`` (``sft_harness.save_sft_checkpoint``; saved before the launch: under ZeRO-3 a model
    built on one rank alone would wait in ``zero.Init``'s collectives for the others)."""
    from sft_harness import dataset, sft_tokenizer
    from test_dpo_trainer import pairs
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from trl_tree import TreeDPOConfig, TreeDPOTrainer, TreeSFTConfig, TreeSFTTrainer

    common = dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, learning_rate=0.5, optim="sgd",
                  max_steps=2, use_cpu=not ddp_check.ON_GPU, bf16=False, report_to="none", save_strategy="no", seed=0,
                  disable_tqdm=True, gradient_checkpointing=False)
    runs = {"sft_stock": (SFTTrainer, SFTConfig, {}), "sft_packed": (TreeSFTTrainer, TreeSFTConfig, {}),
            "sft_dfs": (TreeSFTTrainer, TreeSFTConfig, {"tree_mode": "dfs"})}
    for run, (trainer_cls, config_cls, tree) in runs.items():
        before = counts["flushes"]
        args = config_cls(output_dir=os.path.join(out_dir, run), **common, **tree)
        # from the path, inside the trainer: under ZeRO-3 the weights load partitioned (zero3_init_flag)
        trainer = trainer_cls(model=checkpoint, args=args, train_dataset=dataset("turns", n=6),
                              processing_class=sft_tokenizer())
        start = _whole(trainer)
        trainer.train()
        _save(trainer, out_dir, run, counts, before, start)
    runs = {"dpo_stock": (DPOTrainer, DPOConfig, {}), "dpo_packed": (TreeDPOTrainer, TreeDPOConfig, {}),
            "dpo_dfs": (TreeDPOTrainer, TreeDPOConfig, {"tree_mode": "dfs", "tree_memory_budget": 1 << 30})}
    for run, (trainer_cls, config_cls, tree) in runs.items():
        before = counts["flushes"]
        args = config_cls(output_dir=os.path.join(out_dir, run), **{**common, "per_device_train_batch_size": 2},
                          model_init_kwargs={"dtype": torch.float32}, **tree)
        ref = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        trainer = trainer_cls(model=checkpoint, ref_model=ref, args=args, train_dataset=pairs(8),
                              processing_class=sft_tokenizer())
        start = _whole(trainer)
        trainer.train()
        _save(trainer, out_dir, run, counts, before, start)


if __name__ == "__main__":
    checkpoint, sft_checkpoint, out_dir = sys.argv[1:4]
    parts = sys.argv[4:] or ["grpo", "ppo", "rloo", "offline"]
    counts = count_flushes()
    if "grpo" in parts:
        main_grpo(checkpoint, out_dir, counts)
    if "ppo" in parts or "ppo-core" in parts:
        main_ppo(checkpoint, out_dir, counts, core="ppo" not in parts)
    if "rloo" in parts:
        main_rloo(checkpoint, out_dir, counts)
    if "hybrid" in parts:
        main_hybrid(checkpoint, out_dir, counts)
    if "offline" in parts:
        main_offline(sft_checkpoint, out_dir, counts)
    if "refuse" in parts:
        main_refuse(checkpoint, out_dir)
    if "idle" in parts:
        main_idle(checkpoint, out_dir)
