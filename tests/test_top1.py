"""``tree_logprobs(return_top1=True)``: whether each scored token is the head's argmax, as TRL's
fused head reports it (SFT's token accuracy), in both modes and on the padded path."""

import pytest
import torch

from trl_tree import tree_logprobs
from trl_tree.layout import LAYOUT
from trl_tree.tiny import tiny_model


def _argmax_flags(model, seqs, score_from):
    flags = []
    for seq, first in zip(seqs, score_from):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, :-1]
        flags.append(logits.argmax(-1)[first - 1 :] == torch.tensor(seq[first:]))
    return flags


@pytest.mark.parametrize("mode", ["packed", "dfs"])
def test_top1_matches_the_logits_argmax(mode):
    torch.manual_seed(0)
    model = tiny_model("qwen2", seed=1).eval()
    base = [5, 7, 5, 7, 5, 7, 5, 7, 9]
    with torch.no_grad():  # a greedy continuation: its targets are the argmax
        greedy = model.generate(torch.tensor([base]), max_new_tokens=4, do_sample=False, pad_token_id=0)[0].tolist()
    seqs = [greedy, base + [3, 3, 3], base[:4] + [11, 12], [1, 2, 3]]
    score_from = [9, 9, 2, 1]
    with torch.no_grad():
        logps, top1 = tree_logprobs(model, seqs, mode, score_from=score_from, return_top1=True)
    expected = _argmax_flags(model, seqs, score_from)
    for got, want, lp in zip(top1, expected, logps):
        assert got.dtype == torch.bool and got.shape == lp.shape
        assert torch.equal(got, want)
    assert any(t.any() for t in top1)


def test_top1_on_the_padded_path(monkeypatch):
    model = tiny_model("llama", seed=2).eval()
    seqs = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]  # nothing shared: stock's padded batch
    monkeypatch.setattr(LAYOUT, "dense_unshared_batches", True)
    with torch.no_grad():
        _, ent, top1 = tree_logprobs(model, seqs, score_from=1, return_entropy=True, return_top1=True)
    for got, want in zip(top1, _argmax_flags(model, seqs, [1, 1])):
        assert torch.equal(got, want)
