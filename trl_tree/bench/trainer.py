"""TreeGRPOTrainer against stock GRPO inside the real Trainer loop (GPU, bf16); TreePPOTrainer likewise.

    python -m trl_tree.bench.trainer [--size 1.5b] [--group 16] [--prompt 2048] [--completion 512]
    python -m trl_tree.bench.trainer --algo ppo --critic separate [--workload W4] [--lora]

Generation is replaced by a ``rollout_func`` returning random rollouts of the given shape (a group
per step, no sampling cost), so what is timed is TRL's training step: the policy forward, TRL's
loss and the backward, through ``TreeGRPOTrainer`` in ``tree_mode`` off (= ``trl.GRPOTrainer``),
packed and dfs. Reports the median ``tree/fwd_bwd_time`` (training step minus generation) over
the steps after the first, and the speed-up over stock.

``--algo ppo``: ``TreePPOTrainer`` with a critic (``--critic`` separate, shared or adapter — the
adapter needs ``--lora``) on the same rollouts; what is timed is the policy+critic step (the
rollout's no-grad passes — old values, GAE — are part of generation, as GRPO's old log-probs are),
and "stock" is the same trainer with ``tree_mode="off"``. ``--workload W4``: the suite's agentic
tree (a 4.8k system prompt, 12 trajectories branching at tool calls) as rollouts of one prompt;
``--lora``: a rank-16 LoRA on every linear layer of the policy. ``--per-device 2 --accumulation 8``
with ``--modes off,packed+micro,packed+window``: a group cut over small micro-batches, the trees
per micro-batch against per accumulation window (``tree_window``).

Several GPUs (DDP): ``accelerate launch --config_file examples/accelerate/multi_gpu.yaml -m
trl_tree.bench.trainer ...`` — each process trains on its own GPU; rank 0 reports, and each mode
records whether the ranks' parameters still agree after training (the gradients were averaged).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import zlib

import numpy as np
import torch

from ..dfs.graphs import unit_graph_stats
from .common import add_grpo_shape_args, add_kernels_arg, dump, environment


def _tokenizer(vocab_size: int):
    """A word-level tokenizer with one entry per model token id, so TRL can decode any rollout."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_grpo_shape_args(parser)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--modes", default="off,packed,dfs",
                        help="tree_mode values; +graphs (e.g. packed+graphs) also sets tree_cuda_graphs=True, "
                             "+buckets tree_cuda_graph_buckets=True, +micro tree_window='micro_step' (trees per "
                             "micro-batch and rank, stock TRL's distribution), +window tree_window='accumulation' "
                             "(trees per accumulation window, placed on ranks by cost); neither: tree_window='auto'; "
                             "@BACKEND (e.g. packed@torch_flash) sets tree_attn_backend (default auto)")
    parser.add_argument("--per-device", type=int, default=None,
                        help="per_device_train_batch_size (default: --group, one group per micro-step); smaller "
                             "values cut a group over micro-steps and, under accelerate launch, over processes")
    parser.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--free-lengths", action="store_true",
                        help="completion lengths uniform in [completion/2, completion] (no two micro-batches share a "
                             "layout: packed+graphs then replays the graphs of padded layouts, attention/buckets.py)")
    parser.add_argument("--algo", default="grpo", choices=("grpo", "ppo"))
    parser.add_argument("--critic", default="separate", choices=("separate", "shared", "adapter"))
    parser.add_argument("--workload", default="group", choices=("group", "W4"),
                        help="group: --group completions of one --prompt; W4: the suite's agentic tree")
    parser.add_argument("--lora", action="store_true", help="train a rank-16 LoRA on all linear layers")
    parser.add_argument("--out", default=None)
    add_kernels_arg(parser)
    args = parser.parse_args(argv)
    if args.algo == "ppo" and args.critic == "adapter" and not args.lora:
        parser.error("--critic adapter trains a second LoRA adapter: add --lora")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from ..tiny import shaped_config
    from ..trainers import TreeGRPOConfig, TreeGRPOTrainer, TreePPOConfig, TreePPOTrainer
    from .workloads import agentic_tree

    config = shaped_config(args.size)
    tok = _tokenizer(config.vocab_size)
    # every process draws its own rollouts: with one seed, the ranks' prompts and completions would be the
    # same tokens, and trees placed over ranks would share them across ranks (a T/U no real run has)
    rng = np.random.default_rng([0, int(os.environ.get("RANK", 0))] if "RANK" in os.environ else 0)
    if args.workload == "W4":
        trajectories = agentic_tree(config.vocab_size)
        system = 4800
        args.group, args.prompt = len(trajectories), system
        args.completion = max(len(t) for t in trajectories) - system

    def rollout(prompts, trainer):
        """One random prompt per distinct prompt string, random completions (no generation); W4: the
        agentic tree's trajectories, the system prompt as prompt, each group's i-th row the i-th leaf."""
        cache: dict[str, list[int]] = {}
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        if args.workload == "W4":
            for i, _ in enumerate(prompts):
                path = trajectories[i % len(trajectories)]
                out["prompt_ids"].append(path[:system])
                out["completion_ids"].append(path[system:])
                out["logprobs"].append([0.0] * (len(path) - system))
            return out
        for p in prompts:
            ids = cache.setdefault(p, rng.integers(2, config.vocab_size, args.prompt).tolist())
            out["prompt_ids"].append(ids)
            n = int(rng.integers(args.completion // 2, args.completion + 1)) if args.free_lengths else args.completion
            out["completion_ids"].append(rng.integers(2, config.vocab_size, n).tolist())
            out["logprobs"].append([0.0] * n)
        return out

    def reward(completions, **kwargs):
        return [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]

    results = {}
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))  # accelerate launch: one GPU per process
    torch.cuda.set_device(device)
    for run in args.modes.split(","):
        # a mode named twice runs twice (its later results under "MODE#2", ...)
        mode = run if run not in results else f"{run}#{sum(1 for k in results if k.partition('#')[0] == run) + 1}"
        torch.manual_seed(0)
        with device:  # initialised on the GPU: a 7B random init on the CPU takes minutes
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        config_cls, trainer_cls = (TreePPOConfig, TreePPOTrainer) if args.algo == "ppo" else \
            (TreeGRPOConfig, TreeGRPOTrainer)
        ppo = dict(critic=args.critic, kl_coef=0.0) if args.algo == "ppo" else {}
        extra = {}
        if args.lora:
            from peft import LoraConfig

            extra["peft_config"] = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
        flags, _, backend = run.partition("@")
        window = "micro_step" if "+micro" in flags else "accumulation" if "+window" in flags else "auto"
        cfg = config_cls(
            output_dir=tempfile.mkdtemp(), tree_mode=flags.split("+")[0], tree_window=window, **ppo,
            tree_attn_backend=backend or "auto",
            tree_cuda_graphs="+graphs" in flags, tree_cuda_graph_buckets="+buckets" in flags, max_steps=args.steps,
            per_device_train_batch_size=args.per_device or args.group,
            gradient_accumulation_steps=args.accumulation, num_generations=args.group, max_completion_length=args.completion, learning_rate=1e-6, beta=0.0,
            use_liger_kernel=args.kernels == "liger", tree_compile_layers=args.kernels == "compiled", bf16=True,
            logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        )
        trainer = trainer_cls(model=model, reward_funcs=reward, args=cfg, processing_class=tok,
                              train_dataset=Dataset.from_dict({"prompt": [f"p{i}" for i in range(64)]}),
                              rollout_func=rollout, **extra)
        torch.cuda.reset_peak_memory_stats()
        trainer.train()
        logs = [h for h in trainer.state.log_history if "tree/fwd_bwd_time" in h]
        times = [h["tree/fwd_bwd_time"] for h in logs][1:]
        results[mode] = {"fwd_bwd_ms": round(statistics.median(times) * 1e3, 1), "steps_timed": len(times),
                         # graphs captured along the run (free lengths: a bucket at its second sighting) cost
                         # the early steps; the later half shows the step once they are made
                         "fwd_bwd_ms_later_half": round(statistics.median(times[len(times) // 2 :]) * 1e3, 1),
                         "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                         "T_over_U": round(logs[-1].get("tree/dedup_ratio", 1.0), 3)}
        stats = unit_graph_stats(trainer.accelerator.unwrap_model(trainer.model))
        if stats is not None:  # the walk's units: replayed or eager (free lengths: padded to buckets)
            results[mode]["unit_graphs"] = stats
        for key in ("tree/rank_imbalance", "tree/rank_imbalance_stock"):  # estimated max/mean cost over ranks
            if key in logs[-1]:
                results[mode][key.split("/")[1]] = round(logs[-1][key], 4)
        processes = trainer.accelerator.num_processes
        if processes > 1:  # each rank's own step time: the slowest one sets the pace
            from accelerate.utils import gather_object

            results[mode]["rank_fwd_bwd_ms"] = [round(t * 1e3, 1) for t in
                                                gather_object([statistics.median(times)])]
        if processes > 1:  # DDP: every rank must end with the same parameters
            fingerprint = torch.stack([p.detach().float().norm() for p in trainer.model.parameters()]).sum()
            ranks = trainer.accelerator.gather(fingerprint.reshape(1))
            results[mode] |= {"processes": processes, "ranks_agree": bool((ranks == ranks[0]).all())}
        if trainer.accelerator.is_main_process:
            print(mode, results[mode], flush=True)
        del trainer, model
        torch.cuda.empty_cache()
    if "off" in results:
        for mode, r in results.items():
            r["speedup_over_stock"] = round(results["off"]["fwd_bwd_ms"] / r["fwd_bwd_ms"], 3)
    if int(os.environ.get("RANK", 0)) != 0:
        return 0
    print(results)
    dump(args.out, {"environment": environment(args.kernels), "workload": {
        "model": f"Qwen2.5-{args.size}-shaped (random init), bf16, gradient checkpointing (TRL default)"
                 f"{', LoRA r=16 on all linear layers' if args.lora else ''}",
        "algo": args.algo, **({"critic": args.critic} if args.algo == "ppo" else {}), "shape": args.workload,
        "group": args.group, "prompt": args.prompt, "completion": args.completion,
        "per_device_train_batch_size": args.per_device or args.group, "gradient_accumulation_steps": args.accumulation,
        "completion_lengths": "uniform in [completion/2, completion]" if args.free_lengths else "fixed"},
        "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
