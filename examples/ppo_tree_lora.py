"""PPO under LoRA with a critic adapter: one frozen base model serves the policy (its adapter), the
critic (a second adapter plus a value head) and the reference (adapters disabled) — all over the tree.

    python examples/ppo_tree_lora.py                       # tiny built-in model, CPU or GPU
    python examples/ppo_tree_lora.py --model Qwen/Qwen2.5-1.5B-Instruct --mode dfs
    accelerate launch --config_file examples/accelerate/cpu_2proc.yaml examples/ppo_tree_lora.py
"""

from __future__ import annotations

import argparse
import os
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: tiny built-in model)")
    parser.add_argument("--mode", default="packed", choices=("packed", "dfs", "off"))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--story-length", type=int, default=320, help="characters of each toy prompt's story")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--output-dir", default=None, help="save the trained model (or adapter) here")
    args = parser.parse_args()

    # the tiny policy and the trainer's output (unless --output-dir) go, and leave, with this folder
    with tempfile.TemporaryDirectory(prefix="ppo_tree_lora_", ignore_cleanup_errors=True) as workdir:
        _train(args, workdir)


def _train(args, workdir: str) -> None:
    # imported after the arguments are parsed, so that --help answers at once
    import torch
    from datasets import Dataset
    from peft import LoraConfig

    from trl_tree import TreePPOConfig, TreePPOTrainer
    from trl_tree.data.toy import TOY_PPO, build_tiny_policy, learning_line, reward_letter_a, toy_prompts

    model = args.model or build_tiny_policy(os.path.join(workdir, "policy"))
    config = TreePPOConfig(
        output_dir=args.output_dir or os.path.join(workdir, "out"),
        tree_mode=args.mode,
        critic="adapter",
        max_steps=args.steps,
        per_device_train_batch_size=16,
        num_generations=8,
        response_length=16,
        **TOY_PPO,  # the KL penalty is against the base with adapters disabled; the rest: trl_tree/data/toy.py
        learning_rate=2e-2,
        bf16=args.model is not None,
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", lora_dropout=0.0)
    trainer = TreePPOTrainer(
        model=model,
        reward_funcs=reward_letter_a,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": toy_prompts(story_len=args.story_length)}),
        peft_config=lora,
    )
    trainer.train()
    if args.output_dir:  # the trained weights (an adapter under PEFT), with the tokenizer
        trainer.save_model(args.output_dir)
    if trainer.accelerator.is_main_process:
        logs = [h for h in trainer.state.log_history if "objective/scores" in h]
        print(f"{learning_line([h['objective/scores'] for h in logs])}; "
              f"kl {logs[-1].get('objective/kl', 0):.4f}; T/U {logs[-1].get('tree/dedup_ratio', 1.0):.2f}; "
              f"processes {trainer.accelerator.num_processes}")
    # every rank closes the process group before the interpreter exits (Accelerate's end of a script):
    # torch 2.15's gloo threads can abort an exit that leaves it open
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
