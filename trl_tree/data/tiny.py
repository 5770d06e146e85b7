"""Tiny randomly initialised decoders and synthetic rollouts, built in code (no hub access).

Used by the README's demo, the tests and the benchmarks, so every one of them runs offline on any
machine. ``shaped_config`` gives real model shapes (Qwen2.5-0.5B to 32B, Qwen3-30B-A3B) for GPU benchmarks.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

# family -> (config class name, extra config fields)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "gemma": ("GemmaConfig", {"head_dim": 8}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {"logits_scaling": 2.0, "residual_multiplier": 0.5}),
    # attention variants: soft-capping and alternating windows; sinks, windows and experts
    "gemma2": ("Gemma2Config", {"head_dim": 8, "query_pre_attn_scalar": 8, "final_logit_softcapping": None}),
    "gpt_oss": ("GptOssConfig", {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 16}),
    # Llama-4's text model: chunked local attention with RoPE in 3 of 4 layers (a chunk of 64 positions
    # here), global NoPE layers with temperature-tuned queries, experts beside a shared MLP
    "llama4": ("Llama4TextConfig", {"num_hidden_layers": 4, "head_dim": 8, "attention_chunk_size": 64,
                                    "num_local_experts": 2, "num_experts_per_tok": 1, "intermediate_size_mlp": 64,
                                    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                    "initializer_range": 0.05}),
    # a hybrid: short convolutions (kernel 3) between softmax-attention layers
    "lfm2": ("Lfm2Config", {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "conv"],
                            "conv_L_cache": 3, "conv_bias": True}),
    # recurrent hybrids: gated DeltaNet in 3 of 4 layers (dense MLPs); Mamba-2 beside attention, MoE and
    # MLP blocks (two groups, a scan chunk of 8 tokens, so nodes start mid-chunk)
    "qwen3_next": ("Qwen3NextConfig", {"num_hidden_layers": 4, "head_dim": 8, "linear_num_value_heads": 4,
                                       "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                       "layer_types": ["linear_attention", "full_attention", "linear_attention",
                                                       "linear_attention"],
                                       "num_experts": 0, "mlp_only_layers": [0, 1, 2, 3],
                                       # the delta rule's fp32 triangular solves amplify rounding at sharper weights
                                       "initializer_range": 0.02}),
    "nemotron_h": ("NemotronHConfig", {"num_hidden_layers": 4, "layers_block_type": ["mamba", "attention", "moe",
                                                                                     "mamba"],
                                       "head_dim": 8, "mamba_num_heads": 4, "mamba_head_dim": 8, "n_groups": 2,
                                       "ssm_state_size": 8, "chunk_size": 8, "n_routed_experts": 4,
                                       "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                       "moe_shared_expert_intermediate_size": 16}),
    "bamba": ("BambaConfig", {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8,
                              "mamba_chunk_size": 8, "attn_layer_indices": [1]}),
    # attention and Mamba-2 side by side in every layer, with Falcon-H1's multipliers
    "falcon_h1": ("FalconH1Config", {"mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_n_groups": 1,
                                     "mamba_d_state": 8, "mamba_chunk_size": 8}),
    # Mamba-1 (a selective scan per channel) and attention, experts in every other layer
    "jamba": ("JambaConfig", {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                              "expert_layer_offset": 1, "num_experts": 2, "mamba_d_state": 8, "mamba_dt_rank": 4,
                              # its fp32 step-by-step scan rounds at 1e-5 of a log-prob at sharper weights
                              "initializer_range": 0.05}),
    # the 2026 hybrids: Qwen3.5's gated DeltaNet (projections split), dense and with experts; OLMo-hybrid's;
    # Kimi Delta Attention (a decay per key channel) beside latent attention; LFM3's short convolutions
    "qwen3_5": ("Qwen3_5TextConfig", {"num_hidden_layers": 4, "head_dim": 8, "linear_num_value_heads": 4,
                                      "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                      "layer_types": ["linear_attention", "full_attention", "linear_attention",
                                                      "linear_attention"], "initializer_range": 0.02}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", {"num_hidden_layers": 4, "head_dim": 8, "linear_num_value_heads": 4,
                                             "linear_num_key_heads": 2, "linear_key_head_dim": 8,
                                             "linear_value_head_dim": 8,
                                             "layer_types": ["linear_attention", "full_attention", "linear_attention",
                                                             "linear_attention"],
                                             "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                             "shared_expert_intermediate_size": 16, "initializer_range": 0.02}),
    "olmo_hybrid": ("OlmoHybridConfig", {"num_hidden_layers": 4, "linear_num_key_heads": 2,
                                         "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                                         "linear_value_head_dim": 8, "pad_token_id": 0, "eos_token_id": 2,
                                         "layer_types": ["linear_attention", "full_attention", "linear_attention",
                                                         "linear_attention"], "initializer_range": 0.02}),
    "kimi_linear": ("KimiLinearConfig", {"num_hidden_layers": 4, "num_key_value_heads": 4, "linear_head_dim": 8,
                                         "linear_num_heads": 4, "kv_lora_rank": 16, "q_lora_rank": None,
                                         "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                                         "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                         "layer_types": ["linear_attention", "full_attention", "linear_attention",
                                                         "linear_attention"], "initializer_range": 0.02}),
    "lfm3": ("Lfm3Config", {"num_hidden_layers": 4, "head_dim": 8, "conv_L_cache": 3, "conv_bias": True,
                            "layer_types": ["conv", "full_attention", "conv", "sliding_attention"],
                            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # Mamba-2 layers and hybrid layers that add one attention block shared across them (its weights reused)
    "zamba2": ("Zamba2Config", {"mamba_d_state": 8, "n_mamba_heads": 4, "mamba_headdim": 16, "mamba_ngroups": 1,
                                "layers_block_type": ["mamba", "hybrid"], "hybrid_layer_ids": [1],
                                # fp32 rounding of its scan reaches 1e-5 of a log-prob at sharper weights
                                "initializer_range": 0.05}),
    "granite_hybrid": ("GraniteMoeHybridConfig", {"layer_types": ["mamba", "attention"], "mamba_n_heads": 4,
                                                  "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8,
                                                  "mamba_chunk_size": 8, "num_local_experts": 2,
                                                  "num_experts_per_tok": 1}),
}

#: (hidden, intermediate, layers, heads, kv heads, vocab, max positions) of Qwen2.5 models
QWEN2_SHAPES: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "0.5b": (896, 4864, 24, 14, 2, 151936, 32768),
    "1.5b": (1536, 8960, 28, 12, 2, 151936, 32768),
    "7b": (3584, 18944, 28, 28, 4, 152064, 32768),
    "14b": (5120, 13824, 48, 40, 8, 152064, 32768),
    "32b": (5120, 27648, 64, 40, 8, 152064, 32768),
}

#: (hidden, expert intermediate, layers, heads, kv heads, head width, experts, experts per token, vocab,
#: max positions) of Qwen3's mixture-of-experts models (every layer's MLP routed, no shared expert)
QWEN3_MOE_SHAPES: dict[str, tuple[int, ...]] = {
    "30b-a3b": (2048, 768, 48, 32, 4, 128, 128, 8, 151936, 40960),
}

#: the size names ``shaped_config`` takes (the benches' ``--size`` choices)
SHAPED_SIZES: tuple[str, ...] = tuple(QWEN2_SHAPES) + tuple(QWEN3_MOE_SHAPES)


def tiny_config(family: str = "qwen2", vocab_size: int = 96, **overrides) -> PretrainedConfig:
    """A 2-layer, 32-wide config of ``family`` with GQA (4 query heads, 2 K/V heads)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    cls_name, extra = FAMILIES[family]
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.2,  # sharper attention than the 0.02 default: wrong masks show up clearly
    )
    fields.update(extra)
    fields.update(overrides)
    return getattr(transformers, cls_name)(**fields)


def tiny_model(family: str = "qwen2", seed: int = 0, attn_implementation: str = "sdpa", **overrides) -> torch.nn.Module:
    """A tiny fp32 causal LM of ``family``, deterministic for ``seed``, in eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation=attn_implementation)
    return model.eval()


#: model families ``shaped_config`` builds: the first three at the Qwen2.5 sizes, ``qwen3_moe`` at its own
SHAPED_FAMILIES = ("qwen2", "qwen3_next", "qwen3_5", "qwen3_moe")


def shaped_family(size: str) -> str:
    """The family ``shaped_config`` builds at ``size`` when none is named: ``qwen3_moe`` for Qwen3's
    mixture-of-experts sizes, ``qwen2`` for Qwen2.5's."""
    return "qwen3_moe" if size in QWEN3_MOE_SHAPES else "qwen2"


def parameter_count(config: PretrainedConfig) -> int:
    """How many parameters a causal LM of ``config`` has, counted on the meta device (nothing allocated;
    ``config`` itself is left as it was)."""
    import copy

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(copy.deepcopy(config)).parameters())


def shaped_config(size: str = "1.5b", family: str | None = None, **overrides) -> PretrainedConfig:
    """A Qwen2.5-``size``-shaped config (random weights are made from it; nothing is downloaded).

    ``family`` defaults to the size's own: ``qwen2`` for Qwen2.5's sizes, ``qwen3_moe`` for Qwen3's
    mixture-of-experts sizes (``"30b-a3b"``: Qwen3-30B-A3B's 48 layers of 128 experts, 8 per token —
    the shape RL users train most, and the one whose whole weights do not fit beside its sharded
    state on four GPUs).

    ``family="qwen3_next"``: the hybrid of the same size — Qwen3-Next's layers (gated DeltaNet in 3
    of every 4, gated softmax attention in the 4th) at Qwen2.5's width, depth, heads and dense MLP;
    the DeltaNet's heads in Qwen3-Next's proportions (128-wide, twice as many value as key heads,
    key heads two thirds of the attention heads). ``family="qwen3_5"``: the same with Qwen3.5's dense
    layers (its DeltaNet's projections split)."""
    family = family or shaped_family(size)
    if family == "qwen3_moe" or size in QWEN3_MOE_SHAPES:
        return _moe_shaped_config(size, family, overrides)
    if size not in QWEN2_SHAPES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SHAPED_SIZES)}")
    hidden, inter, layers, heads, kv, vocab, max_pos = QWEN2_SHAPES[size]
    fields = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max_pos,
        rope_theta=1_000_000.0,
        tie_word_embeddings=size == "0.5b",
    )
    if family == "qwen2":
        from transformers import Qwen2Config as config_class
    elif family == "qwen3_next":
        from transformers import Qwen3NextConfig as config_class

        key_heads = max(1, 2 * heads // 3)
        fields.update(head_dim=hidden // heads, linear_key_head_dim=128, linear_value_head_dim=128,
                      linear_num_key_heads=key_heads, linear_num_value_heads=2 * key_heads,
                      layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                   for i in range(layers)],
                      # dense MLPs: no experts, so no load-balancing loss (TRL would ask for router logits)
                      num_experts=0, mlp_only_layers=list(range(layers)), router_aux_loss_coef=0.0)
    elif family == "qwen3_5":
        from transformers import Qwen3_5TextConfig as config_class

        key_heads = max(1, 2 * heads // 3)
        fields.update(head_dim=hidden // heads, linear_key_head_dim=128, linear_value_head_dim=128,
                      linear_num_key_heads=key_heads, linear_num_value_heads=2 * key_heads,
                      layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                   for i in range(layers)])
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
    else:
        raise ValueError(f"unknown shaped family {family!r}; choose one of {', '.join(SHAPED_FAMILIES)}")
    fields.update(overrides)
    return config_class(**fields)


def _moe_shaped_config(size: str, family: str, overrides: dict) -> PretrainedConfig:
    """``shaped_config`` for Qwen3's mixture-of-experts sizes (a size and family that belong together)."""
    if family != "qwen3_moe" or size not in QWEN3_MOE_SHAPES:
        raise ValueError(f"size {size!r} with family {family!r}: the qwen3_moe family takes the sizes "
                         f"{', '.join(QWEN3_MOE_SHAPES)}, the others {', '.join(QWEN2_SHAPES)}")
    from transformers import Qwen3MoeConfig

    hidden, expert_inter, layers, heads, kv, head_dim, experts, active, vocab, max_pos = QWEN3_MOE_SHAPES[size]
    fields = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=6 * hidden // 2,
                  moe_intermediate_size=expert_inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, head_dim=head_dim, num_experts=experts, num_experts_per_tok=active,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=max_pos,
                  rope_theta=1_000_000.0, tie_word_embeddings=False)
    fields.update(overrides)
    return Qwen3MoeConfig(**fields)


# ---------------------------------------------------------------------- synthetic rollouts
def grpo_group(
    prompt_len: int, completion_len: int, group_size: int, vocab_size: int, num_prompts: int = 1, seed: int = 0
) -> list[list[int]]:
    """``num_prompts`` GRPO groups: each prompt followed by ``group_size`` random completions."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(num_prompts):
        prompt = rng.integers(0, vocab_size, prompt_len)
        for _ in range(group_size):
            seqs.append(np.concatenate([prompt, rng.integers(0, vocab_size, completion_len)]).tolist())
    return seqs


def random_tree(
    num_sequences: int, vocab_size: int, max_len: int = 24, seed: int = 0, share: float = 0.7
) -> list[list[int]]:
    """Random sequences that branch off earlier ones at random depths (multi-level trees)."""
    rng = np.random.default_rng(seed)
    seqs: list[list[int]] = []
    for _ in range(num_sequences):
        length = int(rng.integers(1, max_len + 1))
        if seqs and rng.random() < share:
            base = seqs[int(rng.integers(len(seqs)))]
            keep = int(rng.integers(0, min(len(base), length) + 1))
            seq = base[:keep] + rng.integers(0, vocab_size, length - keep).tolist()
        else:
            seq = rng.integers(0, vocab_size, length).tolist()
        seqs.append(seq)
    return seqs


#: characters of ``tiny_tokenizer``'s vocabulary after its three special tokens (their ids stay fixed:
#: the toy tasks and the tests' token ids use them); the rest of printable ASCII follows
#: (:data:`TINY_MORE_CHARS`), then one token per byte for anything else
TINY_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;!?+-*/=()'\""
TINY_MORE_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ#$%&<>@[\\]^_`{|}~\n\t"


#: the special tokens; ``unk_token`` is named (what the compact alphabet maps other characters to)
#: so that a class chosen by the model's type on loading (Qwen2's) adds no unknown token of its own
#: beyond the model's embeddings
SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<pad>"}


def tiny_tokenizer(every_character: bool = False):
    """A character-level fast tokenizer built in memory (``<pad>``=0, ``<eos>``=1, ``<bos>``=2).

    Trainers need a real ``PreTrainedTokenizerFast`` (padding, decoding, eos); one character per
    token keeps the toy tasks' rewards readable and needs no hub download.

    ``every_character=False``: :data:`TINY_CHARS` only, the alphabet of the toy reward tasks (any
    other character becomes ``<pad>``). A random policy samples from the whole vocabulary, so a
    small one is what lets the letter task's reward rise within a CPU demo's few steps (with the
    whole vocabulary below it barely moves in 12 steps).
    ``every_character=True``: every text round-trips — the rest of printable ASCII, then any other
    character as its UTF-8 bytes (byte fallback, as Llama's tokenizers do), never an unknown
    token. What a user's own data is trained with on the tiny model (capitals, JSON tool calls,
    accents must reach the model whole, or the loss falls on nothing).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    for ch in TINY_CHARS + (TINY_MORE_CHARS if every_character else ""):
        vocab.setdefault(ch, len(vocab))
    if not every_character:
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one character a word
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)
