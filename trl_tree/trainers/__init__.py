"""Drop-in TRL trainers on the tree engine: change one import and one config class."""

from .config import TreeArguments, TreeGRPOConfig, TreeRLOOConfig
from .grpo import TreeGRPOTrainer
from .rloo import TreeRLOOTrainer

__all__ = ["TreeArguments", "TreeGRPOConfig", "TreeGRPOTrainer", "TreeRLOOConfig", "TreeRLOOTrainer"]
