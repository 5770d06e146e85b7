"""``TreeRLOOTrainer``: TRL's ``RLOOTrainer`` with the policy's log-probs computed over a prefix tree."""

from __future__ import annotations

from trl import RLOOTrainer

from .config import TreeRLOOConfig, as_tree_config
from .mixin import TreeTrainerMixin


class TreeRLOOTrainer(TreeTrainerMixin, RLOOTrainer):
    """Drop-in for ``trl.RLOOTrainer``: same constructor arguments; pass a :class:`TreeRLOOConfig`.
    RLOO's sequence-level ratio works in both tree modes (``dfs`` through the two-pass backward)."""

    _tag_names = ["trl", "rloo", "trl_tree"]

    def __init__(self, model, reward_funcs=None, args=None, *rest, **kwargs):
        args = as_tree_config(args, TreeRLOOConfig, model, "RLOO")
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._setup_tree()

    def _why_two_pass(self) -> str | None:
        return "RLOO's importance ratio is per sequence (the exponential of its summed log-probs)"
