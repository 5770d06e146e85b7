"""trl_tree: RL post-training with TRL that never computes a shared token twice.

The sequences of a micro-batch go into a prefix forest; the policy's forward and backward run over
its unique tokens with tree attention, exactly (docs/architecture.md; the trainers:
docs/trainers.md).

Every name below is loaded on first use: ``import trl_tree`` (and ``trl-tree --help``) costs no
torch, transformers or TRL import until something is asked for.
"""

from .engine._lazy import lazy_exports

#: public name -> the module that defines it
_LAZY = {
    "compile_layers": ".engine.compile", "uncompile_layers": ".engine.compile",
    "TreeOptions": ".engine.options",
    "tree_backward": ".engine.api", "tree_logprobs": ".engine.api", "tree_value_backward": ".engine.api",
    "tree_values": ".engine.api",
    "PrefixForest": ".engine.forest",
    **{name: ".trainers" for name in ("TreeGRPOConfig", "TreeGRPOTrainer", "TreePPOConfig", "TreePPOTrainer",
                                      "TreeRLOOConfig", "TreeRLOOTrainer", "TreeSFTConfig", "TreeSFTTrainer",
                                      "TreeDPOConfig", "TreeDPOTrainer")},
    # TRL's experimental async GRPO: imported only when asked for
    **{name: ".trainers.asynchronous.async_grpo" for name in ("TreeAsyncGRPOConfig", "TreeAsyncGRPOTrainer")},
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

__version__ = "0.1.0"

__all__ = [*_LAZY, "__version__"]
