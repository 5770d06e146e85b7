"""TreeSFTTrainer against stock SFTTrainer inside the real Trainer loop (GPU, bf16).

    python -m trl_tree.bench.trainer --algo sft [--size 1.5b] [--shapes turns_2x8,branches] [--steps 5]

Each SFT data shape (``workloads.sft_shapes``) is one micro-batch of samples, trained as:
``stock`` (SFTTrainer, a padded batch of the samples, sdpa), ``stock_packed`` (SFTTrainer with
``packing=True``, bfd: the samples packed padding-free into one row, attention through the best
kernel transformers accepts here — FlashAttention-4 when ``flash_attn.cute`` imports, else sdpa on
the packed row — recorded in the results as ``attention``), and ``tree`` / ``tree_dfs``
(TreeSFTTrainer, packed and dfs; the model loads with sdpa, the tree runs its own attention kernels,
``tree_attn_backend="auto"`` or ``tree@BACKEND``). What is timed is the training step without the
optimizer (``Trainer.training_step``: forward, loss and backward of the micro-batch,
CUDA-synchronised), median over the steps after the first;
gradient checkpointing on (TRL's default), SGD so that the optimizer's state does not limit the
model size. The FLOP limit is the cost model's (``inspection.inspect``): stock's FLOPs on the real
tokens (packing's, with no padding) over the tree's.
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

#: in this order: the tree first, so its step is timed before stock's large padded batches have
#: grown the caching allocator (measured once: one shape's tree step 1.5x slower when run after them)
MODES = ("tree", "stock_packed", "stock", "tree_dfs")


def _attention_for_packing() -> str:
    """FlashAttention-4 where transformers takes it here, else sdpa (the packed row's block mask)."""
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:
        return "sdpa"
    return "flash_attention_4"


def run_mode(mode: str, shape, config, steps: int) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from ..trainers import TreeSFTConfig, TreeSFTTrainer

    mode, _, backend = mode.partition("@")  # tree@torch_flash: tree_attn_backend
    packed = mode == "stock_packed"
    attention = _attention_for_packing() if packed else "sdpa"
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()  # the CPU runs it too (its test, on a tiny config)
    with process_device(), built_whole():
        try:
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16,
                                                     attn_implementation=attention)
        except Exception as err:  # transformers here does not take it: the packed row through sdpa
            print(f"{mode}: attn_implementation={attention!r} refused ({type(err).__name__}: {err}); sdpa")
            attention = "sdpa"
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16,
                                                     attn_implementation=attention)
    total = sum(len(s) for s in shape.input_ids)
    data = Dataset.from_dict({"input_ids": shape.input_ids, "labels": shape.labels})
    batch = shape.batch_size or len(shape.input_ids)
    if shape.batch_size is not None:  # a dataset over epochs: two of them (the second reuses what the first built)
        steps = 2 * -(-len(shape.input_ids) // batch)
    common = dict(output_dir=tempfile.mkdtemp(), max_steps=steps, learning_rate=1e-7, optim="sgd", bf16=cuda,
                  use_cpu=not cuda,
                  gradient_checkpointing=True, logging_steps=1, report_to="none", save_strategy="no",
                  disable_tqdm=True, max_length=total if packed else None, packing=packed,
                  per_device_train_batch_size=1 if packed else batch)
    if packed and shape.batch_size is not None:
        common["max_length"] = max(sum(sorted(len(x) for x in shape.input_ids)[-batch:]), 1)
    if mode.startswith("tree"):
        args = TreeSFTConfig(**common, tree_mode="dfs" if mode == "tree_dfs" else "packed",
                             tree_attn_backend=backend or "auto",
                             tree_shuffle="groups" if shape.batch_size is not None else "rows")
        trainer = TreeSFTTrainer(model=model, args=args, train_dataset=data, processing_class=bench_tokenizer(
            config.vocab_size))
    else:
        trainer = SFTTrainer(model=model, args=SFTConfig(**common), train_dataset=data,
                             processing_class=bench_tokenizer(config.vocab_size))
    result, logs = train_and_time(trainer, epochs=2 if shape.batch_size is not None else 1)
    result["attention"] = attention
    if mode.startswith("tree"):
        result["padded_calls"] = logs[-1]["tree/padded_calls"]
    if packed:
        result["rows"] = len(trainer.train_dataset)
    del trainer, model
    release_memory()
    return result


def main(argv: list[str] | None = None) -> int:
    from ..inspection import inspect
    from ..data.tiny import shaped_config
    from .workloads import sft_shapes

    parser = offline_bench_parser("sft", MODES, __doc__, "; tree@BACKEND sets tree_attn_backend")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the SFT trainer benchmark times a GPU")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    config = shaped_config(args.size, args.family)
    shapes = sft_shapes(config.vocab_size, tuple(args.shapes.split(",")) if args.shapes else None)
    results = {}
    for shape in shapes:
        report, _ = inspect(shape.input_ids, shape.score_from, config)
        row = {"description": shape.description, "samples": len(shape.input_ids), "T": report.total_tokens,
               "U": report.unique_tokens, "T_over_U": round(report.dedup_ratio, 3),
               "flop_limit": round(report.flop_ratio, 3)}
        for mode in args.modes.split(","):
            try:
                row[mode] = run_mode(mode, shape, config, args.steps)
            except torch.OutOfMemoryError:
                row[mode] = {"error": "out of memory"}
                torch.cuda.empty_cache()
            print(shape.name, mode, row[mode], flush=True)
        tree = row.get("tree", {}).get("step_ms")
        for base in ("stock", "stock_packed"):
            ms = row.get(base, {}).get("step_ms")
            if tree and ms:
                row[f"speedup_over_{base}"] = round(ms / tree, 3)
                row[f"speedup_over_{base}_per_limit"] = round(ms / tree / report.flop_ratio, 3)
        results[shape.name] = row
    print(results)
    dump(args.out, {"environment": environment(), "workload": {
        "model": f"{shaped_name(args.size, args.family)} (random init), bf16, gradient checkpointing (TRL's "
                 "default), SGD",
        "timed": "Trainer.training_step (forward, loss, backward; no optimizer), median after the first step",
        "micro_batch": "all samples of a shape (stock_packed: one bfd-packed row of them)"}, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
