"""Short convolutions (LFM2's hybrid layers) over the tree: each token's convolution reads its root
path's inputs — in the packed call from the forest's root paths, in the depth-first walk from the
layer's stack slots — so log-probs and gradients equal the untreed computation (fp32, CPU), through
the padded batch, checkpointing, LoRA and the GRPO, SFT and DPO trainers."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_grads_close, assert_logps_close, grads_of, weighted_loss

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl_tree import tree_backward, tree_logprobs  # noqa: E402
from trl_tree.engine.reference import untreed_backward, untreed_logprobs  # noqa: E402
from trl_tree.data.tiny import random_tree, tiny_model  # noqa: E402

VOCAB = 96
FORESTS = {
    # deep: long shared chains, branching several levels down; wide: many siblings off short prefixes;
    # sequences shorter than the kernel and branches one token past a fork
    "deep": random_tree(12, VOCAB, max_len=30, seed=7),
    "wide": [[3, 4] + [10 + i, 20 + i % 3] for i in range(10)] + [[3], [3, 4], [3, 5]],
    "short": [[7], [7, 1], [7, 1, 2], [8, 3], [7, 1, 9, 9, 9]],
}


def check_exact(model, seqs, keep_graph=None, **kwargs):
    assert_logps_close(tree_logprobs(model, seqs, **kwargs), untreed_logprobs(model, seqs))
    model.zero_grad(set_to_none=True)
    tree_backward(model, seqs, weighted_loss, **kwargs, **({} if keep_graph is None else {"keep_graph": keep_graph}))
    got = grads_of(model)
    model.zero_grad(set_to_none=True)
    untreed_backward(model, seqs, weighted_loss)
    assert_grads_close(got, grads_of(model))
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kernel", [2, 3, 4])
@pytest.mark.parametrize("forest", sorted(FORESTS))
def test_short_convolutions_over_the_packed_tree(forest, kernel):
    model = tiny_model("lfm2", conv_L_cache=kernel)
    check_exact(model, FORESTS[forest])


#: the walk's shapes: nodes cut into chunks shorter and longer than the kernel, a pushed node's graph
#: kept or recomputed (merged with its first group), groups sized by a tiny budget (every node alone)
WALKS = {
    "chunk_1": {"chunk_size": 1},
    "chunk_2": {"chunk_size": 2},
    "chunk_5": {"chunk_size": 5},
    "keep_graph": {"chunk_size": 3, "keep_graph": True},
    "groups": {},
    "tiny_budget": {"memory_budget": 1},
}


@pytest.mark.parametrize("walk", sorted(WALKS))
@pytest.mark.parametrize("forest", sorted(FORESTS))
def test_short_convolutions_over_the_walk(forest, walk):
    """Each unit reads the k - 1 inputs above it from the layer's stack slots and hands their gradient
    back to the pushed nodes that own them."""
    check_exact(tiny_model("lfm2", conv_L_cache=4), FORESTS[forest], mode="dfs", **WALKS[walk])


def test_checkpointed_recompute_and_the_padded_batch():
    """HF's gradient checkpointing recomputes a layer in the backward, outside the call: the layer
    still finds the tree's metadata. A batch with nothing shared runs as the padded batch, through
    the model's own convolution."""
    model = tiny_model("lfm2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    check_exact(model, FORESTS["deep"])
    check_exact(model, [[1, 2, 3, 4, 5], [2, 3, 4, 5, 6], [9, 9, 9, 9, 9]])


def test_lora_on_the_convolutions_projections():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("lfm2"), LoraConfig(r=4, lora_alpha=8, target_modules=["in_proj", "out_proj",
                                                                                               "q_proj"],
                                                           lora_dropout=0.0, init_lora_weights=False))
    check_exact(model, FORESTS["wide"])


def test_checkpointed_walk():
    model = tiny_model("lfm2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    check_exact(model, FORESTS["deep"], mode="dfs", chunk_size=3)


def test_grpo_update_matches_stock(tmp_path):
    from test_stock_parity import ONE_UPDATE, compare
    from trainer_harness import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "lfm2", "lfm2")
    compare(checkpoint, ("packed", "dfs"), **ONE_UPDATE)
    compare(checkpoint, ("packed",), tree_fields={"tree_token_budget": 40}, **ONE_UPDATE)


def test_sft_and_dpo_updates_match_stock(tmp_path):
    from sft_harness import assert_same_update, dataset, run, save_sft_checkpoint
    from test_dpo_trainer import compare as dpo_compare
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from trl_tree import TreeSFTConfig, TreeSFTTrainer

    checkpoint = save_sft_checkpoint(tmp_path / "lfm2", family="lfm2")
    start = {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float64).named_parameters()}
    stock, _ = run(SFTTrainer, SFTConfig, checkpoint, dataset("turns"), dtype=torch.float64)
    for mode in ("packed", "dfs"):
        tree, log = run(TreeSFTTrainer, TreeSFTConfig, checkpoint, dataset("turns"), dtype=torch.float64,
                        tree_mode=mode)
        assert_same_update(stock, tree, start)
        assert log[0]["tree/dedup_ratio"] > 1.0
    dpo_compare(checkpoint)
    dpo_compare(checkpoint, tree={"tree_mode": "dfs"})


def test_compiled_layers():
    """``tree_compile_layers``: the convolution's projections compile, its tree gathers stay eager."""
    from trl_tree.engine.compile import compile_layers

    model = tiny_model("lfm2")
    assert compile_layers(model, backend="aot_eager") > 0
    check_exact(model, FORESTS["short"], mode="dfs", chunk_size=2)  # the walk: its stack code stays eager
