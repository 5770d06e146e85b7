"""``tree_logprobs(head_outputs=...)``: the fused head's by-products per scored token — whether the
target is the argmax (SFT's token accuracy), the mean logit (DPO's ``logits/*``), log Σp² (WPO) —
as the untreed logits give them, in both modes and on the padded path."""

import pytest
import torch

from trl_tree import tree_logprobs
from trl_tree.engine.layout import LAYOUT
from trl_tree.data.tiny import tiny_model

NAMES = ("is_top1", "mean_logits", "log_sum_sq_probs")


def _reference(model, seqs, score_from):
    out = {name: [] for name in NAMES}
    for seq, first in zip(seqs, score_from):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, :-1].float()[first - 1 :]
        out["is_top1"].append(logits.argmax(-1) == torch.tensor(seq[first:]))
        out["mean_logits"].append(logits.mean(-1))
        out["log_sum_sq_probs"].append(torch.logsumexp(2 * logits.log_softmax(-1), -1))
    return out


@pytest.mark.parametrize("mode", ["packed", "dfs"])
def test_head_outputs_match_the_logits(mode):
    torch.manual_seed(0)
    model = tiny_model("qwen2", seed=1).eval()
    base = [5, 7, 5, 7, 5, 7, 5, 7, 9]
    with torch.no_grad():  # a greedy continuation: its targets are the argmax
        greedy = model.generate(torch.tensor([base]), max_new_tokens=4, do_sample=False, pad_token_id=0)[0].tolist()
    seqs = [greedy, base + [3, 3, 3], base[:4] + [11, 12], [1, 2, 3]]
    score_from = [9, 9, 2, 1]
    with torch.no_grad():
        logps, *extra = tree_logprobs(model, seqs, mode, score_from=score_from, head_outputs=NAMES)
    expected = _reference(model, seqs, score_from)
    for name, got in zip(NAMES, extra):
        for g, want, lp in zip(got, expected[name], logps):
            assert g.shape == lp.shape
            if name == "is_top1":
                assert g.dtype == torch.bool and torch.equal(g, want)
            else:
                torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)
    assert any(t.any() for t in extra[0])


def test_head_outputs_on_the_padded_path(monkeypatch):
    model = tiny_model("llama", seed=2).eval()
    seqs = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]  # nothing shared: stock's padded batch
    monkeypatch.setattr(LAYOUT, "dense_unshared_batches", True)
    with torch.no_grad():
        _, _, top1, mean = tree_logprobs(model, seqs, score_from=1, return_entropy=True,
                                         head_outputs=("is_top1", "mean_logits"))
    expected = _reference(model, seqs, [1, 1])
    for got, want in zip(top1, expected["is_top1"]):
        assert torch.equal(got, want)
    for got, want in zip(mean, expected["mean_logits"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_unknown_head_output_is_refused():
    model = tiny_model("qwen2").eval()
    with pytest.raises(ValueError, match="not among"):
        tree_logprobs(model, [[1, 2, 3]], head_outputs=("logits",))
