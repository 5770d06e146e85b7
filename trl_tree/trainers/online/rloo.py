"""``TreeRLOOTrainer``: TRL's ``RLOOTrainer`` with the policy's log-probs computed over a prefix tree."""

from __future__ import annotations

from trl import RLOOTrainer

from ..config import TreeRLOOConfig, as_tree_config
from .mixin import TreeTrainerMixin
from .separable_loss import RLOOSequenceLoss


class TreeRLOOTrainer(TreeTrainerMixin, RLOOTrainer):
    """Drop-in for ``trl.RLOOTrainer``: same constructor arguments; pass a :class:`TreeRLOOConfig`.
    RLOO's sequence-level ratio works in both tree modes; the engine's own backward (dfs, budgets,
    windows) takes it in one pass where a sequence's terms stay together (``separable_loss``)."""

    _tag_names = ["trl", "rloo", "trl_tree"]
    #: RLOO's loss, a sum of per-sequence terms: one pass where the engine keeps a sequence's terms
    #: together (packed calls; the walk where its plan does)
    _one_pass_loss_class = RLOOSequenceLoss

    def __init__(self, model, reward_funcs=None, args=None, *rest, **kwargs):
        args = as_tree_config(args, TreeRLOOConfig, model, "RLOO")
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._setup_tree()
