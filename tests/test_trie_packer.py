"""The benchmark path through TRL 1.16's experimental trie packer computes the untreed step
(fp32, CPU: the math reference stands in for the FlashAttention varlen kernel)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_grads_close, grads_of

from trl_tree import PrefixForest
from trl_tree.engine.reference import untreed_backward
from trl_tree.data.tiny import grpo_group, random_tree, tiny_model

pytest.importorskip("trl.experimental.async_grpo.packing")


@pytest.mark.parametrize("seqs,score_from", [(grpo_group(12, 6, 5, 96, seed=1), 12),
                                             (random_tree(10, 96, max_len=24, seed=5), 1)])
def test_trie_packer_step_matches_the_untreed_step(seqs, score_from):
    from trl.trainer.utils import add_fused_lm_head

    from trl_tree.bench.trie_packer import trie_packer_step

    model = tiny_model("qwen2")
    add_fused_lm_head(model)
    adv = torch.linspace(-1.0, 2.0, len(seqs))
    n_terms = sum(len(s) - score_from for s in seqs)
    step = trie_packer_step(model, seqs, adv, score_from, n_terms)
    loss = step()
    packed = grads_of(model)
    model.zero_grad(set_to_none=True)
    ref = untreed_backward(model, seqs, lambda lp, s, p: -lp * adv[s] / n_terms, score_from=score_from)
    assert loss == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert_grads_close(packed, grads_of(model))
    assert model.config._attn_implementation == "sdpa"  # restored after the step
    # TRL's trie forks one token before the samples diverge: at least the unique tokens are forwarded
    assert step.num_forwarded >= PrefixForest.from_sequences(seqs).num_unique_tokens


def test_trie_packer_refuses_sliding_windows():
    from trl_tree.bench.trie_packer import _TorchVarlenKernel

    q = torch.zeros(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="sliding window"):
        _TorchVarlenKernel.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, window_size=(2, 0))
