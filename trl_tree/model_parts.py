"""Find the pieces of a (possibly wrapped) causal LM that the tree engine needs.

Users hand in a bare ``*ForCausalLM``, a PEFT model or an Accelerate/DDP-wrapped one. The engine
always calls the *outer* module (so DDP's hooks and PEFT's adapters run) and reads the final
hidden state from a forward hook on the backbone; the LM head is applied by the engine itself, only
to the unique predictions, so the model is asked for no logits at all (``logits_to_keep`` empty).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

#: layer types whose attention the tree computes exactly (sliding windows only while no sequence
#: is longer than the window, checked per call by the attention function)
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelParts:
    outer: torch.nn.Module
    causal_lm: PreTrainedModel
    backbone: torch.nn.Module
    lm_head: torch.nn.Module
    num_layers: int
    vocab_size: int
    max_positions: int | None
    final_logit_softcapping: float | None
    logit_scale: float
    head_dim: int

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype


def head_dim_of(config) -> int:
    """Attention head dimension of a (text) config: ``head_dim`` where the config sets it (Qwen3,
    Gemma, ... decouple it from the hidden size), else ``hidden_size // num_attention_heads``."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


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
    text_config = causal_lm.config.get_text_config()
    layer_types = getattr(text_config, "layer_types", None) or ()
    unsupported = sorted({t for t in layer_types if t not in SUPPORTED_LAYER_TYPES})
    if unsupported:
        raise ValueError(
            f"{type(causal_lm).__name__} has {', '.join(unsupported)} layers; the tree engine computes only "
            "full (or short-enough sliding-window) softmax attention exactly"
        )
    backbone = causal_lm.base_model
    if backbone is causal_lm:
        raise TypeError(f"{type(causal_lm).__name__} exposes no backbone (base_model_prefix)")
    lm_head = causal_lm.get_output_embeddings()
    if hasattr(lm_head, "base_layer"):  # a PEFT tuner layer (LoRA, IA3, ...) wrapped around the head
        raise ValueError(
            f"the LM head carries a PEFT adapter ({type(lm_head).__name__}: 'lm_head' in target_modules); the tree "
            "engine scores predictions from the head's weight matrix (TRL's fused head) and would leave the adapter "
            "out. Leave lm_head out of target_modules, or train it whole with modules_to_save=['lm_head']"
        )
    vocab = causal_lm.get_input_embeddings().num_embeddings
    return ModelParts(
        outer=model,
        causal_lm=causal_lm,
        backbone=backbone,
        lm_head=lm_head,
        num_layers=int(text_config.num_hidden_layers),
        vocab_size=int(vocab),
        max_positions=getattr(text_config, "max_position_embeddings", None),
        final_logit_softcapping=getattr(text_config, "final_logit_softcapping", None),
        logit_scale=_logit_scale(text_config),
        head_dim=head_dim_of(text_config),
    )


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
    missing attribute goes through ``Module.__getattr__`` and an exception — with checkpointing off,
    1.26 against 0.80 ms here for a 24-layer model (a full walk either way), paid on every engine
    call (notes §18)."""
    for module in _modules(model):
        flag = module.__dict__.get("gradient_checkpointing")
        if flag is None:
            flag = getattr(type(module), "gradient_checkpointing", False)
        if flag is True:
            return True
    return False
