"""``TreeGRPOTrainer``: TRL's ``GRPOTrainer`` with the policy's log-probs computed over a prefix tree."""

from __future__ import annotations

from trl import GRPOTrainer

from ..config import TreeGRPOConfig, as_tree_config
from .mixin import TreeTrainerMixin


class TreeGRPOTrainer(TreeTrainerMixin, GRPOTrainer):
    """Drop-in for ``trl.GRPOTrainer``: same constructor arguments; pass a :class:`TreeGRPOConfig`
    (a plain ``GRPOConfig`` is accepted and gets the tree defaults). Every GRPO loss type, ``beta``,
    ``num_iterations``, gradient checkpointing, PEFT, tools / environments / ``rollout_func`` work as
    in TRL; what the tree cannot compute exactly is refused at construction."""

    _tag_names = ["trl", "grpo", "trl_tree"]

    def __init__(self, model, reward_funcs=None, args=None, *rest, **kwargs):
        args = as_tree_config(args, TreeGRPOConfig, model, "GRPO")
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._setup_tree()

