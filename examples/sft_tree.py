"""Agentic SFT with TreeSFTTrainer: TRL's script with one import and one config class changed.

    python examples/sft_tree.py                           # tiny built-in model, generated agent data, CPU or GPU
    python examples/sft_tree.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset my_conversations.jsonl
    accelerate launch --config_file examples/accelerate/cpu_2proc.yaml examples/sft_tree.py

Each conversation (a system prompt, a tool, turns that call the tool and answer with what it
returned) becomes one sample per assistant turn with its whole history (``trl_tree.data.sft_data.
expand_turns``), and ``tree_shuffle="groups"`` puts the turns of one conversation in one
micro-batch, so each history is computed once. ``--dataset`` reads a local JSONL or Parquet file
with a ``messages`` column (expanded the same way; ``--no-expand`` trains the rows as they are) or
any other dataset SFTTrainer takes. ``--shuffle rows`` keeps TRL's own order: the update is then
stock SFTTrainer's, bit for bit, and the tree shares what happens to meet.
"""

from __future__ import annotations

import argparse
import os
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint path or hub id (default: tiny built-in model)")
    parser.add_argument("--dataset", default=None, help="local .jsonl/.json/.parquet file (default: generated)")
    parser.add_argument("--no-expand", action="store_true", help="train conversations as they are, not per turn")
    parser.add_argument("--mode", default="packed", choices=("packed", "dfs", "off"))
    parser.add_argument("--shuffle", default="groups", choices=("groups", "rows"), help="tree_shuffle")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=128, help="generated conversations")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--token-budget", type=int, default=None, help="tree_token_budget")
    parser.add_argument("--output-dir", default=None, help="save the trained model (or adapter) here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="sft_tree_", ignore_cleanup_errors=True) as workdir:
        try:
            _train(args, workdir)
        except ValueError as e:  # bad data (trl_tree.data.data_files.DataError) or a refusal: one line, no traceback
            parser.exit(2, f"{parser.prog}: {e}\n")


def _load(args):
    from datasets import Dataset

    from trl_tree.data.data_files import DataError, load_local_dataset
    from trl_tree.data.sft_data import expand_turns_dataset
    from trl_tree.data.toy import toy_conversations

    if args.dataset is None:
        data = Dataset.from_list(toy_conversations(args.conversations))
    else:  # datasets' loader, with errors that name the file's bad line
        data = load_local_dataset(args.dataset)
    if "messages" in data.column_names and not args.no_expand:
        try:
            data = expand_turns_dataset(data)
        except ValueError as e:
            raise DataError(f"{args.dataset or 'the generated conversations'}, {e}") from None
    return data


def _train(args, workdir: str) -> None:
    # imported after the arguments are parsed, so that --help answers at once
    import torch

    from trl_tree import TreeSFTConfig, TreeSFTTrainer
    from trl_tree.data.toy import build_tiny_policy, learning_line

    # every process builds the same tiny model from the same seed, so no file has to be shared
    model = args.model or build_tiny_policy(os.path.join(workdir, "policy"), chat=True)
    config = TreeSFTConfig(
        output_dir=args.output_dir or os.path.join(workdir, "out"),
        tree_mode=args.mode,
        tree_shuffle=args.shuffle,
        tree_token_budget=args.token_budget,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        max_length=None if args.model is None else 4096,
        gradient_checkpointing=args.model is not None,  # the tiny model needs no recompute
        bf16=args.model is not None,  # the tiny model trains in fp32
        use_cpu=not torch.cuda.is_available(),  # CPU processes then join one gloo process group
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    trainer = TreeSFTTrainer(model=model, args=config, train_dataset=_load(args))
    trainer.train()
    if args.output_dir:  # the trained weights (an adapter under PEFT), with the tokenizer
        trainer.save_model(args.output_dir)
    if trainer.accelerator.is_main_process:
        logs = [h for h in trainer.state.log_history if "loss" in h]
        ratio = sum(h.get("tree/total_tokens", 0) for h in logs) / max(sum(h.get("tree/unique_tokens", 0)
                                                                           for h in logs), 1)
        print(f"{learning_line([h['loss'] for h in logs], 'loss')}; token accuracy "
              f"{logs[0]['mean_token_accuracy']:.2f} -> {logs[-1]['mean_token_accuracy']:.2f}; "
              f"T/U {ratio if args.mode != 'off' else 1.0:.2f}; processes {trainer.accelerator.num_processes}")
    # every rank closes the process group before the interpreter exits (Accelerate's end of a script):
    # torch 2.15's gloo threads can abort an exit that leaves it open
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
