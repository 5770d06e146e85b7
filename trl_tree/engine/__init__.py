"""The engine: the tree's forward and backward, everything below the trainers.

A micro-batch's sequences become a prefix forest (``forest.py``); the policy runs over its unique
tokens once, either as one packed pass (``packed.py``, replayed as CUDA graphs by ``graphs.py``) or
as a depth-first walk with a K/V stack (``dfs/``), with tree attention behind transformers'
``AttentionInterface`` (``attention/``) and other sequence mixers made exact over the tree
(``mixers/``). ``api.py`` holds the entry points and is the only module that chooses among them.

The public names below load on first use, as the package's own do, so that importing one engine
module (the forest, the cost model) does not import the rest.
"""

import importlib

#: public name -> the module of this package that defines it
_LAZY = {
    "tree_backward": ".api", "tree_logprobs": ".api", "tree_value_backward": ".api", "tree_values": ".api",
    "PrefixForest": ".forest",
    "TreeOptions": ".options",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = [*_LAZY]
