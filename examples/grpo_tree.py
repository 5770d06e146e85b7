"""GRPO with TreeGRPOTrainer: TRL's script with one import and one config class changed.

    python examples/grpo_tree.py                           # tiny built-in model, toy task, CPU or GPU
    python examples/grpo_tree.py --model Qwen/Qwen2.5-0.5B-Instruct --mode dfs
    accelerate launch --config_file examples/accelerate/cpu_2proc.yaml examples/grpo_tree.py
    accelerate launch --config_file examples/accelerate/multi_gpu.yaml examples/grpo_tree.py --model ...

Without ``--model`` the policy is a tiny Qwen2-shaped model built in code and the task rewards the
letter 'a' (nothing is downloaded). With ``--model`` any causal LM checkpoint (local path or hub
id) trains on the same toy prompts; swap in your dataset and reward functions as with TRL.
"""

from __future__ import annotations

import argparse
import os
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: tiny built-in model)")
    parser.add_argument("--mode", default="packed", choices=("packed", "dfs", "off"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--story-length", type=int, default=320, help="characters of each toy prompt's story")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=24)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--token-budget", type=int, default=None, help="tree_token_budget")
    parser.add_argument("--output-dir", default=None, help="save the trained model (or adapter) here")
    args = parser.parse_args()

    # the tiny policy and the trainer's output (unless --output-dir) go, and leave, with this folder
    with tempfile.TemporaryDirectory(prefix="grpo_tree_", ignore_cleanup_errors=True) as workdir:
        _train(args, workdir)


def _train(args, workdir: str) -> None:
    # imported after the arguments are parsed, so that --help answers at once
    import torch
    from datasets import Dataset

    from trl_tree import TreeGRPOConfig, TreeGRPOTrainer
    from trl_tree.data.toy import build_tiny_policy, learning_line, reward_letter_a, toy_prompts

    # every process builds the same tiny model from the same seed, so no file has to be shared
    model = args.model or build_tiny_policy(os.path.join(workdir, "policy"))
    config = TreeGRPOConfig(
        output_dir=args.output_dir or os.path.join(workdir, "out"),
        tree_mode=args.mode,
        tree_token_budget=args.token_budget,
        max_steps=args.steps,
        per_device_train_batch_size=2 * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate,
        beta=0.0,
        bf16=args.model is not None,  # the tiny model trains in fp32
        use_cpu=not torch.cuda.is_available(),  # CPU processes then join one gloo process group
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    trainer = TreeGRPOTrainer(
        model=model,
        reward_funcs=reward_letter_a,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": toy_prompts(story_len=args.story_length)}),
    )
    trainer.train()
    if args.output_dir:  # the trained weights (an adapter under PEFT), with the tokenizer
        trainer.save_model(args.output_dir)
    if trainer.accelerator.is_main_process:
        logs = [h for h in trainer.state.log_history if "reward" in h]
        print(f"{learning_line([h['reward'] for h in logs])}; "
              f"T/U {logs[-1].get('tree/dedup_ratio', 1.0):.2f}; processes {trainer.accelerator.num_processes}")
    # every rank closes the process group before the interpreter exits (Accelerate's end of a script):
    # torch 2.15's gloo threads can abort an exit that leaves it open
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
