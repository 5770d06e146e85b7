"""The one tree attention function, installed once into ``transformers.AttentionInterface``.

Why a dispatcher wrapped around the model's *own* implementation (``sdpa``, ``eager``,
``flash_attention_2``, …) rather than switching ``config._attn_implementation`` around a forward:
under gradient checkpointing the backward re-runs the attention, and it must still be the tree
attention then (swapping back after the forward raises ``CheckpointError``). The dispatcher is a
pure pass-through when a call carries no tree metadata, so generation and stock forwards of the
same model are untouched, and the model object itself is never modified.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch
from transformers import AttentionInterface

from .backends import packed_attention
from .metadata import TREE_KWARG, DenseCausalBatch, TreeAttentionMetadata
from .support import unsupported_variant

# implementation name -> the function that was registered before we wrapped it (None: model's own eager)
_ORIGINALS: dict[str, Callable | None] = {}


def _module_eager(module: torch.nn.Module) -> Callable:
    """The modeling file's own ``eager_attention_forward`` (what HF uses when nothing is registered)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"no eager attention found for {type(module).__name__}")
    return fn


def _original(name: str, module: torch.nn.Module) -> Callable:
    """The implementation registered under ``name`` before the dispatcher wrapped it."""
    original = _ORIGINALS[name]
    return original if original is not None else _module_eager(module)


def refuse_inexact(module: torch.nn.Module, dropout: float = 0.0, **_: object) -> None:
    """Raise for what no tree call can reproduce exactly (never a wrong number): attention dropout
    draws one mask per unique token where the untreed batch draws one per sequence."""
    if dropout:
        raise ValueError(
            f"attention dropout ({dropout}) is active; the tree cannot reproduce per-sequence dropout masks. "
            "Set the model's attention_dropout to 0 (RL fine-tuning normally runs without it)"
        )


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta,
    *,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention over the packed forest (or a unit of the walk), refusing anything the tree cannot
    compute exactly; a sliding window, a soft-cap and sinks go to the backend
    (``attention/support.py`` says which takes which)."""
    if query.shape[0] != 1 or query.shape[2] != meta.num_tokens or key.shape[2] != meta.num_tokens:
        raise ValueError(
            f"tree attention got queries {tuple(query.shape)} and keys {tuple(key.shape)} for a forest of "
            f"{meta.num_tokens} packed tokens; the tree forward takes one packed row and no KV cache"
        )
    refuse_inexact(module, **kwargs)
    why = unsupported_variant(meta.backend, "dfs" if getattr(meta, "stack", None) is not None else "packed",
                              softcap, s_aux is not None)
    if why is not None:
        raise ValueError(f"{type(module).__name__}: {why}")
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # fp32 weights under autocast: the projections come out in the autocast dtype, RoPE's fp32 tables
        # promote the queries and keys back; the model's SDPA is cast by autocast, the backends are not
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    window = sliding_window if sliding_window is not None and sliding_window < meta.max_depth else None
    meta.calls += 1
    if isinstance(meta, TreeAttentionMetadata):
        out = packed_attention(meta, module, query, key, value, scaling, window=window, softcap=softcap, sinks=s_aux)
    else:  # a unit of the walk attends over its K/V stack (``dfs/stack.py``)
        out = meta.attend(module, query, key, value, scaling, window=window, softcap=softcap, sinks=s_aux)
    return out, None


@torch.compiler.disable
def _tree_call(name: str, module, query, key, value, attention_mask, meta, kwargs: dict):
    """Everything the dispatcher does for a call that carries tree metadata.

    Dynamo must not trace it: it reads and writes Python-side state (call counts, kept attention
    outputs, the walk's K/V stack) that a compiled graph would freeze. The graph break here lets
    compiled layers (``trl_tree.engine.compile``) fuse everything around the attention, while a call
    without tree metadata (generation, TRL's own forward) stays traceable.
    """
    if not isinstance(meta, DenseCausalBatch):
        return tree_attention_forward(module, query, key, value, meta, **kwargs)
    # a dense batch: the model's own attention (its window, soft-cap and sinks), under the tree's refusals
    refuse_inexact(module, **kwargs)
    meta.calls += 1
    return _original(name, module)(module, query, key, value, attention_mask, **kwargs)


def _make_dispatcher(name: str) -> Callable:
    def trl_tree_attention(module, query, key, value, attention_mask, **kwargs):
        carried = kwargs.pop(TREE_KWARG, None)
        if carried is not None:
            return _tree_call(name, module, query, key, value, attention_mask, carried.meta, kwargs)
        return _original(name, module)(module, query, key, value, attention_mask, **kwargs)

    trl_tree_attention.__trl_tree_dispatcher__ = True  # type: ignore[attr-defined]
    return trl_tree_attention


def install(attn_implementation: str) -> None:
    """Route ``attn_implementation`` through the tree dispatcher (idempotent, process-wide)."""
    if attn_implementation in _ORIGINALS:
        return
    current = AttentionInterface._global_mapping.get(attn_implementation)
    if getattr(current, "__trl_tree_dispatcher__", False):
        return
    _ORIGINALS[attn_implementation] = current
    AttentionInterface.register(attn_implementation, _make_dispatcher(attn_implementation))


def uninstall() -> None:
    """Restore every wrapped implementation (tests; normal use never needs it)."""
    for name, original in _ORIGINALS.items():
        if original is None:
            AttentionInterface._global_mapping.pop(name, None)
        else:
            AttentionInterface._global_mapping[name] = original
    _ORIGINALS.clear()

