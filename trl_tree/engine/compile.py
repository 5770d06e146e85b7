"""Compile a causal LM's decoder layers piecewise, leaving attention to the tree dispatcher.

Why: on small models (0.5B–1.5B) the tree's steps wait on the host launching kernels, not on the
GPU. Each layer runs RMSNorm, RoPE, SwiGLU and residual arithmetic as a dozen small kernels,
three times per step under gradient checkpointing (forward, recompute, backward); the tree, with
~T/U fewer tokens per kernel, makes each of them cheap for the GPU but not for the host. Fusing
them with ``torch.compile`` (Inductor) cuts the launches, and the fused kernels read memory fewer
times.

Why piecewise, each *child* of every decoder layer (attention module, MLP, norms) rather than the
layer or the whole model:

* The attention call goes through ``trl_tree``'s dispatcher, which reads Python-side metadata
  (the forest, kept attention outputs, the depth-first walk's K/V stack) and must stay eager: it
  is a graph break (``torch.compiler.disable``), so the attention module compiles as two graphs
  around it.
* Hugging Face's gradient checkpointing wraps the layer's ``forward`` (transformers ≥ 5.20) or its
  ``__call__`` (earlier); a graph break inside a checkpointed compiled region makes Dynamo give up
  on the whole layer. Compiling the children puts every compiled graph *inside* the checkpoint on
  every transformers version, so the recompute runs the same compiled code as the forward.
* One compiled entry per child type serves all layers (Dynamo does not guard on module identity),
  and ``dynamic=True`` serves every number of tokens: a training run compiles a handful of graphs
  once (packed and batched shapes, a walk's unit metadata) instead of one per forest.

The model's numbers change only by the fused kernels' summation order (fp32 ≈ 1e-6 relative); the
tree and the untreed model compiled alike agree as tightly as eager ones (tests/test_compile.py).
"""

from __future__ import annotations

import torch

from .model_parts import model_parts

#: the ``torch.compile`` backend of :func:`compile_layers` when none is given (the trainers' field
#: uses it; the CPU tests set ``"aot_eager"``, which traces and differentiates the same graphs
#: without building kernels)
BACKEND = "inductor"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of ``model`` (bare, PEFT- or Accelerate-wrapped): the modules of the
    classes the model lists as ``_no_split_modules`` (every HF decoder names its layer there)."""
    causal_lm = model_parts(model).causal_lm
    names = set(getattr(causal_lm, "_no_split_modules", None) or ())
    layers = [m for m in causal_lm.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(causal_lm).__name__} names no decoder layer class (_no_split_modules is {sorted(names)}); "
            "compile_layers cannot tell which modules to compile"
        )
    return layers


def compile_layers(model: torch.nn.Module, *, backend: str | None = None, mode: str | None = None,
                   dynamic: bool = True) -> int:
    """``torch.compile`` every child of every decoder layer of ``model`` in place; returns how many.

    ``backend`` (None: :data:`BACKEND`), ``mode`` and ``dynamic`` go to ``nn.Module.compile``
    (never ``fullgraph``: the attention call is a graph break by design). ``mode`` must not
    capture CUDA graphs (``"reduce-overhead"``, ``"max-autotune"``): Inductor records one graph per
    compiled child, shared by all layers, and each replay overwrites the outputs the previous
    layer's checkpoint still needs (a ``RuntimeError`` on an H200); the tree's shapes also change
    every step, which would re-record them. Compiling again is a no-op for children already
    compiled; :func:`uncompile_layers` undoes it. The first steps after compiling are slow
    (Inductor builds its kernels, once per child type and kind of call); the later ones reuse them.
    """
    if mode in ("reduce-overhead", "max-autotune"):
        raise ValueError(
            f"mode={mode!r} records CUDA graphs: one per compiled child, shared by every layer, whose replays "
            "overwrite outputs the earlier layers still need; use mode=None, 'default' or 'max-autotune-no-cudagraphs'"
        )
    count = 0
    for layer in decoder_layers(model):
        for child in layer.children():
            if getattr(child, "_compiled_call_impl", None) is None:
                child.compile(backend=backend or BACKEND, mode=mode, dynamic=dynamic)
            count += 1
    return count


def uncompile_layers(model: torch.nn.Module) -> int:
    """Undo :func:`compile_layers`: every decoder layer's children run eagerly again (Dynamo keeps
    its compiled code, so compiling again costs nothing). Returns how many were compiled."""
    count = 0
    for layer in decoder_layers(model):
        for child in layer.children():
            if getattr(child, "_compiled_call_impl", None) is not None:
                child._compiled_call_impl = None
                count += 1
    return count

