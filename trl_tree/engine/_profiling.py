"""Named ranges for the torch profiler around the package's phases (``bench --profile`` charges
the GPU's idle time to them).

Why not ``@torch.profiler.record_function(name)`` itself: used as a decorator it is one object
for every call, and its ``__enter__`` keeps the open range on that object, so a call inside
another call of the same function, or on another thread, would close the wrong range. Here each
call opens its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from torch.profiler import record_function

F = TypeVar("F", bound=Callable)


def profiled(name: str) -> Callable[[F], F]:
    """Decorate a function so that each call runs inside a profiler range ``name`` of its own."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return decorate
