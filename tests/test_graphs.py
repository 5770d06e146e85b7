"""CUDA-graph replay of packed training calls (``trl_tree.engine.graphs``), on the CPU.

CPU has no CUDA graphs, so ``graphs.EagerReplay`` stands in for one: a "replay" runs the captured
function again and leaves its outputs in the first run's tensors, as a graph leaves them in its
static outputs. Everything else — signatures, static buffers refreshed per call, the autograd
function, gradient buffers handed to autograd, the order check, the refusals — is the code that
runs on the GPU (``python -m trl_tree.bench.check_gpu`` checks real captures there).
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_grads_close, assert_logps_close, grads_of, weighted_loss
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_tree import PrefixForest, tree_backward, tree_logprobs
from trl_tree.engine import graphs, packed
from trl_tree.engine.layout import LAYOUT
from trl_tree.engine.reference import untreed_backward
from trl_tree.data.tiny import grpo_group, random_tree, tiny_model

VOCAB = 96
GROUP = grpo_group(12, 6, 4, VOCAB, seed=1)
SAME_LAYOUT = grpo_group(12, 6, 4, VOCAB, seed=2)  # other tokens, the same lengths and sharing
TREE = random_tree(8, VOCAB, max_len=20, seed=4)


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(graphs, "CPU_STAND_IN", graphs.EagerReplay)


@pytest.fixture(params=[False, True], ids=["accumulate-grad", "autograd-grad"])
def grad_handoff(request, monkeypatch):
    """How the captured backward hands gradients to the buffers: autograd accumulating into them, or
    ``torch.autograd.grad`` plus one add (the path under ``torch.distributed``, see
    ``graphs.GRADS_BY_AUTOGRAD_GRAD``)."""
    monkeypatch.setattr(graphs, "GRADS_BY_AUTOGRAD_GRAD", request.param)
    return request.param


def _model(checkpoint: str | None = "non-reentrant") -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_model("qwen2", vocab_size=VOCAB)
    if checkpoint is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpoint == "reentrant"})
    model.train()
    return model


def _runner(model) -> graphs.GraphRunner:
    return graphs._RUNNERS[model]


def _graphed_backward(model, seqs, loss=weighted_loss, cuda_graphs=True, **kw) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    value = tree_backward(model, seqs, loss, cuda_graphs=cuda_graphs, **kw)
    return value, grads_of(model)


@pytest.mark.parametrize("checkpoint", [None, "non-reentrant", "reentrant"])
@pytest.mark.parametrize("seqs", [GROUP, TREE], ids=["grpo", "deep_tree"])
def test_replayed_backward_matches_the_untreed_model(stand_in, grad_handoff, checkpoint, seqs):
    if grad_handoff and checkpoint == "reentrant":
        model = _model(checkpoint)
        with pytest.raises(ValueError, match="reentrant gradient checkpointing does not support"):
            for _ in range(2):
                _graphed_backward(model, seqs)
        return
    model = _model(checkpoint)
    model.zero_grad(set_to_none=True)
    ref_loss = untreed_backward(model, seqs, weighted_loss)
    ref = grads_of(model)
    for call in range(3):  # eager, capture, replay
        loss, grads = _graphed_backward(model, seqs)
        assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
        assert_grads_close(grads, ref)
        assert _runner(model).captures == (0 if call == 0 else 1)


def test_new_tokens_in_the_same_layout_replay_the_captured_graphs(stand_in):
    model = _model()
    for _ in range(2):
        _graphed_backward(model, GROUP)
    assert _runner(model).captures == 1
    model.zero_grad(set_to_none=True)
    untreed_backward(model, SAME_LAYOUT, weighted_loss)
    ref = grads_of(model)
    _, grads = _graphed_backward(model, SAME_LAYOUT)
    assert _runner(model).captures == 1 and len(_runner(model).pairs) == 1
    assert_grads_close(grads, ref)


def test_the_loss_stays_eager(stand_in):
    """A loss closing over tensors that change every call (advantages) is applied as it is now."""
    model = _model()
    for scale in (1.0, 2.0, -3.0):
        adv = torch.tensor([scale, 0.5, -1.0, 2.0])

        def loss(lp, seq_idx, pos, adv=adv):
            return -lp * adv[seq_idx]

        model.zero_grad(set_to_none=True)
        untreed_backward(model, GROUP, loss)
        ref = grads_of(model)
        _, grads = _graphed_backward(model, GROUP, loss)
        assert_grads_close(grads, ref)
    assert _runner(model).captures == 1


def test_replayed_gradients_accumulate_like_autograd(stand_in, grad_handoff):
    """Gradient accumulation over micro-batches, ``zero_grad`` to None or in place, and a ``.grad``
    that is some other tensor: the same gradients as eager autograd in every case."""
    model = _model()
    for _ in range(2):
        _graphed_backward(model, GROUP)
    runner = _runner(model)
    model.zero_grad(set_to_none=True)
    untreed_backward(model, GROUP, weighted_loss)
    ref_one = grads_of(model)
    untreed_backward(model, SAME_LAYOUT, weighted_loss)
    ref_two = grads_of(model)
    for set_to_none in (True, False, True):
        model.zero_grad(set_to_none=set_to_none)
        tree_backward(model, GROUP, weighted_loss, cuda_graphs=True)
        assert_grads_close(grads_of(model), ref_one)
        tree_backward(model, SAME_LAYOUT, weighted_loss, cuda_graphs=True)  # accumulates in place
        assert_grads_close(grads_of(model), ref_two)
    assert all(p.grad is b for p, b in zip(runner.params, runner.grad_buffers))
    # a .grad that is not the buffer (set by the user, or by an eager call) is added to
    model.zero_grad(set_to_none=True)
    tree_backward(model, GROUP, weighted_loss)  # eager: autograd's own .grad tensors
    tree_backward(model, SAME_LAYOUT, weighted_loss, cuda_graphs=True)
    assert_grads_close(grads_of(model), ref_two)
    assert not any(p.grad is b for p, b in zip(runner.params, runner.grad_buffers))
    assert runner.captures == 1


def test_logprobs_and_entropies_through_the_graph(stand_in):
    """``tree_logprobs`` with a graph (TRL's training forward): values and the backward of any loss."""
    model = _model()
    forest = PrefixForest.from_sequences(TREE)
    eager_lp, eager_ent = tree_logprobs(model, forest, return_entropy=True)
    loss = sum((lp * (i + 1)).sum() for i, lp in enumerate(eager_lp))
    model.zero_grad(set_to_none=True)
    loss.backward()
    ref = grads_of(model)
    for _ in range(3):
        lp, ent = tree_logprobs(model, forest, return_entropy=True, cuda_graphs=True)
        assert_logps_close(lp, eager_lp)
        assert_logps_close(ent, eager_ent)
        model.zero_grad(set_to_none=True)
        sum((x * (i + 1)).sum() for i, x in enumerate(lp)).backward()
        assert_grads_close(grads_of(model), ref)
    assert _runner(model).captures == 1
    # without a graph to build (no_grad: TRL's old/reference log-probs), the call runs eagerly
    with torch.no_grad():
        lp = tree_logprobs(model, forest, cuda_graphs=True)
    assert_logps_close(lp, eager_lp)


def test_a_backward_after_a_later_graphed_forward_is_refused(stand_in):
    """The pool holds the activations of the last replayed forward only: never a wrong gradient."""
    model = _model()
    for _ in range(2):
        tree_logprobs(model, GROUP, cuda_graphs=True)
    first = tree_logprobs(model, GROUP, cuda_graphs=True)
    second = tree_logprobs(model, SAME_LAYOUT, cuda_graphs=True)
    with pytest.raises(RuntimeError, match="ran after a later graphed forward"):
        torch.cat(first).sum().backward()
    torch.cat(second).sum().backward()  # the latest one is fine


def test_layouts_are_captured_at_their_second_sighting_and_evicted_lru(stand_in, monkeypatch):
    monkeypatch.setattr(graphs, "GRAPH_CACHE_SIZE", 2)
    monkeypatch.setattr(graphs, "BUCKETS", False)  # exact layouts only (buckets: the tests below)
    model = _model()
    layouts = [grpo_group(8 + i, 4, 3, VOCAB, seed=i) for i in range(3)]
    for seqs in layouts:
        _graphed_backward(model, seqs)
    assert _runner(model).captures == 0
    for seqs in layouts:
        _graphed_backward(model, seqs)
    runner = _runner(model)
    assert runner.captures == 3 and len(runner.pairs) == 2 and not runner.sightings
    # layouts that never come back are forgotten beyond SIGHTINGS_KEPT
    monkeypatch.setattr(graphs, "SIGHTINGS_KEPT", 2)
    for i in range(4):
        _graphed_backward(model, grpo_group(5 + i, 3, 2, VOCAB, seed=i))
    assert len(runner.sightings) == 2 and runner.captures == 3
    # a dense batch of unshared equal-length rows runs eagerly (the model's own attention, GPU-efficient)
    unshared = [[i + 1] * 6 for i in range(4)]
    for _ in range(3):
        _graphed_backward(model, unshared)
    assert runner.captures == 3


def test_adapter_switches_and_train_mode_are_part_of_the_layout(stand_in):
    """A graph captured with LoRA adapters on is not replayed with them off (PEFT's disable_adapter,
    TRL's reference model), nor in eval mode."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(tiny_model("qwen2", vocab_size=VOCAB), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # a non-zero adapter, so on and off give different numbers
    model.train()
    for _ in range(2):
        tree_logprobs(model, GROUP, cuda_graphs=True)
    runner = graphs._RUNNERS[model.get_base_model()]
    assert runner.captures == 1
    with model.disable_adapter():
        eager_off = tree_logprobs(model, GROUP)
        graphed_off = tree_logprobs(model, GROUP, cuda_graphs=True)
    assert_logps_close(graphed_off, eager_off)
    model.eval()
    assert_logps_close(tree_logprobs(model, GROUP, cuda_graphs=True), tree_logprobs(model, GROUP))
    assert runner.captures == 1  # both ran eagerly: first sightings of their own layouts


def test_graphed_calls_may_take_the_dense_kernels_eager_calls_do_not(stand_in, monkeypatch):
    """Where cuDNN pays only without the host's cost per call (head_dim 64, ``CUDNN_GRAPHED_MIN_HEAD_DIM``),
    a layout's eager calls keep the varlen kernels and its captured graphs hold the dense ones: the
    choice is part of the metadata, hence of the layout signature. Exact either way."""
    from trl_tree.engine.attention import backends, partial

    dense_calls = []

    def counting(*args):
        dense_calls.append(args[7])
        return partial.math_dense_forward(*args)

    monkeypatch.setitem(partial.PARTIAL_KERNELS, "math", (partial.math_partial_forward, partial.math_partial_backward))
    monkeypatch.setitem(partial.DENSE_KERNELS, "math", (counting, partial.math_dense_backward))
    monkeypatch.setattr(partial, "DENSE_MIN_ROWS", 1)
    monkeypatch.setitem(backends.TREE_ATTENTION, "math", backends.torch_flash_tree_attention)
    monkeypatch.setattr(backends, "resolve_backend", lambda requested, device, dtype, **_: "math")
    monkeypatch.setattr(graphs, "GRAPH_BACKENDS", (*graphs.GRAPH_BACKENDS, "math"))
    monkeypatch.setattr(packed, "dense_blocks", lambda parts, backend, graphed=False: graphed)
    monkeypatch.setattr(LAYOUT, "root_split", True)
    from trl_tree.engine.attention import metadata

    uploads = []
    real_upload = metadata.upload
    monkeypatch.setattr(metadata, "upload", lambda arrays, *a: uploads.append(len(arrays)) or real_upload(arrays, *a))
    walks = []
    real_walk = packed.activation_checkpointing
    monkeypatch.setattr(packed, "activation_checkpointing", lambda m: walks.append(1) or real_walk(m))
    model = _model()
    model.zero_grad(set_to_none=True)
    untreed_backward(model, GROUP, weighted_loss)
    ref = grads_of(model)
    for call in range(3):  # eager (first sighting), capture, replay
        dense_calls.clear()
        uploads.clear()
        walks.clear()
        _, grads = _graphed_backward(model, GROUP)
        assert_grads_close(grads, ref)
        assert bool(dense_calls) == (call > 0), call
        assert len(uploads) == 2  # the forest's arrays went up once: the eager call's metadata shares them
        assert len(walks) == 1, call  # the checkpointing flag: one walk over the model per call, fallback included
    pair = next(iter(_runner(model).pairs.values()))
    assert pair.meta.dense and _runner(model).captures == 1


def test_refusals(stand_in, monkeypatch):
    model = _model()
    with pytest.raises(TypeError, match="cuda_graphs must be True, False or 'buckets'"):
        tree_logprobs(model, GROUP, cuda_graphs="yes")

    class DistributedDataParallel(torch.nn.Module):  # what DDP looks like to the check
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kw):
            return self.module(**kw)

    with pytest.raises(ValueError, match="wrapped in DistributedDataParallel"):
        tree_logprobs(DistributedDataParallel(model), GROUP, cuda_graphs=True)
    handle = model.model.norm.weight.register_hook(lambda g: g)
    with pytest.raises(ValueError, match="gradient hook"):
        tree_logprobs(model, GROUP, cuda_graphs=True)
    handle.remove()
    monkeypatch.setattr(graphs, "CPU_STAND_IN", None)
    with pytest.raises(ValueError, match="needs the model on a CUDA device"):
        tree_backward(model, TREE, weighted_loss, cuda_graphs=True)


# ---------------------------------------------------------------- layouts padded to buckets


def _free_length_group(prompt: int, lengths: list[int], seed: int) -> list[list[int]]:
    """A GRPO group whose completions have free lengths (no two groups share a layout)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(1, VOCAB, (prompt,), generator=g).tolist()
    return [head + torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


FREE = [_free_length_group(40, [10, 14, 9, 12], 1), _free_length_group(40, [12, 11, 10, 13], 2),
        _free_length_group(40, [13, 9, 12, 10], 3)]


@pytest.fixture(params=["masked", "varlen"])
def graph_backend(request, monkeypatch):
    """The CPU's masked attention (sdpa), or the packed FlashAttention function's varlen path with the
    math kernels standing in for FA2 (no dense pair: a bucketed layout never splits)."""
    if request.param == "varlen":
        from trl_tree.engine.attention import backends, partial

        monkeypatch.setitem(partial.PARTIAL_KERNELS, "math", (partial.math_partial_forward, partial.math_partial_backward))
        monkeypatch.setitem(backends.TREE_ATTENTION, "math", backends.torch_flash_tree_attention)
        monkeypatch.setattr(backends, "resolve_backend", lambda requested, device, dtype, **_: "math")
        monkeypatch.setattr(graphs, "GRAPH_BACKENDS", (*graphs.GRAPH_BACKENDS, "math"))
    return request.param


def test_layouts_that_never_repeat_replay_their_bucket(stand_in, graph_backend):
    """Free-length groups: no layout is seen twice, yet from the second call on they share the
    graphs of one padded layout — and every call gives the untreed model's gradients."""
    from trl_tree.engine.attention.buckets import BucketedLayout

    model = _model()
    forests = [PrefixForest.from_sequences(seqs) for seqs in FREE]
    pads = [BucketedLayout.pad(f, *(lambda p: (p.pred_src, f.tokens[p.pred_dst]))(f.scoring_plan(None))) for f in forests]
    assert len({(p.tokens.shape, p.kv_index.shape, p.cu_seqlens_q.shape, p.pred_src.shape, p.max_seqlen_q,
                 p.max_seqlen_k) for p in pads}) == 1, "the test groups must share a bucket"
    assert len({(f.num_unique_tokens, f.kv_index.shape) for f in forests}) == 3
    for call, seqs in enumerate(FREE):
        model.zero_grad(set_to_none=True)
        untreed_backward(model, seqs, weighted_loss)
        ref = grads_of(model)
        _, grads = _graphed_backward(model, seqs, cuda_graphs="buckets")
        assert_grads_close(grads, ref)
        runner = _runner(model)
        assert runner.captures == (0 if call == 0 else 1), call
    assert [sig[7] for sig in runner.pairs] == ["bucket"]
    for seed in (4, 5, 6):  # cuda_graphs=True: exact layouts only, and these never repeat
        _graphed_backward(model, _free_length_group(40, [20 + seed, 11, 12, 10], seed))
    assert runner.captures == 1
    logps = tree_logprobs(model, FREE[0], cuda_graphs="buckets")  # a replay of the bucket: real predictions only
    assert [len(lp) for lp in logps] == [len(s) - 1 for s in FREE[0]]
    assert_logps_close(logps, tree_logprobs(model, FREE[0]))


def test_a_repeating_layout_takes_its_own_graphs_first(stand_in):
    """Fixed-length rollouts: the exact layout is captured at its second sighting (no padding)."""
    model = _model()
    for _ in range(3):
        _graphed_backward(model, GROUP, cuda_graphs="buckets")
    assert [sig[7] for sig in _runner(model).pairs] != ["bucket"] and _runner(model).captures == 1


def test_buckets_only_pads_a_repeating_layout_too(stand_in, monkeypatch):
    """``EXACT_LAYOUTS = False`` (how check_gpu checks the bucketed path on the GPU): the same group
    replays its bucket's graphs, with the untreed model's gradients."""
    monkeypatch.setattr(graphs, "EXACT_LAYOUTS", False)
    model = _model()
    model.zero_grad(set_to_none=True)
    untreed_backward(model, GROUP, weighted_loss)
    ref = grads_of(model)
    for _ in range(3):
        _, grads = _graphed_backward(model, GROUP, cuda_graphs="buckets")
        assert_grads_close(grads, ref)
    assert [sig[7] for sig in _runner(model).pairs] == ["bucket"] and _runner(model).captures == 1


def test_bucket_rounding():
    from trl_tree.engine.attention.buckets import bucket

    assert [bucket(n) for n in (1, 7, 16, 17, 100, 10_240, 10_241)] == [1, 7, 16, 18, 104, 10_240, 11_264]
    for n in range(1, 5000):
        b = bucket(n)
        assert n <= b <= max(n, n * 9 // 8 + 1) and bucket(b) == b


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_padding_keeps_every_real_query_s_keys(seed):
    """On random forests: the real segments are unchanged, pad segments are never empty and only
    read pad rows, padded predictions read a pad row — whatever the bucket sizes."""
    import numpy as np

    from trl_tree.engine.attention.buckets import BucketedLayout, bucket

    forest = PrefixForest.from_sequences(random_tree(1 + seed % 12, VOCAB, max_len=30, seed=seed))
    plan = forest.scoring_plan(None)
    pad = BucketedLayout.pad(forest, plan.pred_src, forest.tokens[plan.pred_dst])
    U, N, K, P = forest.num_unique_tokens, forest.num_nodes, forest.kv_index.shape[0], plan.num_predictions
    U_b, N_b, K_b = pad.tokens.shape[0], pad.cu_seqlens_q.shape[0] - 1, pad.kv_index.shape[0]
    assert (U_b, N_b, K_b, pad.pred_src.shape[0]) == (bucket(U + N_b - N), bucket(N + 1), bucket(K + U_b - U), bucket(P))
    assert np.array_equal(pad.cu_seqlens_q[: N + 1], forest.cu_seqlens_q)
    assert np.array_equal(pad.cu_seqlens_k[: N + 1], forest.cu_seqlens_k)
    assert np.array_equal(pad.kv_index[:K], forest.kv_index) and np.array_equal(pad.tokens[:U], forest.tokens)
    q_len, k_len = np.diff(pad.cu_seqlens_q)[N:], np.diff(pad.cu_seqlens_k)[N:]
    assert (q_len >= 1).all() and (k_len >= q_len).all()
    assert pad.cu_seqlens_q[-1] == U_b and pad.cu_seqlens_k[-1] == K_b
    assert (pad.kv_index[K:] >= U).all() and (pad.kv_index < U_b).all()
    assert pad.max_seqlen_q >= max(np.diff(pad.cu_seqlens_q)) and pad.max_seqlen_k >= max(np.diff(pad.cu_seqlens_k))
    assert np.array_equal(pad.pred_src[:P], plan.pred_src) and (pad.pred_src[P:] == U).all()


def test_views_handoff_with_lora_adapters(stand_in, monkeypatch):
    """The views path (several processes) swaps views into PEFT's LoRA layers and into the trained
    copy of a ``modules_to_save`` LM head too: their gradients equal the eager ones, the frozen base
    gets none."""
    from peft import LoraConfig, get_peft_model

    monkeypatch.setattr(graphs, "GRADS_BY_AUTOGRAD_GRAD", True)
    torch.manual_seed(0)
    base = tiny_model("qwen2", vocab_size=VOCAB)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    model.train()
    model.zero_grad(set_to_none=True)
    tree_backward(model, TREE, weighted_loss)
    ref = grads_of(model)
    assert ref and all("lora_" in name or "modules_to_save" in name for name in ref)
    assert any("modules_to_save" in name for name in ref)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        tree_backward(model, TREE, weighted_loss, cuda_graphs=True)
        assert_grads_close(grads_of(model), ref)
    assert graphs._RUNNERS[model.get_base_model()].captures == 1
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())  # swapped back


def test_the_graph_state_does_not_keep_a_deleted_model_alive(stand_in):
    """The runner and the walk's unit graphs live in weak-keyed tables whose key is the model: they
    must not reference it back, or a deleted model would keep its weights, graphs and memory (a
    benchmark or a sweep making one model after another would run out of memory)."""
    import gc
    import weakref

    from trl_tree.engine.dfs import graphs as dfs_graphs

    model = _model()
    seqs = grpo_group(6, 4, 2, VOCAB, seed=0)
    tree_backward(model, seqs, weighted_loss, cuda_graphs=True)  # first sighting: runs eagerly, makes the runner
    tree_backward(model, seqs, weighted_loss, mode="dfs", cuda_graphs=True)  # the walk's graph state and stack
    assert model in graphs._RUNNERS and model in dfs_graphs._WALK_GRAPHS
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None  # and with it its entries in both tables
