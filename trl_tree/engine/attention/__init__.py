"""Tree attention: metadata, kernels and the dispatcher registered in transformers' AttentionInterface."""

from .backends import BACKENDS, resolve_backend
from .dispatch import install, tree_attention_forward, uninstall
from .metadata import TREE_KWARG, TreeAttentionMetadata

__all__ = [
    "BACKENDS",
    "TREE_KWARG",
    "TreeAttentionMetadata",
    "install",
    "resolve_backend",
    "tree_attention_forward",
    "uninstall",
]
