"""Bad input gets a clear ValueError/TypeError naming the problem, never a wrong number."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trl_tree import PrefixForest, tree_backward, tree_logprobs
from trl_tree.data.tiny import tiny_model


def loss(lp, s, p):
    return -lp


@pytest.mark.parametrize(
    "seqs, error, match",
    [
        ([], ValueError, "no sequences"),
        ([[1, 2], []], ValueError, "sequence 1 is empty"),
        ([[1, 2.5]], TypeError, "non-integer id"),
        ([[1, True]], TypeError, "non-integer id"),
        ([["a", "b"]], TypeError, "non-integer id"),
        ([torch.tensor([1.0, 2.0])], TypeError, "integer dtype"),
        ([torch.tensor([True, False])], TypeError, "integer dtype"),
        ([np.array([0.5, 1.5])], TypeError, "integers"),
        ([torch.zeros(2, 2, dtype=torch.long)], ValueError, "1-D"),
        ([[1, [2, 3]]], TypeError, "non-integer id"),
        ("abc", TypeError, "list of token-id sequences"),
        ([5, 6], TypeError, "sequence 0 is a int"),
        (torch.zeros(2, 2, 2, dtype=torch.long), ValueError, "3-D tensor"),
    ],
)
def test_bad_sequences(seqs, error, match):
    with pytest.raises(error, match=match):
        PrefixForest.from_sequences(seqs)


def test_ids_out_of_vocabulary(qwen2):
    vocab = qwen2.config.vocab_size
    with pytest.raises(ValueError, match=rf"sequence 1 holds token id {vocab}, outside .*\[0, {vocab}\)"):
        tree_logprobs(qwen2, [[1, 2], [1, vocab]])
    with pytest.raises(ValueError, match=r"token id -3"):
        tree_backward(qwen2, [[1, -3, 2]], loss)


def test_sequence_longer_than_max_positions(qwen2):
    """A RoPE model computes past max_position_embeddings as stock does (tests/test_model_variants.py);
    a learned position table refuses a depth it has no row for (same file)."""
    n = qwen2.config.max_position_embeddings + 1
    assert len(tree_logprobs(qwen2, [[1, 2], [1] * n])[1]) == n - 1


def test_tensors_on_different_devices():
    meta = torch.tensor([1, 2], device="meta")
    with pytest.raises(ValueError, match="different devices"):
        PrefixForest.from_sequences([torch.tensor([1, 2]), meta])


def test_score_from_out_of_range(qwen2):
    with pytest.raises(ValueError, match=r"score_from\[1\] = 3 is outside \[1, 2\]"):
        tree_logprobs(qwen2, [[1, 2, 3], [1, 2]], score_from=3)
    with pytest.raises(ValueError, match="one int per sequence"):
        tree_logprobs(qwen2, [[1, 2, 3], [1, 2]], score_from=[1])
    with pytest.raises(ValueError, match=r"score_from\[0\] = 0"):
        tree_logprobs(qwen2, [[1, 2, 3]], score_from=0)


def test_bad_mode_backend_temperature_loss(qwen2):
    seqs = [[1, 2, 3]]
    with pytest.raises(ValueError, match="unknown mode"):
        tree_logprobs(qwen2, seqs, mode="bfs")
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        tree_backward(qwen2, seqs, loss, mode="dfs", chunk_size=0)
    with pytest.raises(ValueError, match="not available in mode='dfs'"):
        tree_logprobs(qwen2, seqs, mode="dfs", attn_backend="flex")
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        tree_logprobs(qwen2, seqs, attn_backend="xformers")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        tree_logprobs(qwen2, seqs, attn_backend="torch_flash")
    with pytest.raises(ValueError, match="temperature"):
        tree_logprobs(qwen2, seqs, temperature=0)
    with pytest.raises(TypeError, match="token_loss must be callable"):
        tree_backward(qwen2, seqs, "not a function")
    with pytest.raises(ValueError, match=r"one loss term per log-prob \(a tensor of shape \(2,\)\)"):
        tree_backward(qwen2, seqs, lambda lp, s, p: lp.sum())


def test_not_a_causal_lm():
    with pytest.raises(TypeError, match="holds no transformers PreTrainedModel"):
        tree_logprobs(torch.nn.Linear(3, 3), [[1, 2]])
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        tree_logprobs("gpt2", [[1, 2]])


class _HandWrittenAttention(torch.nn.Module):
    """Causal attention that does not go through transformers' AttentionInterface."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        mod = self.inner
        b, n, _ = hidden_states.shape
        q = mod.q_proj(hidden_states).view(b, n, -1, mod.head_dim).transpose(1, 2)
        k = mod.k_proj(hidden_states).view(b, n, -1, mod.head_dim).transpose(1, 2)
        v = mod.v_proj(hidden_states).view(b, n, -1, mod.head_dim).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return mod.o_proj(out.transpose(1, 2).reshape(b, n, -1)), None


def test_model_whose_attention_bypasses_the_interface():
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.self_attn = _HandWrittenAttention(layer.self_attn)
    with pytest.raises(ValueError, match=r"0 of its 2 attention layers and mixers ran through the tree \(attention through transformers' AttentionInterface\)"):
        tree_logprobs(model, [[1, 2, 3], [1, 2, 4]])


def test_soft_cap_refused_at_call_time_on_a_kernel_without_it(monkeypatch):
    """The dispatcher's own check (a direct engine call; trainers refuse at construction): a
    Gemma-2 soft-cap reaching the FlashAttention path, here its math stand-in."""
    from trl_tree.engine.attention import backends, partial

    monkeypatch.setitem(partial.PARTIAL_KERNELS, "torch_flash", (partial.math_partial_forward,
                                                                  partial.math_partial_backward))
    monkeypatch.setattr(backends, "resolve_backend", lambda requested, device, dtype, **_: "torch_flash")
    model = tiny_model("gemma2", attn_implementation="eager", attn_logit_softcapping=20.0)
    with pytest.raises(ValueError, match="soft-capping \\(20.0\\) is not computed by attn_backend='torch_flash'"):
        tree_logprobs(model, [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]])
    assert backends.TREE_ATTENTION["torch_flash"] is backends.torch_flash_tree_attention


def test_attention_dropout_is_refused():
    model = tiny_model("qwen2", attention_dropout=0.1).train()
    with pytest.raises(ValueError, match="attention dropout"):
        tree_logprobs(model, [[1, 2, 3]])


def test_non_softmax_layers_are_refused():
    from transformers import Qwen2Config

    model = tiny_model("qwen2")
    model.config.layer_types = ["full_attention", "linear_attention"]
    assert isinstance(model.config, Qwen2Config)
    with pytest.raises(ValueError, match=r"mixer layers the tree engine cannot run exactly \(layer 1 \(linear_attention\)"):
        tree_logprobs(model, [[1, 2, 3]])


def test_a_peft_adapter_on_the_lm_head_is_refused():
    """LoRA on the LM head would be left out of the scores (the head is scored from its weight
    matrix): refused with the fix named; a head trained whole (``modules_to_save``) is exact."""
    from conftest import assert_logps_close
    from peft import LoraConfig, get_peft_model

    from trl_tree.engine.reference import untreed_logprobs

    seqs = [[1, 2, 3, 4], [1, 2, 5]]
    lora = get_peft_model(tiny_model("qwen2"), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="LM head carries a PEFT adapter"):
        tree_logprobs(lora, seqs)
    saved = get_peft_model(tiny_model("qwen2"), LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with torch.no_grad():
        saved.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)  # differs from the original
    assert_logps_close(tree_logprobs(saved, seqs), untreed_logprobs(saved, seqs))
    with saved.disable_adapter():
        assert_logps_close(tree_logprobs(saved, seqs), untreed_logprobs(saved, seqs))


def test_auto_backend_is_not_changed_by_an_installed_package(monkeypatch):
    """Without FlashAttention-4's pair, 'auto' keeps PyTorch's FlashAttention varlen however a call
    runs; soft-capping, which torch_flash cannot apply, goes to flash."""
    from trl_tree.engine.attention import backends, fa4

    monkeypatch.setattr(backends, "backend_available", lambda name, device, dtype: (True, name))
    monkeypatch.setattr(fa4, "fa4_pair_available", lambda: False)
    cuda = torch.device("cuda")
    assert backends.resolve_backend("auto", cuda, torch.bfloat16) == "torch_flash"
    assert backends.resolve_backend("auto", cuda, torch.bfloat16, hidden_size=8192, graphed=True) == "torch_flash"
    assert backends.resolve_backend("auto", cuda, torch.bfloat16, softcap=30.0) == "flash"
    assert backends.resolve_backend("auto", torch.device("cpu"), torch.float32) == "sdpa"


def test_flex_is_not_chosen_below_its_smallest_head_dimension(monkeypatch):
    """On a GPU in fp32 'auto' takes the compiled flex kernel, which Triton cannot build for heads
    narrower than 16 (a tiny test model's 8: the lowering failed in a two-GPU check); there it takes
    sdpa, and an explicit 'flex' is refused naming the head dimension."""
    from trl_tree.engine.attention import backends, support

    def available(name, device, dtype):
        return (name in ("flex", "sdpa"), name)

    monkeypatch.setattr(backends, "backend_available", available)
    cuda = torch.device("cuda")
    assert backends.resolve_backend("auto", cuda, torch.float32, head_dim=64) == "flex"
    assert backends.resolve_backend("auto", cuda, torch.float32, head_dim=8) == "sdpa"
    with pytest.raises(ValueError, match="head dimension of at least 16 \\(this model's is 8\\)"):
        backends.resolve_backend("flex", cuda, torch.float32, head_dim=8)
    assert support.attention_features(tiny_model("qwen2").config)["head_dim"] == 8
    assert backends.resolve_backend("auto", torch.device("cpu"), torch.float32, head_dim=8) == "sdpa"


def test_auto_takes_fa4_where_it_was_measured_faster(monkeypatch):
    """With FA4 installed on a GPU it runs on, 'auto' takes it for replayed CUDA graphs and for eager
    calls of models wide enough (by mode: backends.FA4_EAGER_MIN_HIDDEN), and keeps PyTorch's FA2 for
    a narrow model's eager step, whose host-side launches FA4's Python path makes slower."""
    from trl_tree.engine.attention import backends, fa4
    from trl_tree.engine.dfs.walk import resolve_dfs_backend

    monkeypatch.setattr(backends, "backend_available", lambda name, device, dtype: (True, name))
    monkeypatch.setattr(fa4, "fa4_pair_available", lambda: True)
    monkeypatch.setattr(fa4, "fa4_runs_on", lambda device: True)
    monkeypatch.setattr(fa4, "register_fa4", lambda: True)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    narrow, medium, wide = 896, 1536, 3584  # Qwen2.5-0.5B, -1.5B, -7B
    assert backends.resolve_backend("auto", cuda, bf16, hidden_size=narrow) == "torch_flash"
    assert backends.resolve_backend("auto", cuda, bf16, hidden_size=narrow, graphed=True) == "flash"
    assert backends.resolve_backend("auto", cuda, bf16, hidden_size=medium) == "flash"
    assert backends.resolve_backend("auto", cuda, torch.float32, hidden_size=wide, graphed=True) != "flash"
    assert backends.resolve_backend("auto", cuda, bf16, hidden_size=wide, sinks=True) != "flash"
    assert resolve_dfs_backend("auto", cuda, bf16, hidden_size=medium) == "torch_flash"
    assert resolve_dfs_backend("auto", cuda, bf16, hidden_size=medium, graphed=True) == "flash"
    assert resolve_dfs_backend("auto", cuda, bf16, hidden_size=wide) == "flash"
    assert resolve_dfs_backend("auto", cuda, bf16, hidden_size=wide, softcap=30.0) == "sdpa"
    assert backends.resolve_backend("torch_flash", cuda, bf16, hidden_size=wide, graphed=True) == "torch_flash"
