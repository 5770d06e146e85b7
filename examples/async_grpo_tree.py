"""Asynchronous GRPO with TreeAsyncGRPOTrainer: TRL's async trainer with the tree engine running each
micro-batch, generation and training overlapping.

    python examples/async_grpo_tree.py                       # tiny built-in model, toy task, CPU, no server
    python examples/async_grpo_tree.py --model Qwen/Qwen2.5-0.5B-Instruct --mode dfs
    python examples/async_grpo_tree.py --model Qwen/Qwen3-0.6B --vllm-url http://localhost:8000

Without ``--vllm-url`` the samples come from the local rollout worker: TRL's own rollout loop
(rewards, group advantages, staleness tags) in a background thread, generating with transformers
from a copy of the policy that every optimizer step refreshes in-process. With ``--vllm-url`` they
come from TRL's vLLM worker, as in stock (not run here: no server is installable on these machines).
Without ``--model`` the policy is a tiny Qwen2-shaped model built in code and the task rewards the
letter 'a' (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import os
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: tiny built-in model)")
    parser.add_argument("--vllm-url", default=None, help="a running `trl vllm-serve` (default: the local worker)")
    parser.add_argument("--mode", default="packed", choices=("packed", "dfs", "off"))
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--token-budget", type=int, default=512, help="unique tokens of one micro-batch")
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--output-dir", default=None, help="save the trained model (or adapter) here")
    args = parser.parse_args()

    # the tiny policy and the trainer's output (unless --output-dir) go, and leave, with this folder
    with tempfile.TemporaryDirectory(prefix="async_grpo_tree_", ignore_cleanup_errors=True) as workdir:
        _train(args, workdir)


def letter_a(completions, **kwargs) -> list[float]:
    """Share of the letter 'a' in each completion's last message (0 for an empty one)."""
    texts = [c[-1]["content"] if c else "" for c in completions]
    return [t.count("a") / max(len(t), 1) for t in texts]


def _train(args, workdir: str) -> None:
    # imported after the arguments are parsed, so that --help answers at once
    import torch
    from datasets import Dataset

    from trl_tree import TreeAsyncGRPOConfig, TreeAsyncGRPOTrainer
    from trl_tree.data.toy import build_tiny_policy, learning_line, toy_prompts

    # the letter task: its alphabet alone, which a random policy learns from fastest (toy.build_tiny_policy)
    model = args.model or build_tiny_policy(os.path.join(workdir, "policy"), chat=True, every_character=False)
    config = TreeAsyncGRPOConfig(
        output_dir=args.output_dir or os.path.join(workdir, "out"),
        tree_mode=args.mode,
        max_steps=args.steps,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate,
        token_budget=args.token_budget,
        max_staleness=args.max_staleness,
        bf16=args.model is not None and torch.cuda.is_available(),  # the tiny model trains in fp32
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        **({"vllm_server_base_url": args.vllm_url} if args.vllm_url else {}),
    )
    prompts = [[{"role": "user", "content": p}] for p in toy_prompts(story_len=120)]
    trainer = TreeAsyncGRPOTrainer(
        model=model,
        reward_funcs=letter_a,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        rollout_worker=None if args.vllm_url else "local",
    )
    trainer.train()
    if args.output_dir:  # the trained weights (an adapter under PEFT), with the tokenizer
        trainer.save_model(args.output_dir)
    logs = [h for h in trainer.state.log_history if h.get("reward") is not None]
    print(f"{learning_line([h['reward'] for h in logs])}; T/U {logs[-1].get('tree/dedup_ratio', 1.0):.2f}; "
          f"staleness max {max(h.get('sample/staleness_max') or 0 for h in logs):.0f}")
    # every rank closes the process group before the interpreter exits (Accelerate's end of a script):
    # torch 2.15's gloo threads can abort an exit that leaves it open
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
