"""Find the pieces of a (possibly wrapped) causal LM that the tree engine needs.

Users hand in a bare ``*ForCausalLM``, a PEFT model or an Accelerate/DDP-wrapped one. The engine
always calls the *outer* module (so DDP's hooks and PEFT's adapters run) and reads the final
hidden state from a forward hook on the backbone; the LM head is applied by the engine itself, only
to the unique predictions, so the model is asked for no logits at all (``logits_to_keep`` empty).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from .mixers import (
    MIXER_LAYER_TYPES,
    PARALLEL_LAYER_TYPES,
    TOKENWISE_LAYER_TYPES,
    install_tree_mixers,
    unknown_mixers,
)
from .mixers.kernels import TREE_KERNELS

#: layer types whose attention the tree computes exactly (sliding windows only while no sequence
#: is longer than the window, checked per call by the attention function; chunked attention — Llama-4's
#: local layers — only while no sequence is longer than a chunk, where it is full attention: checked
#: per call, ``ModelParts.attention_chunk``)
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


#: families whose forward the tree does not reproduce, found by ``tests/family_enumeration.py``: model type -> why
REFUSED_FAMILIES = {
    "doge": "its attention adds a learned bias per key (dynamic mask attention) to the attention mask, which the "
            "tree's attention replaces",
    "hrm_text": "it runs its decoder layers several times per forward (its H and L cycles), where the engine keeps one "
                "state per layer",
    "modernbert-decoder": "its log-probs over the tree differ from its own forward (found by the family enumeration; "
                          "the cause is not isolated yet)",
}

#: RoPE types whose frequencies depend on the length of the call (``transformers``' ``dynamic_rope_update``)
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass
class ModelParts:
    outer: torch.nn.Module
    causal_lm: PreTrainedModel
    backbone: torch.nn.Module
    lm_head: torch.nn.Module
    num_layers: int
    vocab_size: int
    max_positions: int | None
    #: chunked attention's chunk (Llama-4's local layers): tokens attend within their chunk of positions
    attention_chunk: int | None
    #: a module (with a ``layer_idx``) that several decoder layers call (Zamba2's shared transformer
    #: blocks): its class name, or "" — the walk's per-layer stacks cannot hold it
    shared_layers: str
    final_logit_softcapping: float | None
    logit_scale: float
    head_dim: int
    #: the dtype of the layers' weights (``_layer_dtype``); ``compute_dtype`` is what they compute in
    weight_dtype: torch.dtype = torch.float32
    #: a learned table of absolute positions (GPT-2's ``wpe``): depths past it cannot be computed
    absolute_positions: bool = False
    #: rotary modules whose frequencies follow the call's length (dynamic NTK, LongRoPE)
    length_dependent_rope: tuple[torch.nn.Module, ...] = ()
    #: the length those modules choose their frequencies for in this call (see ``rope_length_hint``)
    rope_length: int | None = None
    #: score in fp32 outside autocast (TRL's ``cast_lm_head_to_fp32``)
    head_fp32: bool = False
    #: the MoE load-balancing loss being collected or back-propagated (``trl_tree.engine.router.RouterAux``)
    router: object | None = None
    #: multiplicities of the next model call's unique tokens (``router``'s weights), on the device
    router_weights: torch.Tensor | None = None
    #: a value head (hidden ``[n, H]`` -> ``[n, 1]``) read at the same positions as the log-probs:
    #: beside them (a critic sharing the policy's trunk) or, without ``scores_logps``, instead of them
    value_head: torch.nn.Module | None = None
    #: whether the LM head scores log-probs (False: a value-only call, ``value_model_parts``)
    scores_logps: bool = True
    #: per-prediction by-products of the fused head a call asks for (TRL's ``is_top1``, ``mean_logits``,
    #: ``log_sum_sq_probs``: SFT's and DPO's metrics and weights): every scoring of the LM head appends
    #: each one's tensor to its list; empty: none asked
    head_outputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    #: sequence mixers other than softmax attention (``trl_tree.engine.mixers``: short convolutions, gated
    #: DeltaNet, Mamba-2, Mamba-1): their calls run eagerly (no CUDA graphs)
    mixer_layers: int = 0
    #: tree calls one forward serves (each attention and each mixer counts one): checked after a
    #: forward, and how a checkpointed recompute is told from the forward (``attention/kept.py``)
    tree_calls: int = 0

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the layers' attention runs in: under autocast (fp32 weights with ``bf16=True``,
        mixed precision) the autocast dtype, as it is for the model's own SDPA; read at each call, so
        a backend is chosen (and K/V are kept) for the precision the call runs in."""
        device_type = self.device.type
        return self.compute_dtype_under(torch.get_autocast_dtype(device_type)
                                        if torch.is_autocast_enabled(device_type) else None)

    def compute_dtype_under(self, autocast_dtype: torch.dtype | None) -> torch.dtype:
        """The layers' compute dtype under autocast to ``autocast_dtype`` (None: no autocast): fp32
        weights compute in it, lower-precision weights in their own dtype."""
        if self.weight_dtype == torch.float32 and autocast_dtype is not None:
            return autocast_dtype
        return self.weight_dtype

    @property
    def device(self) -> torch.device:
        if self.lm_head is not None:
            return self.lm_head.weight.device
        return self.causal_lm.get_input_embeddings().weight.device

    @property
    def hidden_size(self) -> int:
        """The decoder's width (what ``attention.backends.fa4_pays`` reads as its launch-cost proxy)."""
        return int(self.causal_lm.config.get_text_config().hidden_size)

    @property
    def calls_backbone(self) -> bool:
        """Whether a call goes to the backbone itself (a value-only call: no LM head, no logits)."""
        return self.outer is self.backbone



def head_dim_of(config) -> int:
    """Attention head dimension of a (text) config: ``head_dim`` where the config sets it (Qwen3,
    Gemma, ... decouple it from the hidden size), else ``hidden_size // num_attention_heads``."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def kv_heads_of(config) -> int:
    """K/V heads of a (text) config; configs without GQA fields (GPT-2) have one per query head."""
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def intermediate_size_of(config) -> int:
    """MLP width of a (text) config; GPT-2 style configs leave it unset (``n_inner=None``: 4 × hidden)."""
    return int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * config.hidden_size)


def _find_causal_lm(model: torch.nn.Module) -> PreTrainedModel | None:
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module.get_output_embeddings() is not None:
            return module
    return None


def _logit_scale(text_config) -> float:
    """The factor HF models apply to the logits (1.0 for most; Cohere, Granite, Falcon-H1, ... differ)."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(text_config, name, None)
        if value is not None:
            return float(value)
    scaling = getattr(text_config, "logits_scaling", None)
    if scaling is not None:
        return float(scaling) if text_config.model_type == "hyperclovax" else 1.0 / float(scaling)
    return 1.0


def _backbone_of(causal_lm: PreTrainedModel) -> torch.nn.Module:
    """The decoder stack under the head: ``base_model`` where the class's ``base_model_prefix`` names
    it; else (Llama-4's text model names ``language_model``, which it only has inside the multimodal
    model) the one child model that holds the input embeddings."""
    backbone = causal_lm.base_model
    if backbone is not causal_lm:
        return backbone
    embeddings = causal_lm.get_input_embeddings()
    holders = [m for m in causal_lm.children() if isinstance(m, PreTrainedModel)
               and any(sub is embeddings for sub in m.modules())]
    if len(holders) != 1:
        raise TypeError(f"{type(causal_lm).__name__} exposes no backbone (its base_model_prefix "
                        f"{causal_lm.base_model_prefix!r} names no module, and {len(holders)} child models hold the "
                        "input embeddings)")
    return holders[0]


def model_parts(model: torch.nn.Module) -> ModelParts:
    """Validate ``model`` for the tree engine and return its parts.

    Raises ``TypeError`` for a module that is not a transformers causal LM and ``ValueError`` for
    one whose attention the tree cannot reproduce exactly (linear/recurrent/chunked layers) or whose
    LM head carries a PEFT adapter (the head is scored from its weight matrix).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module holding a transformers causal LM, got {type(model).__name__}")
    causal_lm = _find_causal_lm(model)
    if causal_lm is None:
        raise TypeError(
            f"{type(model).__name__} holds no transformers PreTrainedModel with an LM head; the tree engine "
            "needs a *ForCausalLM model (bare, PEFT-wrapped or Accelerate-wrapped)"
        )
    return _parts_of(model, causal_lm, causal_lm.get_output_embeddings())


def _parts_of(model: torch.nn.Module, pretrained: PreTrainedModel, lm_head: torch.nn.Module | None) -> ModelParts:
    """Validate the layers of ``pretrained`` (a causal LM, or a value model when ``lm_head`` is None)."""
    causal_lm = pretrained
    text_config = causal_lm.config.get_text_config()
    layer_types = getattr(text_config, "layer_types", None) or ()
    backbone = _backbone_of(causal_lm)
    why = REFUSED_FAMILIES.get(text_config.model_type)
    if why is not None:
        raise ValueError(f"{type(causal_lm).__name__} is refused by the tree engine: {why}")
    declares_mixers = any(t in MIXER_LAYER_TYPES + PARALLEL_LAYER_TYPES for t in layer_types)
    if not (getattr(causal_lm, "_supports_attention_backend", False) or getattr(causal_lm, "_supports_sdpa", False)
            or declares_mixers):
        raise ValueError(f"{type(causal_lm).__name__}'s layers compute attention (or their recurrence) in code of their "
                         "own, not through transformers' attention interface, where the tree computes attention")
    bidirectional, shared_layers = _layer_facts(backbone)
    if bidirectional:  # BERT-style models under a causal-LM head without is_decoder=True: every token sees the next
        raise ValueError(f"{type(causal_lm).__name__} has attention that is not causal ({', '.join(bidirectional)}: "
                         "is_causal=False); the tree computes causal attention only. An encoder family trains as a "
                         "causal LM with is_decoder=True in its config")
    unknown = unknown_mixers(backbone, layer_types) if declares_mixers else []
    if unknown:
        raise ValueError(f"{type(causal_lm).__name__} has mixer layers the tree engine cannot run exactly "
                         f"({'; '.join(unknown)}); it runs softmax attention and the mixers whose layers call "
                         f"transformers' {', '.join(TREE_KERNELS)}")
    mixers = install_tree_mixers(backbone)  # hybrids: exact over the tree (trl_tree.engine.mixers)
    allowed = SUPPORTED_LAYER_TYPES + MIXER_LAYER_TYPES + PARALLEL_LAYER_TYPES + TOKENWISE_LAYER_TYPES
    unsupported = sorted({t for t in layer_types if t not in allowed})
    if unsupported:
        raise ValueError(
            f"{type(causal_lm).__name__} has {', '.join(unsupported)} layers; the tree engine computes only "
            "full (or short-enough sliding-window) softmax attention, short convolutions, gated DeltaNet and "
            "Mamba mixers exactly"
        )
    num_layers = int(text_config.num_hidden_layers)
    attention = (sum(t in SUPPORTED_LAYER_TYPES + PARALLEL_LAYER_TYPES for t in layer_types) if layer_types
                 else num_layers)
    if hasattr(lm_head, "base_layer"):  # a PEFT tuner layer (LoRA, IA3, ...) wrapped around the head
        raise ValueError(
            f"the LM head carries a PEFT adapter ({type(lm_head).__name__}: 'lm_head' in target_modules); the tree "
            "engine scores predictions from the head's weight matrix (TRL's fused head) and would leave the adapter "
            "out. Leave lm_head out of target_modules, or train it whole with modules_to_save=['lm_head']"
        )
    vocab = causal_lm.get_input_embeddings().num_embeddings
    try:
        head_dim = head_dim_of(text_config)
    except Exception as e:  # noqa: BLE001 - a config whose attention shape varies per layer (Gemma-4 unified)
        raise ValueError(f"{type(causal_lm).__name__}'s config gives no one attention shape ({type(e).__name__}: "
                         f"{str(e)[:120]}); the tree engine reads one head dimension per model") from e
    return ModelParts(
        weight_dtype=_layer_dtype(backbone, causal_lm.get_input_embeddings(), lm_head),
        absolute_positions=_has_absolute_positions(backbone, causal_lm.get_input_embeddings()),
        length_dependent_rope=_length_dependent_rope(backbone),
        outer=model,
        causal_lm=causal_lm,
        backbone=backbone,
        lm_head=lm_head,
        num_layers=num_layers,
        vocab_size=int(vocab),
        max_positions=getattr(text_config, "max_position_embeddings", None),
        attention_chunk=(getattr(text_config, "attention_chunk_size", None) if "chunked_attention" in layer_types
                         else None),
        shared_layers=shared_layers,
        final_logit_softcapping=getattr(text_config, "final_logit_softcapping", None),
        logit_scale=_logit_scale(text_config),
        head_dim=head_dim,
        mixer_layers=mixers,
        tree_calls=attention + mixers,
    )


def value_model_parts(model: torch.nn.Module, value_head: torch.nn.Module) -> ModelParts:
    """The parts of a critic's forward: the backbone of ``model`` — a ``*ForCausalLM`` (a value head
    on the policy's trunk or on a critic adapter), a ``*ForTokenClassification`` value model, bare
    or PEFT-wrapped — called directly (no LM head, no logits) and ``value_head`` applied by the
    engine at the scored positions. The backbone runs whatever adapter is active (PEFT injects its
    layers there); a DDP wrapper is bypassed, so the caller averages these gradients itself."""
    if not isinstance(value_head, torch.nn.Module):
        raise TypeError(f"value_head must be a torch.nn.Module mapping hidden states to one value, got "
                        f"{type(value_head).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module holding a transformers model, got {type(model).__name__}")
    causal_lm = _find_causal_lm(model)
    if causal_lm is not None:
        parts = model_parts(model)
    else:
        pretrained = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
        if pretrained is None or pretrained.base_model is pretrained:
            raise TypeError(f"{type(model).__name__} holds no transformers PreTrainedModel with a backbone "
                            "(base_model_prefix); a value model is e.g. AutoModelForTokenClassification(num_labels=1)")
        parts = _parts_of(model, pretrained, None)
    parts.outer = parts.backbone
    parts.lm_head = None
    parts.value_head = value_head
    parts.scores_logps = False
    return parts


def walk_refusal(parts: ModelParts) -> str | None:
    """Why the depth-first walk cannot run this model (packed mode can), or None."""
    if parts.shared_layers:
        return (f"{type(parts.causal_lm).__name__} calls one attention or mixer module from several decoder layers "
                f"({parts.shared_layers}): the depth-first walk keeps one stack per layer")
    return None


def _layer_facts(backbone: torch.nn.Module) -> tuple[list[str], str]:
    """``(classes of attention that is not causal, the class several layers share or "")``: read from
    the modules once per backbone (every engine call validates its model; its structure stays)."""
    facts = getattr(backbone, "_trl_tree_layer_facts", None)
    if facts is None:
        facts = (sorted({type(m).__name__ for m in backbone.modules() if getattr(m, "is_causal", None) is False}),
                 _shared_layers(backbone))
        backbone._trl_tree_layer_facts = facts
    return facts


def _shared_layers(backbone: torch.nn.Module) -> str:
    """The class of a module whose ``layer_idx`` (the index the engine keys a layer's state by) is held
    under more than one decoder layer — Zamba2's shared attention blocks, numbered by block — or ""."""
    owners: dict[object, set[int]] = {}
    names: dict[object, str] = {}
    for i, layer in enumerate(getattr(backbone, "layers", None) or ()):
        for module in layer.modules():
            index = getattr(module, "layer_idx", None)
            if isinstance(index, int):
                owners.setdefault(index, set()).add(i)
                names[index] = type(module).__name__
    return next((names[k] for k, v in owners.items() if len(v) > 1), "")


def _layer_dtype(backbone: torch.nn.Module, token_embeddings: torch.nn.Module, lm_head: torch.nn.Module | None
                 ) -> torch.dtype:
    """The first decoder parameter's dtype, not the head's: TRL's ``cast_lm_head_to_fp32`` makes the
    head (and a tied embedding) fp32 while the layers stay bf16."""
    for p in backbone.parameters():
        if p.is_floating_point() and p is not token_embeddings.weight:
            return p.dtype
    return (lm_head if lm_head is not None else token_embeddings).weight.dtype


def _has_absolute_positions(backbone: torch.nn.Module, token_embeddings: torch.nn.Module) -> bool:
    """A learned position table (GPT-2's ``wpe``, OPT's ``embed_positions``) beside the token embeddings."""
    for name, module in backbone.named_children():
        if isinstance(module, torch.nn.Embedding) and module is not token_embeddings and (
                "pos" in name or name == "wpe"):
            return True
    return False


def _length_dependent_rope(backbone: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """The backbone's rotary modules whose frequencies depend on the call's length."""
    found = []
    for module in backbone.children():
        rope_type = getattr(module, "rope_type", None)
        kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        if any(isinstance(k, str) and any(t in k for t in LENGTH_DEPENDENT_ROPE) for k in kinds):
            found.append(module)
    return tuple(found)


@contextmanager
def rope_length_hint(parts: ModelParts):
    """Make the length-dependent rotary modules choose their frequencies for ``parts.rope_length``
    tokens during one call, as they do for a padded batch of that width.

    Why: dynamic NTK scaling and LongRoPE pick their frequencies from ``max(position_ids) + 1``.
    A padded batch (what TRL runs) shows them its padded width; a tree call shows them its deepest
    token, and a unit of the depth-first walk or one call under a token budget less. The module
    is called with one extra position, ``rope_length - 1``, appended to the call's positions, and
    that column is cut from its cos/sin: the same frequency choice (and the same state update of
    dynamic NTK's cache), the positions' own values unchanged.
    """
    if not parts.length_dependent_rope or parts.rope_length is None:
        yield
        return
    last = parts.rope_length - 1
    patched = []
    for module in parts.length_dependent_rope:
        original = module.forward

        def forward(x, position_ids, *args, _original=original, **kwargs):
            extra = position_ids.new_full((*position_ids.shape[:-1], 1), last)
            outputs = _original(x, torch.cat([position_ids, extra], dim=-1), *args, **kwargs)
            return tuple(o[..., :-1, :] for o in outputs)

        module.forward = forward
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward  # the instance attribute; the class's forward shows again


#: attributes an attention module keeps its dropout rate in (not an ``nn.Dropout``, so TRL's
#: ``disable_dropout`` does not reach it)
ATTENTION_DROPOUT_ATTRS = ("attention_dropout", "attn_dropout")


def _attention_rates(module: torch.nn.Module) -> list[tuple[str, float]]:
    rates = []
    for attr in ATTENTION_DROPOUT_ATTRS:
        rate = module.__dict__.get(attr)
        if isinstance(rate, (int, float)) and not isinstance(rate, bool):
            rates.append((attr, float(rate)))
    return rates


def is_dropout_site(module: torch.nn.Module) -> bool:
    """An ``nn.Dropout`` module, or an attention module holding a dropout rate."""
    return isinstance(module, torch.nn.modules.dropout._DropoutNd) or bool(_attention_rates(module))


def dropout_rate(module: torch.nn.Module) -> float:
    """The rate a dropout site draws masks with (the largest, for an attention module)."""
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return module.p
    return max((rate for _, rate in _attention_rates(module)), default=0.0)


def active_dropout(model: torch.nn.Module) -> list[str]:
    """What would draw dropout masks in a training forward of ``model``: ``nn.Dropout`` modules with
    ``p > 0`` (by name) and attention dropout (an attention module's ``attention_dropout`` /
    ``attn_dropout`` rate, which TRL's ``disable_dropout`` does not reach). The tree draws one mask
    per *unique* token where the untreed batch draws one per sequence, so neither can run there."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            if module.p > 0:
                found.append(f"{name or type(module).__name__} (p={module.p})")
            continue
        found += [f"{name}.{attr} ({rate})" for attr, rate in _attention_rates(module) if rate > 0]
    return found


@contextmanager
def capture_last_hidden_state(backbone: torch.nn.Module):
    """Yield a list that receives the backbone's final (normed) hidden state during a forward."""
    captured: list[torch.Tensor] = []

    def hook(_module, _args, output):
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        captured.append(hidden)

    handle = backbone.register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def _modules(root: torch.nn.Module):
    """Every submodule of ``root`` (itself included), each once: ``Module.modules()`` without the
    names it builds for every module — a per-call walk the engine makes, so its cost is host time."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield module
        children = [m for m in module.__dict__["_modules"].values() if m is not None]
        stack.extend(reversed(children))  # pre-order, children in order: ``modules()``'s order


def trainable_parameters(model: torch.nn.Module) -> tuple[torch.nn.Parameter, ...]:
    """``tuple(p for p in model.parameters() if p.requires_grad)`` (same order, tied parameters once),
    at about half the host time: the graph runner checks its parameters on every call."""
    seen: set[int] = set()
    params = []
    for module in _modules(model):
        for p in module.__dict__["_parameters"].values():
            if p is not None and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return tuple(params)


def activation_checkpointing(model: torch.nn.Module) -> bool:
    """HF's ``is_activation_checkpointing`` (any module with ``gradient_checkpointing`` set), read
    from the modules' dicts. Why not the property: it asks ``hasattr`` of every module, and a
    missing attribute goes through ``Module.__getattr__`` and an exception, a host cost paid on
    every engine call (measured in docs/benchmarks/notes.md §18)."""
    for module in _modules(model):
        flag = module.__dict__.get("gradient_checkpointing")
        if flag is None:
            flag = getattr(type(module), "gradient_checkpointing", False)
        if flag is True:
            return True
    return False
