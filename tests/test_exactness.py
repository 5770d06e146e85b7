"""Packed tree log-probs and gradients equal the untreed per-sequence computation (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_grads_close, assert_logps_close, grads_of, weighted_loss
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_tree import PrefixForest, packed, tree_backward, tree_logprobs
from trl_tree.reference import untreed_backward, untreed_logprobs
from trl_tree.tiny import FAMILIES, grpo_group, random_tree, tiny_model

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


def test_unshared_equal_lengths_run_as_a_dense_batch(qwen2, monkeypatch):
    """No sharing and one length: the model's own causal attention over a (B, L) batch, exact; with
    sharing or ragged lengths the tree layout is used."""

    seqs = WORKLOADS["no_sharing_equal_lengths"]
    assert packed.dense_row_length(PrefixForest.from_sequences(seqs)) == 5
    assert packed.dense_row_length(PrefixForest.from_sequences(WORKLOADS["no_sharing"])) is None
    assert packed.dense_row_length(PrefixForest.from_sequences(WORKLOADS["duplicates"])) is None
    original, calls = packed._dense_hidden_states, []

    def recording(*args):
        calls.append(args[2])
        return original(*args)

    monkeypatch.setattr(packed, "_dense_hidden_states", recording)
    check_exact(qwen2, seqs, "sdpa")
    assert calls and set(calls) == {5}
