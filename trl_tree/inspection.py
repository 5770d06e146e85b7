"""What the tree would gain on a user's own rollouts, before training (``trl-tree inspect``).

Reads a file of sequences — token ids, texts or chat messages — builds the prefix forests a
trainer would build (all rows in one forest, or ``rows_per_forest`` rows each, like micro-batches),
and reports T, U, T/U, the shape (depth and branching histograms) and what the cost model
predicts for a model config: the FLOP ratio of the untreed step to the tree's (the speed-up's
ceiling, reached by packed mode on GPU-bound models) and the activation memory of the untreed
padded batch, of packed mode and of the depth-first walk.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .data.data_files import DataError
from .data.data_files import read_rows as load_rows  # noqa: F401  (the CLI's name for it)

#: column sets understood, in the order they are tried
COLUMN_SETS = (
    ("prompt_ids", "completion_ids"),
    ("input_ids",),
    ("prompt", "completion"),
    ("messages",),
    ("text",),
)
#: preference pairs (TRL's DPO formats), each row two sequences sharing its prompt
PAIR_COLUMN_SETS = (
    ("prompt_ids", "chosen_ids", "rejected_ids"),
    ("prompt", "chosen", "rejected"),
    ("chosen", "rejected"),  # an implicit prompt: the forest finds the shared prefix itself
)


#: a file, column or tokenizer problem, said plainly (the CLI prints it without a traceback)
InspectError = DataError


#: ``--tokenizer tiny``: the package's own character-level chat tokenizer (``toy.chat_tokenizer``)
TINY_TOKENIZER = "tiny"


def load_tokenizer(path: str | None):
    """A local tokenizer directory, or the package's tiny chat tokenizer for ``tiny`` (offline, every
    character kept: its counts are characters, not a real model's tokens)."""
    if path is None:
        return None
    if path == TINY_TOKENIZER:
        from .data.toy import chat_tokenizer

        return chat_tokenizer()
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise InspectError(f"--tokenizer: no directory at {path!r} (give a local directory holding tokenizer files, "
                           f"or {TINY_TOKENIZER!r} for the package's character-level one; nothing is downloaded)")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise InspectError(f"cannot load a tokenizer from {path!r} ({type(e).__name__}: {e}); give a local "
                           "directory holding tokenizer files") from e


def sequences_from_rows(rows: Sequence[dict], tokenizer=None) -> tuple[list[list[int]], list[int]]:
    """Token sequences and, for each, the index of its first scored token (after the prompt; 1 when
    the file has whole sequences only)."""
    if not rows:
        raise InspectError("the file has no rows")
    columns = set(rows[0])
    chosen = next((c for c in COLUMN_SETS if set(c) <= columns), None)
    if chosen is None:
        wanted = " | ".join("+".join(c) for c in COLUMN_SETS)
        raise InspectError(f"no known columns in {sorted(columns)}; expected one of: {wanted}")
    if chosen not in (("prompt_ids", "completion_ids"), ("input_ids",)) and tokenizer is None:
        raise InspectError(_needs_tokenizer(chosen))
    seqs, score_from = [], []
    for i, row in enumerate(rows):
        try:
            if chosen == ("prompt_ids", "completion_ids"):
                prompt, completion = _ids(row["prompt_ids"]), _ids(row["completion_ids"])
            elif chosen == ("input_ids",):
                prompt, completion = _ids(row["input_ids"])[:1], _ids(row["input_ids"])[1:]
            elif chosen == ("prompt", "completion") and isinstance(row["prompt"], list):  # conversational
                ids = _chat(tokenizer, row["prompt"] + row["completion"], row.get("tools"))
                prompt = _chat(tokenizer, row["prompt"], row.get("tools"), generation_prompt=True)
                prompt, completion = ids[: len(prompt)], ids[len(prompt) :]
            elif chosen == ("prompt", "completion"):
                prompt = _encode(tokenizer, row["prompt"])
                completion = _encode(tokenizer, row["completion"], special=False)
            elif chosen == ("messages",):
                ids = _chat(tokenizer, row["messages"], row.get("tools"))
                prompt, completion = ids[:1], ids[1:]
            else:
                ids = _encode(tokenizer, row["text"])
                prompt, completion = ids[:1], ids[1:]
        except InspectError as e:
            raise e if str(e).startswith("row ") else InspectError(f"row {i}: {e}") from e
        except Exception as e:
            raise InspectError(f"row {i}: cannot read {'+'.join(chosen)} ({type(e).__name__}: {e})") from e
        if not prompt or not completion:
            raise InspectError(f"row {i} has {'no prompt' if not prompt else 'no completion'} token")
        seqs.append(prompt + completion)
        score_from.append(len(prompt))
    return seqs, score_from


def pairs_from_rows(rows: Sequence[dict], tokenizer=None) -> tuple[list[list[int]], list[int]] | None:
    """Preference pairs (``PAIR_COLUMN_SETS``) as sequences, each pair's chosen then rejected, with
    the index of each one's first scored token; None where the rows are not pairs."""
    columns = set(rows[0]) if rows else set()
    chosen_set = next((c for c in PAIR_COLUMN_SETS if set(c) <= columns), None)
    if chosen_set is None:
        return None
    if chosen_set[0] != "prompt_ids" and tokenizer is None:
        raise InspectError(_needs_tokenizer(chosen_set))
    seqs, score_from = [], []
    for i, row in enumerate(rows):
        try:
            for answer in ("chosen", "rejected"):
                if chosen_set[0] == "prompt_ids":
                    prompt, completion = _ids(row["prompt_ids"]), _ids(row[f"{answer}_ids"])
                elif "prompt" not in chosen_set:
                    text = row[answer]
                    ids = _chat(tokenizer, text) if isinstance(text, list) else _encode(tokenizer, text)
                    prompt, completion = ids[:1], ids[1:]
                elif isinstance(row["prompt"], list):  # conversational
                    prompt = _chat(tokenizer, row["prompt"], row.get("tools"), generation_prompt=True)
                    ids = _chat(tokenizer, row["prompt"] + row[answer], row.get("tools"))
                    prompt, completion = ids[: len(prompt)], ids[len(prompt) :]
                else:
                    prompt = _encode(tokenizer, row["prompt"])
                    completion = _encode(tokenizer, row[answer], special=False)
                if not prompt or not completion:
                    raise InspectError(f"row {i}: its {answer} answer has no {'prompt' if not prompt else 'answer'} "
                                       "token")
                seqs.append(prompt + completion)
                score_from.append(len(prompt))
        except InspectError as e:
            raise e if str(e).startswith("row ") else InspectError(f"row {i}: {e}") from e
        except Exception as e:
            raise InspectError(f"row {i}: cannot read {'+'.join(chosen_set)} ({type(e).__name__}: {e})") from e
    return seqs, score_from


def _needs_tokenizer(columns: tuple[str, ...]) -> str:
    return (f"columns {'+'.join(columns)} hold text: give --tokenizer PATH (a local tokenizer directory, e.g. one "
            f"saved with save_pretrained), or --tokenizer {TINY_TOKENIZER} for the package's character-level one")


def _chat(tokenizer, messages, tools=None, generation_prompt: bool = False) -> list[int]:
    if not isinstance(messages, list):
        raise InspectError(f"a chat must be a list of messages, got {type(messages).__name__}")
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or not message.get("role"):
            raise InspectError(f"message {j} has no 'role' (each message is {{'role': ..., 'content': ...}}): "
                               f"{str(message)[:80]}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InspectError("the rows hold chats but the tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5


def inspect_sft(seqs: list[list[int]], score_from: list[int], config, model_name: str, batch_size: int,
                pairs: bool = False) -> tuple[Report, Report, list[float]]:
    """SFT samples in micro-batches of ``batch_size``: the report in TRL's (random) order, the report
    with the prefix-grouped sampler (``tree_shuffle='groups'``), and the grouped micro-batches' T/U.
    ``pairs``: DPO's preference pairs (``pairs_from_rows``: each sample's chosen then rejected
    sequence), ordered as ``TreeDPOTrainer``'s sampler orders them, by prompt + chosen."""
    from .trainers.offline.sft_sampler import PrefixGroupedSampler

    width = 2 if pairs else 1
    lead = [np.asarray(s) for s in seqs[::width]]  # what the sampler orders by
    order = np.random.default_rng(0).permutation(len(lead)).tolist()
    _, chunks = PrefixGroupedSampler(lead, batch_size).micro_batches(0)
    grouped = [int(i) for chunk in chunks for i in chunk]
    reports = []
    for samples in (order, grouped):
        ordering = [width * i + k for i in samples for k in range(width)]
        report, forests = inspect([seqs[i] for i in ordering], [score_from[i] for i in ordering], config,
                                  model_name, batch_size * width)
        reports.append((report, forests))
    ratios = [f.dedup_ratio for f in reports[1][1]]
    return reports[0][0], reports[1][0], ratios


def _ids(value) -> list[int]:
    ids = [int(t) for t in value]
    if any(t < 0 for t in ids):
        raise InspectError("token ids must be non-negative")
    return ids


def _encode(tokenizer, text, special: bool = True) -> list[int]:
    if not isinstance(text, str):
        raise InspectError(f"expected a string, got {type(text).__name__}")
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


@dataclass
class Report:
    rows: int
    forests: int
    total_tokens: int
    unique_tokens: int
    depth_histogram: dict[str, int]  # sequence lengths, binned
    branching_histogram: dict[int, int]  # children per inner node
    flop_ratio: float  # untreed step FLOPs / tree step FLOPs: the speed-up's ceiling
    stock_bytes: int  # activations of the untreed padded micro-batch (the largest)
    packed_bytes: int  # packed mode, the largest forest
    dfs_bytes: int  # the depth-first walk, the longest path
    model: str

    @property
    def dedup_ratio(self) -> float:
        return self.total_tokens / max(self.unique_tokens, 1)

    def lines(self) -> list[str]:
        gib = 2**30
        out = [
            f"rows {self.rows} in {self.forests} forest(s); T = {self.total_tokens:,} tokens, U = {self.unique_tokens:,} "
            f"unique, T/U = {self.dedup_ratio:.2f}",
            f"predicted for {self.model} (bf16, gradient checkpointing):",
            f"  speed-up ceiling (FLOPs untreed / tree): {self.flop_ratio:.2f}x  — packed mode reaches ~0.9 of it on "
            "GPU-bound models; the depth-first walk less on small ones (docs/multi_gpu.md, docs/benchmarks)",
            f"  activation memory: untreed {self.stock_bytes / gib:.2f} GiB, packed {self.packed_bytes / gib:.2f} GiB, "
            f"dfs {self.dfs_bytes / gib:.2f} GiB",
            "sequence lengths: " + ", ".join(f"{k}: {v}" for k, v in self.depth_histogram.items()),
            "children per branching node: " + (", ".join(f"{k}: {v}" for k, v in sorted(self.branching_histogram.items()))
                                               or "none (no two sequences share a prefix)"),
        ]
        return out


def _length_bins(lengths: Sequence[int]) -> dict[str, int]:
    edges = [0, 64, 256, 1024, 4096, 16384, 65536, 2**62]
    counts = Counter(int(np.searchsorted(edges, n, side="right")) - 1 for n in lengths)
    names = ["<64", "64-255", "256-1k", "1k-4k", "4k-16k", "16k-64k", "64k+"]
    return {names[b]: counts[b] for b in sorted(counts)}


def inspect(seqs: list[list[int]], score_from: list[int], config, model_name: str = "model",
            rows_per_forest: int | None = None, progress: bool = False) -> tuple[Report, list]:
    """The report, and the forests (for a picture)."""
    from .engine.cost_model import ActivationModel, StepCost, estimate_bytes, runs_padded, step_flops
    from .engine.forest import PrefixForest
    from .engine.layout import LAYOUT

    if rows_per_forest is not None and rows_per_forest < 1:
        raise InspectError(f"rows_per_forest must be at least 1, got {rows_per_forest}")
    step = rows_per_forest or len(seqs)
    chunks = range(0, len(seqs), step)
    if progress:
        from tqdm.auto import tqdm

        chunks = tqdm(chunks, desc="forests", unit="forest")
    forests, tree_flops, stock_flops = [], 0.0, 0.0
    stock_bytes = packed_bytes = 0
    model = ActivationModel.of(config, True)
    branching: Counter = Counter()
    for start in chunks:
        part, first = seqs[start : start + step], score_from[start : start + step]
        forest = PrefixForest.from_sequences(part)
        forests.append(forest)
        plan = forest.scoring_plan(first)
        tree_flops += step_flops(StepCost(forest.num_unique_tokens, plan.num_predictions, forest.sum_visible_keys()),
                                 config, True)
        lengths = [len(s) for s in part]
        scored = sum(n - f for n, f in zip(lengths, first))
        stock_flops += step_flops(StepCost(sum(lengths), scored, sum(n * (n + 1) // 2 for n in lengths)), config, True)
        padded = model.call(len(part) * max(lengths), scored, True)
        stock_bytes = max(stock_bytes, padded)
        # what the packed call runs: a forest that shares too little runs as the padded batch (the
        # no-sharing rule), any other keeps its attention outputs for the recompute by default
        packed = padded if LAYOUT.dense_unshared_batches and runs_padded(forest) else estimate_bytes(
            config, forest.num_unique_tokens, True, keep_attention=LAYOUT.keep_attention, head_rows=plan.num_predictions)
        packed_bytes = max(packed_bytes, packed)
        children = forest.node_num_children
        branching.update(int(c) for c in children[children > 1])
    longest = max(len(s) for s in seqs)
    dfs_bytes = model.single_sequence(longest) + model.stack(longest, longest, False)
    report = Report(
        rows=len(seqs), forests=len(forests), total_tokens=sum(f.num_tokens for f in forests),
        unique_tokens=sum(f.num_unique_tokens for f in forests),
        depth_histogram=_length_bins([len(s) for s in seqs]), branching_histogram=dict(branching),
        flop_ratio=stock_flops / max(tree_flops, 1.0), stock_bytes=stock_bytes, packed_bytes=packed_bytes,
        dfs_bytes=dfs_bytes, model=model_name,
    )
    return report, forests


def sharded_gathering(config, gpus: int, gpu_memory_gib: float) -> dict:
    """What ``tree_gather="auto"`` would choose for a model of ``config`` trained with full parameters
    under FSDP2 over ``gpus`` GPUs of ``gpu_memory_gib`` GiB, at its first hold (before the optimizer
    has state): the rule of ``distributed/gathering.decide`` on estimates — the parameters counted
    on the meta device; the GPU holding the sharded fp32 parameters (Accelerate's FSDP2 keeps an fp32
    copy under bf16 mixed precision); the whole model gathered in bf16."""
    from .data.tiny import parameter_count
    from .distributed.gathering import decide, step_allocation

    if gpus < 1 or gpu_memory_gib <= 0:
        raise InspectError(f"--gpus must be at least 1 and --gpu-memory positive, got {gpus} and {gpu_memory_gib}")
    params = parameter_count(config)
    total = int(gpu_memory_gib * 2**30)
    local = -(-params // gpus)
    chosen = decide(2 * params, step_allocation(params, local, True), max(total - 4 * local, 0), total)
    return {"gpus": gpus, "gpu_memory_gib": gpu_memory_gib, "parameters": params,
            "sharded_state_gib": round(16 * local / 2**30, 2), "whole_bf16_gib": round(2 * params / 2**30, 2),
            "block": chosen.block, "reason": chosen.reason}


def gathering_lines(chosen: dict) -> list[str]:
    return [f"FSDP2 over {chosen['gpus']} GPU(s) of {chosen['gpu_memory_gib']:g} GiB, full parameters "
            f"({chosen['parameters'] / 1e9:.2f}B): sharded training state {chosen['sharded_state_gib']:.1f} GiB per GPU; "
            f"holding the model whole adds {chosen['whole_bf16_gib']:.1f} GiB",
            f"  {chosen['reason']} (docs/multi_gpu.md, tree_gather)"]


def draw_forest(forest, path: str, max_nodes: int = 4000) -> None:
    """An icicle picture of one forest: each node a bar from its first to its last depth, nodes in
    depth-first order top to bottom, so shared prefixes are the long bars that children hang from."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise InspectError("--png needs matplotlib: pip install 'trl-tree[bench]'") from e
    n = min(forest.num_nodes, max_nodes)
    depth, length = forest.node_depth[:n], forest.node_length[:n]
    fig, ax = plt.subplots(figsize=(9, max(2.5, min(12, n * 0.12))))
    ax.barh(np.arange(n), length, left=depth, height=0.8, color="#3b7dd8")
    ax.invert_yaxis()
    ax.set_xlabel("depth (tokens)")
    ax.set_ylabel("node (depth-first order)")
    ax.set_title(f"{forest.num_sequences} sequences: T = {forest.num_tokens:,}, U = {forest.num_unique_tokens:,}, "
                 f"T/U = {forest.dedup_ratio:.2f}" + (f" (first {n} of {forest.num_nodes} nodes)"
                                                       if n < forest.num_nodes else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
