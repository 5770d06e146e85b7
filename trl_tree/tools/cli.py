"""``trl-tree``: one command for what a user runs around training with the tree.

    trl-tree demo [--algo grpo|rloo|ppo]   the README's main job: a tiny model on the CPU, tree vs stock
    trl-tree inspect FILE [--tokenizer DIR] [--model 1.5b|config.json] [--rows-per-forest N] [--gpus N] [--png OUT]
    trl-tree bench [suite options]          the GPU benchmark suite (W1–W7 x model sizes)
    trl-tree check [options]                the GPU exactness check of every attention path

Nothing heavy (torch, TRL) is imported before a subcommand runs, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import sys

SUBCOMMANDS = {
    "demo": "train a tiny built-in model on the CPU with the tree and with stock TRL, and print both step times",
    "inspect": "read your rollouts (token ids, texts or chats) and predict the tree's T/U, speed-up ceiling and "
               "memory for a model, before training",
    "bench": "run the GPU benchmark suite (tree vs TRL on the suite's workloads; needs a GPU)",
    "check": "check the tree's log-probs and gradients against the untreed model on the GPU, every attention path",
}


def _inspect(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trl-tree inspect", description=SUBCOMMANDS["inspect"] + ".", epilog=(
        "Columns read (the first set present): prompt_ids+completion_ids, input_ids (token ids); "
        "prompt+completion, messages (chat), text (with --tokenizer). Rows sharing a prompt share its nodes. "
        "Preference pairs (prompt_ids+chosen_ids+rejected_ids, prompt+chosen+rejected, chosen+rejected: DPO's "
        "formats) are reported as TreeDPOTrainer trains them: micro-batches of pairs, in TRL's order and grouped."))
    parser.add_argument("file", help="a .jsonl/.json/.parquet file or a datasets directory (save_to_disk)")
    parser.add_argument("--tokenizer", default=None,
                        help="for text or chat columns: a local tokenizer directory (e.g. saved by a tokenizer's "
                        "save_pretrained, or a model directory), or 'tiny' for the package's character-level chat "
                        "tokenizer (offline; it counts characters, not a real model's tokens)")
    parser.add_argument("--model", default="1.5b",
                        help="the model the prediction is for: 0.5b, 1.5b, 7b (Qwen2.5 shapes), or what "
                        "from_pretrained takes (a config.json, a model directory, a hub id: cache first)")
    parser.add_argument("--rows-per-forest", type=int, default=None,
                        help="rows per forest, like a micro-batch (default: all rows in one forest)")
    parser.add_argument("--limit", type=int, default=None, help="read only the first N rows")
    parser.add_argument("--sft", action="store_true",
                        help="the rows are SFT samples: micro-batches of --rows-per-forest (default 8) in TRL's order "
                        "and with TreeSFTTrainer's sampler (tree_shuffle='groups'), T/U per micro-batch")
    parser.add_argument("--per-turn", action="store_true",
                        help="with --sft: a 'messages' row becomes one sample per assistant turn (sft_data.expand_turns)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="also say how tree_gather='auto' would gather the model under FSDP2 over this many GPUs "
                        "(whole through a step's calls, or block by block inside each call)")
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="with --gpus: GiB per GPU (default 80)")
    parser.add_argument("--png", default=None, help="write a picture of the first forest's shape here")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)

    import dataclasses
    import json

    from ..data.data_files import DataError
    from ..inspection import (draw_forest, gathering_lines, inspect, load_rows, load_tokenizer, pairs_from_rows,
                              sequences_from_rows, sharded_gathering)

    if args.per_turn and not args.sft:
        parser.error("--per-turn expands SFT conversations: add --sft")
    try:
        config, name = _model_config(args.model)
        rows = load_rows(args.file)[: args.limit]
        if not rows:
            raise DataError(f"{args.file} has no rows")
        if args.per_turn:
            rows = _per_turn(rows, args.file)
        tokenizer = load_tokenizer(args.tokenizer)
        pairs = pairs_from_rows(rows, tokenizer)
        if pairs is not None:
            return _inspect_sft(args, *pairs, config, name, pairs=True)
        seqs, score_from = sequences_from_rows(rows, tokenizer)
        if args.sft:
            return _inspect_sft(args, seqs, score_from, config, name)
        report, forests = inspect(seqs, score_from, config, name, args.rows_per_forest, progress=not args.json)
        chosen = sharded_gathering(config, args.gpus, args.gpu_memory) if args.gpus is not None else None
        if args.png:
            draw_forest(forests[0], args.png)
    except DataError as e:
        print(f"trl-tree inspect: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**dataclasses.asdict(report), "dedup_ratio": report.dedup_ratio,
                          **({"gathering": chosen} if chosen else {})}, indent=1))
    else:
        print("\n".join(report.lines() + (gathering_lines(chosen) if chosen else [])))
        if args.png:
            print(f"forest picture: {args.png}")
    return 0


def _per_turn(rows: list[dict], path: str) -> list[dict]:
    """``--per-turn``: each conversation as one sample per assistant turn (``sft_data.expand_turns``)."""
    from ..data.data_files import DataError
    from ..data.sft_data import expand_turns

    samples = []
    for i, row in enumerate(rows):
        try:
            samples += expand_turns(row)
        except ValueError as e:
            raise DataError(f"{path}, row {i}: {e}") from e
    if not samples:
        raise DataError(f"none of the {len(rows)} rows of {path} has an assistant turn after its first message: "
                        "--per-turn makes one sample per assistant turn, so there is nothing to train")
    return samples


def _inspect_sft(args, seqs, score_from, config, name, pairs: bool = False) -> int:
    import json
    import statistics

    from ..inspection import inspect_sft

    batch = args.rows_per_forest or 8
    stock, grouped, ratios = inspect_sft(seqs, score_from, config, name, batch, pairs=pairs)
    if args.json:
        print(json.dumps({"trl_order": {**vars(stock), "dedup_ratio": stock.dedup_ratio},
                          "groups": {**vars(grouped), "dedup_ratio": grouped.dedup_ratio},
                          "groups_micro_batch_T_over_U": ratios}, indent=1))
        return 0
    print(f"{len(seqs) // 2} preference pairs (chosen and rejected share their prompt) in micro-batches of {batch} "
          "pairs" if pairs else f"{len(seqs)} SFT samples in micro-batches of {batch}")
    print(f"TRL's order (tree_shuffle='rows'): T/U {stock.dedup_ratio:.2f}, speed-up ceiling "
          f"{stock.flop_ratio:.2f}x")
    print(f"tree_shuffle='groups': T/U {grouped.dedup_ratio:.2f}, speed-up ceiling {grouped.flop_ratio:.2f}x")
    print(f"  T/U per micro-batch: median {statistics.median(ratios):.2f}, min {min(ratios):.2f}, "
          f"max {max(ratios):.2f}; first: {', '.join(f'{r:.2f}' for r in ratios[:12])}")
    print("with groups, " + "\n".join(grouped.lines()[1:]))
    return 0


def _model_config(spec: str):
    """A model config from a size name, or from whatever ``AutoConfig.from_pretrained`` takes: a
    config.json, a model directory, a hub id (from the local cache first; the hub only where it
    is reachable and ``HF_HUB_OFFLINE`` is not set). A failure is one plain line."""
    import os

    from ..data.data_files import DataError
    from ..data.tiny import SHAPED_SIZES, shaped_config, shaped_family

    if spec.lower() in SHAPED_SIZES:
        family = {"qwen2": "Qwen2.5", "qwen3_moe": "Qwen3"}[shaped_family(spec.lower())]
        return shaped_config(spec.lower()), f"a {family}-{spec.upper()}-shaped model"
    from transformers import AutoConfig

    if os.path.isfile(spec):  # a config.json itself
        try:
            return AutoConfig.from_pretrained(spec).get_text_config(), os.path.basename(os.path.dirname(spec)) or spec
        except Exception as e:
            raise DataError(f"--model: cannot read {spec} as a transformers config ({type(e).__name__})") from e
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    for local_only in (True,) if offline or os.path.isdir(spec) else (True, False):
        try:
            return AutoConfig.from_pretrained(spec, local_files_only=local_only).get_text_config(), spec
        except Exception as e:  # not here (or not in the cache): the hub next, where allowed
            why = e
    where = "a directory here" if os.path.isdir(spec) else \
        "a size (0.5b, 1.5b, 7b), a config.json, a model directory, nor a cached hub id" + \
        ("" if offline else " (and the hub did not answer)")
    raise DataError(f"--model: {spec!r} is neither {where}" if not os.path.isdir(spec) else
                       f"--model: {spec!r} is {where} without a readable config.json ({type(why).__name__})")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="trl-tree", description="Prefix-tree training for TRL: tools around the trainers.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="subcommands:\n" + "\n".join(f"  {k:8s} {v}" for k, v in SUBCOMMANDS.items())
        + "\n\n'trl-tree SUBCOMMAND --help' explains each.",
    )
    parser.add_argument("subcommand", choices=list(SUBCOMMANDS), help="what to run")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args = parser.parse_args(argv[:1])  # the subcommand; the rest is its own
    rest = argv[1:]
    if args.subcommand == "demo":
        from .demo import main as demo

        return demo(rest, prog="trl-tree demo")
    if args.subcommand == "inspect":
        return _inspect(rest)
    if args.subcommand == "bench":
        from ..bench.suite import main as suite

        return suite(rest, prog="trl-tree bench")
    from ..bench.check_gpu import main as check

    return check(rest, prog="trl-tree check")


if __name__ == "__main__":
    raise SystemExit(main())
