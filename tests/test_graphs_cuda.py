"""CUDA graphs on a CUDA device: what the CPU stand-in (``graphs.EagerReplay``) cannot show — the
streams the captures run on. Skipped without a GPU; ``python -m trl_tree.bench.check_gpu`` checks
the graphed paths' numbers there."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import grads_of, weighted_loss

from trl_tree.engine import graphs
from trl_tree import tree_backward
from trl_tree.data.tiny import grpo_group, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.float().flatten() for _, g in sorted(grads.items())])


def test_captures_leave_no_autograd_graph_on_their_stream():
    """Warm-up and capture run on the runner's stream, and the captured call's autograd graph is
    dropped after capture: no later call — a second layout's eager first sighting, an eager call, a
    replay — meets an AccumulateGrad node made on another stream (PyTorch warns when one does, and
    moves the accumulation onto that stream). The gradients stay the eager calls' (bf16)."""
    torch.manual_seed(0)
    model = tiny_model(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
    model = model.to("cuda", torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    first, second = grpo_group(24, 8, 4, 96, seed=1), grpo_group(20, 12, 4, 96, seed=2)

    def step(seqs, cuda_graphs):
        model.zero_grad(set_to_none=True)
        tree_backward(model, seqs, weighted_loss, attn_backend="torch_flash", cuda_graphs=cuda_graphs)
        return _flat(grads_of(model))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = step(first, False)
        for seqs, graphed in ((first, True), (first, True), (first, True), (second, True), (second, True),
                              (first, False), (first, True)):
            grads = step(seqs, graphed)
            if seqs is first:
                assert ((grads - eager).norm() / eager.norm()).item() < 0.05
    assert not [w for w in caught if "AccumulateGrad" in str(w.message)]
    assert graphs._RUNNERS[model].captures == 2
