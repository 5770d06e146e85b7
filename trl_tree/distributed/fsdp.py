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
  collective per parameter group, with sync on: FSDP2's own end-of-backward steps run directly
  (each group's post-backward, then the root's final callback), with no backward around them, so
  the reduction gathers nothing and costs the host no pass through the model. A torch whose FSDP2
  lacks those steps gets the older way: a one-token forward of the model, its output times zero,
  backward (FSDP2 reduces the accumulated gradients with that backward's own, which are zero), the
  parameters kept unsharded from that forward to its backward. The trainers call it inside
  :func:`gathered`, with the calls that close the step; where those calls run inside another
  backward, at the step's last micro-step.

The price is the full parameters in memory during the walk (2 bytes per parameter in bf16),
which is what "gather once per step" means.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from ..engine._profiling import profiled


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP2 (``fully_shard``) modules of ``model``, outermost first; [] without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


# ---------------------------------------------------------------------- FSDP2's private state, in one place
# FSDP2 has setters for what the tree changes (``set_reshard_after_forward``, ``..._after_backward``,
# ``set_requires_gradient_sync``) but no getters, no public "reduce what accumulated" before torch 2.15
# and no public lazy initialisation of the root: those few reads of FSDP2's state live here, each
# checked by :func:`missing_support` at construction.


def _groups(module) -> list:
    """The parameter groups of one FSDP module: torch's main branch holds several per module
    (``_fsdp_param_groups``; its ``_fsdp_param_group`` raises there for more than one)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = state._fsdp_param_group
        groups = [] if group is None else [group]
    return [g for g in groups if g is not None]


def missing_support() -> str | None:
    """Why this torch's FSDP2 cannot run the tree's gather-once, reduce-once calls (None: it can):
    the public ``FSDPModule`` methods they use, and the few private names this module reads."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return f"torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.FSDPModule); install torch>={TORCH_FLOOR}"
    public = ("unshard", "reshard", "set_reshard_after_forward", "set_reshard_after_backward",
              "set_requires_gradient_sync", "_get_fsdp_state")
    absent = [name for name in public if not hasattr(FSDPModule, name)]
    state_cls = _state_class()
    if state_cls is None or not hasattr(state_cls, "_lazy_init"):
        absent.append("FSDPState._lazy_init")
    if absent:
        return (f"torch {torch.__version__}'s FSDP2 lacks {', '.join(absent)}, which the tree's calls under FSDP2 use "
                f"(parameters gathered once per sequence of calls, reduced once per step); install "
                f"torch>={TORCH_FLOOR}, or DDP / DeepSpeed")
    return None


def offload_refusal(plugin) -> str | None:
    """Why the tree refuses an FSDP plugin's CPU offload (None: it offloads nothing). The tree's calls
    gather, hold and reduce FSDP2's shards themselves (once per step, or block by block with the ranks'
    calls lined up); with the shards kept on the CPU between calls that was never run — refused, not
    guessed at."""
    offload = getattr(plugin, "cpu_offload", None)
    if offload is None or offload is False:
        return None
    if type(offload).__name__ == "CPUOffloadPolicy" or offload is True or getattr(offload, "offload_params", False):
        return ("FSDP's CPU offload (fsdp_offload_params: true) is not supported by the tree's calls, which gather, "
                "hold and reduce the shards themselves; drop the offload (FSDP2 with tree_gather='block' keeps stock's "
                "memory per GPU, docs/multi_gpu.md)")
    return None


#: the oldest torch the FSDP2 path was tested on (pyproject's floor; docs/limitations.md)
TORCH_FLOOR = "2.11"


def _state_class():
    for where in ("torch.distributed.fsdp._fully_shard._fsdp_state", "torch.distributed._composable.fsdp._fsdp_state"):
        try:
            module = __import__(where, fromlist=["FSDPState"])
        except ImportError:
            continue
        return getattr(module, "FSDPState", None)
    return None


def _settings(module) -> tuple[bool, bool, bool]:
    """(reshard after forward, reshard after backward, gradient sync) of one FSDP module, read from
    its parameter group (FSDP2 has setters, not getters); FSDP2's defaults where it has none."""
    groups = _groups(module)
    if not groups:
        return True, True, True
    group = groups[0]
    return (group.post_forward_mesh_info is not None, bool(getattr(group, "reshard_after_backward", True)),
            bool(getattr(group, "reduce_grads", True)))


def _apply(module, after_forward: bool, after_backward: bool, sync: bool) -> None:
    if not _groups(module):
        return
    module.set_reshard_after_forward(after_forward, recurse=False)
    module.set_reshard_after_backward(after_backward, recurse=False)
    module.set_requires_gradient_sync(sync, recurse=False)


#: ids of the models inside :func:`gathered` now: a nested ``gathered`` of the same model is a no-op (its
#: exit would reshard what the outer block still computes with, and a backward there would find freed storage)
_GATHERED: set[int] = set()


@contextmanager
def gathered(model: torch.nn.Module):
    """Every FSDP2 module of ``model`` unsharded once, kept so, gradients accumulated unreduced;
    yields whether there was any. Settings restored and parameters resharded after. Re-entrant: inside
    a ``gathered`` of the same model it changes nothing."""
    if id(model) in _GATHERED:
        yield bool(fsdp_modules(model))
        return
    modules = fsdp_modules(model)
    if not modules:
        yield False
        return
    init_root(modules[0])
    _GATHERED.add(id(model))
    try:
        with _gathered(modules):
            yield True
    finally:
        _GATHERED.discard(id(model))


#: ids of the models inside :func:`block_held` now (a nested hold of the same model changes nothing)
_BLOCK_HELD: set[int] = set()


@contextmanager
def block_held(model: torch.nn.Module, lockstep=None):
    """``model``'s blocks gathered one at a time inside each call, by FSDP2's own per-block hooks
    (resharded after each block's forward and after its backward), gradients accumulated unreduced
    as under Accelerate's ``no_sync``; the outermost module's own parameters (embeddings, final norm,
    LM head: the engine reads the head's weight past the model's forward) held whole for the block.
    ``lockstep`` (:class:`~trl_tree.distributed.lockstep.CallLockstep`): the ranks' calls lined up,
    for several ranks. Yields whether there was any FSDP2 module; re-entrant, and a no-op inside
    :func:`gathered` of the same model (whole already). Settings restored after."""
    modules = fsdp_modules(model)
    if not modules or id(model) in _GATHERED or id(model) in _BLOCK_HELD:
        yield bool(modules)
        return
    init_root(modules[0])
    blocks = layer_units(model)
    kept = [m for m in modules if id(m) not in blocks]
    saved = [_settings(m) for m in modules]
    were_unsharded = [_unsharded(m) for m in kept]
    for m in modules:
        if id(m) in blocks:
            _apply(m, True, True, False)
        else:
            _apply(m, False, False, False)
    for m in kept:
        m.unshard()
    _BLOCK_HELD.add(id(model))
    try:
        with (lockstep.holding(model) if lockstep is not None else nullcontext()):
            yield True
    finally:
        _BLOCK_HELD.discard(id(model))
        for m, settings in zip(modules, saved):
            _apply(m, *settings)
        for m, keep in zip(kept, were_unsharded):
            if not keep:
                m.reshard()


def layer_units(model: torch.nn.Module) -> set[int]:
    """Ids of the FSDP2 units that are a model's repeated blocks (the items of a ``ModuleList``: its
    decoder layers), the units :func:`block_held` gathers one at a time. The others — the root, and
    a unit Accelerate wraps around the final norm and the LM head — are held whole: the engine reads
    the head's weight past the model's forward, and they are a small part of the model."""
    fsdp_ids = {id(m) for m in fsdp_modules(model)}
    return {id(child) for m in model.modules() if isinstance(m, torch.nn.ModuleList)
            for child in m if id(child) in fsdp_ids}


def whole_bytes(model: torch.nn.Module) -> int:
    """The bytes ``model``'s parameters take gathered whole, in the dtype its FSDP2 units compute in
    (a mixed-precision policy's ``param_dtype``), which :func:`gathered` holds for a block."""
    total = 0
    seen: set[int] = set()
    for m in fsdp_modules(model):
        for group in _groups(m):
            for fsdp_param in getattr(group, "fsdp_params", ()):
                if id(fsdp_param) in seen:
                    continue
                seen.add(id(fsdp_param))
                shape = getattr(fsdp_param, "_orig_size", None)
                numel = int(torch.Size(shape).numel()) if shape is not None else 0
                dtype = getattr(fsdp_param, "param_dtype", None) or fsdp_param.sharded_param.dtype
                total += numel * dtype.itemsize
    return total


def init_root(root: torch.nn.Module) -> None:
    """FSDP2's lazy initialisation of ``root`` as the root, if no forward of it ran yet. Calls in a
    gathered block may enter past the root (the engine calls a critic's backbone, on the policy's
    trunk too, where no policy forward came first: PPO without a KL penalty under a rollout
    function), and the first FSDP2 module to run a forward makes itself the root — under
    Accelerate's sharding a group of several modules (the final norm and the LM head), which FSDP2
    refuses as a root (measured on torch 2.11: "FSDP requires a single root module")."""
    state = root._get_fsdp_state()
    if getattr(state, "_is_root", False) is None and hasattr(state, "_lazy_init"):
        state._lazy_init()


def _unsharded(module) -> bool:
    """Whether an FSDP module's parameters are unsharded now (kept so by :func:`root_unsharded` for a
    backward still to come, say)."""
    return any(bool(getattr(group, "is_unsharded", False)) for group in _groups(module))


@contextmanager
def _gathered(modules: list[torch.nn.Module]):
    """What was unsharded before stays unsharded after: a pending backward may still read it."""
    saved = [_settings(m) for m in modules]
    already = [_unsharded(m) for m in modules]
    for m in modules:
        _apply(m, False, False, False)
    for m in modules:
        m.unshard()
    try:
        yield
    finally:
        for m, settings in zip(modules, saved):
            _apply(m, *settings)
        for m, keep in zip(modules, already):
            if not keep:
                m.reshard()


@profiled("trl_tree.fsdp.reduce")
def reduce_gradients(model: torch.nn.Module, device: torch.device) -> None:
    """Reduce-scatter the gradients accumulated under :func:`gathered` (and by FSDP2's own unsynced
    backwards) once, with sync on: FSDP2's end-of-backward steps run directly, or a one-token
    backward where this torch lacks them (see the module docstring)."""
    modules = fsdp_modules(model)
    if not modules:
        return
    saved = [_settings(m) for m in modules]
    for m in modules:  # sync on, resharded after; the fallback's forward keeps them unsharded to its backward
        _apply(m, False, True, True)
    try:
        if not (_REDUCE_WITHOUT_BACKWARD and _reduce_without_backward(modules)):
            out = model(input_ids=torch.ones(1, 1, dtype=torch.long, device=device), use_cache=False)
            logits = out.logits if hasattr(out, "logits") else out[0]
            (logits.float().sum() * 0.0).backward()
    finally:
        for m, settings in zip(modules, saved):
            _apply(m, *settings)


#: whether :func:`reduce_gradients` runs FSDP2's end-of-backward steps directly (else through a one-token backward)
_REDUCE_WITHOUT_BACKWARD = True


def _reduce_without_backward(modules: list[torch.nn.Module]) -> bool:
    """FSDP2's own end-of-backward steps, run where no backward runs: each parameter group's
    post-backward (last layer first, as a backward meets them: it accumulates, reshards and
    reduce-scatters that group's gradients) and then the root's final callback (waits for the
    reductions and hands each parameter its sharded gradient). Each post-backward is called here, not
    left to the callback: the callback skips a group whose state an earlier backward of the tree's
    calls left at post-backward (a call that ran the layers past the root queues no callback to reset
    it), and that group's gradients would stay unreduced. What the one-token backward did,
    without the model's forward and backward around it, whose host time (the whole model's modules
    and FSDP2's hooks, for one token) was the larger part of the reduction's. False where this
    torch's FSDP2 lacks the steps (the caller then takes the backward)."""
    root = modules[0]
    root_state = root._get_fsdp_state()
    groups = [g for m in modules for g in _groups(m)]
    if hasattr(root, "finalize_backward") and hasattr(root, "set_manual_backward_finalization"):
        return _finalize(root, groups)
    final = getattr(root_state, "_root_post_backward_final_callback", None)
    if final is None or not all(hasattr(g, "post_backward") for g in groups):
        return False
    for group in reversed(groups):
        group.post_backward()
    final()
    return True


def _finalize(root, groups: list) -> bool:
    """torch >= 2.15: FSDP2's public manual backward finalization (``set_manual_backward_finalization``,
    ``finalize_backward``) reduces what the groups accumulated and waits for it — the root's final
    callback, called directly, now asserts that a backward set the mode. Every group is marked as
    awaiting its post-backward (FSDP2 marks those an unsynced backward reached; a call past the root
    leaves others unmarked), so each is reduced once, last layer first."""
    state = root._get_fsdp_state()
    if getattr(state, "_is_root", None) is None:  # no forward ran: nothing accumulated
        return True
    saved = bool(getattr(state._state_ctx, "manual_backward_finalization", False))
    root.set_manual_backward_finalization(True)
    try:
        for group in groups:
            group._post_backward_pending = True
        root.finalize_backward()
    finally:
        root.set_manual_backward_finalization(saved)
    return True


@contextmanager
def root_unsharded(model: torch.nn.Module, reshard_after: bool):
    """The outermost FSDP2 module's own parameters (embeddings, final norm, LM head) kept unsharded
    from before the engine's forward until after its scoring: the engine reads the LM head's weight
    itself, after the model's forward, where FSDP2 (``reshard_after_forward``) would have resharded
    it. ``reshard_after``: reshard on leaving (a forward without a graph); else the backward's
    post-backward hook reshards, as after FSDP2's own forward."""
    modules = fsdp_modules(model)
    if not modules or id(model) in _GATHERED:  # inside gathered(): whole already, and kept so
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


def wrap_only_present_layers(model: torch.nn.Module) -> list[str] | None:
    """Narrow the decoder-layer classes ``model`` lists in ``_no_split_modules`` to those it holds
    (on the instance); returns the classes dropped, or None where nothing was.

    Why: Accelerate's FSDP2 wrap policy (``TRANSFORMER_BASED_WRAP``, examples/accelerate/fsdp2.yaml) wraps
    every class a model lists there and raises ("Could not find the transformer layer class ...") for
    one the model does not contain. Some families share the list between their text and their
    vision-language models — Qwen3.5's text models (transformers 5.24) list ``Qwen3_5VisionBlock`` —
    so their text-only model cannot be prepared under FSDP2 at all, by stock TRL either. A list
    naming only absent classes is left as it is (Accelerate's error then says what is wrong)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model: its base
    names = list(getattr(base, "_no_split_modules", None) or ())
    present = {type(m).__name__ for m in base.modules()}
    kept = [n for n in names if n in present]
    if not kept or len(kept) == len(names):
        return None
    base._no_split_modules = kept
    return [n for n in names if n not in present]


def shard_as_accelerate(accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` sharded the way ``accelerator.prepare`` shards the policy under FSDP2 (its plugin's
    wrap policy, mixed precision, fp32 upcast of trainable low-precision weights), for a model that
    trains beside the policy without being handed to ``prepare`` (a PPO value model: one
    ``prepare`` takes one model with its optimizer). Its calls past the root go through
    :func:`gathered`, which initialises the root first (:func:`init_root`)."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    return fsdp2_prepare_model(accelerator, model)


def resharded(model: torch.nn.Module) -> None:
    """Every FSDP2 module of ``model`` sharded again. A module that keeps its parameters after a
    forward (Accelerate: the root's) shows its unsharded parameters as its own until then, and an
    optimizer built from ``model.parameters()`` must get the sharded ones (as the Trainer does for
    the policy before it builds the optimizer)."""
    for m in fsdp_modules(model):
        m.reshard()


def is_sharded(tensor: torch.Tensor) -> bool:
    """A DTensor (a parameter FSDP2 shards), told apart without importing torch.distributed.tensor."""
    return type(tensor).__name__ == "DTensor" or hasattr(tensor, "full_tensor")


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a DTensor gathered (a collective every rank must make), any other as it is."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write a whole tensor into ``param``: into this rank's shard where ``param`` is a DTensor."""
    with torch.no_grad():
        if is_sharded(param):
            from torch.distributed.tensor import distribute_tensor

            full = distribute_tensor(full.to(param.device, param.dtype), param.device_mesh, param.placements)
        param.copy_(full.to(param.device, param.dtype))
