"""The engine: the tree's forward and backward, everything below the trainers.

A micro-batch's sequences become a prefix forest (``forest.py``); the policy runs over its unique
tokens once, either as one packed pass (``packed.py``, replayed as CUDA graphs by ``graphs.py``) or
as a depth-first walk with a K/V stack (``dfs/``), with tree attention behind transformers'
``AttentionInterface`` (``attention/``) and other sequence mixers made exact over the tree
(``mixers/``). ``api.py`` holds the entry points and is the only module that chooses among them.

The public names below load on first use, as the package's own do, so that importing one engine
module (the forest, the cost model) does not import the rest.
"""

from ._lazy import lazy_exports

#: public name -> the module of this package that defines it
_LAZY = {
    "tree_backward": ".api", "tree_logprobs": ".api", "tree_value_backward": ".api", "tree_values": ".api",
    "PrefixForest": ".forest",
    "TreeOptions": ".options",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

__all__ = [*_LAZY]
