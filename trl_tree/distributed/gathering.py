"""Whole or block by block: how a sharded model's parameters are gathered for the tree's calls.

Why a choice: the tree runs many calls per optimizer step (a walk's units, calls under a budget, a
window's trees). Holding the model whole through them (``fsdp.gathered``, ZeRO-3's
``WholeParameters``) gathers every block once per step and lets those calls run with no collective
at all — the fastest where the whole model's weights fit beside the step's training state and
activations. Gathering block by block inside each call (``fsdp.block_held``: the sharded engine's
own per-block hooks, the ranks' calls lined up by ``lockstep.py``) holds one block at a time, as
stock FSDP2 and ZeRO-3 do, at the price of every call's gathers. The first is what the tree did
before; the second is what makes it train every model stock trains on the same GPUs.

``tree_gather="auto"`` takes the whole model where its weights, with what the step still has to
allocate, take at most :data:`WHOLE_SHARE` of the accelerator's free memory, and blocks otherwise;
``"whole"`` and ``"block"`` force either. The choice and its figures are logged once per model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GATHERINGS = ("auto", "whole", "block")
#: the largest share of the free accelerator memory the whole model (plus the state the step will
#: still allocate) may take under ``"auto"``: the rest is left to the calls' activations
WHOLE_SHARE = 0.6

_GIB = float(1 << 30)


@dataclass(frozen=True)
class Gathering:
    """One model's gathering: ``block`` (else whole) and why, in words for the log."""

    block: bool
    reason: str


def step_allocation(trainable: int, local: int, optimizer_state_pending: bool) -> int:
    """What a step still allocates beside the whole model, in bytes, for ``trainable`` parameters
    (``local``: this rank's shard of them): their accumulated gradients whole in fp32, and an Adam-like
    optimizer's two fp32 moments per local element where it has no state yet (the first step)."""
    return 4 * trainable + (8 * local if optimizer_state_pending else 0)


def choose(setting: str, whole: int, to_allocate: int, device: torch.device) -> Gathering:
    """The gathering for a model whose parameters take ``whole`` bytes gathered, on ``device``, where
    the step will still allocate ``to_allocate`` bytes (optimizer state, accumulated gradients)."""
    if setting not in GATHERINGS:
        raise ValueError(f"tree_gather must be one of {GATHERINGS}, got {setting!r}")
    if setting != "auto":
        return Gathering(setting == "block", f"tree_gather={setting!r} ({_size(whole)})")
    if device.type != "cuda" or not torch.cuda.is_available():
        return Gathering(False, f"tree_gather='auto' on {device.type}, which has no free-memory reading: held whole "
                                f"({_size(whole)}); tree_gather='block' gathers block by block")
    free, total = torch.cuda.mem_get_info(device)
    return decide(whole, to_allocate, free, total)


def decide(whole: int, to_allocate: int, free: int, total: int) -> Gathering:
    """``tree_gather="auto"``'s rule on given figures (bytes): whole where it fits (:func:`fits_whole`).
    ``trl-tree inspect --gpus`` runs it on estimates."""
    block = not fits_whole(whole, to_allocate, free)
    verdict = "gathered block by block" if block else "held whole"
    return Gathering(block, f"tree_gather='auto': {memory_figures(whole, to_allocate, free, total)} "
                            f"({'more than' if block else 'at most'} {WHOLE_SHARE:.0%} of it): {verdict}")


def fits_whole(whole: int, to_allocate: int, free: int) -> bool:
    """Whether the whole model (``whole`` bytes) with what the step still allocates takes at most
    :data:`WHOLE_SHARE` of the ``free`` accelerator memory."""
    return whole + to_allocate <= WHOLE_SHARE * free


def memory_figures(whole: int, to_allocate: int, free: int, total: int) -> str:
    """The figures a gathering is decided from, in words for the log."""
    return (f"{_size(whole)}, the step still allocates {to_allocate / _GIB:.2f} GiB, {free / _GIB:.2f} of "
            f"{total / _GIB:.2f} GiB free")


def _size(whole: int) -> str:
    return f"the whole model takes {whole / _GIB:.2f} GiB gathered"
