"""DPO with TreeDPOTrainer: TRL's script with one import and one config class changed.

    python examples/dpo_tree.py                           # tiny built-in model, generated preference pairs
    python examples/dpo_tree.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset my_pairs.jsonl
    accelerate launch --config_file examples/accelerate/cpu_2proc.yaml examples/dpo_tree.py

A pair's chosen and rejected answers share their prompt (here an agent's system prompt and a
tool's answer); the tree computes it once for the policy and once for the reference, where TRL
runs it twice through each. ``--dataset`` reads a local JSONL or Parquet file of
``prompt``/``chosen``/``rejected`` (any format DPOTrainer takes).
"""

from __future__ import annotations

import argparse
import os
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: tiny built-in model)")
    parser.add_argument("--dataset", default=None, help="local .jsonl/.json/.parquet file (default: generated)")
    parser.add_argument("--mode", default="packed", choices=("packed", "dfs", "off"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--pairs-per-prompt", type=int, default=2, help="generated pairs sharing each prompt")
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--output-dir", default=None, help="save the trained model (or adapter) here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="dpo_tree_", ignore_cleanup_errors=True) as workdir:
        try:
            _train(args, workdir)
        except ValueError as e:  # bad data (trl_tree.data.data_files.DataError) or a refusal: one line, no traceback
            parser.exit(2, f"{parser.prog}: {e}\n")


def _train(args, workdir: str) -> None:
    # imported after the arguments are parsed, so that --help answers at once
    import torch
    from datasets import Dataset

    from trl_tree import TreeDPOConfig, TreeDPOTrainer
    from trl_tree.data.data_files import load_local_dataset
    from trl_tree.data.toy import build_tiny_policy, learning_line, toy_preferences

    # every process builds the same tiny model from the same seed, so no file has to be shared
    model = args.model or build_tiny_policy(os.path.join(workdir, "policy"), chat=True)
    if args.dataset is None:
        data = Dataset.from_list(toy_preferences(8 * args.steps, args.pairs_per_prompt))
    else:  # datasets' loader, with errors that name the file's bad line
        data = load_local_dataset(args.dataset)
    config = TreeDPOConfig(
        output_dir=args.output_dir or os.path.join(workdir, "out"),
        tree_mode=args.mode,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        beta=args.beta,
        lr_scheduler_type="constant",
        gradient_checkpointing=args.model is not None,  # the tiny model needs no recompute
        bf16=args.model is not None,  # the tiny model trains in fp32
        use_cpu=not torch.cuda.is_available(),  # CPU processes then join one gloo process group
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    trainer = TreeDPOTrainer(model=model, args=config, train_dataset=data)
    trainer.train()
    if args.output_dir:  # the trained weights (an adapter under PEFT), with the tokenizer
        trainer.save_model(args.output_dir)
    if trainer.accelerator.is_main_process:
        logs = [h for h in trainer.state.log_history if "rewards/accuracies" in h]
        ratio = sum(h.get("tree/total_tokens", 0) for h in logs) / max(sum(h.get("tree/unique_tokens", 0)
                                                                           for h in logs), 1)
        print(f"{learning_line([h['rewards/accuracies'] for h in logs], 'rewards/accuracies')}; margin "
              f"{logs[0]['rewards/margins']:.3f} -> {logs[-1]['rewards/margins']:.3f}; "
              f"T/U {ratio if args.mode != 'off' else 1.0:.2f}; processes {trainer.accelerator.num_processes}")
    # every rank closes the process group before the interpreter exits (Accelerate's end of a script):
    # torch 2.15's gloo threads can abort an exit that leaves it open
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
