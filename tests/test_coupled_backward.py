"""``tree_backward(coupled=...)``: a loss on whole sequences (DPO's, on each pair's summed
log-probs) computed unit by unit where the walk keeps every pair in one unit (one pass), and from
a scoring walk's gradients where it does not (two passes) — both against autograd on the untreed
sequences, in fp32. ``head_outputs`` (the entropy among them, as a constant) reach the loss as
keywords."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_grads_close, grads_of

from trl_tree import TreeOptions, tree_backward, tree_logprobs
from trl_tree.engine import api as engine_module
from trl_tree.engine.reference import untreed_logprobs
from trl_tree.data.tiny import tiny_model


def _pairs_data(seed: int = 0):
    """Three prompts, two preference pairs each; sequence ``2k`` is a pair's chosen, ``2k + 1`` its rejected."""
    rng = np.random.default_rng(seed)
    seqs, score_from = [], []
    for _ in range(3):
        prompt = rng.integers(0, 90, int(rng.integers(8, 14))).tolist()
        for _ in range(4):
            seqs.append(prompt + rng.integers(0, 90, int(rng.integers(3, 7))).tolist())
            score_from.append(len(prompt))
    return seqs, score_from


def _pair_loss(num_seqs: int, seen: list | None = None):
    """Mean over pairs of ``-logsigmoid(0.5 (Σ chosen - Σ rejected))`` from the terms it is given;
    asserts that each call sees both sequences of a pair or neither. Its value rides on one term."""
    chosen = torch.arange(0, num_seqs, 2)
    rejected = chosen + 1

    def token_loss(lp, seq_idx, pos, **extra):
        if seen is not None:
            seen.append(extra)
        sums = lp.new_zeros(num_seqs).index_add(0, seq_idx, lp)
        present = torch.zeros(num_seqs, dtype=torch.bool)
        present[seq_idx] = True
        assert torch.equal(present[chosen], present[rejected]), "a pair split between two calls"
        here = present[chosen]
        per_pair = -F.logsigmoid(0.5 * (sums[chosen] - sums[rejected]))
        loss = per_pair[here].sum() / chosen.shape[0]
        return lp * 0 + F.one_hot(torch.tensor(0), lp.shape[0]).to(lp.dtype) * loss

    return token_loss


def _untreed(model, seqs, score_from):
    model.zero_grad(set_to_none=True)
    logps = untreed_logprobs(model, seqs, score_from=score_from)
    sums = torch.stack([lp.sum() for lp in logps])
    loss = -F.logsigmoid(0.5 * (sums[0::2] - sums[1::2])).mean()
    loss.backward()
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


#: a memory budget whose groups hold whole trees (on the CPU the walk's default sizes them to the
#: longest sequence, which pushes every prompt: its pairs' first terms then sit in the prompt's unit)
WHOLE_TREES = TreeOptions(memory_budget=1 << 30)


@pytest.mark.parametrize("mode, options, passes", [("packed", None, 1), ("dfs", WHOLE_TREES, 1),
                                                   ("dfs", TreeOptions(), 2), ("dfs", TreeOptions(chunk_size=5), 2)])
def test_a_pair_loss_matches_the_untreed_sequences(monkeypatch, mode, options, passes):
    model = tiny_model("qwen2", seed=3)
    seqs, score_from = _pairs_data()
    want_loss, want = _untreed(model, seqs, score_from)
    linearised = []
    original = engine_module._linearised_loss
    monkeypatch.setattr(engine_module, "_linearised_loss", lambda *a: linearised.append(1) or original(*a))
    groups = np.arange(len(seqs)) // 2
    loss = tree_backward(model, seqs, _pair_loss(len(seqs)), mode, options=options, score_from=score_from,
                         coupled=groups)
    assert len(linearised) == passes - 1  # one pass where the walk keeps the pairs whole
    assert_grads_close(grads_of(model), want)
    if passes == 2:  # the value of the one call on every term
        assert loss == pytest.approx(want_loss, rel=1e-5)


def test_the_loss_gets_the_head_outputs():
    model = tiny_model("qwen2", seed=3)
    seqs, score_from = _pairs_data(1)
    with torch.no_grad():
        _, ent, mean, top1 = tree_logprobs(model, seqs, "dfs", score_from=score_from, return_entropy=True,
                                           head_outputs=("mean_logits", "is_top1"))
    for mode, options in (("packed", None), ("dfs", WHOLE_TREES), ("dfs", TreeOptions(chunk_size=5))):
        seen = []
        tree_backward(model, seqs, _pair_loss(len(seqs), seen), mode, options=options,
                      score_from=score_from, coupled=np.arange(len(seqs)) // 2,
                      head_outputs=("mean_logits", "is_top1", "entropy"))
        got_ent = torch.cat([s["entropy"] for s in seen])
        assert not got_ent.requires_grad  # a constant, unlike with_entropy's
        torch.testing.assert_close(got_ent.sort().values, torch.cat(ent).sort().values, rtol=1e-5, atol=1e-5)
        got_mean = torch.cat([s["mean_logits"] for s in seen])
        got_top1 = torch.cat([s["is_top1"] for s in seen])
        assert got_top1.dtype == torch.bool and got_mean.shape == got_top1.shape
        torch.testing.assert_close(got_mean.sort().values, torch.cat(mean).sort().values, rtol=1e-5, atol=1e-5)
        assert int(got_top1.sum()) == int(torch.cat(top1).sum())


def test_bad_coupling_is_refused():
    model = tiny_model("qwen2", seed=3)
    seqs, score_from = _pairs_data()
    with pytest.raises(ValueError, match="one integer group id per sequence"):
        tree_backward(model, seqs, _pair_loss(len(seqs)), "dfs", score_from=score_from, coupled=[0, 1])
    with pytest.raises(ValueError, match="head_outputs"):
        tree_backward(model, seqs, _pair_loss(len(seqs)), "dfs", score_from=score_from, head_outputs=("logits",))
