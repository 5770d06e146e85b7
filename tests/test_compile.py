"""Compiled decoder layers (``trl_tree.engine.compile``): the tree stays exact, the attention stays eager
between the compiled graphs, and new forest sizes reuse the graphs.

Backend ``aot_eager``: Dynamo traces every layer child and AOTAutograd builds its forward and
backward graphs, as with Inductor, without generating kernels (which would take minutes on CI's
CPU); the GPU runs of ``bench.suite --kernels compiled`` cover Inductor itself.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from conftest import assert_grads_close, assert_logps_close, grads_of, weighted_loss
from test_exactness import WORKLOADS
from test_root_split import _math_backend
from torch._dynamo.utils import counters

from trl_tree.engine import compile as tree_compile
from trl_tree import tree_backward, tree_logprobs
from trl_tree.engine.compile import compile_layers, decoder_layers, uncompile_layers
from trl_tree.engine.reference import untreed_backward, untreed_logprobs
from trl_tree.data.tiny import grpo_group, random_tree, tiny_model

VOCAB = 96
DEEP = random_tree(12, VOCAB, max_len=18, seed=7)


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    """Each test compiles from scratch (else graphs of an earlier test's model would be reused, and
    enough of them would exhaust Dynamo's recompile limit, silently running eagerly)."""
    monkeypatch.setattr(tree_compile, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _model(checkpointing: bool, family: str = "qwen2") -> torch.nn.Module:
    model = tiny_model(family)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _check_compiled_tree(model, seqs, backend: str, **kw) -> None:
    """Tree (compiled layers) against the untreed model (eager layers), log-probs and gradients."""
    uncompile_layers(model)
    ref = untreed_logprobs(model, seqs)
    model.zero_grad(set_to_none=True)
    loss_ref = untreed_backward(model, seqs, weighted_loss)
    g_ref = grads_of(model)
    compile_layers(model)
    assert_logps_close(tree_logprobs(model, seqs, attn_backend=backend, **kw), ref)
    model.zero_grad(set_to_none=True)
    loss = tree_backward(model, seqs, weighted_loss, attn_backend=backend, **kw)
    assert loss == pytest.approx(loss_ref, rel=1e-5, abs=1e-5)
    assert_grads_close(grads_of(model), g_ref)
    assert _graphs() > 0, "nothing was compiled: the comparison ran eagerly"


# the walk only under checkpointing: its plain backward is the packed one's, per unit (the suite's time)
@pytest.mark.parametrize(("mode", "checkpointing"), [("packed", False), ("packed", True), ("dfs", True)],
                         ids=["packed-plain", "packed-checkpointed", "dfs-checkpointed"])
def test_compiled_layers_are_exact(mode, checkpointing):
    seqs = WORKLOADS["grpo_group"] + WORKLOADS["multi_level"]
    kw = {"chunk_size": 7} if mode == "dfs" else {}  # cuts nodes, so the walk's chunked units run too
    _check_compiled_tree(_model(checkpointing), seqs, "sdpa", mode=mode, **kw)


def test_compiled_layers_on_a_dense_batch():
    """Unshared equal-length sequences run as a (B, L) batch through the model's own attention."""
    _check_compiled_tree(_model(True), WORKLOADS["no_sharing_equal_lengths"], "sdpa")


@pytest.mark.parametrize("dense", [False, True], ids=["varlen", "dense"])
def test_compiled_layers_with_the_flash_path_and_kept_attention(monkeypatch, dense):
    """The packed FlashAttention function (math kernels on CPU) under checkpointing: the recompute
    runs the compiled graphs again and takes the attention outputs kept from the forward."""
    _math_backend(monkeypatch, dense)
    _check_compiled_tree(_model(True), grpo_group(10, 5, 4, VOCAB, num_prompts=2, seed=3) + DEEP, "math")


def test_new_forest_sizes_reuse_the_graphs():
    """``dynamic=True``: one set of graphs per kind of call, not one per forest."""
    model = _model(True)
    compile_layers(model)
    for seqs in (grpo_group(9, 4, 3, VOCAB, seed=1), grpo_group(17, 6, 5, VOCAB, seed=2)):
        tree_backward(model, seqs, weighted_loss, attn_backend="sdpa")
        graphs = _graphs()
    tree_backward(model, grpo_group(23, 8, 7, VOCAB, seed=3), weighted_loss, attn_backend="sdpa")
    assert _graphs() == graphs > 0


def test_attention_is_the_only_graph_break_and_stock_forwards_trace_through():
    """A tree call breaks the graph at the dispatcher (its Python state must stay eager); a forward
    without tree metadata (generation, TRL's own step) traces through the dispatcher unbroken."""
    model = _model(False)
    compile_layers(model)
    tree_logprobs(model, WORKLOADS["multi_level"], attn_backend="sdpa")  # installs the dispatcher
    breaks = sum(counters["graph_break"].values())
    assert breaks > 0 and all("disable" in reason for reason in counters["graph_break"])
    counters["graph_break"].clear()
    ids = torch.tensor([WORKLOADS["no_sharing_equal_lengths"][0]])
    with torch.no_grad():
        compiled = model(input_ids=ids).logits
    assert not counters["graph_break"], dict(counters["graph_break"])
    uncompile_layers(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_compile_uncompile_and_refusals():
    model = _model(False)
    children = sum(len(list(layer.children())) for layer in decoder_layers(model))
    assert len(decoder_layers(model)) == model.config.num_hidden_layers
    assert compile_layers(model) == children
    assert compile_layers(model) == children  # idempotent
    assert uncompile_layers(model) == children
    assert uncompile_layers(model) == 0
    with pytest.raises(ValueError, match="CUDA graphs"):
        compile_layers(model, mode="reduce-overhead")
    model._no_split_modules = []
    with pytest.raises(ValueError, match="no decoder layer class"):
        decoder_layers(model)


def test_compiled_lora_layers_and_the_disabled_adapter():
    """PEFT: the LoRA-wrapped projections are traced inside the compiled children; the gradients
    reach only the adapters and match the eager untreed model; disabling the adapter (TRL's PEFT
    reference model) is seen by the compiled graphs."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model(True), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                    init_lora_weights=False))
    seqs = WORKLOADS["grpo_group"]
    _check_compiled_tree(model, seqs, "sdpa")
    assert all("lora_" in name for name in grads_of(model))
    with torch.no_grad(), model.disable_adapter():
        tree_ref = tree_logprobs(model, seqs)
        uncompile_layers(model)
        assert_logps_close(tree_ref, untreed_logprobs(model, seqs))
