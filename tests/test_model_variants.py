"""Model features that the untreed computation handles per sequence or per batch, computed exactly
over the tree (fp32, CPU): sliding windows, soft-capping, sinks, the MoE load-balancing loss,
length-dependent RoPE, absolute positions, an fp32 LM head, entropies in the backward; and the
refusals where a backend cannot (dropout, a soft-cap on FlashAttention), and non-finite losses.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_grads_close, assert_logps_close, grads_of, weighted_loss
from transformers import AutoModelForCausalLM, GPT2Config
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from trl_tree import tree_backward, tree_logprobs
from trl_tree.engine.attention import backends, partial
from trl_tree.engine.attention.metadata import TreeAttentionMetadata
from trl_tree.engine.reference import untreed_backward, untreed_logprobs
from trl_tree.engine.router import RouterAux
from trl_tree.data.tiny import random_tree, tiny_model

SEQS = [s for s in random_tree(10, 96, max_len=20, seed=3) if len(s) > 1]  # paths up to 20 tokens

WINDOWED = {
    "mistral": dict(sliding_window=4),  # every layer slides
    "qwen2": dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),  # full, then sliding
    "gemma2": dict(sliding_window=4, attn_logit_softcapping=20.0),  # alternating, soft-capped
    "gpt_oss": dict(sliding_window=4),  # alternating, sinks, experts
}


def check_model(model, seqs=SEQS, backends_=("sdpa", "eager"), chunk_size=3, **kwargs):
    """Log-probs (packed and dfs, each backend) and gradients (packed and dfs) equal the untreed ones."""
    ref = untreed_logprobs(model, seqs)
    for mode in ("packed", "dfs"):
        for backend in backends_:
            out = tree_logprobs(model, seqs, mode=mode, attn_backend=backend, chunk_size=chunk_size if mode == "dfs"
                                else None, **kwargs)
            assert_logps_close(out, ref)
    model.zero_grad()
    untreed_backward(model, seqs, weighted_loss)
    expected = grads_of(model)
    for mode in ("packed", "dfs"):
        model.zero_grad()
        tree_backward(model, seqs, weighted_loss, mode=mode, attn_backend=backends_[0],
                      chunk_size=chunk_size if mode == "dfs" else None, **kwargs)
        assert_grads_close(grads_of(model), expected)


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_sliding_windows_softcap_and_sinks_are_exact(family):
    """Windows shorter than the paths (a key is visible iff an ancestor less than a window above),
    Gemma-2's soft-cap and GPT-OSS's sinks, on the reference backends, packed and dfs."""
    model = tiny_model(family, attn_implementation="eager", **WINDOWED[family])
    assert max(map(len, SEQS)) > 2 * WINDOWED[family]["sliding_window"]
    check_model(model)


def test_sliding_window_on_the_flash_path(monkeypatch):
    """torch_flash's logic (PyTorch's FlashAttention varlen with its window; the walk's windowed path
    gather) with the per-segment math kernels standing in for the CUDA ones."""
    monkeypatch.setitem(partial.PARTIAL_KERNELS, "math", (partial.math_partial_forward, partial.math_partial_backward))
    monkeypatch.setitem(backends.TREE_ATTENTION, "math", backends.torch_flash_tree_attention)
    monkeypatch.setattr(backends, "resolve_backend", lambda requested, device, dtype, **_: "math")
    monkeypatch.setattr(backends, "resolve_dfs_backend", lambda requested, device, dtype, **_: "math")
    model = tiny_model("qwen2", attn_implementation="eager", **WINDOWED["qwen2"])
    check_model(model, backends_=("auto",))
    check_model(model, backends_=("auto",), chunk_size=None)


def test_window_mask_is_what_makes_it_exact():
    """The same window dropped from the tree's mask gives other numbers (the test above can fail)."""
    model = tiny_model("mistral", attn_implementation="eager", sliding_window=4)
    meta_mask, span_mask = TreeAttentionMetadata.dense_mask, TreeAttentionMetadata.span_mask
    try:  # a forest's mask, and each tree's block of it (several trees: one block each)
        TreeAttentionMetadata.dense_mask = lambda self, window=None: meta_mask(self, None)
        TreeAttentionMetadata.span_mask = lambda self, start, end, window=None: span_mask(self, start, end, None)
        out = tree_logprobs(model, SEQS, attn_backend="eager")
    finally:
        TreeAttentionMetadata.dense_mask, TreeAttentionMetadata.span_mask = meta_mask, span_mask
    ref = untreed_logprobs(model, SEQS)
    assert max((a - b).abs().max().item() for a, b in zip(out, ref) if a.numel()) > 1e-3


def test_variants_refused_where_a_kernel_cannot_compute_them():
    from trl_tree.engine.attention.support import attention_refusal, unsupported_variant

    assert "soft-capping" in unsupported_variant("torch_flash", "packed", softcap=30.0)
    assert unsupported_variant("flex", "packed", softcap=30.0) is None
    assert "soft-capping" in unsupported_variant("torch_flash", "dfs", softcap=30.0)
    assert "sinks" in unsupported_variant("flash", "packed", sinks=True)
    assert unsupported_variant("torch_flash", "dfs") is None
    gemma = tiny_model("gemma2", attn_implementation="eager", attn_logit_softcapping=20.0)
    assert attention_refusal(gemma, "sdpa", torch.device("cpu"), torch.float32, "packed") is None
    assert "soft-capping" in attention_refusal(gemma, "torch_flash", torch.device("cpu"), torch.float32, "packed")
    plain = tiny_model("qwen2")
    assert "needs a CUDA device" in attention_refusal(plain, "torch_flash", torch.device("cpu"), torch.float32, "dfs")
    # the walk's own refusals come at construction too, not at the first step
    assert "not available in mode='dfs'" in attention_refusal(plain, "flex", torch.device("cpu"), torch.float32, "dfs")
    assert "needs a CUDA device" in attention_refusal(plain, "flex", torch.device("cpu"), torch.float32, "packed")


def _padded_moe_reference(model, seqs, logp_weight, aux_weight):
    """The untreed batch: right-padded, HF's own load-balancing loss over its attention mask."""
    length = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (length - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (length - len(s)) for s in seqs])
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    lp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    model.zero_grad()
    (logp_weight * (lp * mask[:, 1:]).sum() + aux_weight * out.aux_loss).backward()
    return out.aux_loss.detach(), grads_of(model)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "qwen3_5_moe"])
def test_moe_load_balancing_loss_over_the_tree(family):
    """Each unique token's router logits weighted by its multiplicity: the loss and every gradient
    equal the padded batch's — in one packed call, and taken apart over the depth-first walk."""
    model = tiny_model(family, attn_implementation="eager")
    config = model.config
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    seqs = [s for s in random_tree(8, 96, max_len=14, seed=5) if len(s) > 1]
    ref_aux, expected = _padded_moe_reference(model, seqs, 0.1, 3.0)

    router = RouterAux(experts, config.num_experts_per_tok)
    model.zero_grad()
    logps = tree_logprobs(model, seqs, router=router, attn_backend="eager")
    aux = router.loss()
    (0.1 * sum(lp.sum() for lp in logps) + 3.0 * aux).backward()
    torch.testing.assert_close(aux, ref_aux, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads_of(model), expected)

    router = RouterAux(experts, config.num_experts_per_tok)
    with torch.no_grad():
        tree_logprobs(model, seqs, router=router, mode="dfs", attn_backend="eager", chunk_size=3)
    torch.testing.assert_close(router.loss(), ref_aux, rtol=1e-5, atol=1e-6)
    router.set_backward(torch.tensor(3.0))
    model.zero_grad()
    tree_backward(model, seqs, lambda lp, s, p: 0.1 * lp, router=router, mode="dfs", attn_backend="eager",
                  chunk_size=3)
    assert_grads_close(grads_of(model), expected)
    # the multiplicities matter: unweighted unique tokens give another loss
    unweighted = RouterAux(experts, config.num_experts_per_tok)
    with torch.no_grad():
        tree_logprobs(model, seqs, router=unweighted, attn_backend="eager")
    unweighted.weights = [torch.ones_like(w) for w in unweighted.weights]
    assert abs(unweighted.loss().item() - ref_aux.item()) > 1e-4


def _padded_logps(model, seqs, length):
    """Each sequence right-padded to ``length``: what a padded batch of that width shows the RoPE."""
    out = []
    for s in seqs:
        ids = torch.tensor([s + [0] * (length - len(s))])
        mask = torch.tensor([[1] * len(s) + [0] * (length - len(s))])
        logits = model(input_ids=ids, attention_mask=mask).logits[0, : len(s) - 1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1 : len(s), None]).squeeze(-1))
    return out


@pytest.mark.parametrize("rope", ["dynamic", "longrope"])
def test_length_dependent_rope_uses_the_padded_width(rope):
    """Dynamic NTK and LongRoPE choose their frequencies from the call's length: with ``rope_length``
    every call (a packed call, each unit of the walk) chooses for the padded batch's width."""
    if rope == "dynamic":
        model = tiny_model("llama", max_position_embeddings=16,
                           rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    else:
        model = tiny_model("phi3", max_position_embeddings=16, original_max_position_embeddings=8, rope_parameters={
            "rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0, 3.0, 2.0, 1.5],
            "rope_theta": 10000.0, "original_max_position_embeddings": 8})
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 8, 7, 6]]
    width = 24
    ref = _padded_logps(model, seqs, width)
    for mode in ("packed", "dfs"):
        assert_logps_close(tree_logprobs(model, seqs, mode=mode, rope_length=width, chunk_size=2), ref)
    unhinted = tree_logprobs(model, seqs, mode="dfs", chunk_size=2)
    assert max((a - b).abs().max().item() for a, b in zip(unhinted, ref)) > 1e-3
    with pytest.raises(ValueError, match="rope_length must be an int >= the longest sequence"):
        tree_logprobs(model, seqs, rope_length=3)


def test_rope_models_compute_past_max_position_embeddings_and_learned_positions_refuse():
    model = tiny_model("qwen2", max_position_embeddings=8)
    seqs = [list(range(1, 12)), list(range(1, 11)) + [40, 41, 42]]
    assert_logps_close(tree_logprobs(model, seqs), untreed_logprobs(model, seqs))
    gpt2 = _gpt2()
    with pytest.raises(ValueError, match=r"sequence 0 has 17 tokens, more than the 16 rows of the model's position"):
        tree_logprobs(gpt2, [[1] * 17])


def _gpt2(**overrides):
    torch.manual_seed(0)
    fields = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0, bos_token_id=1, eos_token_id=1)
    config = GPT2Config(**{**fields, **overrides})
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_absolute_positions_packed_and_dfs():
    """GPT-2 (no GQA fields in its config, learned positions) in both modes."""
    check_model(_gpt2(), seqs=[s[:16] for s in SEQS], backends_=("sdpa",))


def test_dropout_in_training_mode_is_refused():
    model = _gpt2(resid_pdrop=0.1).train()
    with pytest.raises(ValueError, match=r"dropout is active in training mode \(.*p=0.1"):
        tree_logprobs(model, [[1, 2, 3], [1, 2, 4]])
    model.eval()
    tree_logprobs(model, [[1, 2, 3], [1, 2, 4]])  # eval: no masks drawn
    qwen = tiny_model("qwen2", attention_dropout=0.1).train()
    with pytest.raises(ValueError, match=r"attention_dropout \(0.1\)"):
        tree_backward(qwen, [[1, 2, 3], [1, 2, 4]], weighted_loss)


def test_entropies_in_the_backward():
    """``with_entropy=True``: the token loss sees differentiable entropies (an entropy bonus), in
    packed mode and through the depth-first walk (its deferred LM head included)."""
    model = tiny_model("qwen2")

    def loss(lp, seq_idx, pos, ent):
        return weighted_loss(lp, seq_idx, pos) - 0.3 * ent * (1 + seq_idx % 2)

    logps, ents = untreed_logprobs(model, SEQS, return_entropy=True)
    model.zero_grad()
    total = 0.0
    for i, (lp, ent) in enumerate(zip(logps, ents)):
        pos = torch.arange(lp.shape[0])
        term = loss(lp, torch.full_like(pos, i), pos, ent).sum()
        term.backward()
        total += term.item()
    expected = grads_of(model)
    for mode in ("packed", "dfs"):
        model.zero_grad()
        value = tree_backward(model, SEQS, loss, mode=mode, with_entropy=True, chunk_size=4 if mode == "dfs" else None)
        assert value == pytest.approx(total, rel=1e-5)
        assert_grads_close(grads_of(model), expected)


def test_non_finite_loss_raises_naming_the_sequences():
    model = tiny_model("qwen2")

    def poisoned(lp, seq_idx, pos):
        return torch.where(seq_idx == 2, lp * float("nan"), lp)

    with pytest.raises(FloatingPointError, match=r"non-finite terms in sequence\(s\) \[2\]"):
        tree_backward(model, SEQS, poisoned)
    with pytest.raises(FloatingPointError, match="mode='dfs'"):
        tree_backward(model, SEQS, poisoned, mode="dfs")


def test_lm_head_in_fp32():
    """``lm_head_fp32`` (TRL's cast_lm_head_to_fp32): a bf16 model's head scored from fp32 hidden
    states and weights, outside autocast; one sequence, so the hidden states are the untreed ones."""
    model = tiny_model("qwen2").to(torch.bfloat16)
    seq = [3, 5, 7, 9, 11, 13, 2, 4]
    ids = torch.tensor([seq])
    hidden = model.model(input_ids=ids).last_hidden_state[0, :-1].float()
    ref = torch.log_softmax(hidden @ model.lm_head.weight.float().T, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    (fp32,) = tree_logprobs(model, [seq], lm_head_fp32=True)
    (bf16,) = tree_logprobs(model, [seq])
    torch.testing.assert_close(fp32, ref, rtol=0, atol=1e-5)
    assert (bf16 - ref).abs().max() > 1e-4
    with pytest.raises(TypeError, match="lm_head_fp32 must be True or False"):
        tree_logprobs(model, [seq], lm_head_fp32="yes")


def test_load_balancing_weights_are_multiplicities():
    """``RouterAux.loss`` is transformers' function with the multiplicities as its mask: one layer,
    a token counted twice weighs as two copies of it."""
    z = torch.randn(3, 4)
    twice = RouterAux(4, 2)
    twice.collect([z], torch.tensor([2, 1, 1]))
    expected = load_balancing_loss_func((torch.cat([z[:1], z]),), 4, 2, None)
    torch.testing.assert_close(twice.loss(), expected)


@pytest.mark.parametrize("mode", ["packed", "dfs"])
def test_fp32_weights_under_autocast(mode, monkeypatch):
    """Mixed precision (fp32 weights, ``bf16=True``): the attention runs in the autocast dtype, as the
    model's own SDPA does under autocast, the backend is chosen for it, and the tree keeps DESIGN.md's
    bf16 rule against the fp32 reference (its error at most 1.5x the untreed autocast forward's)."""
    from trl_tree.engine.dfs import stack
    from trl_tree.engine.model_parts import model_parts

    seen = set()

    def spy(original):
        def attention(q, k, v, *args, **kwargs):
            seen.add((q.dtype, k.dtype, v.dtype))
            return original(q, k, v, *args, **kwargs)
        return attention

    monkeypatch.setattr(backends, "masked_attention", spy(backends.masked_attention))
    monkeypatch.setattr(stack, "masked_attention", spy(stack.masked_attention))
    torch.manual_seed(0)
    model = tiny_model("qwen2")
    seqs = random_tree(6, model.config.vocab_size, seed=3)
    reference = untreed_logprobs(model, seqs)
    parts = model_parts(model)
    assert parts.compute_dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert parts.compute_dtype == torch.bfloat16
        untreed = untreed_logprobs(model, seqs)
        tree = tree_logprobs(model, seqs, mode=mode)
    assert seen == {(torch.bfloat16,) * 3}  # the projections' dtype, though RoPE promotes q and k to fp32
    error = max((a.float() - r).abs().max().item() for a, r in zip(tree, reference))
    stock = max((a.float() - r).abs().max().item() for a, r in zip(untreed, reference))
    assert 0 < error <= 1.5 * stock, (error, stock)


def test_llama4_chunked_attention_is_exact_within_a_chunk_and_refused_past_it():
    """Llama-4's local layers attend within chunks of ``attention_chunk_size`` positions: within one
    chunk that is full attention (exact, packed and dfs; its backbone found under ``model`` although
    the class names ``language_model``); a longer sequence is refused, not computed with the wrong mask."""
    model = tiny_model("llama4")
    assert "chunked_attention" in model.config.layer_types
    seqs = random_tree(10, 96, max_len=40, seed=3)
    for kwargs in ({}, {"mode": "dfs", "chunk_size": 3}):
        assert_logps_close(tree_logprobs(model, seqs, **kwargs), untreed_logprobs(model, seqs))
    with pytest.raises(ValueError, match=r"more than the model's attention_chunk_size \(64\)"):
        tree_logprobs(model, [list(range(3, 3 + 65))])
