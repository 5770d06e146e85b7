"""FlashAttention-4 as the ``flash`` backend's partial-kernel pair (``attention/fa4.py``), on the CPU.

FA4 needs a Hopper or Blackwell GPU, so a stand-in ``flash_attn.cute.interface`` takes its place:
its ``_flash_attn_fwd`` / ``_flash_attn_bwd`` have FA4's parameter names and compute with the
per-segment math kernels of ``attention/partial.py``. What is checked is the wiring the GPU check
(``bench.check_gpu``, paths ``*/flash*``) then runs with the real kernels: the argument translation
(varlen arguments, window, the merged output and log-sum-exp handed to the backward), and that
``attn_backend="flash"`` takes every path ``torch_flash`` takes — packed whole and split at the
roots, under checkpointing with kept outputs, the depth-first walk — exactly (fp32).
"""

from __future__ import annotations

import types

import pytest
import torch
from test_dfs import check_dfs, deep_tree
from test_exactness import WORKLOADS, check_exact
from test_model_variants import WINDOWED, check_model

from trl_tree.engine.attention import backends, fa4, partial
from trl_tree.engine.dfs import walk
from trl_tree.engine.layout import LAYOUT
from trl_tree.data.tiny import tiny_model

CALLS: list[str] = []


def _fake_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
              max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
              causal=False, softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None,
              return_lse=False, **_):
    assert return_lse and softcap is None and window_size_right in (None, 0)
    window = None if window_size_left is None else window_size_left + 1
    CALLS.append("fwd")
    out, lse, _ = partial.math_partial_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               causal, softmax_scale, window=window)
    return out, lse, None, None, None


def _fake_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
              window_size_right=None, m_block_size=64, n_block_size=128, num_threads=256, pack_gqa=False,
              cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None,
              max_seqlen_k=None, **_):
    assert softcap == 0.0 and lse.dtype in (torch.float32, torch.float64) and lse.is_contiguous()
    window = None if window_size_left is None else window_size_left + 1
    CALLS.append("bwd")
    return partial.math_partial_backward(dout, q, k, v, out, lse, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, causal, softmax_scale, window=window)


@pytest.fixture
def fa4_on_cpu(monkeypatch):
    """``attn_backend="flash"`` with the stand-in FA4 registered as its pair (no dense pair on a CPU)."""
    interface = types.SimpleNamespace(_flash_attn_fwd=_fake_fwd, _flash_attn_bwd=_fake_bwd)
    monkeypatch.setattr(fa4, "_interface", lambda: interface)
    fa4.fa4_pair_available.cache_clear()
    monkeypatch.delitem(partial.PARTIAL_KERNELS, "flash", raising=False)
    monkeypatch.setattr(partial, "DENSE_KERNELS", dict(partial.DENSE_KERNELS))
    monkeypatch.setattr(partial, "PLANNED_DENSE", set(partial.PLANNED_DENSE))
    assert fa4.register_fa4()
    monkeypatch.setattr(backends, "resolve_backend", lambda requested, device, dtype, **_: "flash")
    monkeypatch.setattr(backends, "resolve_dfs_backend", lambda requested, device, dtype, **_: "flash")
    CALLS.clear()
    yield
    partial.PARTIAL_KERNELS.pop("flash", None)
    fa4.fa4_pair_available.cache_clear()


@pytest.mark.parametrize("split", [False, True, None], ids=["whole-paths", "split", "auto"])
def test_packed_flash_runs_the_fa4_pair_exactly(qwen2, fa4_on_cpu, monkeypatch, split):
    monkeypatch.setattr(LAYOUT, "root_split", split)
    check_exact(qwen2, WORKLOADS["grpo_group"] + WORKLOADS["multi_level"], "flash")
    assert "fwd" in CALLS and "bwd" in CALLS  # the pair ran, not the gathered-path varlen function


def test_dfs_flash_runs_the_fa4_pair_exactly(qwen2, fa4_on_cpu):
    check_dfs(qwen2, deep_tree(), backend="flash", chunk_size=4, score_from=[3] * len(deep_tree()))
    assert CALLS.count("bwd") > 0


def test_checkpointed_flash_keeps_its_outputs(fa4_on_cpu, monkeypatch):
    """Under gradient checkpointing the packed FA4 path keeps its attention outputs for the recompute,
    as torch_flash's does: the forward kernels run once per layer, not twice."""
    model = tiny_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    monkeypatch.setattr(LAYOUT, "root_split", True)
    check_exact(model, WORKLOADS["grpo_group"], "flash")
    CALLS.clear()
    from trl_tree import tree_backward

    tree_backward(model, WORKLOADS["grpo_group"], lambda lp, s, p: -lp, attn_backend="flash")
    layers = model.config.num_hidden_layers
    assert CALLS.count("bwd") >= layers and CALLS.count("fwd") == CALLS.count("bwd")  # no second forward


def test_sliding_window_reaches_fa4_as_its_window_arguments(fa4_on_cpu):
    model = tiny_model("qwen2", attn_implementation="eager", **WINDOWED["qwen2"])
    check_model(model, backends_=("flash",))


def test_softcap_stays_on_the_gathered_path(monkeypatch, fa4_on_cpu):
    """The pair takes no soft-cap: a soft-capped model's packed call goes to flash-attn's own varlen
    function (which takes one) instead, never to the pair without its soft-cap."""
    seen = {}

    def fake_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    softcap=None):
        seen["softcap"] = softcap
        return q.new_zeros(q.shape)

    monkeypatch.setattr(backends, "_flash_attn_varlen", lambda: (fake_varlen, "fa4"))
    backends._flash_kwargs_accepted.cache_clear()
    try:
        from trl_tree import PrefixForest
        from trl_tree.engine.attention.metadata import TreeAttentionMetadata

        meta = TreeAttentionMetadata.from_forest(PrefixForest.from_sequences([[1, 2, 3], [1, 2, 4]]),
                                                 torch.device("cpu"), "flash")
        q = torch.randn(1, 2, 4, 8)
        backends.flash_tree_attention(q, q[:, :1], q[:, :1], meta, 0.5, softcap=20.0)
    finally:
        backends._flash_kwargs_accepted.cache_clear()
    assert seen == {"softcap": 20.0} and "fwd" not in CALLS


def test_dfs_with_flash_attn_2_is_refused_by_name(monkeypatch):
    """flash-attn 2's varlen function returns no log-sum-exp to merge: the walk refuses it, naming why."""
    monkeypatch.delitem(partial.PARTIAL_KERNELS, "flash", raising=False)
    monkeypatch.setattr(backends, "backend_available", lambda name, device, dtype: (True, ""))
    with pytest.raises(ValueError, match="FlashAttention-4"):
        walk.resolve_dfs_backend("flash", torch.device("cuda"), torch.bfloat16)


def test_an_fa4_release_with_other_arguments_is_not_used(monkeypatch):
    """A release whose private functions lost an argument this module passes is not registered (auto
    keeps PyTorch's FA2) instead of failing inside a training step."""
    def renamed_fwd(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    softmax_scale=None, causal=False, return_softmax_lse=False):
        raise AssertionError("never called")

    monkeypatch.setattr(fa4, "_interface", lambda: types.SimpleNamespace(_flash_attn_fwd=renamed_fwd,
                                                                          _flash_attn_bwd=_fake_bwd))
    monkeypatch.delitem(partial.PARTIAL_KERNELS, "flash", raising=False)
    fa4.fa4_pair_available.cache_clear()
    try:
        assert not fa4.fa4_pair_available() and not fa4.register_fa4()
        assert "flash" not in partial.PARTIAL_KERNELS
    finally:
        fa4.fa4_pair_available.cache_clear()
