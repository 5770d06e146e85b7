"""Drop-in TRL trainers on the tree engine: change one import and one config class."""

from .config import TreeArguments, TreeDPOConfig, TreeGRPOConfig, TreePPOConfig, TreeRLOOConfig, TreeSFTConfig
from .dpo import TreeDPOTrainer
from .grpo import TreeGRPOTrainer
from .ppo import TreePPOTrainer
from .rloo import TreeRLOOTrainer
from .sft import TreeSFTTrainer

__all__ = ["TreeArguments", "TreeDPOConfig", "TreeDPOTrainer", "TreeGRPOConfig", "TreeGRPOTrainer", "TreePPOConfig",
           "TreePPOTrainer", "TreeRLOOConfig", "TreeRLOOTrainer", "TreeSFTConfig", "TreeSFTTrainer"]
