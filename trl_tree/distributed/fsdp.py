"""FSDP2 around the engine's own backward: parameters gathered once, gradients reduced once.

Why: the depth-first walk, calls under a token budget and an accumulation window's trees run many
forward/backward calls per optimizer step, and none of them is FSDP2's own single forward and
backward. Under ``fully_shard`` each call would all-gather every layer in its pre-forward hook,
free it after, and reduce-scatter its gradients after its backward — once per call; parameters
the engine reads directly (the LM head's weight, scored by the fused head) would still be shards.
So, around the engine's backward:

* :func:`gathered` unshards every FSDP module once and keeps it unsharded (reshard after forward
  and after backward off) with gradient sync off, so the calls accumulate full-size gradients
  locally, and restores the modules' settings after;
* :func:`reduce_gradients`, once per optimizer step, reduce-scatters what was accumulated in one
  collective per parameter group: a one-token forward of the model, its output times zero,
  backward with sync on (FSDP2 reduces the accumulated gradients with that backward's own, which
  are zero). The parameters stay unsharded from that forward to its backward. The trainers call it
  inside :func:`gathered`, with the calls that close the step, so it gathers nothing at all; where
  those calls run inside another backward (where FSDP2's own cannot), at the step's last
  micro-step, gathering the model once for it.

The price is the full parameters in memory during the walk (2 bytes per parameter in bf16),
which is what "gather once per step" means.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..engine._profiling import profiled


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP2 (``fully_shard``) modules of ``model``, outermost first; [] without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _settings(module) -> tuple[bool, bool, bool]:
    """(reshard after forward, reshard after backward, gradient sync) of one FSDP module, read from
    its parameter group (FSDP2 has setters, not getters); FSDP2's defaults where it has none."""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return True, True, True
    return (group.post_forward_mesh_info is not None, bool(getattr(group, "reshard_after_backward", True)),
            bool(getattr(group, "reduce_grads", True)))


def _apply(module, after_forward: bool, after_backward: bool, sync: bool) -> None:
    if module._get_fsdp_state()._fsdp_param_group is None:
        return
    module.set_reshard_after_forward(after_forward, recurse=False)
    module.set_reshard_after_backward(after_backward, recurse=False)
    module.set_requires_gradient_sync(sync, recurse=False)


@contextmanager
def gathered(model: torch.nn.Module):
    """Every FSDP2 module of ``model`` unsharded once, kept so, gradients accumulated unreduced;
    yields whether there was any. Settings restored and parameters resharded after."""
    modules = fsdp_modules(model)
    saved = [_settings(m) for m in modules]
    for m in modules:
        _apply(m, False, False, False)
    for m in modules:
        m.unshard()
    try:
        yield bool(modules)
    finally:
        for m, settings in zip(modules, saved):
            _apply(m, *settings)
        for m in modules:
            m.reshard()


@profiled("trl_tree.fsdp.reduce")
def reduce_gradients(model: torch.nn.Module, device: torch.device) -> None:
    """Reduce-scatter the gradients accumulated under :func:`gathered` (and by FSDP2's own unsynced
    backwards) once, through a backward with sync on (see the module docstring)."""
    modules = fsdp_modules(model)
    if not modules:
        return
    saved = [_settings(m) for m in modules]
    for m in modules:  # kept unsharded from the forward to the backward: one all-gather, not two
        _apply(m, False, True, True)
    try:
        out = model(input_ids=torch.ones(1, 1, dtype=torch.long, device=device), use_cache=False)
        logits = out.logits if hasattr(out, "logits") else out[0]
        (logits.float().sum() * 0.0).backward()
    finally:
        for m, settings in zip(modules, saved):
            _apply(m, *settings)


@contextmanager
def root_unsharded(model: torch.nn.Module, reshard_after: bool):
    """The outermost FSDP2 module's own parameters (embeddings, final norm, LM head) kept unsharded
    from before the engine's forward until after its scoring: the engine reads the LM head's weight
    itself, after the model's forward, where FSDP2 (``reshard_after_forward``) would have resharded
    it. ``reshard_after``: reshard on leaving (a forward without a graph); else the backward's
    post-backward hook reshards, as after FSDP2's own forward."""
    modules = fsdp_modules(model)
    if not modules:
        yield
        return
    root = modules[0]
    saved = _settings(root)
    _apply(root, False, saved[1], saved[2])
    root.unshard()
    try:
        yield
    finally:
        _apply(root, *saved)
        if reshard_after:
            root.reshard()
