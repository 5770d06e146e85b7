"""Shared pieces of the GPU benchmarks: timing with CUDA events, peak memory, the FLOP limit.

Timing rule (DESIGN, "Measuring speed"): warm up, then the median of several runs timed with CUDA
events, baseline and tree in the same process on the same rollouts; report ratios.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch

from ..engine.cost_model import StepCost, step_flops  # noqa: F401 - the benchmarks' FLOP limit, defined with the balancer's costs
from ..data.tiny import SHAPED_FAMILIES, SHAPED_SIZES, parameter_count, shaped_family


def drop_graphs(model: torch.nn.Module) -> None:
    """Forget ``model``'s captured CUDA graphs (packed calls and walk units): their memory pool and
    the walk's kept K/V stack are freed, so the next graphed path's memory is its own."""
    from ..engine import graphs
    from ..engine.dfs import graphs as dfs_graphs

    graphs._RUNNERS.pop(model, None)
    dfs_graphs._WALK_GRAPHS.pop(model, None)
    gc.collect()


def process_device() -> torch.device:
    """This process's device: its own GPU under ``accelerate launch`` (``LOCAL_RANK``), made current
    so that a model built under ``with process_device():`` lands there and not on GPU 0; the CPU
    where there is no GPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    import os

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


@contextlib.contextmanager
def built_whole():
    """A benchmark's random model built whole, never inside DeepSpeed ZeRO-3's ``zero.Init``:
    Transformers builds there once any ``TrainingArguments`` of a ZeRO-3 launch exists (a later
    mode's, while the first mode's model came before it) and, until that object is collected, that
    init draws other random weights. Built whole, every mode of a launch starts from the same weights
    (DeepSpeed partitions them when it builds its engine)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    config = ref() if ref is not None else None
    if config is None:
        yield
        return
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed.set_hf_deepspeed_config(config)


def rank0_builds(config, rule: str = "auto") -> bool:
    """Whether only the main process builds the launch's random model (``build_random_model``).

    Accelerate's FSDP2 preparation upcasts the whole model to fp32 on each process before it shards it
    and keeps that copy until the shards are placed: a 30B model's 122 GiB beside its shards does not fit
    on a 141 GB GPU. A user's ``from_pretrained`` under ``fsdp_cpu_ram_efficient_loading`` loads the
    weights on the main process only, and Accelerate broadcasts them from there; ``"auto"`` does the
    same where the fp32 copy would not fit in half of the GPU, ``"on"`` / ``"off"`` force it."""
    if rule == "off" or os.environ.get("ACCELERATE_USE_FSDP", "").lower() != "true" or \
            os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "").lower() != "true":
        return False
    if rule == "on" or not torch.cuda.is_available():
        return rule == "on"
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return 4 * parameter_count(config) > total / 2


def build_random_model(config, dtype: torch.dtype, device: torch.device, main_only: bool = False,
                       upcast: bool = True) -> torch.nn.Module:
    """The launch's random model, initialised on ``device`` (a 7B random init on the CPU takes minutes).

    ``main_only`` (``rank0_builds``): the main process builds it on ``device`` and keeps it on the CPU;
    the others get uninitialised CPU storage in the dtype Accelerate would give it (fp32 where it
    upcasts for mixed precision: then its upcast copies nothing and the pages are never touched, so
    they cost no memory) — Accelerate broadcasts the main process's weights into the shards. Not the
    meta device: Accelerate maps the optimizer's parameters to the shards by their storage address,
    which every meta tensor shares. The rotary frequencies (non-persistent buffers, not broadcast)
    are computed by Transformers' own initialisation, as its ``from_pretrained`` does there."""
    from transformers import AutoModelForCausalLM

    def build(dtype):
        # a copy: the trainer aligns the model's config with the tokenizer (pad_token_id = 0), and a later
        # mode built from the same object would initialise the pad row of the embedding as zeros
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype, attn_implementation="sdpa")

    if not main_only or int(os.environ.get("RANK", "0")) == 0:
        with device, built_whole():
            model = build(dtype)
        return model.to("cpu") if main_only else model
    with torch.device("meta"):
        model = build(torch.float32 if upcast else dtype)
    model.to_empty(device="cpu")
    owners = {name.rpartition(".")[0] for name, _ in model.named_non_persistent_buffers()}
    for owner in owners:  # Transformers' own initialisation of each owner computes its buffers
        model._init_weights(model.get_submodule(owner))
    return model


def release_memory() -> None:
    """Between a bench's modes: free what the last one left. A trainer holds reference cycles, so
    its model and optimizer state outlive ``del`` until a collection; left in place, they shift the
    next mode's peak and its allocator's state (measured once: the walk's step 1.5x slower when
    timed after four other modes)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_cuda(
    fn: Callable[[], object], warmup: int = 3, iters: int = 5, reset: Callable[[], object] | None = None
) -> tuple[float, float, float]:
    """Median milliseconds of ``fn`` over ``iters`` (≥ 2) runs after ``warmup``, and two peaks (GiB).

    Three warm-up runs by default: an eager packed step takes cuDNN for a dense shape from its third
    sighting (``partial.DENSE_AT_SIGHTING``), whose plan must be built before the timed runs.

    ``peak``: above what is allocated after ``reset`` (pass one that drops the gradients, e.g.
    ``model.zero_grad(set_to_none=True)``) during the first timed run: the step's gradients,
    activations and temporaries — everything above the weights.
    ``activation_peak``: above weights *and* gradients, over the later runs (the gradients then
    exist; ``fn`` must accumulate into them or zero them in place, not free them): what the
    computation itself needs — the figure the depth-first walk's memory target is about, and the
    same for every method, since all of them end with the same gradients.
    """
    if iters < 2:
        raise ValueError("time_cuda needs iters >= 2 (the activation peak is taken after the first run)")
    for _ in range(warmup):
        fn()
    if reset is not None:
        reset()
    gc.collect()  # what an earlier path left in reference cycles must not be freed inside this one's peak
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times, peak = [], 0.0
    for i in range(iters):
        if i == 1:
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            torch.cuda.reset_peak_memory_stats()
            base_with_grads = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    activation_peak = (torch.cuda.max_memory_allocated() - base_with_grads) / 2**30
    return statistics.median(times), peak, activation_peak


#: layer kernels a benchmark can run the model with; the baseline and the tree always share them
KERNELS = ("hf", "liger", "compiled")


def bench_tokenizer(vocab_size: int):
    """A word-level tokenizer with one entry per model token id, so TRL can decode any rollout and
    tokenise text of ``t<id>`` words back to the same ids. Its special tokens match whole words only:
    matched inside words, ``t1`` (EOS) would cut ``t17`` into ``t1`` and an unknown ``7``."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=AddedToken("t0", single_word=True, special=True),
                                   eos_token=AddedToken("t1", single_word=True, special=True))


def add_kernels_arg(parser) -> None:
    parser.add_argument(
        "--kernels", default="hf", choices=KERNELS,
        help="hf: the modeling file's own layers; liger: Liger-Kernel's fused RMSNorm, RoPE and SwiGLU "
             "(what TRL's use_liger_kernel=True applies); compiled: torch.compile of every layer's attention "
             "module, MLP and norms (trl_tree.compile_layers) — for the baseline and the tree alike")


def apply_kernels(model: torch.nn.Module, kernels: str) -> None:
    """Patch ``model``'s layers with ``kernels`` the way TRL's ``use_liger_kernel=True`` does.

    Why it matters here: at 0.5B every layer launches ~200 small kernels per step (RMSNorm, RoPE and
    SwiGLU are several each, forward, recompute and backward), and the tree paths — fewer tokens per
    kernel, several calls for the walk — wait on the host launching them (``bench.overhead``).
    Liger fuses each of those into one Triton kernel. Only the layer kernels are applied: TRL keeps
    its own fused LM head (Liger's fused linear cross-entropy would replace the model's forward).
    ``kernels="compiled"`` fuses them with Inductor instead (``trl_tree.compile_layers``).
    """
    if kernels == "hf":
        return
    if kernels == "compiled":
        from ..engine.compile import compile_layers

        compile_layers(model)
        return
    if kernels != "liger":
        raise ValueError(f"unknown kernels {kernels!r}; choose one of {', '.join(KERNELS)}")
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as e:
        raise SystemExit("--kernels liger needs Liger-Kernel: pip install liger-kernel") from e
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)


def bench_model(size: str, kernels: str = "hf", family: str | None = None) -> torch.nn.Module:
    """A Qwen2.5-``size``-shaped model (or ``family`` at that shape, ``tiny.shaped_config``), random
    init on the GPU, bf16, gradient checkpointing on and TRL's fused LM head added (the padded
    baseline uses it; the tree engine calls the original forward), in train mode — how TRL trains
    it; ``kernels="liger"`` patches its layers (:func:`apply_kernels`)."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from ..data.tiny import shaped_config

    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(shaped_config(size, family), dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False
    apply_kernels(model, kernels)
    model.gradient_checkpointing_enable()
    model.train()
    add_fused_lm_head(model)
    return model


def shaped_name(size: str, family: str | None = None) -> str:
    """How a result file names ``tiny.shaped_config(size, family)``."""
    family = family or shaped_family(size)
    names = {"qwen2": "Qwen2.5", "qwen3_next": "Qwen3-Next (hybrid)", "qwen3_5": "Qwen3.5 (hybrid)",
             "qwen3_moe": "Qwen3-MoE"}
    return f"{names[family]}-{size}-shaped"


def add_grpo_shape_args(parser) -> None:
    """The model size and GRPO group shape shared by the GRPO benchmarks' command lines."""
    parser.add_argument("--size", default="1.5b", choices=SHAPED_SIZES)
    parser.add_argument("--family", default=None, choices=SHAPED_FAMILIES,
                        help="qwen2 (the default for Qwen2.5's sizes): Qwen2.5's dense decoder; qwen3_next, qwen3_5: "
                             "the hybrids of the same size (gated DeltaNet in 3 of 4 layers, tiny.shaped_config); "
                             "qwen3_moe (the default for 30b-a3b): Qwen3's mixture of experts")
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--completion", type=int, default=512)


def padded_step(model, seqs, weights: torch.Tensor, score_from: int, n_terms: int) -> Callable[[], None]:
    """TRL's per-sequence step on ``seqs``: the right-padded batch through the model's attention,
    TRL's fused LM head on the tokens from ``score_from`` on, loss ``-Σ w_i·logp / n_terms``,
    backward (gradients accumulate; the caller zeroes them if it wants to)."""
    from ..engine.reference import right_pad

    ids, mask = right_pad(seqs, "cuda")
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :score_from] = -100

    def step():
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        (-(out.log_probs * weights[:, None]).sum() / n_terms).backward()
    return step


def step_paths(model, seqs, score_from: int, advantages: torch.Tensor) -> dict[str, Callable[[], None]]:
    """TRL's padded step and the packed and depth-first tree steps on ``seqs`` (PyTorch's
    FlashAttention), all with the loss ``-Σ adv_i·logp / n_terms`` over the tokens from
    ``score_from`` on: the paths the host-overhead, compiled-layer and CUDA-graph comparisons time
    (``packed_graphs``: the packed step replaying CUDA graphs from its second call on)."""
    from .. import PrefixForest, TreeOptions, tree_backward

    forest = PrefixForest.from_sequences(seqs)
    n_terms = sum(len(s) - score_from for s in seqs)

    def token_loss(lp, seq_idx, pos):
        return -lp * advantages[seq_idx] / n_terms

    def tree(mode, cuda_graphs=False):
        return lambda: tree_backward(model, forest, token_loss, mode=mode, score_from=score_from,
                                     options=TreeOptions(attn_backend="torch_flash", cuda_graphs=cuda_graphs))

    return {"trl_padded": padded_step(model, seqs, advantages, score_from, n_terms), "packed": tree("packed"),
            "dfs": tree("dfs"), "packed_graphs": tree("packed", cuda_graphs=True)}


def parameter_grads(model) -> list[torch.Tensor]:
    """Copies of the model's gradients, in parameter order (for comparing two ways of one step)."""
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def relative_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """``||a - b|| / ||a||`` over all the tensors together, in fp32."""
    num = sum(((x.float() - y.float()) ** 2).sum() for x, y in zip(a, b))
    den = sum((x.float() ** 2).sum() for x in a)
    return float((num / den).sqrt())


def environment(kernels: str = "hf") -> dict:
    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    import transformers

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = None
    return {
        "device": props.name if props else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "trl": trl_version,
        "python": platform.python_version(),
        "kernels": _kernels_label(kernels),
        # what attn_backend="auto" may pick on a Hopper/Blackwell GPU (attention.backends.fa4_pays)
        "flash_attn_4": _version("flash-attn-4"),
        # the packages transformers routes hybrid layers' kernels to (None: its PyTorch reference kernels)
        "sequence_kernels": {name: _version(name) for name in ("flash-linear-attention", "causal-conv1d", "mamba-ssm")},
        # the host's intra-op threads: `accelerate launch` sets OMP_NUM_THREADS=1 per process where
        # a plain `python` run takes every core, so one-process and launched runs differ here
        "cpu_threads": torch.get_num_threads(),
        # other jobs on this host's GPUs when the results were written: a neighbour slowed stock's host-bound
        # micro-steps up to 2.4x and the tree's step ~6% (measured), so a figure taken beside one is not a result
        "gpu_neighbours": gpu_neighbours(),
    }


def allreduce_bandwidth(sizes_mib: tuple[int, ...] = (25, 1024), iters: int = 10) -> dict | None:
    """What NCCL reaches between this launch's ranks: one bf16 all-reduce of each size on the default
    group, its median time and bus bandwidth as nccl-tests computes it (``bytes · 2(n-1)/n / time``)
    — to set beside what a step's gradient average gets, which runs 25 MiB buckets during a backward.
    A collective: every rank calls it. None in a one-process run or without a GPU."""
    dist = torch.distributed
    if not (torch.cuda.is_available() and dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    n = dist.get_world_size()
    out = {}
    for mib in sizes_mib:
        x = torch.zeros(mib * 2**20 // 2, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            dist.all_reduce(x)
        dist.barrier()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_reduce(x)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        out[f"{mib}_MiB"] = {"ms": round(ms, 3), "busbw_GBps": round(mib * 2**20 * 2 * (n - 1) / n / (ms * 1e-3) / 1e9, 1)}
        del x
    torch.cuda.empty_cache()
    return {"processes": n, "dtype": "bf16", **out}


def gpu_neighbours() -> list[dict] | str:
    """The processes of other jobs that hold memory on this host's GPUs now (``nvidia-smi``), this
    run's own left out — this process, its launcher and the launcher's other ranks — with a warning
    on stderr when there are any; a string where it cannot be told (no ``nvidia-smi``, or one that
    lists no process of this run, as in containers that hide the host's process table)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown: no nvidia-smi"
    if done.returncode != 0:
        return "unknown: nvidia-smi failed"
    listed = []
    for line in done.stdout.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) >= 3 and fields[0].isdigit():
            listed.append({"pid": int(fields[0]), "name": fields[1], "used_mib": fields[2]})
    ours = _own_processes()
    if torch.cuda.is_available() and torch.cuda.memory_reserved() > 0 and not any(p["pid"] in ours for p in listed):
        return "unknown: nvidia-smi lists no process of this run (another process namespace)"
    others = [p for p in listed if p["pid"] not in ours]
    if others:
        print(f"WARNING: other processes use this host's GPUs ({others}): timings taken beside them are not "
              "results (one benchmark per host at a time)", file=sys.stderr, flush=True)
    return others


def _own_processes() -> set[int]:
    """This process, its parent (a launcher), the parent's other children (the launch's ranks) and
    every process descending from those (the ranks' FlashAttention-4 compile workers,
    ``engine/attention/fa4_ahead.py``, which hold a CUDA context)."""
    me, parent = os.getpid(), os.getppid()
    parents: dict[int, int] = {}
    try:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])  # field 4: the parent's pid
                except OSError:  # ended meanwhile
                    continue
    except OSError:
        pass
    ours = {me, parent} | {pid for pid, ppid in parents.items() if ppid == parent}
    for pid in parents:
        seen, up = set(), pid
        while up in parents and up not in ours and up not in seen and up > 1:
            seen.add(up)
            up = parents[up]
        if up in ours:
            ours |= seen
    return ours


def _kernels_label(kernels: str) -> str:
    """What ran the layers, for the reports: the library and its version where it is one."""
    if kernels == "liger":
        return f"liger {_version('liger-kernel')}"
    if kernels == "compiled":
        return "compiled (trl_tree.compile_layers: torch.compile, Inductor, dynamic shapes)"
    return kernels


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def dump(path: str | None, payload: dict) -> None:
    text = json.dumps(payload, indent=2)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    print(text)


def _timed_steps(trainer) -> list[float]:
    """Wrap ``trainer.training_step`` with (CUDA-synchronised) wall-clock timing; the list fills as it trains."""
    import time

    times: list[float] = []
    step = trainer.training_step
    cuda = torch.cuda.is_available()

    def timed(*args, **kwargs):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = step(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        return out

    trainer.training_step = timed
    return times


def train_and_time(trainer, epochs: int = 1) -> tuple[dict, list[dict]]:
    """Train ``trainer`` (an offline trainer's bench run) timing each ``training_step`` — the step
    without the optimizer; ``({step_ms, steps_timed, first_ms, peak_gib, loss[, T_over_U]}, logged
    steps)``, the median over the steps after the first (``first_ms``: the first, which compiles
    kernels and grows the allocator); ``epochs``: how many passes over the data the steps make
    (then ``epoch_s``, each pass's seconds)."""
    import statistics

    times = _timed_steps(trainer)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = {"step_ms": round(statistics.median(times[1:]) * 1e3, 1), "steps_timed": len(times) - 1,
              "first_ms": round(times[0] * 1e3, 1),
              "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
              "loss": round(logs[-1]["loss"], 4)}
    if len(times) > 8:  # an epoch of varied micro-batches: every step, and what FA4 compiled in it
        result["each_step_ms"] = [round(t * 1e3, 1) for t in times]
        compiled = [round(h.get("tree/kernel_compile_time", 0.0) * 1e3, 1) for h in logs]
        if any(compiled):
            result["each_step_fa4_compile_ms"] = compiled
        fallbacks = [int(h.get("tree/kernel_fallback_calls", 0)) for h in logs]
        if any(fallbacks):  # calls on FA2 while their FA4 variant compiled off the step (fa4_ahead)
            result["each_step_fa4_fallback_calls"] = fallbacks
        if epochs > 1 and len(times) % epochs == 0:  # each epoch's training steps, the first's compiles included
            per = len(times) // epochs
            result["epoch_s"] = [round(sum(times[i * per:(i + 1) * per]), 2) for i in range(epochs)]
    if "tree/dedup_ratio" in logs[-1]:
        result["T_over_U"] = round(logs[-1]["tree/dedup_ratio"], 3)
    return result, logs


def offline_bench_parser(algo: str, modes: tuple[str, ...], doc: str, modes_help: str = ""):
    """The command line of ``bench.trainer --algo sft|dpo``: size, shapes, modes, steps, output."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m trl_tree.bench.trainer --algo {algo}",
                                     description=doc.split("\n")[0])
    parser.add_argument("--size", default="1.5b", choices=SHAPED_SIZES)
    parser.add_argument("--family", default=None, choices=SHAPED_FAMILIES,
                        help="qwen2 (the default for Qwen2.5's sizes): Qwen2.5's dense decoder; qwen3_next, qwen3_5: "
                             "the hybrids of the same size (gated DeltaNet in 3 of 4 layers, tiny.shaped_config); "
                             "qwen3_moe (the default for 30b-a3b): Qwen3's mixture of experts")
    parser.add_argument("--shapes", default=None, help=f"comma-separated (default: all of workloads.{algo}_shapes)")
    parser.add_argument("--modes", default=",".join(modes), help=f"comma-separated, of {modes}{modes_help}")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    return parser

