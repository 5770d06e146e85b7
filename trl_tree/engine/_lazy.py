"""Public names that load on first use, for a package's ``__init__``.

Why: ``import trl_tree`` (and ``trl-tree --help``) must cost no torch, transformers or TRL import,
and importing one engine module (the forest, the cost model) must not load the attention and the
entry points; a package that re-exports its public names eagerly would do both.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, table: dict[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose public names ``table`` maps to the
    (relative) modules that define them; a name is imported on first use and kept in ``namespace``
    (the package's globals)."""

    def __getattr__(name: str):
        if name in table:
            value = getattr(importlib.import_module(table[name], package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted([*namespace, *table])

    return __getattr__, __dir__
