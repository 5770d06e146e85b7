"""TreeAsyncGRPOTrainer against TRL's async GRPO packing, on recorded sample streams (GPU, bf16).

    python -m trl_tree.bench.trainer --algo async [--size 1.5b] [--shapes grpo,agentic,agentic_long] [--steps 5]

Each stream (``workloads.async_streams``) is fed to the async trainer through a stub rollout worker
(no generation, no server: what is timed is the training step), the same stream for every mode:

* ``stock``: ``tree_mode="off"``, which is TRL 1.16's ``AsyncGRPOTrainer`` bit for bit (tested):
  its trie packing, one packed pass through its ``tree_fa3`` attention. That attention calls the
  FlashAttention-3 kernel TRL fetches from the hub, which cannot be installed here; PyTorch's own
  FlashAttention varlen (FA2, with its backward) stands in for it — the trie packer benchmark's
  stand-in (``trie_packer.install_varlen_stand_in``).
* ``tree`` / ``tree_dfs``: the engine (packed; the depth-first walk), its own attention kernels
  (``tree_attn_backend="auto"``).
* suffixes: ``+compile`` sets ``tree_compile_layers`` (``torch.compile`` of every layer's
  attention module, MLP and norms; with ``stock``: TRL's own step on the same compiled layers);
  ``@BACKEND`` picks ``tree_attn_backend``; ``+fit`` runs at the stream's ``fit_budget`` (over its
  longest sample) instead of its ``token_budget``; ``+rollouts`` takes this package's batcher
  (``tree_batcher="rollouts"``; with dfs, samples over the budget train in rows of their own
  instead of being dropped).

With TRL's batcher (no ``+rollouts``) every mode trains the same micro-batches. Timed: each
``training_step`` (forward, loss, backward; no optimizer), CUDA-synchronised, over the optimizer
steps after the first (one micro-batch each). Reported: tokens/s (the trained samples' tokens,
shared ones counted once per sample, over the timed steps' time), the step time, peak memory,
samples trained and dropped, T/U, and the first step's loss (the same micro-batch in every mode on
TRL's batcher: the modes' losses agree to bf16).
"""

from __future__ import annotations

import copy
import os
import queue
import statistics
import tempfile

import torch

from .common import (
    _timed_steps,
    bench_tokenizer,
    dump,
    environment,
    offline_bench_parser,
    process_device,
    release_memory,
    shaped_name,
)
from .trie_packer import install_varlen_stand_in

MODES = ("tree", "stock", "tree_dfs")
LONG_MODES = ("tree_dfs+rollouts", "stock", "stock+fit", "tree+fit")


class StreamWorker:
    """A rollout worker that hands the trainer a recorded stream (``RolloutWorkerProtocol``)."""

    def __init__(self, samples):
        self.rollout_buffer = queue.Queue()
        for sample in samples:
            self.rollout_buffer.put(sample)
        self.metrics_queue = queue.Queue()

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, version):
        pass

    def check_health(self, stale_after_s):
        raise RuntimeError("the recorded stream ran out: raise the bench's groups or lower --steps")


class NoTransfer:
    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        pass

    def resume(self):
        pass

    def destroy(self):
        pass


def rollout_samples(stream) -> list:
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    return [RolloutSample(prompt=[], completion=[], input_ids=s["input_ids"], completion_mask=s["completion_mask"],
                          old_log_probs=torch.full((len(s["input_ids"]),), -12.0).numpy(),
                          advantage=s["advantage"], model_version=0, group_id=s["group_id"], metrics={"reward": 0.0})
            for s in stream.samples]


def run_mode(mode: str, stream, config, steps: int) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo import async_grpo_trainer

    from ..trainers.asynchronous.async_grpo import TreeAsyncGRPOConfig, TreeAsyncGRPOTrainer

    mode, _, backend = mode.partition("@")  # tree@torch_flash: tree_attn_backend
    base, *suffixes = mode.split("+")
    budget = stream.fit_budget if "fit" in suffixes else stream.token_budget
    if budget is None:
        raise ValueError(f"{mode}: stream {stream.name} has no fit_budget")
    cuda = torch.cuda.is_available()
    leftover = torch.cuda.memory_allocated() if cuda else 0  # what earlier modes left (past release_memory)
    torch.manual_seed(0)
    with process_device():
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16 if cuda else torch.float32,
                                                 attn_implementation="sdpa")  # fp32 on the CPU (its test)
    args = TreeAsyncGRPOConfig(
        output_dir=tempfile.mkdtemp(), max_steps=steps, learning_rate=1e-7, optim="sgd", bf16=cuda, use_cpu=not cuda,
        gradient_checkpointing=True, per_device_train_batch_size=16, gradient_accumulation_steps=1,
        token_budget=budget, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        max_staleness=10**6, tree_mode={"stock": "off", "tree": "packed", "tree_dfs": "dfs"}[base],
        tree_batcher="rollouts" if "rollouts" in suffixes else "trl", tree_compile_layers="compile" in suffixes,
        tree_attn_backend=backend or "auto")
    # what each micro-batch holds, recorded where TRL's collator receives it (in training order)
    held: list[dict] = []
    original = async_grpo_trainer.DataCollatorForRollout.torch_call

    def recording(collator, examples):
        rows = examples[0]
        held.append({"T": sum(len(s["input_ids"]) for row in rows for s in row.samples),
                     "U": sum(len(row.tokens) for row in rows), "samples": sum(len(row.samples) for row in rows)})
        return original(collator, examples)

    async_grpo_trainer.DataCollatorForRollout.torch_call = recording
    try:
        trainer = TreeAsyncGRPOTrainer(model, lambda **kw: [0.0], args=args,
                                       train_dataset=Dataset.from_dict({"prompt": ["p"] * 4}),
                                       processing_class=bench_tokenizer(config.vocab_size),
                                       rollout_worker=StreamWorker(rollout_samples(stream)),
                                       weight_transfer=NoTransfer())
        times = _timed_steps(trainer)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    finally:
        async_grpo_trainer.DataCollatorForRollout.torch_call = original
    logs = [h for h in trainer.state.log_history if "loss" in h]
    timed = held[1 : len(times)]
    seconds = sum(times[1:])
    result = {
        "token_budget": budget, "step_ms": round(statistics.median(times[1:]) * 1e3, 1),
        "tokens_per_s": round(sum(b["T"] for b in timed) / seconds), "unique_per_s": round(
            sum(b["U"] for b in timed) / seconds), "steps_timed": len(times) - 1,
        "samples_trained": sum(b["samples"] for b in held[: len(times)]),
        "dropped": int(sum(h.get("batch/dropped_oversize_total") or 0 for h in logs)),
        "T_over_U": round(sum(b["T"] for b in timed) / max(sum(b["U"] for b in timed), 1), 3),
        "peak_gib": round((torch.cuda.max_memory_allocated() - leftover) / 2**30, 2) if cuda else None,
        "first_loss": round(logs[0]["loss"], 5)}
    del trainer, model
    release_memory()
    return result


def main(argv: list[str] | None = None) -> int:
    from ..data.tiny import shaped_config
    from .workloads import async_streams

    parser = offline_bench_parser("async", MODES, __doc__, modes_help=" (default per stream; the long stream: "
                                  f"{','.join(LONG_MODES)})")
    parser.set_defaults(modes=None)
    parser.add_argument("--groups", type=int, default=None,
                        help="rollout groups per stream (default: --steps + 4, what the longest stream needs with "
                             "one group per step and the dataloader's prefetch)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the async trainer benchmark times a GPU")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    install_varlen_stand_in()
    config = shaped_config(args.size, args.family)
    groups = args.groups or args.steps + 4
    streams = async_streams(config.vocab_size, tuple(args.shapes.split(",")) if args.shapes else None, groups)
    results = {}
    for stream in streams:
        row = {"description": stream.description, "samples": len(stream.samples), "token_budget": stream.token_budget,
               "longest": max(len(s["input_ids"]) for s in stream.samples)}
        modes = args.modes.split(",") if args.modes else (LONG_MODES if stream.fit_budget else MODES)
        for mode in modes:
            try:
                row[mode] = run_mode(mode, stream, config, args.steps)
            except torch.OutOfMemoryError:
                row[mode] = {"error": "out of memory"}
                torch.cuda.empty_cache()
            except Exception as err:  # one mode's failure is recorded, the others still run
                row[mode] = {"error": f"{type(err).__name__}: {err}"[:500]}
                torch.cuda.empty_cache()
            print(stream.name, mode, row[mode], flush=True)
        stock = row.get("stock", {}).get("tokens_per_s")
        for mode in modes:
            if mode != "stock" and stock and "tokens_per_s" in row[mode]:
                row[mode]["speedup"] = round(row[mode]["tokens_per_s"] / stock, 3)
        results[stream.name] = row
    dump(args.out, {"environment": environment(), "workload": {
        "model": f"{shaped_name(args.size, args.family)} policy (random init), bf16, gradient checkpointing, SGD",
        "stock_attention": "TRL 1.16 async GRPO packing; PyTorch FlashAttention varlen (FA2) standing in for the hub "
                           "FA3 kernel (not installable here)",
        "timed": "training_step per optimizer step (one micro-batch; forward, loss, backward; no optimizer), "
                 "CUDA-synchronised, after the first step; tokens/s counts each trained sample's tokens"},
        "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
