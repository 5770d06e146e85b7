"""Sequence mixers other than softmax attention, run over a prefix tree exactly.

Hybrid models mix softmax-attention layers with layers whose token mixer is a short causal
convolution (LFM2, LFM3), a gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-hybrid), Kimi Delta Attention
(Kimi-Linear), a Mamba-2 selective state space (Nemotron-H, Bamba, Granite-4 hybrid, Falcon-H1 —
beside attention in the same layer) or Mamba-1 (Jamba). Every one of them is causal along a
sequence, and a token's output depends only on its own root path: a convolution reads its ``k - 1``
nearest ancestors (``conv.py``); a recurrence reads the state its sequence had reached at the
token's parent, which is the same for every sequence through the node (``scan.py``). So the tree
computes each unique token once, as it does attention, and the gradients are exact.

How it is wired: a mixer is a module whose forward calls one of the sequence kernels the engine runs
over the tree (``kernels.py``: read from the layer's code, not its class name). The mixer stays in
the model, its ``forward`` wrapped once (:func:`install_tree_mixers`). A call that carries tree
metadata runs the mixer's own forward with the tree set for its kernels, which then compute over the
tree; every other call (generation, TRL's own forward, the padded batch the engine runs where nothing
is shared — right padding sits after every real token) runs the original forward and kernels. The
metadata reaches the mixer with the attention's keyword arguments: where the decoder layer hands them
down (recent transformers), directly; where it does not, through the layer, whose ``forward``
receives them and whose wrapper keeps the metadata in a context variable for the layer's duration.
Either way HF's checkpointed recompute, which calls the layer again with the same arguments during
the backward, finds it too.
"""

from __future__ import annotations

import functools
from contextvars import ContextVar

import torch

from ..attention.metadata import TREE_KWARG, DenseCausalBatch
from .kernels import end_tree_call, install_kernels, is_mixer, kernels_called, tree_call, unknown_kernels

#: ``config.layer_types`` entries whose layer holds a sequence mixer instead of softmax attention
MIXER_LAYER_TYPES = ("conv", "linear_attention", "mamba")
#: entries whose layer holds a mixer beside softmax attention (Falcon-H1: both read the same input)
PARALLEL_LAYER_TYPES = ("hybrid",)
#: entries whose layer mixes no tokens at all (Nemotron-H's MLP and MoE blocks)
TOKENWISE_LAYER_TYPES = ("mlp", "moe")

#: the tree metadata of the decoder layer running now (set by the layer's wrapped forward)
_CURRENT_CALL: ContextVar = ContextVar("trl_tree_mixer_call", default=None)


def tree_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's sequence mixers the tree runs: modules whose forward calls a kernel it runs over
    the tree and none it does not know."""
    return [m for m in model.modules() if is_mixer(m) and not unknown_kernels(m)]


def unknown_mixers(backbone: torch.nn.Module, layer_types) -> list[str]:
    """``"layer i (type): Class calls kernel"`` for every decoder layer declared a mixer layer that holds
    no mixer the tree runs (a kernel the engine does not know, a model newer than its list)."""
    layers = getattr(backbone, "layers", None)
    if layers is None:
        return []
    found = []
    for i, (layer, kind) in enumerate(zip(layers, layer_types)):
        if kind in MIXER_LAYER_TYPES + PARALLEL_LAYER_TYPES and not tree_mixers(layer):
            parts = []
            for module in layer.children():
                if "norm" in type(module).__name__.lower():
                    continue
                unknown = unknown_kernels(module) or list(kernels_called(type(module)))
                parts.append(f"{type(module).__name__}" + (f" calls {', '.join(unknown)}" if unknown else ""))
            found.append(f"layer {i} ({kind}): {'; '.join(parts) or type(layer).__name__}")
    return found


def install_tree_mixers(backbone: torch.nn.Module) -> int:
    """Wrap, once, every mixer of ``backbone`` and the decoder layer holding it (see the module
    docstring), with the kernels of their modeling modules; returns how many mixers the model has.
    Later calls (every engine call validates its model) read the count kept on the backbone instead
    of walking its modules again."""
    installed = getattr(backbone, "_trl_tree_mixers", None)
    if installed is not None:
        return installed
    mixers = tree_mixers(backbone)
    for mixer in mixers:
        install_kernels(type(mixer))
    held = {id(m) for m in mixers}
    for layer in backbone.modules():
        if any(id(m) in held for m in layer.children()):
            layer.forward = _carrying_call(layer, _own_forward(layer))
    for mixer in mixers:
        mixer.forward = functools.partial(_mixer_forward, mixer, _own_forward(mixer))
    backbone._trl_tree_mixers = len(mixers)
    return len(mixers)


def _own_forward(module: torch.nn.Module):
    """``module``'s forward as it will be when called, not as it is now: its class's, looked up at each
    call (or a forward already set on the instance, kept). FSDP2's ``fully_shard`` swaps a wrapped
    layer's class for a subclass of it after the mixers may have been installed, and transformers
    (5.2x) checkpoints a layer only in its class's outermost ``forward`` (``type(self).forward is`` the
    wrapper it runs): a bound method taken before the swap ran the layer un-checkpointed under
    FSDP2 — every hybrid layer's activations kept through the call (measured: a 1.5B hybrid's window
    at 4.4x stock's peak)."""
    own = module.__dict__.get("forward")
    if own is not None:
        return own

    def forward(*args, **kwargs):
        return type(module).forward(module, *args, **kwargs)

    return forward


def _carrying_call(layer, forward):
    @functools.wraps(forward)
    def layer_forward(*args, **kwargs):
        carried = kwargs.get(TREE_KWARG)
        _carry_through_checkpoint(layer)
        token = _CURRENT_CALL.set(carried.meta if carried is not None else None)
        try:
            return forward(*args, **kwargs)
        finally:
            _CURRENT_CALL.reset(token)

    return layer_forward


def _carry_through_checkpoint(layer) -> None:
    """Have the layer's checkpointed recompute carry the metadata too. transformers (5.2x) checkpoints
    the layer class's own ``forward`` — not this wrapper — with the call's keyword arguments bound
    (``partial(forward, self, **kwargs)``); a layer that does not hand them to its mixer (Jamba) would
    recompute it without the tree. The checkpoint function is wrapped (again, should
    ``gradient_checkpointing_enable`` have replaced it) to set the context variable from them."""
    checkpoint = getattr(layer, "_gradient_checkpointing_func", None)
    if checkpoint is None or getattr(checkpoint, "_trl_tree_carries", False):
        return

    @functools.wraps(checkpoint)
    def carrying_checkpoint(function, *args, **kwargs):
        carried = (getattr(function, "keywords", None) or {}).get(TREE_KWARG)
        meta = carried.meta if carried is not None else None

        def call(*inner_args, **inner_kwargs):
            token = _CURRENT_CALL.set(meta)
            try:
                return function(*inner_args, **inner_kwargs)
            finally:
                _CURRENT_CALL.reset(token)

        return checkpoint(call, *args, **kwargs)

    carrying_checkpoint._trl_tree_carries = True
    layer._gradient_checkpointing_func = carrying_checkpoint


def _mixer_forward(module, original, hidden_states: torch.Tensor, *args, **kwargs):
    carried = kwargs.pop(TREE_KWARG, None)  # transformers versions that hand the layer's kwargs down
    meta = carried.meta if carried is not None else _CURRENT_CALL.get()
    if meta is None:
        return original(hidden_states, *args, **kwargs)
    meta.calls += 1
    if isinstance(meta, DenseCausalBatch):  # the padded batch: the model's own mixer is exact there
        return original(hidden_states, *args, **kwargs)
    if hidden_states.shape[0] != 1:
        raise ValueError(f"a tree call is one packed row, got a batch of {hidden_states.shape[0]}")
    token = tree_call(module, meta)
    try:  # the layer's own forward; its kernels see the tree (``kernels.py``)
        return original(hidden_states, *args, **kwargs)
    finally:
        end_tree_call(token)
