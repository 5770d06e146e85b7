"""The model is left as it was; gradient checkpointing, PEFT and the dispatcher behave."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_grads_close, assert_logps_close, grads_of, weighted_loss
from transformers import AttentionInterface

from trl_tree import tree_backward, tree_logprobs
from trl_tree.engine.attention.backends import _GatherRows
from trl_tree.engine.reference import untreed_backward, untreed_logprobs
from trl_tree.data.tiny import grpo_group, random_tree, tiny_model

SEQS = random_tree(10, 96, max_len=16, seed=7) + grpo_group(8, 5, 4, 96, seed=2)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_model_is_left_exactly_as_it_was(attn_implementation):
    model = tiny_model("qwen2", attn_implementation=attn_implementation)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_logits = model(prompt).logits
    before_gen = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    forward, impl = model.forward, model.config._attn_implementation

    tree_logprobs(model, SEQS)
    tree_backward(model, SEQS, weighted_loss)
    model.zero_grad(set_to_none=True)

    assert model.forward == forward and model.config._attn_implementation == impl
    assert all(not m._forward_hooks for m in model.modules())
    assert all(torch.equal(v, before_state[k]) for k, v in model.state_dict().items())
    assert torch.equal(model(prompt).logits, before_logits)  # the dispatcher is a pure pass-through
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0), before_gen)


def test_gradient_checkpointing():
    """Backward re-runs the attention after tree_logprobs returned: it must still be the tree's."""
    model = tiny_model("llama")
    model.gradient_checkpointing_enable()
    model.train()
    logps = tree_logprobs(model, SEQS)
    sum((lp * (i + 1)).sum() for i, lp in enumerate(logps)).backward()
    g_tree = grads_of(model)
    model.zero_grad(set_to_none=True)
    ref = untreed_logprobs(model, SEQS)
    assert_logps_close(logps, ref)
    sum((lp * (i + 1)).sum() for i, lp in enumerate(ref)).backward()
    assert_grads_close(g_tree, grads_of(model))
    model.zero_grad(set_to_none=True)
    tree_backward(model, SEQS, weighted_loss)
    g_tree = grads_of(model)
    model.zero_grad(set_to_none=True)
    untreed_backward(model, SEQS, weighted_loss)
    assert_grads_close(g_tree, grads_of(model))


def test_peft_lora_and_disabled_adapter():
    from peft import LoraConfig, get_peft_model

    base = tiny_model("qwen2")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                            init_lora_weights=False))
    tree_backward(model, SEQS, weighted_loss)
    g_tree = grads_of(model)
    assert g_tree and all("lora_" in n for n in g_tree)
    model.zero_grad(set_to_none=True)
    untreed_backward(model, SEQS, weighted_loss)
    assert_grads_close(g_tree, grads_of(model))
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        assert_logps_close(tree_logprobs(model, SEQS), untreed_logprobs(model, SEQS))
        with model.disable_adapter():  # the reference model of TRL's PEFT path
            tree_ref = tree_logprobs(model, SEQS)
            untreed_ref = untreed_logprobs(model, SEQS)
        assert_logps_close(tree_ref, untreed_ref)
        assert max((a - b).abs().max() for a, b in zip(tree_ref, tree_logprobs(model, SEQS)) if len(a)) > 1e-3


def test_dispatcher_installed_once_and_passes_through():
    model = tiny_model("qwen2")
    tree_logprobs(model, SEQS[:2])
    dispatcher = AttentionInterface._global_mapping["sdpa"]
    assert getattr(dispatcher, "__trl_tree_dispatcher__", False)
    tree_logprobs(model, SEQS[:2])
    assert AttentionInterface._global_mapping["sdpa"] is dispatcher


def test_gather_rows_backward_sums_in_fp32():
    x = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([0, 1, 0, 2, 0, 1, 4])
    assert torch.autograd.gradcheck(lambda t: _GatherRows.apply(t, index), (x,))
    xb = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
    many = torch.zeros(4096, dtype=torch.long)
    grad = torch.full((4096, 4), 1e-3, dtype=torch.bfloat16)
    _GatherRows.apply(xb, many).backward(grad)
    # 4096 additions of 1e-3 in bf16 would stall far below 4.096; fp32 accumulation does not
    assert xb.grad[0].float().sub(4.096).abs().max() < 0.02


def test_flash_adapter_calls_the_varlen_api(monkeypatch):
    """The flash-attn adapter (not runnable here: no CUDA, no flash-attn) gets FA2-style arguments,
    filtered to what the installed function accepts (FA4's ``flash_attn.cute`` has fewer)."""
    from trl_tree.engine.attention import backends
    from trl_tree.engine.attention.metadata import TreeAttentionMetadata
    from trl_tree.engine.forest import PrefixForest

    seen = {}

    def fake_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False):  # FA4-like
        seen.update(q=q.shape, k=k.shape, causal=causal, scale=softmax_scale, cu_k=cu_seqlens_k.tolist())
        return torch.zeros_like(q), None

    backends._flash_attn_varlen.cache_clear()
    backends._flash_kwargs_accepted.cache_clear()
    monkeypatch.setattr(backends, "_flash_attn_varlen", lambda: (fake_varlen, "fa4"))
    forest = PrefixForest.from_sequences([[1, 2, 3], [1, 2, 4]])
    meta = TreeAttentionMetadata.from_forest(forest, torch.device("cpu"), "flash")
    q, k = torch.randn(1, 4, 4, 8), torch.randn(1, 2, 4, 8)
    out = backends.flash_tree_attention(q, k, k.clone(), meta, 0.5)
    assert out.shape == (1, 4, 4, 8)
    assert seen == {"q": (4, 4, 8), "k": (8, 2, 8), "causal": True, "scale": 0.5, "cu_k": [0, 2, 5, 8]}
    backends._flash_kwargs_accepted.cache_clear()


def test_the_engine_keeps_no_model_alive_once_its_user_drops_it():
    """The engine's per-model caches must not keep a model (its parameters, its memory) alive after
    the caller lets it go — also where a submodule reaches back to the model, as FSDP2's hooks do (each
    layer's parameter group holds the modules; measured: every FSDP2 trainer of a process kept its model's
    weights on the GPU until the process ended). A training-mode call fills the dropout check's cache."""
    import gc
    import weakref

    from trl_tree.data.tiny import tiny_model

    model = tiny_model("qwen2").train()
    model.model.layers[0].self_attn.__dict__["reaches_back"] = model  # a plain attribute: no submodule registered
    tree_backward(model, [[1, 2, 3, 4], [1, 2, 5]], weighted_loss)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None, "a cache of the engine still holds the model"
