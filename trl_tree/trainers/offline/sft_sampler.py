"""The prefix-aware sampler of ``TreeSFTTrainer`` (``tree_shuffle='groups'``) and the construction
line that says what it would buy.

In SFT the tree's gain comes from the order of the samples: per-turn samples of one conversation
share its whole history, but TRL's random order scatters them over the epoch, so a micro-batch
rarely holds two of them. The sampler walks the samples' trie in a random depth-first order — every
epoch a new one — and cuts that order into micro-batches: samples that share prefixes land together.

How, without building the dataset's trie: sort the samples once (any lexicographic order keeps each
subtree contiguous) and take the longest common prefix of neighbours; a node of the trie is a range
of that order whose inner prefixes are at least its depth. Each epoch the ranges' children are
visited in a random order (an exact random DFS of the trie), and the unique tokens of any run of
consecutive samples follow from the neighbours' common prefixes (``U = sum(len) - sum(lcp)``).

Micro-batches keep stock's ``per_device_train_batch_size`` samples; each sample is drawn exactly
once per epoch. With several processes, Accelerate hands consecutive micro-batches to the ranks in
turn, so each step's micro-batches are chosen of similar cost (unique tokens plus attention over
depth) before the steps are shuffled. The order depends only on ``(seed, epoch)``, so a run
resumed from a checkpoint skips into the same order.
"""

from __future__ import annotations

import logging

import numpy as np
from torch.utils.data import Sampler

from ...engine.forest import common_prefix, trie_key

logger = logging.getLogger(__name__)

#: above this many samples the construction estimate reads a random subset of this size
ESTIMATE_SAMPLES = 20000


class SampleTrie:
    """The samples' token sequences in one lexicographic order, with their neighbours' common
    prefixes: everything a random depth-first order of their trie needs."""

    def __init__(self, sequences: list[np.ndarray]):
        self.sequences = [np.asarray(s, dtype=np.int64) for s in sequences]
        self.lengths = np.array([s.size for s in self.sequences], dtype=np.int64)
        keys = [trie_key(s) for s in self.sequences]
        self.order = np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
        # lcp[k]: common prefix of order[k - 1] and order[k]; lcp[0] = 0
        self.lcp = np.zeros(len(self.order), dtype=np.int64)
        for k in range(1, len(self.order)):
            self.lcp[k] = common_prefix(self.sequences[self.order[k - 1]], self.sequences[self.order[k]])

    def random_dfs(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``(samples, lcp)``: the samples in a random depth-first order of the trie (children of
        every node shuffled) and each one's common prefix with the one before it."""
        n = len(self.order)
        out, out_lcp = np.empty(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        filled = 0
        stack = [(0, n, 0)]  # (start, stop, lcp with the sample placed before this range)
        while stack:
            start, stop, before = stack.pop()
            if stop - start == 1:
                out[filled], out_lcp[filled] = self.order[start], before
                filled += 1
                continue
            inner = self.lcp[start + 1 : stop]
            depth = int(inner.min())
            cuts = [start] + (np.flatnonzero(inner == depth) + start + 1).tolist() + [stop]
            children = list(zip(cuts[:-1], cuts[1:]))
            rng.shuffle(children)
            # pushed in reverse so they are taken in the shuffled order; the first keeps ``before``
            for k in range(len(children) - 1, -1, -1):
                a, b = children[k]
                stack.append((a, b, before if k == 0 else depth))
        return out, out_lcp

    def run_cost(self, samples: np.ndarray, lcp: np.ndarray, attention_weight: float) -> tuple[int, int, float]:
        """``(T, U, cost)`` of consecutive samples of a depth-first order: total and unique tokens,
        and unique tokens plus ``attention_weight`` times the keys their queries see."""
        lengths = self.lengths[samples]
        shared = lcp.copy()
        shared[0] = 0
        total, unique = int(lengths.sum()), int((lengths - shared).sum())
        keys = float(((lengths * (lengths + 1) - shared * (shared + 1)) // 2).sum())
        return total, unique, unique + attention_weight * keys

    def chunk_ratio(self, chunks: list[np.ndarray], parts: list[list[np.ndarray]] | None = None) -> float:
        """T/U of micro-batches given as sample indices in any order; ``parts[i]``: the sequences
        sample ``i`` puts in the forest (a DPO pair: prompt + chosen and prompt + rejected), else
        its own sequence."""
        total = unique = 0
        for chunk in chunks:
            seqs = [s for i in chunk for s in parts[i]] if parts is not None else [self.sequences[i] for i in chunk]
            sub = SampleTrie(seqs)
            t, u, _ = sub.run_cost(np.arange(len(seqs))[sub.order], sub.lcp, 0.0)
            total, unique = total + t, unique + u
        return total / max(unique, 1)


class PrefixGroupedSampler(Sampler[int]):
    """Sample indices in micro-batches of ``batch_size`` that share prefixes (module docstring).

    ``num_replicas``: processes that each take one micro-batch per step (their micro-batches are
    matched by cost). ``attention_weight``: the cost of one visible key relative to one token's
    forward (about ``1 / (6 · hidden size)``)."""

    def __init__(self, sequences: list[np.ndarray], batch_size: int, num_replicas: int = 1, seed: int = 0,
                 attention_weight: float = 0.0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.trie = SampleTrie(sequences)
        self.batch_size, self.num_replicas, self.seed = batch_size, max(num_replicas, 1), seed
        self.attention_weight = attention_weight
        self.epoch = 0

    @classmethod
    def for_trainer(cls, trainer, dataset, sequences: list[np.ndarray] | None = None) -> PrefixGroupedSampler:
        """The sampler of ``trainer``'s training data: ``sequences`` (one per sample) or the tokenised
        samples of ``dataset`` (``dataset_sequences``)."""
        sequences = dataset_sequences(trainer, dataset) if sequences is None else sequences
        args = trainer.args
        hidden = getattr(trainer.model.config.get_text_config(), "hidden_size", None) or 1024
        return cls(sequences, args.per_device_train_batch_size, trainer.accelerator.num_processes,
                   args.data_seed if args.data_seed is not None else args.seed, 1.0 / (6 * hidden))

    def set_epoch(self, epoch: int) -> None:
        """The Trainer calls this before each epoch (and on resume, before skipping into it)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.trie.order)

    def __iter__(self):
        return iter(self.micro_batches(self.epoch)[0].tolist())

    def micro_batches(self, epoch: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """``(order, chunks)``: the epoch's sample order and its micro-batches (consecutive
        ``batch_size`` pieces of it; a short last piece stays last, where the data loader cuts it)."""
        rng = np.random.default_rng([self.seed, epoch, 0x5F7])
        samples, lcp = self.trie.random_dfs(rng)
        b, n = self.batch_size, len(samples)
        full = n // b
        chunks = [np.arange(k * b, (k + 1) * b) for k in range(full)]
        costs = np.array([self.trie.run_cost(samples[c], lcp[c], self.attention_weight)[2] for c in chunks])
        # steps of num_replicas micro-batches of similar cost (one per rank), then the steps shuffled
        by_cost = np.argsort(-costs, kind="stable") if self.num_replicas > 1 else rng.permutation(full)
        r = self.num_replicas
        steps = [by_cost[k : k + r] for k in range(0, full, r)]
        rng.shuffle(steps)
        picked = [chunks[i] for step in steps for i in step]
        if n % b:
            picked.append(np.arange(full * b, n))
        order = samples[np.concatenate(picked)] if picked else samples
        return order, [order[k : k + b] for k in range(0, n, b)]


def dataset_sequences(trainer, dataset) -> list[np.ndarray]:
    """The tokenised samples of a prepared SFT dataset (its ``input_ids`` column)."""
    name = type(trainer).__name__  # (packing with groups is refused by TreeSFTConfig)
    columns = getattr(dataset, "column_names", None) or []
    if "input_ids" not in columns:
        raise ValueError(f"{name}: tree_shuffle='groups' reads the tokenised samples (an 'input_ids' column), which "
                         f"this dataset does not have (columns: {columns}); leave skip_prepare_dataset off or "
                         "tokenise the dataset first")
    return [np.asarray(ids, dtype=np.int64) for ids in dataset["input_ids"]]


def grouping_estimate(sequences: list[np.ndarray], batch_size: int, seed: int = 0,
                      parts: list[list[np.ndarray]] | None = None) -> tuple[float, float]:
    """``(T/U in a random order, T/U with the sampler)`` over micro-batches of ``batch_size``
    (``parts`` as in ``SampleTrie.chunk_ratio``)."""
    rng = np.random.default_rng(seed)
    if len(sequences) > ESTIMATE_SAMPLES:  # the same density of neighbours: a random subset, as many batches
        keep = np.sort(rng.choice(len(sequences), ESTIMATE_SAMPLES, replace=False))
        sequences = [sequences[i] for i in keep]
        parts = [parts[i] for i in keep] if parts is not None else None
    sampler = PrefixGroupedSampler(sequences, batch_size, seed=seed)
    order = rng.permutation(len(sequences))
    random_chunks = [order[k : k + batch_size] for k in range(0, len(order), batch_size)]
    _, grouped = sampler.micro_batches(0)
    return sampler.trie.chunk_ratio(random_chunks, parts), sampler.trie.chunk_ratio(grouped, parts)


def pair_sequences(dataset) -> tuple[list[np.ndarray], list[list[np.ndarray]]] | None:
    """A prepared DPO dataset's pairs: each one's prompt + chosen (what the sampler orders by) and
    its two rows (what the forest holds); None without the tokenised columns."""
    columns = getattr(dataset, "column_names", None) or []
    if not {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(columns):
        return None
    prompts, chosen, rejected = dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"]
    rows = [[np.asarray(p + c, dtype=np.int64), np.asarray(p + r, dtype=np.int64)]
            for p, c, r in zip(prompts, chosen, rejected)]
    return [r[0] for r in rows], rows


def announce_grouping(trainer, pairs: bool = False) -> None:
    """One line at construction: T/U in TRL's order and with ``tree_shuffle='groups'``, or that the
    samples share nothing (the tree then gives nothing, and its calls run as stock's padded batch).
    ``pairs``: the dataset is DPO's (each sample two rows sharing its prompt)."""
    args, dataset = trainer.args, trainer.train_dataset
    if not trainer.accelerator.is_main_process or dataset is None:
        return
    parts = None
    if pairs:
        found = pair_sequences(dataset)
        if found is None:
            return
        sequences, parts = found
    else:
        columns = getattr(dataset, "column_names", None) or []  # None for a streaming dataset
        if "input_ids" not in columns or args.packing or not hasattr(dataset, "__len__"):
            return
        sequences = [np.asarray(ids, dtype=np.int64) for ids in dataset["input_ids"]]
    if len(sequences) < 2:
        return
    stock, grouped = grouping_estimate(sequences, args.per_device_train_batch_size, args.seed, parts)
    name = type(trainer).__name__
    if grouped < 1.05:
        logger.warning("%s: the samples share almost no prefixes (T/U %.2f even with tree_shuffle='groups'): the tree "
                       "gives nothing here; its calls run as stock's padded batch where nothing is shared", name,
                       grouped)
    elif args.tree_shuffle == "groups":
        logger.warning("%s: tree_shuffle='groups': T/U %.2f per micro-batch (%.2f in TRL's order); it changes which "
                       "samples share a step, not a token's weight", name, grouped, stock)
    else:
        logger.warning("%s: T/U %.2f in TRL's order, %.2f with tree_shuffle='groups'; that changes which samples share "
                       "a step (never a token's weight)", name, stock, grouped)
