"""TreeGRPOTrainer against stock GRPO inside the real Trainer loop (GPU, bf16); TreePPOTrainer likewise.

    python -m trl_tree.bench.trainer [--size 1.5b] [--group 16] [--prompt 2048] [--completion 512]
    python -m trl_tree.bench.trainer --algo ppo --critic separate [--workload W4] [--lora]
    python -m trl_tree.bench.trainer --algo sft [--size 1.5b] [--shapes turns_2x8,...]   (bench/sft.py)
    python -m trl_tree.bench.trainer --algo dpo [--size 1.5b] [--shapes one_pair,...]    (bench/dpo.py)
    python -m trl_tree.bench.trainer --algo async [--size 1.5b] [--shapes grpo,...]      (bench/async_grpo.py)

Generation is replaced by a ``rollout_func`` returning random rollouts of the given shape (a group
per step, no sampling cost), so what is timed is TRL's training step: the policy forward, TRL's
loss and the backward, through ``TreeGRPOTrainer`` in ``tree_mode`` off (= ``trl.GRPOTrainer``),
packed and dfs. Reports the median ``tree/fwd_bwd_time`` (training step minus generation) over
the steps after the first, and the speed-up over stock.

``--algo ppo``: ``TreePPOTrainer`` with a critic (``--critic`` separate, shared or adapter — the
adapter needs ``--lora``) on the same rollouts; what is timed is the policy+critic step (the
rollout's no-grad passes — old values, GAE — are part of generation, as GRPO's old log-probs are),
and "stock" is the same trainer with ``tree_mode="off"``. ``--workload W4``: the suite's agentic
tree (a 4.8k system prompt, 12 trajectories branching at tool calls) per prompt, every prompt's
tree sharing the system prompt only (one agent on many tasks);
``--lora``: a rank-16 LoRA on every linear layer of the policy. ``--per-device 2 --accumulation 8``
with ``--modes off,packed+micro,packed+window``: a group cut over small micro-batches, the trees
per micro-batch against per accumulation window (``tree_window``).

Several GPUs (DDP): ``accelerate launch --config_file examples/accelerate/multi_gpu.yaml -m
trl_tree.bench.trainer ...`` — each process trains on its own GPU; rank 0 reports, and each mode
records whether the ranks' parameters still agree after training (the gradients were averaged).

``--update-check DIR``: exactness across processes instead of speed. One process first, with modes
``off+fp32,off,...`` (the fp32 untreed reference, then stock TRL in bf16, the rule's yardstick),
then the same command under ``accelerate launch`` with more processes and half the accumulation
(the same global batch): every mode's one-step update is compared with the one-process fp32
reference (DESIGN.md's bf16 rule: the tree's error at most 1.5x stock's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import zlib
from contextlib import contextmanager

import numpy as np
import torch
from transformers import TrainerCallback

from ..engine.dfs.graphs import unit_graph_stats
from .common import (
    add_grpo_shape_args,
    allreduce_bandwidth,
    add_kernels_arg,
    bench_tokenizer,
    build_random_model,
    dump,
    rank0_builds,
    environment,
    release_memory,
    shaped_name,
)

#: what ``--update-check`` runs and compares (recorded with its results)
PRECISION_CHECKED = "fp32 weights under bf16 autocast (mixed precision; +fp32 modes: fp32 throughout)"
UPDATE_CHECKED = ("one optimizer step, no clipping; update_rel_err = ||g - g_ref|| / ||g_ref|| over all parameters, "
                  "g the gradient the optimizer step sees (averaged over micro-steps and processes), g_ref the fp32 "
                  "untreed gradient of one process on the same global batch; within_bf16_rule: at most 1.5x stock "
                  "TRL's bf16 error on one process (DESIGN.md)")


class GradientCapture(TrainerCallback):
    """Keeps the policy's gradient as the optimizer step sees it: after the micro-steps' accumulation
    and the averaging over processes (DDP's or the tree's own), with clipping off."""

    gradient: torch.Tensor | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = [p.grad.detach().float().flatten() if p.grad is not None else torch.zeros(p.numel(), device=p.device)
                 for p in model.parameters() if p.requires_grad]
        self.gradient = torch.cat(grads).cpu()


class LastStepProfile(TrainerCallback):
    """The torch profiler over the run's last optimizer step (every micro-step, the window's exchanges
    and the gradient average with it), its tables written to ``path``: the operators by self CUDA time
    and by self CPU time — where a multi-GPU step spends what a quarter of the one-GPU step does not —
    and beside it (``.json``) where the GPU idles and in which of the package's ranges the host is
    meanwhile, and the host's synchronisations, by operator and by Python stack (``bench.profile``)."""

    def __init__(self, path: str, rows: int = 40):
        self.path, self.rows, self.prof, self.syncs = path, rows, None, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == state.max_steps - 1 and self.prof is None:
            from torch.profiler import ProfilerActivity, profile

            from .profile import sync_stacks

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof, self.syncs = profile(activities=activities), sync_stacks()
            self.stacks = self.syncs.__enter__()
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        self.syncs.__exit__(None, None, None)
        table = self.prof.key_averages()
        with open(self.path, "w") as f:
            for key in (("self_cuda_time_total",) if torch.cuda.is_available() else ()) + ("self_cpu_time_total",):
                f.write(f"# by {key}\n{table.table(sort_by=key, row_limit=self.rows, max_name_column_width=70)}\n")
        from .profile import gpu_timeline, host_syncs, top_stacks

        with open(os.path.splitext(self.path)[0] + ".json", "w") as f:
            json.dump({"timeline": gpu_timeline(self.prof), "host_syncs": host_syncs(self.prof),
                       "sync_stacks": top_stacks(self.stacks)}, f, indent=1)
        self.prof = self.syncs = None


def compare_update(directory: str, mode: str, gradient: torch.Tensor, accelerator) -> dict:
    """One mode's update against the fp32 untreed one-process reference kept in ``directory``.

    The one-process launch's ``off+fp32`` writes the reference; its ``off`` (stock TRL in bf16) adds
    stock's own error, the yardstick of DESIGN.md's bf16 rule: a tree's error may be at most 1.5x it.
    Every launch also reports whether its processes hold the same gradient (they were averaged)."""
    path = os.path.join(directory, "reference.pt")
    processes = accelerator.num_processes
    result: dict = {"processes": processes}
    if processes > 1:  # averaged over ranks: every rank holds the same gradient
        from accelerate.utils import gather_object

        norms = gather_object([float(gradient.double().norm())])
        result["ranks_agree"] = len(set(norms)) == 1
    if not accelerator.is_main_process:
        return result
    if mode == "off+fp32" and processes == 1 and not os.path.exists(path):
        os.makedirs(directory, exist_ok=True)
        torch.save({"gradient": gradient, "stock_bf16_rel_err": None}, path)
        return result | {"reference": True}
    reference = torch.load(path)  # there: main refuses a launch that would not find it before training
    ref = reference["gradient"].double()
    if ref.numel() != gradient.numel():
        raise ValueError(f"--update-check: the reference in {directory} has {ref.numel()} gradient entries, this "
                         f"model {gradient.numel()}: it was written for another --size")
    error = float((gradient.double() - ref).norm() / ref.norm())
    result["update_rel_err"] = error
    if mode == "off" and processes == 1:
        reference["stock_bf16_rel_err"] = error
        torch.save(reference, path)
    stock = reference["stock_bf16_rel_err"]
    if stock is not None and "+fp32" not in mode:
        result |= {"err_over_stock_bf16": round(error / stock, 3), "within_bf16_rule": error <= 1.5 * stock}
    return result


@contextmanager
def launcher_precision(mixed_precision: str):
    """``ACCELERATE_MIXED_PRECISION`` set for one mode and restored after: ``TrainingArguments`` take
    the launcher's mixed precision unless ``bf16=True``, so an fp32 mode under a bf16 launcher config
    would run in bf16; restored, so that nothing after the benchmark (a test in the same process)
    inherits it."""
    saved = os.environ.get("ACCELERATE_MIXED_PRECISION")
    os.environ["ACCELERATE_MIXED_PRECISION"] = mixed_precision
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
        else:
            os.environ["ACCELERATE_MIXED_PRECISION"] = saved


def parameter_fingerprint(model: torch.nn.Module, optimizer=None) -> torch.Tensor:
    """The sum of the parameters' norms and of the ``optimizer``'s state tensors' (Adam's moments),
    over the *full* tensors: under FSDP2 each rank holds a different shard (a ``DTensor``), so its
    local norm says nothing about agreement; ``full_tensor`` gathers each (a collective every rank
    makes, one tensor at a time). The state, because a bf16 weight may not move at all under a
    small learning rate, so equal weights alone do not show that the gradients were averaged; the
    moments hold those gradients."""
    from ..distributed import deepspeed as zero

    tensors = list(model.parameters())
    if zero.zero3_parameters(tensors):  # ZeRO-3: each rank holds a partition; gathered whole (a collective)
        norms = []
        for t in tensors:  # one at a time: a 14B model gathered whole at once did not fit beside its training state
            with zero.whole([t]):
                norms.append(t.detach().float().norm())
        return torch.stack(norms).sum()
    if optimizer is not None:
        tensors += [t for state in optimizer.state.values() for t in state.values()
                    if torch.is_tensor(t) and t.dim() > 0]
    from ..distributed.fsdp import full_tensor

    norms = [full_tensor(t).detach().float().norm() for t in tensors]
    return torch.stack(norms).sum()


def _distributed_type(accelerator) -> str:
    """``DDP``, ``FSDP2``, ``FSDP1``, ``DEEPSPEED`` or ``NO``: what the JSON records for a run."""
    kind = accelerator.distributed_type.value
    if kind == "FSDP":
        return "FSDP2" if getattr(accelerator, "is_fsdp2", False) else "FSDP1"
    return {"MULTI_GPU": "DDP", "MULTI_CPU": "DDP"}.get(kind, kind)


class BenchRollouts:
    """A ``rollout_func`` of random rollouts (no generation) whose every row is a function of its
    prompt and its place in its group alone.

    So the same global batch gets the same tokens on one process or several (the update check
    compares them), a group cut over processes shares its prompt's tokens, and no two processes
    draw the same completions (with one seed per process they did: trees placed over ranks then
    shared tokens across ranks, a T/U no real run has). TRL lays each group's rows out contiguously
    and the processes' rows process-major, which gives a row's place in its group.

    ``agentic``: the suite's W4 tree per prompt: a 4.8k system prompt shared by every prompt (one
    agent, many tasks) and each task's own turns branching at tool calls; a group's i-th row is
    its tree's i-th trajectory.
    """

    def __init__(self, vocab: int, prompt: int, completion: int, group: int, free_lengths: bool,
                 agentic: bool = False):
        self.vocab, self.prompt, self.completion, self.group = vocab, prompt, completion, group
        self.free_lengths, self.agentic = free_lengths, agentic
        self._trees: dict[int, list[list[int]]] = {}
        if agentic:
            from .workloads import agentic_tree

            paths = agentic_tree(vocab)
            self.system = 4800
            self.group, self.prompt = len(paths), self.system
            self.completion = max(len(p) for p in paths) - self.system

    def row(self, prompt: str, place: int) -> tuple[list[int], list[int]]:
        """(prompt ids, completion ids) of the ``place``-th row of ``prompt``'s group; ids ≥ 2 (0 is
        the pad token and 1 the EOS, which would end TRL's completion mask early)."""
        key = zlib.crc32(prompt.encode())
        if self.agentic:
            if key not in self._trees:
                from .workloads import agentic_tree

                self._trees[key] = [[t if t > 1 else t + 2 for t in path]
                                    for path in agentic_tree(self.vocab, seed=key, system_seed=0)]
            path = self._trees[key][place % self.group]
            return path[: self.system], path[self.system :]
        ids = np.random.default_rng(key).integers(2, self.vocab, self.prompt).tolist()
        rng = np.random.default_rng([key, place])
        n = int(rng.integers(self.completion // 2, self.completion + 1)) if self.free_lengths else self.completion
        return ids, rng.integers(2, self.vocab, n).tolist()

    def __call__(self, prompts: list[str], trainer) -> dict[str, list]:
        offset = trainer.accelerator.process_index * len(prompts)
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for i, prompt in enumerate(prompts):
            ids, completion = self.row(prompt, (offset + i) % self.group)
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(completion)
            out["logprobs"].append([0.0] * len(completion))
        return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # the offline trainers' data shapes and modes are their own (bench/sft.py, dpo.py), as are the async
    # trainer's streams (bench/async_grpo.py)
    for algo, module in (("sft", "sft"), ("dpo", "dpo"), ("async", "async_grpo")):
        if _takes_algo(argv, algo):
            from importlib import import_module

            rest = [a for i, a in enumerate(argv) if not _is_algo_arg(argv, i)]
            return import_module(f".{module}", __package__).main(rest)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_grpo_shape_args(parser)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--modes", default="off,packed,dfs",
                        help="tree_mode values; +graphs (e.g. packed+graphs) also sets tree_cuda_graphs=True, "
                             "+buckets tree_cuda_graph_buckets=True, +micro tree_window='micro_step' (trees per "
                             "micro-batch and rank, stock TRL's distribution), +window tree_window='accumulation' "
                             "(trees per accumulation window, placed on ranks by cost); neither: tree_window='auto'; "
                             "+budget=N sets tree_token_budget=N; +nooverlap tree_overlap_reduction=False; +twopass "
                             "tree_one_pass=False; +sharedgroup the by-hand average on the default group and the "
                             "step timer waiting for the whole device (as before the average had a communicator of "
                             "its own, to measure that); +ctas=N, +hipri: the average's communicator with NCCL's "
                             "maxCTAs=N, on a high-priority stream; +afterbwd: its all-reduces launched right after "
                             "the backward instead of during it; +noreduce: no gradient average at all (timing only: "
                             "what the step costs without it; the ranks' updates differ); +localmetrics: TRL's per-micro-step "
                             "metric gathers and reductions on each rank's own values (timing only: what the ranks' "
                             "waits at them cost; the logged metrics are rank 0's); +fill: a window's trees cut until every rank "
                             "owns one under DDP and DeepSpeed too (FSDP2 always does); +block / +whole: tree_gather='block' / "
                             "'whole' (a sharded model gathered block by block inside the calls, or whole per step); "
                             "+bucket=MB "
                             "ddp_bucket_cap_mb=MB; +mem=GIB "
                             "tree_memory_budget=GIB GiB (dfs: larger units, fewer of them); +fp32 trains without "
                             "mixed precision (the launcher's mixed_precision is overridden for that mode); "
                             "@BACKEND (e.g. packed@torch_flash) sets tree_attn_backend (default auto)")
    parser.add_argument("--per-device", type=int, default=None,
                        help="per_device_train_batch_size (default: --group, one group per micro-step); smaller "
                             "values cut a group over micro-steps and, under accelerate launch, over processes")
    parser.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--free-lengths", action="store_true",
                        help="completion lengths uniform in [completion/2, completion] (no two micro-batches share a "
                             "layout: packed+graphs then replays the graphs of padded layouts, attention/buckets.py)")
    parser.add_argument("--algo", default="grpo", choices=("grpo", "ppo", "sft", "dpo", "async"),
                        help="sft, dpo: the offline trainers on their data shapes (options: --algo sft --help); "
                             "async: TreeAsyncGRPOTrainer on recorded sample streams")
    parser.add_argument("--critic", default="separate", choices=("separate", "shared", "adapter"))
    parser.add_argument("--workload", default="group", choices=("group", "W4"),
                        help="group: --group completions of one --prompt; W4: the suite's agentic tree")
    parser.add_argument("--lora", action="store_true", help="train a rank-16 LoRA on all linear layers")
    parser.add_argument("--update-check", metavar="DIR", default=None,
                        help="exactness instead of speed: fp32 master weights under bf16 autocast, one optimizer step; "
                             "each mode's averaged gradient is compared with the fp32 untreed one-process reference "
                             "in DIR (written by a one-process launch whose modes begin with off+fp32, the mode "
                             "flag +fp32 turning bf16 off), and its error with stock's bf16 error there (DESIGN.md: "
                             "at most 1.5x)")
    parser.add_argument("--tree-shuffle", default="groups", choices=("groups", "rows"),
                        help="tree_shuffle of every tree mode, pinned so that a change of the trainers' default "
                             "does not move the benchmark's figures (recorded in the JSON)")
    parser.add_argument("--optim", default="adamw_torch",
                        help="TrainingArguments.optim of every mode (sgd: no optimizer state — what lets a 30B model's "
                             "step fit on four 141 GB GPUs beside its fp32 weights and gradients)")
    parser.add_argument("--rank0-init", default="auto", choices=("auto", "on", "off"),
                        help="under FSDP2 with fsdp_cpu_ram_efficient_loading: build the random model on the main "
                             "process only and let Accelerate broadcast it, as from_pretrained does there (auto: where "
                             "the model's fp32 copy would not fit in half of the GPU; Accelerate's preparation holds it)")
    parser.add_argument("--ddp-backend", default=None,
                        help="torch.distributed backend (TrainingArguments.ddp_backend); gloo lets several "
                             "processes share one GPU (LOCAL_RANK=0 in each) where only one is at hand")
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="profile each mode's last optimizer step (torch profiler, CPU and CUDA) and write its "
                             "operator tables to DIR/MODE_rankR.txt, and to DIR/MODE_rankR.json where the GPU idles "
                             "(by the package's range the host is in) and the host's synchronisations (by Python stack)")
    add_kernels_arg(parser)
    args = parser.parse_args(argv)
    if args.algo == "ppo" and args.critic == "adapter" and not args.lora:
        parser.error("--critic adapter trains a second LoRA adapter: add --lora")
    if args.update_check and args.algo == "ppo":
        parser.error("--update-check compares GRPO updates: PPO normalises its loss per micro-batch, so its update "
                     "depends on how the rows fall into micro-batches, which differs between process counts")
    if args.update_check and not os.path.exists(os.path.join(args.update_check, "reference.pt")) and not (
            args.modes.startswith("off+fp32") and int(os.environ.get("WORLD_SIZE", "1")) == 1):
        raise FileNotFoundError(f"--update-check: no reference in {args.update_check}; run one process with modes "
                                "beginning off+fp32 first")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from ..data.tiny import shaped_config
    from ..trainers import TreeGRPOConfig, TreeGRPOTrainer, TreePPOConfig, TreePPOTrainer
    from ..distributed.exchange import reduction_group

    config = shaped_config(args.size, args.family)
    tok = bench_tokenizer(config.vocab_size)
    rollout = BenchRollouts(config.vocab_size, args.prompt, args.completion, args.group, args.free_lengths,
                            agentic=args.workload == "W4")
    if args.workload == "W4":
        args.group, args.prompt, args.completion = rollout.group, rollout.prompt, rollout.completion

    def reward(completions, **kwargs):
        return [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]

    results = {}
    cuda = torch.cuda.is_available()  # the CPU runs it too, slowly (the update check's test, on a tiny shape)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:  # accelerate launch: one GPU per process
        torch.cuda.set_device(device)
    main_only = rank0_builds(config, args.rank0_init)
    for run in args.modes.split(","):
        # a mode named twice runs twice (its later results under "MODE#2", ...)
        mode = run if run not in results else f"{run}#{sum(1 for k in results if k.partition('#')[0] == run) + 1}"
        torch.manual_seed(0)
        if cuda:
            release_memory()
            leftover = torch.cuda.memory_allocated()  # what earlier modes left (before this mode's model): not its own
        config_cls, trainer_cls = (TreePPOConfig, TreePPOTrainer) if args.algo == "ppo" else \
            (TreeGRPOConfig, TreeGRPOTrainer)
        ppo = {"critic": args.critic, "kl_coef": 0.0} if args.algo == "ppo" else {}
        extra = {}
        if args.lora:
            from peft import LoraConfig

            extra["peft_config"] = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
        flags, _, backend = run.partition("@")
        window = "micro_step" if "+micro" in flags else "accumulation" if "+window" in flags else "auto"
        budget = next((int(f.split("=", 1)[1]) for f in flags.split("+") if f.startswith("budget=")), None)
        bucket_mb = next((int(f.split("=", 1)[1]) for f in flags.split("+") if f.startswith("bucket=")), None)
        memory_gib = next((float(f.split("=", 1)[1]) for f in flags.split("+") if f.startswith("mem=")), None)
        fp32 = "+fp32" in flags
        mixed_precision = "no" if fp32 else "bf16"
        model = build_random_model(config, torch.float32 if args.update_check else torch.bfloat16, device,
                                   main_only, upcast=mixed_precision != "no")
        settings = {"tree_shuffle": args.tree_shuffle, "tree_window": window, "tree_token_budget": budget,
                    "mixed_precision": mixed_precision}
        with launcher_precision(mixed_precision):  # from the config to the end of training
            cfg = config_cls(
                output_dir=tempfile.mkdtemp(), tree_mode=flags.split("+")[0], tree_window=window, **ppo,
                tree_shuffle=args.tree_shuffle, tree_token_budget=budget,
                tree_attn_backend=backend or "auto",
                tree_cuda_graphs="+graphs" in flags, tree_cuda_graph_buckets="+buckets" in flags,
                tree_overlap_reduction="+nooverlap" not in flags, tree_one_pass="+twopass" not in flags,
                tree_gather="block" if "+block" in flags else "whole" if "+whole" in flags else "auto",
                ddp_bucket_cap_mb=bucket_mb,
                tree_memory_budget=int(memory_gib * 2**30) if memory_gib is not None else None,
                max_steps=1 if args.update_check else args.steps, max_grad_norm=0.0 if args.update_check else 1.0,
                ddp_backend=args.ddp_backend,
                per_device_train_batch_size=args.per_device or args.group,
                gradient_accumulation_steps=args.accumulation, num_generations=args.group, optim=args.optim, max_completion_length=args.completion, learning_rate=1e-6, beta=0.0,
                use_liger_kernel=args.kernels == "liger", tree_compile_layers=args.kernels == "compiled",
                bf16=not fp32,
                logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
            )
            trainer = trainer_cls(model=model, reward_funcs=reward, args=cfg, processing_class=tok,
                                  train_dataset=Dataset.from_dict({"prompt": [f"p{i}" for i in range(64)]}),
                                  rollout_func=rollout, **extra)
            if "+sharedgroup" in flags:  # the average on the default group, the timer waiting for the device
                trainer._tree_reduce_group, trainer._tree_timer_waits_for_device = None, True
            if "+noreduce" in flags:  # timing only: no gradient average at all (each rank its own update)
                trainer.args.tree_overlap_reduction = False
                trainer._sync_gradients = lambda model: None
            if "+afterbwd" in flags:  # the average's all-reduces launched after the backward, not during it
                trainer._tree_launch_in_backward = False
            if "+fill" in flags:  # a window's trees cut until every rank owns one (FSDP2 always does)
                trainer._tree_fill_ranks = True
            if "+localmetrics" in flags:  # timing only: TRL's per-micro-step metric collectives on this rank alone
                trainer._compute_loss = local_metric_collectives(trainer)
            max_ctas = next((int(f.split("=", 1)[1]) for f in flags.split("+") if f.startswith("ctas=")), None)
            if (max_ctas is not None or "+hipri" in flags) and trainer._tree_reduce_group is not None:
                trainer._tree_reduce_group = reduction_group(trainer.accelerator.device, max_ctas, "+hipri" in flags)
            capture = GradientCapture() if args.update_check else None
            if capture is not None:
                trainer.add_callback(capture)
            if args.profile:
                os.makedirs(args.profile, exist_ok=True)
                trainer.add_callback(LastStepProfile(os.path.join(
                    args.profile, f"{mode.replace('+', '_')}_rank{int(os.environ.get('RANK', '0'))}.txt")))
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            trainer.train()
        distributed = {"distributed_type": _distributed_type(trainer.accelerator),
                       "processes": trainer.accelerator.num_processes,
                       "backend": trainer.accelerator.state.backend if trainer.accelerator.num_processes > 1 else None}
        if args.update_check:
            results[mode] = compare_update(args.update_check, mode, capture.gradient, trainer.accelerator) | settings \
                | distributed
            if trainer.accelerator.is_main_process:
                print(mode, results[mode], flush=True)
            free_trainer(trainer)
            del trainer, model, capture
            release_memory()
            continue
        logs = [h for h in trainer.state.log_history if "tree/fwd_bwd_time" in h]
        times = [h["tree/fwd_bwd_time"] for h in logs][1:]
        if args.profile and len(times) > 1:  # the profiled last step runs slower: timed apart, in its tables
            times = times[:-1]
        results[mode] = {"fwd_bwd_ms": round(statistics.median(times) * 1e3, 1), "steps_timed": len(times),
                         # graphs captured along the run (free lengths: a bucket at its second sighting) cost
                         # the early steps; the later half shows the step once they are made
                         "fwd_bwd_ms_later_half": round(statistics.median(times[len(times) // 2 :]) * 1e3, 1),
                         # the mode's own peak: above what earlier modes of this process still held at its start
                         "peak_gib": round((torch.cuda.max_memory_allocated() - leftover) / 2**30, 2) if cuda else None,
                         **({"leftover_gib": round(leftover / 2**30, 2)} if cuda and leftover > 2**28 else {}),
                         "T_over_U": round(logs[-1].get("tree/dedup_ratio", 1.0), 3), **settings, **distributed}
        stats = unit_graph_stats(trainer.accelerator.unwrap_model(trainer.model))
        if stats is not None:  # the walk's units: replayed or eager (free lengths: padded to buckets)
            results[mode]["unit_graphs"] = stats
        for key in ("tree/rank_imbalance", "tree/rank_imbalance_stock",  # estimated max/mean cost over ranks
                    "tree/passes",  # the policy backward's passes: 1 where the loss is separable (tree_one_pass)
                    "tree/gather_block"):  # 1 where a sharded model was gathered block by block (tree_gather)
            if key in logs[-1]:
                results[mode][key.split("/")[1]] = round(logs[-1][key], 4)
        processes = trainer.accelerator.num_processes
        if processes > 1:  # each rank's own step time: the slowest one sets the pace
            from accelerate.utils import gather_object

            results[mode]["rank_fwd_bwd_ms"] = [round(t * 1e3, 1) for t in
                                                gather_object([statistics.median(times)])]
        if processes > 1:  # every rank must end with the same parameters and moments (gradients averaged)
            # DeepSpeed's optimizer state is partitioned over the ranks (ZeRO): the parameters alone there
            deepspeed = trainer.accelerator.distributed_type.value == "DEEPSPEED"
            fingerprint = parameter_fingerprint(trainer.model, None if deepspeed else trainer.optimizer)
            ranks = trainer.accelerator.gather(fingerprint.reshape(1))
            results[mode] |= {"ranks_agree": bool((ranks == ranks[0]).all())}
        if trainer.accelerator.is_main_process:
            print(mode, results[mode], flush=True)
        free_trainer(trainer)
        del trainer, model
        release_memory()
    if "off" in results and not args.update_check:
        for mode, r in results.items():
            r["speedup_over_stock"] = round(results["off"]["fwd_bwd_ms"] / r["fwd_bwd_ms"], 3)
    nccl = allreduce_bandwidth()  # every rank: a collective
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    print(results)
    dump(args.out, {"environment": environment(args.kernels) | ({"nccl_allreduce": nccl} if nccl else {}), "workload": {
        "model": f"{shaped_name(args.size, args.family)} (random init), "
                 f"{PRECISION_CHECKED if args.update_check else 'bf16'}, gradient checkpointing (TRL default)"
                 f"{', LoRA r=16 on all linear layers' if args.lora else ''}",
        **({"update_check": UPDATE_CHECKED} if args.update_check else {}),
        **({"ddp_backend": args.ddp_backend} if args.ddp_backend else {}),
        "algo": args.algo, **({"critic": args.critic} if args.algo == "ppo" else {}), "shape": args.workload,
        "group": args.group, "prompt": args.prompt, "completion": args.completion,
        "per_device_train_batch_size": args.per_device or args.group, "gradient_accumulation_steps": args.accumulation,
        **({"optim": args.optim} if args.optim != "adamw_torch" else {}),
        "completion_lengths": "uniform in [completion/2, completion]" if args.free_lengths else "fixed",
        **({"init": "the main process builds the random model and Accelerate broadcasts it; the others hold "
                    "uninitialised CPU storage until then (--rank0-init)"}
           if main_only else {})},
        "results": results})
    return 0


def free_trainer(trainer) -> None:
    """Drop what keeps a finished mode's model and optimizer alive past ``del trainer``: a DeepSpeed
    engine is referenced by the accelerator (its wrapper, its list of models and optimizers) and by
    the trainer's own fields, and its partitioned state stayed allocated into the next mode (measured:
    peaks growing ~26 GiB per mode in one ZeRO-3 launch); the engine's ``destroy`` releases its hooks
    and buffers."""
    accelerator = trainer.accelerator
    engine = getattr(getattr(accelerator, "deepspeed_engine_wrapped", None), "engine", None)
    accelerator.free_memory()
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()
    for name in ("deepspeed", "model_wrapped", "optimizer", "lr_scheduler", "ref_model"):
        if hasattr(trainer, name):
            setattr(trainer, name, None)


def local_metric_collectives(trainer):
    """The trainer's ``_compute_loss`` with the accelerator's ``gather`` and ``reduce`` taking this
    rank's values alone while it runs: TRL's loss logs its metrics through about seven of them per
    micro-step, each read back with ``.item()`` — points where the ranks wait for one another. Timing
    only (``+localmetrics``): the logged metrics are then one rank's; the tree calls inside exchange
    through ``torch.distributed`` directly and the gradients are averaged as before."""
    compute, accelerator = trainer._compute_loss, trainer.accelerator

    def local(model, inputs):
        accelerator.gather = lambda tensor: tensor
        accelerator.reduce = lambda tensor, reduction="sum", scale=1.0: tensor
        try:
            return compute(model, inputs)
        finally:
            del accelerator.gather, accelerator.reduce

    return local


def _is_algo_arg(argv: list[str], i: int) -> bool:
    """Whether ``argv[i]`` is (part of) the ``--algo`` option."""
    return argv[i] == "--algo" or argv[i].startswith("--algo=") or (i > 0 and argv[i - 1] == "--algo")


def _takes_algo(argv: list[str], algo: str) -> bool:
    return any(argv[i] == f"--algo={algo}" or (argv[i] == "--algo" and argv[i + 1 : i + 2] == [algo])
               for i in range(len(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
