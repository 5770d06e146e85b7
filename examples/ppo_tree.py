"""PPO with a learned critic: TreePPOTrainer trains the policy and the critic over the prefix tree.

    python examples/ppo_tree.py                                   # tiny built-in model, toy task, CPU or GPU
    python examples/ppo_tree.py --critic shared --mode dfs
    python examples/ppo_tree.py --model Qwen/Qwen2.5-0.5B-Instruct --critic separate
    accelerate launch --config_file examples/accelerate/cpu_2proc.yaml examples/ppo_tree.py
    accelerate launch --config_file examples/accelerate/multi_gpu.yaml examples/ppo_tree.py --model ...
    accelerate launch --config_file examples/accelerate/fsdp2.yaml --num_processes 4 examples/ppo_tree.py --model ...
    accelerate launch --config_file examples/accelerate/deepspeed_zero3.yaml --num_processes 4 examples/ppo_tree.py --model ...

Which engine and critic kind for which model size and GPUs: docs/ppo.md, "Several GPUs".

Without ``--model`` the policy is a tiny Qwen2-shaped model built in code and the task rewards the
letter 'a' (nothing is downloaded). ``--critic separate`` trains a value model of its own (from the
policy's checkpoint), ``shared`` a value head on the policy's trunk; for a critic adapter under
LoRA see ``ppo_tree_lora.py``. The config takes TRL 1.12's PPOConfig names (docs/ppo.md).
"""

from __future__ import annotations

import argparse
import os
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: tiny built-in model)")
    parser.add_argument("--critic", default="separate", choices=("separate", "shared"))
    parser.add_argument("--mode", default="packed", choices=("packed", "dfs", "off"))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=16)
    parser.add_argument("--story-length", type=int, default=320, help="characters of each toy prompt's story")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--output-dir", default=None, help="save the trained model (or adapter) here")
    args = parser.parse_args()

    # the tiny policy and the trainer's output (unless --output-dir) go, and leave, with this folder
    with tempfile.TemporaryDirectory(prefix="ppo_tree_", ignore_cleanup_errors=True) as workdir:
        _train(args, workdir)


def _train(args, workdir: str) -> None:
    # imported after the arguments are parsed, so that --help answers at once
    import torch
    from datasets import Dataset

    from trl_tree import TreePPOConfig, TreePPOTrainer
    from trl_tree.data.toy import TOY_PPO, build_tiny_policy, learning_line, reward_letter_a, toy_prompts

    # every process builds the same tiny model from the same seed, so no file has to be shared
    model = args.model or build_tiny_policy(os.path.join(workdir, "policy"))
    config = TreePPOConfig(
        output_dir=args.output_dir or os.path.join(workdir, "out"),
        tree_mode=args.mode,
        critic=args.critic,
        max_steps=args.steps,
        per_device_train_batch_size=2 * args.num_generations,
        num_generations=args.num_generations,
        response_length=args.response_length,  # TRL 1.12's name of max_completion_length
        **TOY_PPO,  # one epoch per generation, lam=1 and a critic warm-up: why, in trl_tree/data/toy.py
        learning_rate=args.learning_rate,
        bf16=args.model is not None,  # the tiny model trains in fp32
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    trainer = TreePPOTrainer(
        model=model,
        reward_funcs=reward_letter_a,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": toy_prompts(story_len=args.story_length)}),
    )
    trainer.train()
    if args.output_dir:  # the trained weights (an adapter under PEFT), with the tokenizer
        trainer.save_model(args.output_dir)
    if trainer.accelerator.is_main_process:
        logs = [h for h in trainer.state.log_history if "objective/scores" in h]
        warmup = config.critic_warmup_steps  # these steps train the critic alone and log no policy tree
        ratios = [h["tree/dedup_ratio"] for h in trainer.state.log_history if "tree/dedup_ratio" in h]
        print(f"{learning_line([h['objective/scores'] for h in logs])}; explained variance "
              f"{logs[0]['val/explained_variance']:.2f} -> {logs[-1]['val/explained_variance']:.2f}; "
              f"T/U {f'{ratios[-1]:.2f}' if ratios else 'n/a'}; processes {trainer.accelerator.num_processes}")
        if args.steps <= warmup:
            print(f"all {args.steps} steps were the critic's warm-up (critic_warmup_steps={warmup}): the policy has "
                  f"not trained yet; run more than {warmup} steps")
    # every rank closes the process group before the interpreter exits (Accelerate's end of a script):
    # torch 2.15's gloo threads can abort an exit that leaves it open
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
