"""Drop-in TRL trainers on the tree engine: change one import and one config class.

By family: ``online/`` (GRPO, RLOO, PPO and its critic), ``offline/`` (SFT, DPO), ``asynchronous/``
(TRL's asynchronous GRPO, imported only when asked for); beside them what every family shares: the
tree calls (``tree_calls.py``) and the configs (``config.py``).
"""

from .config import TreeArguments, TreeDPOConfig, TreeGRPOConfig, TreePPOConfig, TreeRLOOConfig, TreeSFTConfig
from .offline.dpo import TreeDPOTrainer
from .offline.sft import TreeSFTTrainer
from .online.grpo import TreeGRPOTrainer
from .online.ppo import TreePPOTrainer
from .online.rloo import TreeRLOOTrainer

__all__ = ["TreeArguments", "TreeDPOConfig", "TreeDPOTrainer", "TreeGRPOConfig", "TreeGRPOTrainer", "TreePPOConfig",
           "TreePPOTrainer", "TreeRLOOConfig", "TreeRLOOTrainer", "TreeSFTConfig", "TreeSFTTrainer"]
