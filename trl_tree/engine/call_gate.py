"""A hook before every model call the engine makes, for callers that must see each call first.

Why: where a sharded model is gathered block by block inside the calls (FSDP2's own per-block
hooks, ``distributed/lockstep.py``), every call of the model is a sequence of collectives,
and the ranks' calls must line up — but a rank's number of calls depends on its own trees (a walk's
units, calls under a token budget, a window's share). The engine does not know about ranks; it
only announces each call (which module it enters, and whether it builds a graph whose backward
follows before the next call) to whatever gate the caller installed for the block.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Protocol

import torch


class CallGate(Protocol):
    def before_call(self, module: torch.nn.Module, grad: bool) -> None:
        """``module`` is about to be called; ``grad``: the call builds a graph (its backward follows)."""

    def sync_point(self) -> None:
        """Every rank is about to make another collective, at the same point of its program."""


_GATES: ContextVar[tuple[CallGate, ...]] = ContextVar("trl_tree_call_gates", default=())


def before_model_call(module: torch.nn.Module) -> None:
    """Every installed gate sees the call first (the engine calls this as each model call begins)."""
    gates = _GATES.get()
    if gates:
        grad = torch.is_grad_enabled()
        for gate in gates:
            gate.before_call(module, grad)


def sync_point() -> None:
    """Before a collective the caller makes between the calls (a window's exchanges), which every rank
    makes at the same point: each gate brings the ranks' calls to that point first, else a rank done
    with its calls would wait in the collective for a rank still waiting for it in the next call's."""
    for gate in _GATES.get():
        gate.sync_point()


def calls_close() -> bool:
    """Whether each call's backward must follow it before the next call (a gate is installed): a walk
    then recomputes its pushed nodes at their pop instead of keeping their graphs (``keep_graph``)."""
    return bool(_GATES.get())


@contextmanager
def gated(gate: CallGate) -> Iterator[None]:
    """``gate`` sees every model call the engine makes inside the block (once: a gate already installed
    by an enclosing block is not installed again)."""
    gates = _GATES.get()
    if any(g is gate for g in gates):
        yield
        return
    token = _GATES.set(gates + (gate,))
    try:
        yield
    finally:
        _GATES.reset(token)
