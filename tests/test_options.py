"""``TreeOptions``: the entry points' tuning knobs in one object; the old keyword arguments still work."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import assert_grads_close, assert_logps_close, grads_of, weighted_loss

from trl_tree import TreeOptions, tree_backward, tree_logprobs, tree_value_backward, tree_values
from trl_tree.data.tiny import grpo_group

SEQS = grpo_group(8, 6, 4, 96, num_prompts=2, seed=5)


def test_options_and_the_deprecated_keywords_give_the_same_numbers(qwen2):
    opts = TreeOptions(attn_backend="sdpa", chunk_size=5, keep_graph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new way warns about nothing
        new = tree_logprobs(qwen2, SEQS, "dfs", options=opts, score_from=6)
        qwen2.zero_grad(set_to_none=True)
        new_loss = tree_backward(qwen2, SEQS, weighted_loss, "dfs", options=opts, score_from=6)
        new_grads = grads_of(qwen2)
    with pytest.warns(DeprecationWarning, match=r"options=TreeOptions\(attn_backend='sdpa', chunk_size=5\)"):
        old = tree_logprobs(qwen2, SEQS, mode="dfs", attn_backend="sdpa", chunk_size=5, score_from=6)
    qwen2.zero_grad(set_to_none=True)
    with pytest.warns(DeprecationWarning, match="tree_backward"):
        old_loss = tree_backward(qwen2, SEQS, weighted_loss, mode="dfs", attn_backend="sdpa", chunk_size=5,
                                 keep_graph=True, score_from=6)
    assert_logps_close(new, old, atol=0.0)
    assert new_loss == old_loss
    assert_grads_close(new_grads, grads_of(qwen2), rtol=0.0)


def test_a_knob_given_both_ways_or_unknown_is_refused(qwen2):
    with pytest.raises(TypeError, match="'chunk_size' given both as a keyword argument and in options"):
        tree_logprobs(qwen2, SEQS, "dfs", options=TreeOptions(chunk_size=4), chunk_size=8)
    with pytest.raises(TypeError, match="unexpected keyword argument 'chunksize'"):
        tree_logprobs(qwen2, SEQS, chunksize=8)
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_graph'"):  # a forward never took it
        tree_logprobs(qwen2, SEQS, keep_graph=True)
    with pytest.raises(TypeError, match="options must be a trl_tree.TreeOptions"):
        tree_backward(qwen2, SEQS, weighted_loss, options={"chunk_size": 4})


@pytest.mark.parametrize(("field", "value", "error"), [
    ("chunk_size", 0, ValueError), ("chunk_size", True, ValueError), ("memory_budget", -1, ValueError),
    ("memory_budget", 1.5e9, ValueError), ("keep_graph", "yes", TypeError), ("keep_attention", 1, TypeError),
    ("cuda_graphs", "always", TypeError), ("attn_backend", None, TypeError),
])
def test_bad_options_are_refused_where_they_are_made(field, value, error):
    with pytest.raises(error, match=field):
        TreeOptions(**{field: value})
    with pytest.raises(error, match=field):
        TreeOptions().replace(**{field: value})


def test_value_calls_run_eagerly(qwen2):
    head = torch.nn.Linear(qwen2.config.hidden_size, 1)
    with pytest.raises(ValueError, match="tree_values\\(\\) runs eagerly"):
        tree_values(qwen2, SEQS, head, options=TreeOptions(cuda_graphs=True))
    with pytest.raises(ValueError, match="tree_value_backward\\(\\) runs eagerly"):
        tree_value_backward(qwen2, SEQS, lambda v, i, p: v, head, options=TreeOptions(cuda_graphs=True))
    with pytest.raises(TypeError, match="unexpected keyword argument 'cuda_graphs'"):
        tree_values(qwen2, SEQS, head, cuda_graphs=False)


def test_trainer_configs_map_to_options():
    from trl_tree.trainers import TreeGRPOConfig

    config = TreeGRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, tree_attn_backend="sdpa",
                            tree_chunk_size=64, tree_memory_budget=10**9, tree_keep_graph=False,
                            tree_keep_attention=False, tree_cuda_graphs=True, tree_cuda_graph_buckets=True)
    assert config.tree_options() == TreeOptions(attn_backend="sdpa", chunk_size=64, memory_budget=10**9,
                                                keep_graph=False, keep_attention=False, cuda_graphs="buckets")
    assert TreeGRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False).tree_options() == TreeOptions(
        keep_attention=True)
