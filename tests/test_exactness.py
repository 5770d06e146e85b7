"""Packed tree log-probs and gradients equal the untreed per-sequence computation (fp32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_grads_close, assert_logps_close, grads_of, weighted_loss
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_tree import PrefixForest, tree_backward, tree_logprobs
from trl_tree.engine import cost_model, packed
from trl_tree.engine.layout import LAYOUT
from trl_tree.engine.reference import untreed_backward, untreed_logprobs
from trl_tree.data.tiny import FAMILIES, grpo_group, random_tree, tiny_model

VOCAB = 96

WORKLOADS = {
    "grpo_group": grpo_group(12, 6, 6, VOCAB, num_prompts=2, seed=1),
    "multi_level": random_tree(14, VOCAB, max_len=20, seed=4),
    "prefix_of_another": [[4, 5, 6, 7, 8], [4, 5, 6], [4, 5, 6, 7, 8, 9, 10], [4, 5]],
    "duplicates": [[9, 8, 7, 6], [9, 8, 7, 6], [9, 8, 7, 6, 5], [9, 8, 7, 6]],
    "len_1_and_2": [[7], [7, 1], [8, 3], [7], [2]],
    "no_sharing": [[1, 2, 3, 4], [2, 3, 4], [3, 4, 5, 6, 7], [50]],
    "no_sharing_equal_lengths": [[1, 2, 3, 4, 5], [2, 3, 4, 5, 6], [9, 9, 9, 9, 9]],  # the dense-batch path
    "single": [[5, 4, 3, 2, 1, 0, 11]],
}


def check_exact(model, seqs, backend, temperature=1.0, score_from=None):
    tree = tree_logprobs(model, seqs, attn_backend=backend, temperature=temperature, score_from=score_from)
    ref = untreed_logprobs(model, seqs, temperature=temperature, score_from=score_from)
    assert_logps_close(tree, ref)
    model.zero_grad(set_to_none=True)
    loss_tree = tree_backward(model, seqs, weighted_loss, attn_backend=backend, temperature=temperature,
                              score_from=score_from)
    g_tree = grads_of(model)
    model.zero_grad(set_to_none=True)
    loss_ref = untreed_backward(model, seqs, weighted_loss, temperature=temperature, score_from=score_from)
    g_ref = grads_of(model)
    model.zero_grad(set_to_none=True)
    assert loss_tree == pytest.approx(loss_ref, rel=1e-5, abs=1e-5)
    assert_grads_close(g_tree, g_ref)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_workloads_qwen2(qwen2, workload, backend):
    check_exact(qwen2, WORKLOADS[workload], backend)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_model_families(family, backend):
    """Every decoder family that routes attention through the interface (GQA in all of them); Gemma-2
    and GPT-OSS have no SDPA implementation of their own (soft-cap, sinks): their model runs eager."""
    model = tiny_model(family, attn_implementation="eager" if family in ("gemma2", "gpt_oss") else backend)
    check_exact(model, WORKLOADS["multi_level"] + WORKLOADS["prefix_of_another"], backend)


def test_temperature_and_score_from(qwen2):
    seqs = WORKLOADS["grpo_group"]
    check_exact(qwen2, seqs, "sdpa", temperature=0.7, score_from=12)
    check_exact(qwen2, seqs, "sdpa", score_from=[12 + (i % 3) for i in range(len(seqs))])


def test_entropy(qwen2):
    seqs = WORKLOADS["multi_level"]
    logps, ents = tree_logprobs(qwen2, seqs, return_entropy=True, temperature=0.9)
    ref_logps, ref_ents = untreed_logprobs(qwen2, seqs, return_entropy=True, temperature=0.9)
    assert_logps_close(logps, ref_logps)
    assert_logps_close(ents, ref_ents)


def test_prebuilt_forest_and_tensor_inputs(qwen2):
    seqs = WORKLOADS["multi_level"]
    forest = PrefixForest.from_sequences([torch.tensor(s) for s in seqs])
    assert_logps_close(tree_logprobs(qwen2, forest), untreed_logprobs(qwen2, seqs))


def test_logprobs_are_differentiable_in_packed_mode(qwen2):
    seqs = WORKLOADS["grpo_group"]
    qwen2.zero_grad(set_to_none=True)
    logps = tree_logprobs(qwen2, seqs)
    sum(lp.sum() for lp in logps).backward()
    g_tree = grads_of(qwen2)
    qwen2.zero_grad(set_to_none=True)
    sum(lp.sum() for lp in untreed_logprobs(qwen2, seqs)).backward()
    assert_grads_close(g_tree, grads_of(qwen2))
    qwen2.zero_grad(set_to_none=True)


def test_no_grad_keeps_no_graph(qwen2):
    with torch.no_grad():
        logps = tree_logprobs(qwen2, WORKLOADS["grpo_group"])
    assert not any(lp.requires_grad for lp in logps)


def test_backward_accumulates_into_existing_grads(qwen2):
    seqs = WORKLOADS["prefix_of_another"]
    qwen2.zero_grad(set_to_none=True)
    tree_backward(qwen2, seqs, weighted_loss)
    tree_backward(qwen2, seqs, weighted_loss)
    twice = grads_of(qwen2)
    qwen2.zero_grad(set_to_none=True)
    untreed_backward(qwen2, seqs, weighted_loss)
    assert_grads_close(twice, {n: 2 * g for n, g in grads_of(qwen2).items()})
    qwen2.zero_grad(set_to_none=True)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=10), min_size=1, max_size=8),
    st.sampled_from(["sdpa", "eager"]),
)
def test_random_forests(qwen2, seqs, backend):
    check_exact(qwen2, seqs, backend)


def _recording_padded(monkeypatch) -> list:
    original, calls = packed._padded_hidden_states, []

    def recording(parts, batch, tokens=None):
        calls.append(batch)
        return original(parts, batch, tokens)

    monkeypatch.setattr(packed, "_padded_hidden_states", recording)
    return calls


def test_unshared_equal_lengths_run_as_a_dense_batch(qwen2, monkeypatch):
    """No sharing and one length: the model's own causal attention over a (B, L) batch that is the
    packed layout itself (nothing gathered), exact."""
    calls = _recording_padded(monkeypatch)
    check_exact(qwen2, WORKLOADS["no_sharing_equal_lengths"], "sdpa")
    assert calls and all(b.length == 5 and b.rows is None for b in calls)


@pytest.mark.parametrize("score_from", [None, 3])
def test_little_sharing_runs_as_stocks_padded_batch(qwen2, monkeypatch, score_from):
    """Padded tokens within ``PADDED_BATCH_MAX_RATIO`` of the unique ones (ragged lengths, a shared
    first token, a duplicate): the right-padded batch, each unique token read at its first
    occurrence — exact log-probs and gradients."""
    rng = np.random.default_rng(0)
    seqs = [[first, *rng.integers(1, 90, length - 1).tolist()] for first, length in ((5, 48), (5, 48), (7, 47), (9, 48))]
    forest = PrefixForest.from_sequences(seqs)
    assert forest.num_unique_tokens == forest.num_tokens - 1 and cost_model.runs_padded(forest)
    calls = _recording_padded(monkeypatch)
    check_exact(qwen2, seqs, "sdpa", score_from=score_from)
    assert calls and all(b.length == 48 and b.rows is not None for b in calls)


def test_the_padded_batch_rule(qwen2, monkeypatch):
    """One rule decides (``cost_model.runs_padded``): batches with something to save keep the tree,
    a MoE router keeps it (its loss would count the padding), and the layout switch turns it off."""
    def ratio(seqs):
        f = PrefixForest.from_sequences(seqs)
        return f.num_sequences * f.max_depth / f.num_unique_tokens

    assert ratio(WORKLOADS["duplicates"]) > cost_model.PADDED_BATCH_MAX_RATIO
    assert not cost_model.runs_padded(PrefixForest.from_sequences(WORKLOADS["duplicates"]))
    assert not cost_model.runs_padded(PrefixForest.from_sequences(WORKLOADS["no_sharing"]))  # ragged: padding
    equal = PrefixForest.from_sequences(WORKLOADS["no_sharing_equal_lengths"])
    assert cost_model.runs_padded(equal) and not cost_model.runs_padded(equal, router=True)
    monkeypatch.setattr(LAYOUT, "dense_unshared_batches", False)
    calls = _recording_padded(monkeypatch)
    check_exact(qwen2, WORKLOADS["no_sharing_equal_lengths"], "sdpa")
    assert not calls
