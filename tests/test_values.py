"""``tree_values`` / ``tree_value_backward`` and ``value_head=`` beside the log-probs: a critic's
values over the tree equal the untreed per-sequence ones, and so do the gradients (fp32, packed and
dfs) — for a token-classification value model and for a head on a causal LM's trunk."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_grads_close, assert_logps_close, grads_of
from transformers import AutoModelForTokenClassification

from trl_tree import tree_backward, tree_logprobs, tree_value_backward, tree_values
from trl_tree.engine.reference import untreed_logprobs
from trl_tree.data.tiny import random_tree, tiny_config, tiny_model

SEQS = [s for s in random_tree(10, 96, max_len=20, seed=1) if len(s) >= 3]
SCORE_FROM = [1 + i % 2 for i in range(len(SEQS))]


def untreed_values(model, head, seqs, score_from):
    """Each sequence alone through the backbone; the head at the state before each scored token."""
    out = []
    for seq, first in zip(seqs, score_from):
        hidden = model.base_model(input_ids=torch.tensor(seq)[None]).last_hidden_state[0]
        out.append(head(hidden[first - 1 : -1]).squeeze(-1))
    return out


def value_loss(v, seq_idx, pos):
    return (v - 0.1 * pos.float()) ** 2 * (1 + seq_idx.float())


@pytest.fixture(scope="module")
def value_model():
    torch.manual_seed(0)
    return AutoModelForTokenClassification.from_config(tiny_config("qwen2", num_labels=1),
                                                       attn_implementation="sdpa").eval()


@pytest.mark.parametrize("mode", ["packed", "dfs"])
def test_value_model_values_and_gradients(value_model, mode):
    ref = untreed_values(value_model, value_model.score, SEQS, SCORE_FROM)
    assert_logps_close(tree_values(value_model, SEQS, value_model.score, mode=mode, score_from=SCORE_FROM), ref)
    value_model.zero_grad()
    for i, (v, first) in enumerate(zip(ref, SCORE_FROM)):
        pos = torch.arange(first - 1, first - 1 + v.shape[0])
        value_loss(v, torch.full_like(pos, i), pos).sum().backward()
    ref_grads = grads_of(value_model)
    value_model.zero_grad()
    tree_value_backward(value_model, SEQS, value_loss, value_model.score, mode=mode, score_from=SCORE_FROM)
    assert_grads_close(grads_of(value_model), ref_grads)


@pytest.mark.parametrize("mode", ["packed", "dfs"])
def test_head_on_the_policy_trunk_beside_the_logprobs(mode):
    policy = tiny_model("qwen2")
    torch.manual_seed(1)
    head = torch.nn.Linear(32, 1)
    logps, values = tree_logprobs(policy, SEQS, mode=mode, score_from=SCORE_FROM, value_head=head)
    ref_logps = untreed_logprobs(policy, SEQS, score_from=SCORE_FROM)
    ref_values = untreed_values(policy, head, SEQS, SCORE_FROM)
    assert_logps_close(logps, ref_logps)
    assert_logps_close(values, ref_values)

    def joint(lp, seq_idx, pos, values):
        return -lp * (1 + pos.float()) + (values - 1) ** 2

    policy.zero_grad()
    head.zero_grad()
    for i, (lp, v, first) in enumerate(zip(untreed_logprobs(policy, SEQS, score_from=SCORE_FROM),
                                           untreed_values(policy, head, SEQS, SCORE_FROM), SCORE_FROM)):
        pos = torch.arange(first - 1, first - 1 + lp.shape[0])
        joint(lp, torch.full_like(pos, i), pos, values=v).sum().backward()
    ref = {**grads_of(policy), **{f"head.{k}": g for k, g in grads_of(head).items()}}
    policy.zero_grad()
    head.zero_grad()
    tree_backward(policy, SEQS, joint, mode=mode, score_from=SCORE_FROM, value_head=head)
    assert_grads_close({**grads_of(policy), **{f"head.{k}": g for k, g in grads_of(head).items()}}, ref)


def test_bad_value_heads_refused(value_model):
    with pytest.raises(TypeError, match="value_head must be a torch.nn.Module"):
        tree_values(value_model, SEQS, lambda h: h.sum(-1))
    with pytest.raises(ValueError, match="one value each"):
        tree_values(value_model, SEQS, torch.nn.Linear(32, 2))
