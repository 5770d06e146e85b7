"""TreeDPOTrainer against stock DPOTrainer inside the real Trainer loop (GPU, bf16).

    python -m trl_tree.bench.trainer --algo dpo [--size 1.5b] [--shapes one_pair,four_pairs,short_prompt]

Each DPO shape (``workloads.dpo_shapes``) is one micro-batch of pairs (``four_pairs_dataset``: a
dataset of four micro-batches, trained in TRL's order and with ``tree_shuffle="groups"``, mode
``tree+groups``), trained by stock ``DPOTrainer`` (its padded batch of chosen and rejected rows,
sdpa) and by ``TreeDPOTrainer`` (packed, dfs; ``+compile``: compiled layers, ``stock+compile``
TRL's step on them; ``+graphs``: the policy's packed call replayed from CUDA graphs): the training
step without the optimizer (``Trainer.training_step``: the reference's forward, the policy's
forward, loss and backward), CUDA-synchronised, median after the first step; gradient
checkpointing on, SGD. The FLOP limit counts the policy's forward and backward and the
reference's forward (``cost_model.step_flops``), stock's real tokens over the tree's.
"""

from __future__ import annotations

import copy
import os
import tempfile

import torch

from .common import (
    bench_tokenizer,
    built_whole,
    dump,
    environment,
    offline_bench_parser,
    process_device,
    release_memory,
    shaped_name,
    train_and_time,
)

MODES = ("tree", "stock", "tree_dfs")
#: shapes that are a dataset of several micro-batches (pairs per micro-batch), and their modes: the
#: tree in TRL's order and with ``tree_shuffle="groups"``
MICRO_BATCH = {"four_pairs_dataset": 8}
DATASET_MODES = ("tree", "tree+groups", "stock")


def flop_limit(rows: list[dict], config) -> tuple[float, int, int]:
    """``(limit, T, U)``: stock's FLOPs over the tree's for the policy step plus the reference forward."""
    from ..engine.cost_model import StepCost, step_flops
    from ..engine.forest import PrefixForest

    seqs = [r["prompt_ids"] + r[k] for k in ("chosen_ids", "rejected_ids") for r in rows]
    first = [len(r["prompt_ids"]) for _ in ("chosen_ids", "rejected_ids") for r in rows]
    forest = PrefixForest.from_sequences(seqs)
    plan = forest.scoring_plan(first)
    lengths = [len(s) for s in seqs]
    scored = sum(n - f for n, f in zip(lengths, first))
    tree = StepCost(forest.num_unique_tokens, plan.num_predictions, forest.sum_visible_keys())
    stock = StepCost(sum(lengths), scored, sum(n * (n + 1) // 2 for n in lengths))
    # the reference's forward is a third of a step without recompute (forward only)
    total = [step_flops(c, config, True) + step_flops(c, config, False) / 3 for c in (stock, tree)]
    return total[0] / total[1], forest.num_tokens, forest.num_unique_tokens


def run_mode(mode: str, rows: list[dict], config, steps: int, micro_batch: int | None = None) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from ..trainers import TreeDPOConfig, TreeDPOTrainer

    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    with process_device(), built_whole():
        model, ref = (AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16,
                                                       attn_implementation="sdpa") for _ in range(2))
    common = dict(output_dir=tempfile.mkdtemp(), max_steps=steps, learning_rate=1e-7, optim="sgd", bf16=cuda,
                  use_cpu=not cuda, gradient_checkpointing=True, logging_steps=1, report_to="none",
                  save_strategy="no", disable_tqdm=True, max_length=None,
                  per_device_train_batch_size=micro_batch or len(rows))
    # DPOTrainer tokenises its dataset: the ids as words of the bench tokenizer (one word per id), each
    # text ending in a space (TRL joins prompt and answer, and answer and EOS, without one)
    data = Dataset.from_list([{key: "".join(f"t{i} " for i in r[f"{key}_ids"]) for key in ("prompt", "chosen",
                                                                                          "rejected")} for r in rows])
    # tree+groups: tree_shuffle="groups"; +compile: compiled layers (stock+compile: TRL's step on them);
    # tree+graphs: tree_cuda_graphs
    mode, _, option = mode.partition("+")
    if mode.startswith("tree") or option == "compile":
        tree_mode = "off" if mode == "stock" else "dfs" if mode == "tree_dfs" else "packed"
        args = TreeDPOConfig(**common, tree_mode=tree_mode, tree_shuffle="groups" if option == "groups" else "rows",
                             tree_compile_layers=option == "compile", tree_cuda_graphs=option == "graphs")
        trainer = TreeDPOTrainer(model=model, ref_model=ref, args=args, train_dataset=data,
                                 processing_class=bench_tokenizer(config.vocab_size))
    else:
        trainer = DPOTrainer(model=model, ref_model=ref, args=DPOConfig(**common), train_dataset=data,
                             processing_class=bench_tokenizer(config.vocab_size))
    _check_tokenised(trainer.train_dataset, rows, trainer.processing_class.eos_token_id)
    result, logs = train_and_time(trainer)
    result["margins"] = round(logs[-1]["rewards/margins"], 4)
    del trainer, model, ref
    release_memory()
    return result


def _check_tokenised(dataset, rows: list[dict], eos: int) -> None:
    """The pairs DPOTrainer tokenised are the shape's (answers ending in EOS): what is timed is what
    the table describes."""
    for got, want in zip(dataset, rows):
        if (got["prompt_ids"] != want["prompt_ids"] or got["chosen_ids"] != want["chosen_ids"] + [eos]
                or got["rejected_ids"] != want["rejected_ids"] + [eos]):
            raise RuntimeError("DPOTrainer tokenised the bench's pairs into other ids than the shape's")


def main(argv: list[str] | None = None) -> int:
    from ..data.tiny import shaped_config
    from .workloads import dpo_shapes

    parser = offline_bench_parser("dpo", MODES, __doc__, modes_help=f" (default; a dataset shape: {DATASET_MODES})")
    parser.set_defaults(modes=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the DPO trainer benchmark times a GPU")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    config = shaped_config(args.size, args.family)
    shapes = dpo_shapes(config.vocab_size, tuple(args.shapes.split(",")) if args.shapes else None)
    results = {}
    for name, (description, rows) in shapes.items():
        micro_batch = MICRO_BATCH.get(name)
        if micro_batch is None:
            limit, total, unique = flop_limit(rows, config)
            row = {"description": description, "pairs": len(rows), "T": total, "U": unique,
                   "T_over_U": round(total / unique, 3), "flop_limit": round(limit, 3)}
        else:  # the sharing depends on which pairs meet: T/U as the tree logged it, per mode
            limit, row = None, {"description": description, "pairs": len(rows), "micro_batch": micro_batch}
        modes = args.modes.split(",") if args.modes else (DATASET_MODES if micro_batch else MODES)
        for mode in modes:
            try:
                row[mode] = run_mode(mode, rows, config, args.steps, micro_batch)
            except torch.OutOfMemoryError:
                row[mode] = {"error": "out of memory"}
                torch.cuda.empty_cache()
            print(name, mode, row[mode], flush=True)
        stock = row.get("stock", {}).get("step_ms")
        for mode in modes:
            tree = row[mode].get("step_ms") if mode != "stock" else None
            if tree and stock and mode == "tree" and limit:
                row["speedup"] = round(stock / tree, 3)
                row["speedup_per_limit"] = round(stock / tree / limit, 3)
            elif tree and stock:
                row[mode]["speedup"] = round(stock / tree, 3)
                if limit:
                    row[mode]["speedup_per_limit"] = round(stock / tree / limit, 3)
        compiled = row.get("tree+compile", {}).get("step_ms"), row.get("stock+compile", {}).get("step_ms")
        if all(compiled) and limit:  # compiled layers on both sides
            row["tree+compile"]["speedup"] = round(compiled[1] / compiled[0], 3)
            row["tree+compile"]["speedup_per_limit"] = round(compiled[1] / compiled[0] / limit, 3)
        results[name] = row
    print(results)
    dump(args.out, {"environment": environment(), "workload": {
        "model": f"{shaped_name(args.size, args.family)} policy and reference (random init), bf16, gradient "
                 "checkpointing, SGD",
        "timed": "Trainer.training_step (reference forward, policy forward, loss, backward; no optimizer), median "
                 "after the first step", "micro_batch": "all pairs of a shape"}, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
