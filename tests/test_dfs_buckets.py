"""The walk's units padded to buckets (``trl_tree.engine.dfs.buckets``, ``cuda_graphs="buckets"`` with
``mode="dfs"``), on the CPU with the stand-in replay of test_dfs_graphs.py.

Padded units must give the untreed model's numbers on every attention path: the reference backends
(an explicit mask over the padded prefix), and the FlashAttention path with math kernels whose
backward fills the key rows it does not own with NaN — as FlashAttention leaves them unwritten —
so that a padded row's gradient reaching the stack or a parameter fails the test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_grads_close, assert_logps_close, grads_of, weighted_loss
from test_dfs import deep_tree
from test_dfs_graphs import VOCAB, _model

from trl_tree.engine import graphs
from trl_tree import tree_backward, tree_logprobs
from trl_tree.engine.attention import backends, partial
from trl_tree.engine.dfs import buckets as dfs_buckets
from trl_tree.engine.dfs import graphs as dfs_graphs
from trl_tree.engine.dfs.plan import Unit, unit_layout
from trl_tree.engine.forest import PrefixForest
from trl_tree.engine.reference import untreed_backward, untreed_logprobs


def free_groups(seed: int, prompts: int = 2, group: int = 4) -> list[list[int]]:
    """GRPO groups with free lengths: prompts of 9-14 tokens, completions of 3-8."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(prompts):
        prompt = rng.integers(0, VOCAB, int(rng.integers(9, 15))).tolist()
        seqs += [prompt + rng.integers(0, VOCAB, int(rng.integers(3, 9))).tolist() for _ in range(group)]
    return seqs


def short_prompt_groups(seed: int) -> list[list[int]]:
    """Two GRPO groups of 3-token prompts and 4 completions of 8-12 tokens: cut at 30 tokens, each
    prompt is pushed and its pop takes the first group of completions along (a merged pop)."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(2):
        prompt = rng.integers(0, VOCAB, 3).tolist()
        seqs += [prompt + rng.integers(0, VOCAB, int(rng.integers(8, 13))).tolist() for _ in range(4)]
    return seqs


def _garbage_rows(grad: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad[int(cu[-1]) :] = float("nan")  # rows past the last segment: unwritten by FlashAttention
    return grad


def _garbage_backward(grad_out, q, k, v, out, lse, state, cu_q, cu_k, *rest, **kw):
    dq, dk, dv = partial.math_partial_backward(grad_out, q, k, v, out, lse, state, cu_q, cu_k, *rest, **kw)
    return dq, _garbage_rows(dk, cu_k), _garbage_rows(dv, cu_k)


@pytest.fixture(params=["sdpa", "math", "math-dense"])
def backend(request, monkeypatch):
    """Stand-in replays; the backend the walk runs: the reference path, or the FlashAttention path
    with math kernels (``math-dense``: one-node units' causal blocks through the dense slot)."""
    monkeypatch.setattr(graphs, "CPU_STAND_IN", graphs.EagerReplay)
    if request.param == "sdpa":
        return "sdpa"

    monkeypatch.setitem(partial.PARTIAL_KERNELS, "math", (partial.math_partial_forward, _garbage_backward))
    if request.param == "math-dense":
        monkeypatch.setitem(partial.DENSE_KERNELS, "math", (partial.math_dense_forward, partial.math_dense_backward))
        monkeypatch.setattr(partial, "DENSE_MIN_ROWS", 1)
    monkeypatch.setattr(backends, "resolve_dfs_backend", lambda requested, device, dtype, **_: "math")
    monkeypatch.setattr(graphs, "GRAPH_BACKENDS", (*graphs.GRAPH_BACKENDS, "math"))
    return "auto"


def _walk(model, seqs, backend, **kw) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    value = tree_backward(model, seqs, weighted_loss, mode="dfs", cuda_graphs="buckets", attn_backend=backend, **kw)
    return value, grads_of(model)


def _padded_graphs(model) -> list:
    return [g for g in dfs_graphs._WALK_GRAPHS[model].units.values() if g.meta.own_slots is not None]


@pytest.mark.parametrize("seqs,chunk_size,checkpoint", [(free_groups(0), None, False),
                                                         (deep_tree(4, VOCAB, seed=3), 12, True),
                                                         (short_prompt_groups(0), 30, True)],
                         ids=["free-grpo", "deep-tree-chunked-checkpointed", "merged-pops-checkpointed"])
def test_padded_units_match_the_untreed_model(backend, monkeypatch, seqs, chunk_size, checkpoint):
    """Every unit replayed from its bucket's graphs (the exact shapes never captured): eager walk,
    capture walk, replay walk — the untreed loss and gradients every time, every slot consumed."""
    monkeypatch.setattr(graphs, "EXACT_LAYOUTS", False)
    model = _model(checkpoint)
    model.zero_grad(set_to_none=True)
    ref_loss = untreed_backward(model, seqs, weighted_loss)
    ref = grads_of(model)
    for _ in range(3):
        loss, grads = _walk(model, seqs, backend, chunk_size=chunk_size)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-5)
        assert_grads_close(grads, ref)
        stack = dfs_graphs._WALK_GRAPHS[model].stack
        assert all(float(g.abs().max()) == 0 for g in (*stack.dk, *stack.dv))
    padded = _padded_graphs(model)
    assert padded and len(padded) == len(dfs_graphs._WALK_GRAPHS[model].units)
    # pads were added: some unit holds more tokens or reads more prefix slots than it has
    assert any(g.meta.num_tokens > int(g.meta.cu_seqlens_q[-2]) or g.meta.depth > int(g.meta.prefix_cu_k[1])
               for g in padded)
    if chunk_size == 30:  # merged pops: their prompt's gradient slots read, their group's not
        assert any(0 < g.meta.pushed_tokens < g.meta.num_tokens for g in padded)
    if chunk_size == 12:  # groups of subtrees: some gather past their last segment (unread, dropped)
        assert any(g.meta.kv_scatter is not None and bool((g.meta.kv_scatter == g.meta.num_tokens).any())
                   for g in padded)


def test_free_length_micro_batches_replay_their_buckets(backend, monkeypatch):
    """Micro-batches whose units never repeat a shape share their buckets' graphs: the first runs
    eagerly, the second captures, the later ones replay without a capture, all exact."""
    monkeypatch.setattr(dfs_buckets, "bucket", lambda n: -(-n // 16) * 16)  # coarse: the tiny units share buckets
    model = _model(checkpoint=True)
    runner_captures = []
    for seed in range(4):
        seqs = free_groups(seed + 10)
        model.zero_grad(set_to_none=True)
        ref_loss = untreed_backward(model, seqs, weighted_loss)
        ref = grads_of(model)
        loss, grads = _walk(model, seqs, backend)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-5)
        assert_grads_close(grads, ref)
        runner_captures.append(graphs._RUNNERS[model].captures)
    assert runner_captures[0] == 0 and runner_captures[1] > 0
    assert runner_captures[3] == runner_captures[2]  # nothing new to capture: every unit replayed a bucket
    assert _padded_graphs(model)
    stats = dfs_graphs.unit_graph_stats(model)
    assert stats["padded"] == len(_padded_graphs(model)) and stats["replayed"] > 0 and stats["eager"] > 0


def test_forward_only_walk_replays_padded_units(backend, monkeypatch):
    monkeypatch.setattr(graphs, "EXACT_LAYOUTS", False)
    model = _model(checkpoint=False)
    seqs = free_groups(3)
    ref = untreed_logprobs(model, seqs)
    with torch.no_grad():
        for _ in range(3):
            out = tree_logprobs(model, seqs, mode="dfs", cuda_graphs="buckets", attn_backend=backend,
                                return_entropy=True)
            assert_logps_close(out[0], ref)
    assert _padded_graphs(model)


def test_padded_layout_keeps_every_real_number():
    """The layout invariants: the real segments, tokens and keys unchanged; pads close the last
    segment, empty segments follow; unread gather entries scatter past the end; the real depth
    stays device data."""
    forest = PrefixForest.from_sequences(deep_tree(4, VOCAB, seed=5))
    children = np.flatnonzero(forest.node_parent == 0)
    first, last = int(children[0]), int(children[-1])
    sub_end = int(forest.subtree_end[forest.node_start[last]])
    node_hi = int(np.searchsorted(forest.node_start, sub_end))
    unit = Unit(int(forest.node_start[first]), sub_end, int(forest.node_depth[first]), first, node_hi, False)
    exact = unit_layout(forest, unit)
    src, targets = np.arange(3), np.array([5, 6, 7])
    padded = dfs_buckets.padded_unit_layout(exact, unit, src, targets)
    n, n_b = unit.num_tokens, padded["tokens"].shape[0]
    assert n_b == dfs_buckets.bucket(n) and not padded["own_only"]
    assert (padded["tokens"][:n] == exact["tokens"]).all() and (padded["tokens"][n:] == 0).all()
    segments = exact["cu_seqlens_q"].shape[0] - 1
    assert (padded["cu_seqlens_q"][:segments] == exact["cu_seqlens_q"][:segments]).all()
    assert (padded["cu_seqlens_q"][segments:] == n_b).all()  # pads close the last segment; then empty ones
    padded_segments = padded["cu_seqlens_q"].shape[0] - 1
    assert padded_segments >= segments and padded_segments & (padded_segments - 1) == 0
    keys = int(exact["cu_seqlens_k"][-1])
    assert (padded["kv_local"][:keys] == exact["kv_local"]).all()
    real_keys = int(padded["cu_seqlens_k"][-1])
    assert (padded["kv_local"][keys:real_keys] == np.arange(n, n_b)).all()  # the last node's keys end with the pads
    assert (padded["kv_scatter"][real_keys:] == n_b).all()
    assert padded["depth"] >= unit.depth and padded["real_depth"] == unit.depth
    assert (padded["own_slots"] == unit.depth + np.arange(n_b)).all()
    assert (padded["src"][:3] == src).all() and padded["src"].shape[0] == dfs_buckets.bucket(3)  # few rows: their own bucket
    many = dfs_buckets.padded_unit_layout(exact, unit, np.arange(n - 1), np.zeros(n - 1, np.int64))
    assert many["src"].shape[0] == n_b  # nearly every token scored: the tokens' bucket
