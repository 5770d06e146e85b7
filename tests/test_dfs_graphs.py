"""CUDA-graph replay of the depth-first walk's units (``trl_tree.engine.dfs.graphs``), on the CPU.

As in test_graphs.py, ``graphs.EagerReplay`` stands in for a CUDA graph (a replay reruns the
captured function into the static outputs); signatures, static inputs refreshed per unit, the kept
K/V stack, the warm-ups' save and restore of its gradient slots, the gradient buffers and the
eager loss between a unit's two graphs are the code that runs on the GPU
(``python -m trl_tree.bench.check_gpu`` checks real captures there).
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_grads_close, assert_logps_close, grads_of, weighted_loss
from test_dfs import deep_tree

from trl_tree.engine import graphs
from trl_tree import tree_backward, tree_logprobs
from trl_tree.engine.dfs import graphs as dfs_graphs
from trl_tree.engine.reference import untreed_backward, untreed_logprobs
from trl_tree.data.tiny import grpo_group, tiny_model

VOCAB = 96
GROUP = grpo_group(12, 8, 4, VOCAB, seed=1)  # a prompt and 8 completions of 4 tokens
SAME_SHAPES = grpo_group(12, 8, 4, VOCAB, seed=2)  # other tokens, the same units
TREE = deep_tree(4, VOCAB, seed=3)  # 4 levels: every path the deeper tree takes, half its units


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(graphs, "CPU_STAND_IN", graphs.EagerReplay)


def _model(checkpoint: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_model("qwen2", vocab_size=VOCAB)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _state(model) -> dfs_graphs.WalkGraphs:
    return dfs_graphs._WALK_GRAPHS[model]


def _dfs_backward(model, seqs, **kw) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    value = tree_backward(model, seqs, weighted_loss, mode="dfs", cuda_graphs=True, **kw)
    return value, grads_of(model)


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("seqs,chunk_size", [(GROUP, 8), (TREE, 5), (TREE, None)],
                         ids=["grpo-chunked", "deep-tree-chunked", "deep-tree"])
def test_replayed_walk_matches_the_untreed_model(stand_in, checkpoint, seqs, chunk_size):
    """Eager walk, capture walk (warm-ups run each unit's backward for real), replay walk: the
    same loss and gradients as the untreed model every time."""
    model = _model(checkpoint)
    model.zero_grad(set_to_none=True)
    ref_loss = untreed_backward(model, seqs, weighted_loss)
    ref = grads_of(model)
    captures = []
    for _ in range(3):
        loss, grads = _dfs_backward(model, seqs, chunk_size=chunk_size)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-5)
        assert_grads_close(grads, ref)
        captures.append(graphs._RUNNERS[model].captures)
        stack = _state(model).stack
        assert all(float(g.abs().max()) == 0 for g in (*stack.dk, *stack.dv))  # every slot consumed
    assert captures[0] == 0 and captures[1] > 0  # a new stack's first walk runs eagerly; the second captures
    assert captures[2] == captures[1]  # the third replays


# cuda_graphs="buckets" hands its gradients over by the same code (``dfs/graphs.py``); its replay's
# exactness is test_dfs_buckets.py's. One variant here keeps CI within its 15 minutes.
@pytest.mark.parametrize("cuda_graphs", [True])
def test_replayed_walk_under_several_processes_takes_gradients_of_views(stand_in, monkeypatch, cuda_graphs):
    """Under ``torch.distributed`` the captured backward hands the gradients over through
    ``torch.autograd.grad`` of views of the parameters (``graphs.GRADS_BY_AUTOGRAD_GRAD``), as the
    packed graphs do: the same loss and gradients, the units replayed."""
    monkeypatch.setattr(graphs, "GRADS_BY_AUTOGRAD_GRAD", True)
    model = _model()
    model.zero_grad(set_to_none=True)
    ref_loss = untreed_backward(model, TREE, weighted_loss)
    ref = grads_of(model)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        loss = tree_backward(model, TREE, weighted_loss, mode="dfs", cuda_graphs=cuda_graphs, chunk_size=5)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-5)
        assert_grads_close(grads_of(model), ref)
    assert graphs._RUNNERS[model].captures > 0 and _state(model).replayed > 0
    assert all(g.views for g in _state(model).units.values() if g.train)


def test_reentrant_checkpointing_under_several_processes_runs_the_walk_eagerly(stand_in, monkeypatch):
    monkeypatch.setattr(graphs, "GRADS_BY_AUTOGRAD_GRAD", True)
    torch.manual_seed(0)
    model = tiny_model("qwen2", vocab_size=VOCAB)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    model.zero_grad(set_to_none=True)
    untreed_backward(model, TREE, weighted_loss)
    ref = grads_of(model)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        tree_backward(model, TREE, weighted_loss, mode="dfs", cuda_graphs=True, chunk_size=5)
        assert_grads_close(grads_of(model), ref)
    assert model not in dfs_graphs._WALK_GRAPHS


def test_units_of_one_shape_share_a_graph_and_new_tokens_replay(stand_in):
    model = _model()
    for _ in range(2):
        _dfs_backward(model, GROUP, chunk_size=8)
    state = _state(model)
    walk_units = len(state.units)
    captured = graphs._RUNNERS[model].captures
    # 8 completions of 4 tokens in groups of 8 tokens: 4 groups of one shape, one graph pair
    signatures = [s for s in state.units if s[1]]
    assert len(signatures) < 4
    model.zero_grad(set_to_none=True)
    ref_loss = untreed_backward(model, SAME_SHAPES, weighted_loss)
    ref = grads_of(model)
    loss, grads = _dfs_backward(model, SAME_SHAPES, chunk_size=8)
    assert graphs._RUNNERS[model].captures == captured and len(state.units) == walk_units
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-5)
    assert_grads_close(grads, ref)


def test_replayed_gradients_accumulate(stand_in):
    model = _model()
    model.zero_grad(set_to_none=True)
    untreed_backward(model, TREE, weighted_loss)
    once = grads_of(model)
    for _ in range(2):
        _dfs_backward(model, TREE, chunk_size=5)
    model.zero_grad(set_to_none=True)
    for _ in range(2):  # replayed twice without zeroing: twice the gradient, as eager autograd
        tree_backward(model, TREE, weighted_loss, mode="dfs", cuda_graphs=True, chunk_size=5)
    assert_grads_close(grads_of(model), {k: 2 * v for k, v in once.items()})


def test_forward_only_walk_replays_its_units(stand_in):
    model = _model()
    ref = untreed_logprobs(model, TREE)
    with torch.no_grad():
        for call in range(3):
            out = tree_logprobs(model, TREE, mode="dfs", cuda_graphs=True, chunk_size=5, return_entropy=True)
            assert_logps_close(out[0], ref)
            eager = tree_logprobs(model, TREE, mode="dfs", chunk_size=5, return_entropy=True)
            assert_logps_close(out[1], eager[1])
    assert graphs._RUNNERS[model].captures > 0


def test_a_larger_walk_gets_a_new_stack_and_drops_the_unit_graphs(stand_in, monkeypatch):
    monkeypatch.setattr(dfs_graphs, "STACK_SLOT_QUANTUM", 8)
    model = _model()
    for _ in range(2):
        _dfs_backward(model, GROUP, chunk_size=8)
    state = _state(model)
    old = state.stack
    assert state.units
    model.zero_grad(set_to_none=True)
    ref_loss = untreed_backward(model, TREE, weighted_loss)
    ref = grads_of(model)
    loss, grads = _dfs_backward(model, TREE, chunk_size=None)  # a deeper stack than GROUP's
    assert state.stack is not old and not state.units
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-5)
    assert_grads_close(grads, ref)


def test_walks_needing_more_slots_one_way_and_the_other_keep_one_stack(stand_in, monkeypatch):
    """Walk A needs many slots and few gradient slots (a short pushed prompt, one large group), walk
    B the other way round (a long pushed prompt): the second new stack covers both, so alternating
    walks keep it and their graphs instead of replacing it each time."""
    monkeypatch.setattr(dfs_graphs, "STACK_SLOT_QUANTUM", 8)
    wide = (grpo_group(4, 8, 8, VOCAB, seed=4), 64)  # stack (72, 8): a pushed prompt of 4, a group of 64
    deep = (grpo_group(40, 2, 2, VOCAB, seed=5), 16)  # stack (48, 32): two chunks of the prompt pushed
    model = _model()
    _dfs_backward(model, wide[0], chunk_size=wide[1])
    _dfs_backward(model, deep[0], chunk_size=deep[1])
    state = _state(model)
    stack = state.stack
    assert (stack.slots, stack.grad_slots) == (72, 32)
    for seqs, chunk_size in (wide, deep, wide, deep):
        model.zero_grad(set_to_none=True)
        ref_loss = untreed_backward(model, seqs, weighted_loss)
        ref = grads_of(model)
        loss, grads = _dfs_backward(model, seqs, chunk_size=chunk_size)
        assert state.stack is stack
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-5)
        assert_grads_close(grads, ref)
    assert state.units  # captured on the kept stack, not dropped


def test_a_walk_stopped_half_way_leaves_no_gradient_behind(stand_in):
    model = _model()
    for _ in range(2):
        _dfs_backward(model, TREE, chunk_size=5)

    def failing(lp, seq_idx, pos):
        if int(seq_idx.max()) >= len(TREE) - 3:
            raise RuntimeError("stop")
        return weighted_loss(lp, seq_idx, pos)

    with pytest.raises(RuntimeError, match="stop"):
        tree_backward(model, TREE, failing, mode="dfs", cuda_graphs=True, chunk_size=5)
    model.zero_grad(set_to_none=True)
    ref_loss = untreed_backward(model, TREE, weighted_loss)
    ref = grads_of(model)
    loss, grads = _dfs_backward(model, TREE, chunk_size=5)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-5)
    assert_grads_close(grads, ref)


def test_keep_graph_is_refused_with_graphs(stand_in):
    model = _model()
    with pytest.raises(ValueError, match="keep_graph=True .* replayed units"):
        tree_backward(model, GROUP, weighted_loss, mode="dfs", cuda_graphs=True, keep_graph=True)


def test_units_that_cannot_replay_run_eagerly(stand_in):
    """A sliding-window model reads per-node paths on the host: no graphs, the eager numbers."""
    torch.manual_seed(0)
    model = tiny_model("mistral", vocab_size=VOCAB, sliding_window=6)
    model.train()
    model.zero_grad(set_to_none=True)
    ref_loss = untreed_backward(model, GROUP, weighted_loss)
    ref = grads_of(model)
    for _ in range(2):
        loss, grads = _dfs_backward(model, GROUP, chunk_size=8)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-5)
        assert_grads_close(grads, ref)
    assert model not in dfs_graphs._WALK_GRAPHS
