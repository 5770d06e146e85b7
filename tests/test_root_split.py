"""The packed FlashAttention path, whole root paths and split at the roots, against the untreed
computation (fp32, CPU: the kernels of ``attention/partial.py``'s math reference stand in for
FlashAttention, as in the depth-first walk's tests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_exactness import WORKLOADS, check_exact

from trl_tree import PrefixForest, tree_logprobs
from trl_tree.engine.attention import backends, partial
from trl_tree.engine.attention.metadata import TreeAttentionMetadata, use_root_split
from trl_tree.engine.attention.root_split import RootSplitLayout
from trl_tree.engine.layout import LAYOUT, layout_choices
from trl_tree.data.tiny import grpo_group, random_tree, tiny_model

VOCAB = 96
CPU = torch.device("cpu")


MATH = (partial.math_partial_forward, partial.math_partial_backward)
MATH_DENSE = (partial.math_dense_forward, partial.math_dense_backward)  # causal aligned top-left, as cuDNN


def _math_backend(mp: pytest.MonkeyPatch, dense: bool) -> None:
    mp.setitem(partial.PARTIAL_KERNELS, "math", MATH)
    if dense:  # single-segment parts (root block, rectangle) through the dense slot, as cuDNN runs them
        mp.setitem(partial.DENSE_KERNELS, "math", MATH_DENSE)
    mp.setattr(partial, "DENSE_MIN_ROWS", 1)  # the tiny test trees' blocks count as dense
    mp.setitem(backends.TREE_ATTENTION, "math", backends.torch_flash_tree_attention)
    mp.setattr(backends, "resolve_backend", lambda requested, device, dtype, **_: "math")


@pytest.fixture(params=[False, True], ids=["varlen", "dense"])
def flash_path_on_cpu(request, monkeypatch):
    """``attn_backend="math"``: the packed torch_flash function (gather, partial kernels, merge,
    fp32 scatter of the gathered gradients) with the math kernels; ``dense``: with a dense pair
    registered too, so a single tree runs its root block and rectangle as dense segments."""
    _math_backend(monkeypatch, request.param)
    return request.param


@pytest.fixture(params=[False, True, None], ids=["whole-paths", "split", "auto"])
def root_split(request, monkeypatch):
    monkeypatch.setattr(LAYOUT, "root_split", request.param)
    return request.param


def _keys_of_every_query(forest: PrefixForest, layout: RootSplitLayout) -> list[list[int]]:
    """The keys each packed query attends to under the split (path part ∪ rectangle part)."""
    keys: list[list[int]] = [[] for _ in range(forest.num_unique_tokens)]
    cu_q, path_cu = forest.cu_seqlens_q, layout.path_cu_seqlens_k
    for v in range(forest.num_nodes):
        path = layout.path_kv_index[path_cu[v] : path_cu[v + 1]].tolist()
        n = int(cu_q[v + 1] - cu_q[v])
        for i in range(n):  # causal, bottom-right: query i sees all but the last n - 1 - i keys
            keys[int(cu_q[v]) + i] += path[: len(path) - (n - 1 - i)]
    rq, rk = layout.rect_cu_seqlens_q, layout.rect_cu_seqlens_k
    for r in range(len(rq) - 1):
        for q in layout.rect_q_rows[rq[r] : rq[r + 1]].tolist():
            keys[q] += layout.rect_k_rows[rk[r] : rk[r + 1]].tolist()
    return keys


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=9), min_size=1, max_size=9))
def test_split_layout_gives_every_query_its_visible_keys_once(seqs):
    forest = PrefixForest.from_sequences(seqs)
    layout = RootSplitLayout.from_forest(forest)
    if layout is None:
        assert not np.any((forest.node_parent < 0) & (forest.node_num_children > 0))
        return
    keys = _keys_of_every_query(forest, layout)
    for q, ks in enumerate(keys):
        visible = [k for k in range(q + 1) if q < forest.subtree_end[k]]
        assert sorted(ks) == visible, f"query {q}"  # the tree rule, and no key twice
    n = np.diff(forest.cu_seqlens_q).astype(np.int64)
    path_pairs = int((n * np.diff(layout.path_cu_seqlens_k) - n * (n - 1) // 2).sum())
    assert layout.rectangle_pairs() + path_pairs == forest.sum_visible_keys()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=9), min_size=1, max_size=9))
def test_the_reference_backends_attend_tree_by_tree(seqs):
    """sdpa and eager (the CPU's path) attend the forest span by span (``metadata.spans``): there is
    a tree per distinct first token, the spans tile the packed tokens and each is whole trees (small
    neighbours merged, or with ``SPAN_TOKENS=0`` only up to the largest tree), the forest's mask sees
    nothing outside their blocks, each block is ``span_mask``'s, and the attention equals the
    forest-wide masked one, with and without a sliding window."""
    from trl_tree.engine.attention import metadata

    forest = PrefixForest.from_sequences(seqs)
    trees = metadata.tree_ranges(forest.subtree_end)
    assert len(trees) == len({seq[0] for seq in seqs})
    for span_tokens in (metadata.SPAN_TOKENS, 0):  # neighbours merged (the default) or not
        metadata.SPAN_TOKENS, saved = span_tokens, metadata.SPAN_TOKENS
        try:
            meta = TreeAttentionMetadata.from_forest(forest, CPU, "sdpa")
        finally:
            metadata.SPAN_TOKENS = saved
        _check_tree_by_tree(forest, meta, trees)


def _check_tree_by_tree(forest, meta, trees) -> None:
    spans, n = meta.spans(), forest.num_unique_tokens
    assert spans[0][0] == 0 and spans[-1][1] == n and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    starts = {start for start, _ in trees}
    assert all(start in starts for start, _ in spans)  # a span is whole trees
    inside = torch.zeros(n, n, dtype=torch.bool)
    for start, end in spans:
        inside[start:end, start:end] = True
        assert torch.equal(meta.span_mask(start, end, 2), meta.dense_mask(2)[start:end, start:end])
    assert not (meta.dense_mask() & ~inside).any()
    q, k, v = (torch.randn(1, 2, n, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for window in (None, 2):
        for kind, attend in (("sdpa", backends.sdpa_tree_attention), ("eager", backends.eager_tree_attention)):
            want = backends.masked_attention(q, k, v, meta.dense_mask(window), 0.5, kind)
            assert torch.allclose(attend(q, k, v, meta, 0.5, window=window), want, atol=1e-6)


def test_one_root_is_a_slice_several_are_gathered():
    one = RootSplitLayout.from_forest(PrefixForest.from_sequences(grpo_group(8, 3, 4, VOCAB)))
    assert one.rect_k_span == (0, 8) and one.rect_q_span == (8, 20)
    several = RootSplitLayout.from_forest(PrefixForest.from_sequences(grpo_group(8, 3, 4, VOCAB, num_prompts=2)))
    assert several.rect_k_span is None and several.rect_q_span is None
    assert several.rect_k_rows.tolist() == list(range(8)) + list(range(20, 28))
    assert RootSplitLayout.from_forest(PrefixForest.from_sequences([[1, 2], [3, 4]])) is None  # nothing shared


def test_split_where_per_node_tiles_would_waste_the_rectangle():
    def decide(seqs):
        forest = PrefixForest.from_sequences(seqs)
        layout = RootSplitLayout.from_forest(forest)
        return layout is not None and use_root_split(forest, layout)

    assert decide(grpo_group(400, 30, 8, VOCAB))  # short nodes below a long root: tiles half empty
    for completion, dense_pays in ((128, True), (400, False)):  # dense blocks 0.90 / 0.68 of the attention
        forest = PrefixForest.from_sequences(grpo_group(400, completion, 8, VOCAB))
        assert use_root_split(forest, RootSplitLayout.from_forest(forest), dense=True) == dense_pays
    assert not decide(grpo_group(400, 512, 4, VOCAB))  # 512-token completions fill their tiles
    assert not decide(grpo_group(1, 40, 8, VOCAB))  # a one-token root: nothing worth a second kernel
    forest = PrefixForest.from_sequences(grpo_group(400, 30, 8, VOCAB))
    assert TreeAttentionMetadata.from_forest(forest, CPU, "torch_flash").root_split is not None
    assert TreeAttentionMetadata.from_forest(forest, CPU, "torch_flash", root_split=False).root_split is None
    assert TreeAttentionMetadata.from_forest(forest, CPU, "sdpa").root_split is None  # FlashAttention only
    distinct = RootSplitLayout.from_forest(PrefixForest.from_sequences(grpo_group(400, 30, 8, 10**6)))
    assert distinct.rectangle_tile_waste(128) == (128 - 30) / 30  # eight 30-token completions, no common token


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_flash_path_exact(qwen2, flash_path_on_cpu, root_split, workload):
    check_exact(qwen2, WORKLOADS[workload], "math")


def test_flash_path_deep_and_multi_root(qwen2, flash_path_on_cpu, root_split):
    check_exact(qwen2, random_tree(16, VOCAB, max_len=40, seed=7), "math", score_from=1)
    check_exact(qwen2, grpo_group(9, 4, 5, VOCAB, num_prompts=3, seed=2) + [[1, 2, 3]], "math", temperature=0.7)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=10), min_size=1, max_size=8),
       st.sampled_from([False, True]), st.booleans())
def test_flash_path_random_forests(qwen2, seqs, split, dense):
    with pytest.MonkeyPatch.context() as mp:
        _math_backend(mp, dense)
        mp.setattr(LAYOUT, "root_split", split)
        check_exact(qwen2, seqs, "math")


def test_one_tree_runs_its_root_block_and_rectangle_dense(qwen2, monkeypatch):
    """With a dense pair, one tree's root block and rectangle go through it as one call per layer
    forward (every query against the root's keys, causal aligned top-left), every other part
    through the varlen pair; a forest of two trees does not."""
    _math_backend(monkeypatch, dense=False)
    calls = []

    def counting(*args):
        calls.append((args[7], args[0].shape[0], args[1].shape[0]))  # causal flag, query and key rows
        return partial.math_dense_forward(*args)

    monkeypatch.setitem(partial.DENSE_KERNELS, "math", (counting, partial.math_dense_backward))
    monkeypatch.setattr(LAYOUT, "root_split", True)
    tree_logprobs(qwen2, grpo_group(12, 4, 3, VOCAB))
    layers = qwen2.config.num_hidden_layers
    assert calls == [(True, 12 + 4 * 3, 12)] * layers  # all 24 packed queries against the 12-token root
    calls.clear()
    tree_logprobs(qwen2, grpo_group(12, 4, 3, VOCAB, num_prompts=2))
    assert calls == []  # two trees: the rectangles are gathered, varlen
    monkeypatch.setattr(partial, "DENSE_MIN_ROWS", 13)
    tree_logprobs(qwen2, grpo_group(12, 4, 3, VOCAB))
    assert calls == []  # a 12-token root is below the dense pair's minimum block


def test_planned_dense_blocks_wait_for_their_shape_s_third_sighting(qwen2, monkeypatch):
    """A dense pair that plans each new shape (cuDNN, ``partial.PLANNED_DENSE``) runs a split's blocks
    only for shapes seen ``DENSE_AT_SIGHTING - 1`` times before: a free-length GRPO group, whose
    shapes never repeat, is not split on it (the rule then decides as without a dense pair), nor
    one seen twice (``num_iterations = 2``); the same group a third time is. Exact both ways."""
    _math_backend(monkeypatch, dense=False)
    calls = []

    def counting(*args):
        calls.append(args[7])
        return partial.math_dense_forward(*args)

    monkeypatch.setitem(partial.DENSE_KERNELS, "math", (counting, partial.math_dense_backward))
    monkeypatch.setattr(partial, "PLANNED_DENSE", {"math"})
    monkeypatch.setattr(partial, "_DENSE_SHAPES", type(partial._DENSE_SHAPES)())
    monkeypatch.setattr(LAYOUT, "root_split", True)
    seqs = grpo_group(12, 4, 3, VOCAB)
    check_exact(qwen2, seqs, "math")  # check_exact runs the model more than once: count from here
    monkeypatch.setattr(partial, "_DENSE_SHAPES", type(partial._DENSE_SHAPES)())
    calls.clear()
    for _ in range(partial.DENSE_AT_SIGHTING - 1):
        tree_logprobs(qwen2, seqs)
        assert calls == []  # earlier sightings: varlen
    tree_logprobs(qwen2, seqs)
    assert calls == [True] * qwen2.config.num_hidden_layers  # root block and rectangle: one call a layer
    calls.clear()
    tree_logprobs(qwen2, grpo_group(12, 5, 3, VOCAB))  # another shape: varlen again
    assert calls == []


def test_split_under_checkpointing(flash_path_on_cpu, monkeypatch):
    """HF gradient checkpointing re-runs the split attention in backward; still exact."""
    monkeypatch.setattr(LAYOUT, "root_split", True)
    model = tiny_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    check_exact(model, grpo_group(10, 5, 4, VOCAB, num_prompts=2, seed=3), "math")


def test_layout_choices_restore_what_was_set_before():
    """The benchmarks' override of the packed layout choices restores the previous values, also
    when the step raises."""
    assert (LAYOUT.dense_unshared_batches, LAYOUT.root_split) == (True, None)
    with layout_choices(dense_unshared_batches=False, root_split=True):
        assert (LAYOUT.dense_unshared_batches, LAYOUT.root_split) == (False, True)
        with pytest.raises(RuntimeError), layout_choices(root_split=False):
            assert LAYOUT.root_split is False
            raise RuntimeError("step failed")
        assert (LAYOUT.dense_unshared_batches, LAYOUT.root_split) == (False, True)
    assert (LAYOUT.dense_unshared_batches, LAYOUT.root_split) == (True, None)


def test_metadata_with_other_choices_shares_the_uploaded_arrays():
    """``rechosen`` (an eager call after a graphed one that did not replay): the same forest's
    arrays, the split kept where both choices split, dropped where the new one does not, uploaded
    where only the new one splits."""
    forest = PrefixForest.from_sequences(grpo_group(12, 4, 3, VOCAB))
    split = TreeAttentionMetadata.from_forest(forest, CPU, "torch_flash", root_split=True, dense=True)
    plain = TreeAttentionMetadata.from_forest(forest, CPU, "torch_flash", root_split=False)
    again = split.rechosen(forest, root_split=True, dense=False)
    assert again.root_split is split.root_split and not again.dense and split.dense
    assert again.kv_index is split.kv_index and again.subtree_end is split.subtree_end
    assert split.rechosen(forest, root_split=False).root_split is None
    added = plain.rechosen(forest, root_split=True)
    assert added.root_split is not None and added.kv_index is plain.kv_index
    fresh = TreeAttentionMetadata.from_forest(forest, CPU, "torch_flash", root_split=True)
    for name in ("path_kv_index", "rect_cu_seqlens_q", "nodes_kv_index"):
        torch.testing.assert_close(getattr(added.root_split, name), getattr(fresh.root_split, name))
