"""trl_tree: RL post-training with TRL that never computes a shared token twice.

The sequences of a micro-batch go into a prefix forest; the policy's forward and backward run over
its unique tokens with tree attention, exactly (see docs/design.md).
"""

from .compile import compile_layers, uncompile_layers
from .engine import tree_backward, tree_logprobs, tree_value_backward, tree_values
from .forest import PrefixForest


def __getattr__(name: str):
    """The trainers import TRL's trainer stack (slow); load them on first use."""
    if name in _TRAINERS:
        from . import trainers

        return getattr(trainers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_TRAINERS = ("TreeGRPOConfig", "TreeGRPOTrainer", "TreePPOConfig", "TreePPOTrainer", "TreeRLOOConfig",
             "TreeRLOOTrainer")

__version__ = "0.1.0"

__all__ = ["PrefixForest", "compile_layers", "tree_backward", "tree_logprobs", "tree_value_backward", "tree_values",
           "uncompile_layers", "__version__",
           *_TRAINERS]
