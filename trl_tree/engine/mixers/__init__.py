"""Sequence mixers other than softmax attention, run over a prefix tree exactly.

Hybrid models mix softmax-attention layers with layers whose token mixer is a short causal
convolution (LFM2), a gated DeltaNet (Qwen3-Next), a Mamba-2 selective state space (Nemotron-H,
Bamba, Granite-4 hybrid, Falcon-H1 — beside attention in the same layer) or Mamba-1 (Jamba). Every
one of them is causal along a sequence, and a token's output depends only on its own root path: a
convolution reads its ``k - 1`` nearest ancestors (``conv.py``); a recurrence reads the state its
sequence had reached at the token's parent, which is the same for every sequence through the node
(``scan.py``). So the tree computes each unique token once, as it does attention, and the gradients
are exact.

How it is wired: the mixer module stays in the model, its ``forward`` wrapped once
(:func:`install_tree_mixers`). A call that carries tree metadata runs the mixer's tree form (built
from the module's own projections, convolution weights, norms and transformers' own scan kernels:
``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan`` — the field's kernels where transformers
routes them there; Mamba-1's scan is written out, ``mamba1.py``); every other call (generation,
TRL's own forward, the padded batch the engine runs where nothing is shared — right padding sits
after every real token) runs the original forward. The metadata reaches the mixer with the
attention's keyword arguments: where the decoder layer hands them down (recent transformers),
directly; where it does not, through the layer, whose ``forward`` receives them and whose wrapper
keeps the metadata in a context variable for the layer's duration. Either way HF's checkpointed
recompute, which calls the layer again with the same arguments during the backward, finds it too.
"""

from __future__ import annotations

import functools
from contextvars import ContextVar

import torch

from ..attention.metadata import TREE_KWARG, DenseCausalBatch
from . import deltanet, mamba2
from .conv import lfm2_short_conv
from .deltanet import gated_deltanet
from .mamba1 import jamba_mamba
from .mamba2 import mamba2_mixer
from .scan import model_kernel

#: mixer class name -> its tree form ``(module, hidden_states [1, n, H], meta) -> [1, n, H]``
TREE_MIXERS = {
    "Lfm2ShortConv": lfm2_short_conv,
    "Lfm2MoeShortConv": lfm2_short_conv,
    "Qwen3NextGatedDeltaNet": gated_deltanet,
    "NemotronHMamba2Mixer": mamba2_mixer,
    "BambaMixer": mamba2_mixer,
    "GraniteMoeHybridMambaLayer": mamba2_mixer,
    "FalconH1Mixer": mamba2_mixer,
    "JambaMambaMixer": jamba_mamba,
}
#: tree form -> the transformers kernel it calls from the layer's module (checked at installation)
KERNELS = {gated_deltanet: deltanet.KERNEL, mamba2_mixer: mamba2.KERNEL}

#: ``config.layer_types`` entries whose layer holds a sequence mixer instead of softmax attention
MIXER_LAYER_TYPES = ("conv", "linear_attention", "mamba")
#: entries whose layer holds a mixer beside softmax attention (Falcon-H1: both read the same input)
PARALLEL_LAYER_TYPES = ("hybrid",)
#: entries whose layer mixes no tokens at all (Nemotron-H's MLP and MoE blocks)
TOKENWISE_LAYER_TYPES = ("mlp", "moe")

#: the tree metadata of the decoder layer running now (set by the layer's wrapped forward)
_CURRENT_CALL: ContextVar = ContextVar("trl_tree_mixer_call", default=None)


def tree_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's sequence mixers the tree runs (modules of a class in :data:`TREE_MIXERS`)."""
    return [m for m in model.modules() if type(m).__name__ in TREE_MIXERS]


def unknown_mixers(backbone: torch.nn.Module, layer_types) -> list[str]:
    """``"layer i (type): Class"`` for every decoder layer declared a mixer layer that holds no mixer
    the tree runs (Zamba2's Mamba-2 beside its shared blocks, a model newer than this list)."""
    layers = getattr(backbone, "layers", None)
    if layers is None:
        return []
    found = []
    for i, (layer, kind) in enumerate(zip(layers, layer_types)):
        if kind in MIXER_LAYER_TYPES + PARALLEL_LAYER_TYPES and not tree_mixers(layer):
            names = [type(m).__name__ for m in layer.children() if "norm" not in type(m).__name__.lower()]
            found.append(f"layer {i} ({kind}): {', '.join(names) or type(layer).__name__}")
    return found


def install_tree_mixers(backbone: torch.nn.Module) -> int:
    """Wrap, once, every mixer of ``backbone`` and the decoder layer holding it (see the module
    docstring), after finding their kernels; returns how many mixers the model has. Later calls
    (every engine call validates its model) read the count kept on the backbone instead of walking
    its modules again."""
    installed = getattr(backbone, "_trl_tree_mixers", None)
    if installed is not None:
        return installed
    mixers = tree_mixers(backbone)
    for mixer in mixers:  # a transformers without the layer's kernel: refused before any call
        form = TREE_MIXERS[type(mixer).__name__]
        if form in KERNELS:
            model_kernel(mixer, KERNELS[form])
    held = {id(m) for m in mixers}
    for layer in backbone.modules():
        if any(id(m) in held for m in layer.children()):
            layer.forward = _carrying_call(layer, layer.forward)
    for mixer in mixers:
        mixer.forward = functools.partial(_mixer_forward, mixer, mixer.forward, TREE_MIXERS[type(mixer).__name__])
    backbone._trl_tree_mixers = len(mixers)
    return len(mixers)


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


def _mixer_forward(module, original, tree_form, hidden_states: torch.Tensor, *args, **kwargs):
    carried = kwargs.pop(TREE_KWARG, None)  # transformers versions that hand the layer's kwargs down
    meta = carried.meta if carried is not None else _CURRENT_CALL.get()
    if meta is None:
        return original(hidden_states, *args, **kwargs)
    meta.calls += 1
    if isinstance(meta, DenseCausalBatch):  # the padded batch: the model's own mixer is exact there
        return original(hidden_states, *args, **kwargs)
    if hidden_states.shape[0] != 1:
        raise ValueError(f"a tree call is one packed row, got a batch of {hidden_states.shape[0]}")
    return tree_form(module, hidden_states, meta)
