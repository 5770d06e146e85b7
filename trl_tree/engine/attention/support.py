"""Which attention variants each tree backend computes exactly, known from the model's config.

The dispatcher refuses an unsupported variant at the first layer that uses it; trainers ask here
at construction instead, so a run that cannot work stops before generating anything, naming the
setting. Variants (what transformers' attention modules pass to the attention function):

- a sliding window (``sliding_window``): a key is visible iff it is an ancestor and
  ``depth(q) - depth(k) < window`` — every backend, packed and dfs;
- attention logit soft-capping (``softcap``, Gemma-2): the kernels that take a soft-cap — the
  references (``eager``/``sdpa``), ``flex`` (a score modifier) and flash-attn (``flash``); not
  PyTorch's built-in FlashAttention (``torch_flash``), nor the depth-first walk's kernels;
- attention sinks (``s_aux``, GPT-OSS): a per-head logit that joins every softmax — the references
  only;
- attention dropout: never (one mask per unique token is not one per sequence; ``model_parts``).
"""

from __future__ import annotations

import torch

from . import backends

#: backends whose kernels take each variant, by mode
SOFTCAP_BACKENDS = {"packed": ("eager", "sdpa", "flex", "flash"), "dfs": ("eager", "sdpa")}
SINK_BACKENDS = {"packed": ("eager", "sdpa"), "dfs": ("eager", "sdpa")}


def attention_features(config) -> dict[str, object]:
    """The variants a model's attention layers use, read from its (text) config: ``window`` (the
    sliding window if any layer slides), ``softcap`` and ``sinks``; and ``head_dim``, which
    decides whether the compiled ``flex`` kernel can run at all (``backends.FLEX_MIN_HEAD_DIM``)."""
    from ..model_parts import head_dim_of

    config = config.get_text_config()
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    return {
        "window": window,
        "softcap": getattr(config, "attn_logit_softcapping", None),
        "sinks": getattr(config, "model_type", None) == "gpt_oss",
        "head_dim": head_dim_of(config) if getattr(config, "num_attention_heads", None) else None,
    }


def unsupported_variant(backend: str, mode: str, softcap: float | None = None, sinks: bool = False) -> str | None:
    """Why ``backend`` in ``mode`` cannot compute these variants exactly, or None."""
    mode = "dfs" if mode == "dfs" else "packed"
    if softcap is not None and backend not in SOFTCAP_BACKENDS[mode]:
        return (f"attention logit soft-capping ({softcap}) is not computed by attn_backend={backend!r} in "
                f"mode={mode!r}; the backends that take a soft-cap there: {', '.join(SOFTCAP_BACKENDS[mode])}")
    if sinks and backend not in SINK_BACKENDS[mode]:
        return (f"attention sinks are not computed by attn_backend={backend!r} in mode={mode!r}; the backends "
                f"that take them: {', '.join(SINK_BACKENDS[mode])} (exact, with an explicit [U, U] mask)")
    return None


def attention_refusal(model, attn_backend: str, device: torch.device, dtype: torch.dtype, mode: str) -> str | None:
    """Why the tree cannot run ``model``'s attention with ``attn_backend`` in ``mode`` — known from the
    config before any forward — or None. ``"auto"`` is resolved as the engine would resolve it."""
    features = attention_features(model.config)
    backend = attn_backend  # named: the variants first, on any device; then whether it runs here
    if attn_backend == "auto" and mode == "dfs":
        backend = backends.resolve_dfs_backend(attn_backend, device, dtype, **features)
    elif attn_backend == "auto":
        backend = backends.resolve_backend(attn_backend, device, dtype, **features)
    why = unsupported_variant(backend, mode, features["softcap"], features["sinks"])
    if why is not None:
        return f"{type(model).__name__}: {why}; set tree_attn_backend accordingly or tree_mode='off'"
    if mode == "dfs":  # the walk's own rule: which backends it takes at all, and whether this one runs here
        from ..model_parts import model_parts, walk_refusal

        why = walk_refusal(model_parts(model))
        if why is not None:
            return f"{why}; set tree_mode='packed'"
        try:
            backends.resolve_dfs_backend(backend, device, dtype, **features)
        except ValueError as e:
            return str(e)
        return None
    ok, reason = backends.backend_available(backend, device, dtype)
    return None if ok else reason
