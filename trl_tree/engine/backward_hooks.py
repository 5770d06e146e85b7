"""A callback run just before a tree call's last autograd backward.

Why: a trainer that averages gradients over processes by hand (the engine's own backward never
runs through DDP's reducer) can overlap that averaging with the backward, as DDP does, only if it
knows when each parameter's gradient is final. In packed mode a call has one backward; the
depth-first walk runs one per unit, and only the last unit's (the root's pop, then the deferred LM
head's) leaves every gradient final. The trainer sets the callback around the last call of an
optimizer step; the engine runs it where that call's last backward starts
(``trainers.grad_sync.GradientAverager.arm``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

_before_last_backward: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "trl_tree_before_last_backward", default=None)


@contextlib.contextmanager
def before_last_backward(callback: Callable[[], None] | None) -> Iterator[None]:
    """Run ``callback`` once, just before the last autograd backward of the tree call(s) made inside."""
    token = _before_last_backward.set(callback)
    try:
        yield
    finally:
        _before_last_backward.reset(token)


def last_backward_starts() -> None:
    """Called by the engine where a call's last backward starts."""
    callback = _before_last_backward.get()
    if callback is not None:
        callback()
