"""The prefix-grouped sampler: every sample once per epoch, a new order each epoch, the same order
for the same (seed, epoch) — what resuming needs — and micro-batches that share prefixes."""

import re

import numpy as np
import pytest
import torch
from sft_harness import dataset, run, save_sft_checkpoint
from test_examples_learn import run_example

from trl_tree import PrefixForest, TreeSFTConfig, TreeSFTTrainer
from trl_tree.trainers.offline.sft_sampler import PrefixGroupedSampler, SampleTrie, grouping_estimate


def _per_turn_samples(conversations=12, turns=5, seed=0):
    """One sample per turn of each conversation (its history as the prefix), a shared system prompt."""
    rng = np.random.default_rng(seed)
    system = list(rng.integers(3, 50, 20))
    out = []
    for _ in range(conversations):
        history = list(system)
        for _ in range(turns):
            history = history + list(rng.integers(3, 50, int(rng.integers(3, 12))))
            out.append(np.array(history))
    return [out[i] for i in rng.permutation(len(out))]


def _ratio(seqs, chunks):
    forests = [PrefixForest.from_sequences([seqs[i].tolist() for i in c]) for c in chunks]
    return sum(f.num_tokens for f in forests) / sum(f.num_unique_tokens for f in forests)


def test_every_sample_once_and_a_new_order_each_epoch():
    seqs = _per_turn_samples()
    sampler = PrefixGroupedSampler(seqs, batch_size=4, seed=3)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert sorted(order) == list(range(len(seqs)))
        orders.append(order)
    assert orders[0] != orders[1] != orders[2]
    again = PrefixGroupedSampler(seqs, batch_size=4, seed=3)  # a resumed run: a fresh sampler, same epoch
    again.set_epoch(1)
    assert list(again) == orders[1]


def test_micro_batches_share_prefixes_and_unique_tokens_are_counted_right():
    seqs = _per_turn_samples()
    sampler = PrefixGroupedSampler(seqs, batch_size=5)
    order, chunks = sampler.micro_batches(0)
    grouped = _ratio(seqs, chunks)
    random_order = np.random.default_rng(0).permutation(len(seqs))
    stock = _ratio(seqs, [random_order[k : k + 5] for k in range(0, len(seqs), 5)])
    assert grouped > 1.5 * stock
    stock_est, grouped_est = grouping_estimate(seqs, 5)
    assert grouped_est == pytest.approx(grouped)  # the trie's count is the forest's
    assert stock_est < grouped_est
    # a random depth-first order: each run's unique tokens from neighbours' common prefixes
    samples, lcp = sampler.trie.random_dfs(np.random.default_rng(1))
    for k in range(0, len(samples), 7):
        run_ = slice(k, k + 7)
        _, unique, _ = sampler.trie.run_cost(samples[run_], lcp[run_], 0.0)
        assert unique == PrefixForest.from_sequences([seqs[i].tolist() for i in samples[run_]]).num_unique_tokens


def test_ranks_get_micro_batches_of_similar_cost():
    seqs = _per_turn_samples(conversations=16)
    sampler = PrefixGroupedSampler(seqs, batch_size=2, num_replicas=2, attention_weight=1e-3)
    _, chunks = sampler.micro_batches(0)
    trie = SampleTrie(seqs)

    def cost(chunk):
        sub = SampleTrie([seqs[i] for i in chunk])
        return sub.run_cost(np.arange(len(chunk))[sub.order], sub.lcp, 1e-3)[2]

    full = [c for c in chunks if len(c) == 2]
    gaps = [abs(cost(a) - cost(b)) / max(cost(a), cost(b)) for a, b in zip(full[0::2], full[1::2])]
    assert np.median(gaps) < 0.2
    assert trie.lengths.sum() == sum(len(s) for s in seqs)


def test_short_last_micro_batch_stays_last():
    seqs = _per_turn_samples(conversations=3, turns=3)  # 9 samples, batches of 4
    order, chunks = PrefixGroupedSampler(seqs, batch_size=4).micro_batches(2)
    assert [len(c) for c in chunks] == [4, 4, 1]


def test_trainer_with_groups_trains_every_sample_once(tmp_path):
    checkpoint = save_sft_checkpoint(tmp_path / "tiny")
    data = dataset("turns", n=4, turns=3)  # 12 samples, 3 micro-batches of 4
    _, log = run(TreeSFTTrainer, TreeSFTConfig, checkpoint, data, tree_shuffle="groups", max_steps=-1,
                 num_train_epochs=1, dtype=torch.float32)
    steps = [e for e in log if "loss" in e]
    assert len(steps) == 3
    assert sum(e["tree/total_tokens"] for e in steps) == steps[-1]["num_tokens"]
    _, stock_log = run(TreeSFTTrainer, TreeSFTConfig, checkpoint, data, max_steps=-1, num_train_epochs=1)
    grouped = sum(e["tree/total_tokens"] for e in steps) / sum(e["tree/unique_tokens"] for e in steps)
    stock = sum(e["tree/total_tokens"] for e in stock_log if "loss" in e) / sum(
        e["tree/unique_tokens"] for e in stock_log if "loss" in e)
    assert grouped > stock


def test_groups_refuse_packing(tmp_path):
    checkpoint = save_sft_checkpoint(tmp_path / "tiny")
    with pytest.raises(ValueError, match="packing=True fixed the rows"):
        run(TreeSFTTrainer, TreeSFTConfig, checkpoint, dataset("turns"), tree_shuffle="groups", packing=True,
            max_length=128)


def test_a_resumed_run_continues_in_the_same_order(tmp_path):
    """Stopped after one step of an epoch and resumed from its checkpoint: the later micro-batches
    (and losses) are the uninterrupted run's."""
    checkpoint = save_sft_checkpoint(tmp_path / "tiny")
    data = dataset("turns", n=4, turns=3)
    config = dict(tree_shuffle="groups", max_steps=-1, num_train_epochs=2, per_device_train_batch_size=3,
                  save_strategy="steps", save_steps=5, output_dir=str(tmp_path / "out"))
    _, full = run(TreeSFTTrainer, TreeSFTConfig, checkpoint, data, **config)
    _, resumed = run(TreeSFTTrainer, TreeSFTConfig, checkpoint, data, **config,
                     resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-5"))
    full_steps = [e for e in full if "loss" in e]
    later = [e for e in resumed if "loss" in e][5:]  # the log before the checkpoint comes back with it
    assert len(full_steps) == 8 and len(later) == 3
    for a, b in zip(full_steps[5:], later):
        assert b["tree/total_tokens"] == a["tree/total_tokens"] and b["tree/unique_tokens"] == a["tree/unique_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


@pytest.mark.slow
def test_sft_example_learns(monkeypatch, capsys, tmp_path):
    """``examples/sft_tree.py``, shortened: the loss falls by at least 10% and the grouped per-turn
    samples share their histories."""
    run_example("sft_tree.py", ["--steps", "24", "--conversations", "32"], monkeypatch, tmp_path)
    out = capsys.readouterr().out
    match = re.search(r"loss ([0-9.]+) -> ([0-9.]+) \(first -> last quarter.*T/U ([0-9.]+)", out)
    assert match, out[-2000:]
    first, last, ratio = map(float, match.groups())
    assert last <= 0.9 * first and ratio > 2.0, match.group(0)
    assert not list(tmp_path.iterdir()), "the example left its temporary folder behind"
