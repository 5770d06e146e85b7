"""TRL async GRPO's packed trie row read back as sequences (``trainers/asynchronous/trie_rows.py``): the tree's
log-probs put in stock's packed layout are each sample's own, term by term (fp32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("trl.experimental.async_grpo")
from trl.experimental.async_grpo.packing import TreeRow

from trl_tree import tree_logprobs
from trl_tree.engine.reference import untreed_logprobs
from trl_tree.trainers.offline.sft_rows import SFTRows
from trl_tree.trainers.asynchronous.trie_rows import TrieRow


def forking_samples(seed: int = 0) -> list[dict]:
    """A multi-turn conversation forking into rows (shared system prompt and turns, tool outputs not
    trained), a second group, a sample equal to another and one that is a prefix of another."""
    rng = np.random.default_rng(seed)

    def tok(n):
        return rng.integers(2, 96, n).tolist()

    system, turn1, tool = tok(12), tok(5), tok(4)
    branches = [system + turn1 + tool + tok(int(rng.integers(2, 6))) for _ in range(3)]
    branches.append(system + turn1 + tok(3))
    other = tok(9)
    rows = [(b, 12) for b in branches] + [(other + tok(4), 9), (other + tok(5), 9)]
    rows.append(rows[0])  # an equal sample: its own terms, the same leaf
    rows.append((rows[4][0][:11], 9))  # a prefix of another sample
    samples = []
    for i, (ids, prompt) in enumerate(rows):
        mask = np.zeros(len(ids), dtype=np.int64)
        mask[prompt:] = 1
        if i < 3:
            mask[12 + 5 : 12 + 5 + 4] = 0  # the tool's output is context, not trained
        samples.append({"input_ids": torch.tensor(ids), "completion_mask": torch.tensor(mask),
                        "old_log_probs": torch.zeros(len(ids)), "advantage": float(i), "group_id": int(i >= 4)})
    return samples


def packed_row(samples):
    row = TreeRow()
    for s in samples:
        row.add(s)
    return row.pack()


def trie_of(packed) -> TrieRow:
    return TrieRow.from_packed(packed["input_ids"], packed["position_ids"], packed["shift_labels"],
                               packed["tree_kv_index"], packed["tree_cu_seqlens_q"], packed["tree_cu_seqlens_k"])


def test_leaves_are_the_distinct_samples():
    samples = forking_samples()
    trie = trie_of(packed_row(samples))
    assert sorted(map(tuple, trie.sequences)) == sorted({tuple(s["input_ids"].tolist()) for s in samples})


@pytest.mark.parametrize("mode", ["packed", "dfs"])
def test_stock_terms_get_each_samples_log_probs(qwen2, mode):
    samples = forking_samples(1)
    packed = packed_row(samples)
    trie = trie_of(packed)
    logps = tree_logprobs(qwen2, trie.sequences, mode)
    width = max(len(s) for s in trie.sequences)
    grid = torch.zeros(len(trie.sequences), width - 1)
    for i, lp in enumerate(logps):
        grid[i, : lp.shape[0]] = lp
    terms = trie.to_packed(grid).flatten()[packed["token_index"]]  # what stock's loss reads
    ref = untreed_logprobs(qwen2, [s["input_ids"].tolist() for s in samples])
    want = torch.cat([ref[i][s["completion_mask"][1:].bool()] for i, s in enumerate(samples)])
    assert terms.shape == want.shape
    torch.testing.assert_close(terms, want, atol=1e-5, rtol=0)


def test_padded_batch_is_what_the_fused_head_scores():
    samples = forking_samples(2)
    trie = trie_of(packed_row(samples))
    batch = trie.padded_batch(pad_token_id=0)
    rows = SFTRows.from_batch(batch, "test")  # labels are the next tokens: accepted
    assert not rows.empty
    assert int((batch["labels"] != -100).sum()) == trie.labelled.shape[0]


def test_a_label_that_is_not_the_next_token_is_refused():
    packed = packed_row(forking_samples(3))
    labels = packed["shift_labels"].clone()
    p = int(torch.nonzero(labels != -100)[0])
    labels[p] = (labels[p] + 1) % 96
    with pytest.raises(ValueError, match=f"packed position {p} is trained to predict"):
        TrieRow.from_packed(packed["input_ids"], packed["position_ids"], labels, packed["tree_kv_index"],
                            packed["tree_cu_seqlens_q"], packed["tree_cu_seqlens_k"])
