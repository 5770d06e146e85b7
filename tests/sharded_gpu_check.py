"""FSDP2 and DeepSpeed inside the trainers, on GPUs (run by hand: Accelerate runs FSDP and
DeepSpeed on GPUs only, so CPU processes cannot):

    python tests/sharded_gpu_check.py OUT                     # reference: no wrapper, tree_mode="off"
    accelerate launch --config_file examples/accelerate/fsdp2.yaml --num_processes N --mixed_precision no \\
        tests/sharded_gpu_check.py OUT                        # every tree path under FSDP2
    accelerate launch --use_deepspeed --zero_stage 2 --num_processes N --mixed_precision no \\
        tests/sharded_gpu_check.py OUT                        # what DeepSpeed runs (packed per micro-step)
    python tests/sharded_gpu_check.py OUT --compare

Trains the tiny model (fp32) two optimizer steps on fixed rollouts (``ddp_check.fixed_rollout``:
12 rows per step over two micro-steps, groups of 4) and writes the trained parameters; the compare
step checks every wrapped run against the unwrapped untreed run (1e-4 relative: fp32 on GPU).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from ddp_check import COMPLETION, fixed_rollout, reward_chars
from trainer_harness import PROMPTS, save_tiny_checkpoint

RUNS = {  # name: tree fields
    "off": dict(tree_mode="off"),
    "packed-micro": dict(tree_mode="packed", tree_window="micro_step"),
    "packed-window": dict(tree_mode="packed", tree_window="accumulation"),
    "packed-budget": dict(tree_mode="packed", tree_window="micro_step", tree_token_budget=40),
    "dfs-micro": dict(tree_mode="dfs", tree_window="micro_step", tree_chunk_size=4),
    "dfs-window": dict(tree_mode="dfs", tree_window="accumulation"),
}


def train(out_dir: str) -> None:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast

    from trl_tree import TreeGRPOConfig, TreeGRPOTrainer

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    checkpoint = os.path.join(out_dir, "tiny")
    if int(os.environ.get("RANK", "0")) == 0 and not os.path.exists(checkpoint):
        save_tiny_checkpoint(checkpoint)
    if processes > 1:
        torch.distributed.barrier() if torch.distributed.is_initialized() else None
    if os.environ.get("ACCELERATE_USE_FSDP") is not None:
        runs = list(RUNS)
    elif os.environ.get("ACCELERATE_USE_DEEPSPEED") is not None:
        runs = ["off", "packed-micro"]  # the two-pass paths are refused under DeepSpeed
    else:
        runs = ["off"]
    for run in runs:
        args = TreeGRPOConfig(output_dir=os.path.join(out_dir, run), per_device_train_batch_size=6 // processes,
                              num_generations=4, max_completion_length=COMPLETION, learning_rate=0.05, optim="sgd",
                              max_steps=2, gradient_accumulation_steps=2, num_iterations=2, loss_type="dapo",
                              beta=0.04, bf16=False, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
                              tree_attn_backend="sdpa",  # head_dim 8: below flex's and FlashAttention's minimum
                              **RUNS[run])
        torch.manual_seed(0)
        trainer = TreeGRPOTrainer(model=checkpoint, reward_funcs=reward_chars, args=args, rollout_func=fixed_rollout,
                                  train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                  processing_class=PreTrainedTokenizerFast.from_pretrained(checkpoint))
        trainer.train()
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
                  for n, p in trainer.model.named_parameters()}
        plugin = trainer.accelerator.state.deepspeed_plugin
        if plugin is not None:
            tag = f"zero{plugin.zero_stage}"
            if plugin.zero_stage == 3:  # partitioned: gather the full parameters to save them
                import deepspeed

                with deepspeed.zero.GatheredParameters(list(trainer.model.parameters())):
                    params = {n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters()}
        else:
            tag = "fsdp2" if any(type(p).__name__ == "DTensor" for p in trainer.model.parameters()) else "plain"
        if trainer.accelerator.is_main_process:
            torch.save(params, os.path.join(out_dir, f"{tag}-{run}.pt"))
            print(run, tag, trainer.accelerator.distributed_type.value, flush=True)


def compare(out_dir: str) -> int:
    ref = torch.load(os.path.join(out_dir, "plain-off.pt"))
    worst_all = 0.0
    for tag in ("fsdp2", "zero2", "zero3"):
        for run in RUNS:
            path = os.path.join(out_dir, f"{tag}-{run}.pt")
            if not os.path.exists(path):
                continue
            got = torch.load(path)
            worst = max(((got[n] - p).norm() / p.norm().clamp(min=1e-30)).item() for n, p in ref.items())
            worst_all = max(worst_all, worst)
            print(f"{tag} {run}: max relative parameter difference from the unwrapped untreed run {worst:.2e}")
    return 0 if worst_all <= 1e-4 else 1


if __name__ == "__main__":
    if "--compare" in sys.argv:
        raise SystemExit(compare(sys.argv[1]))
    train(sys.argv[1])
