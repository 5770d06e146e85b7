"""``TreeGRPOTrainer``: TRL's ``GRPOTrainer`` with the policy's log-probs computed over a prefix tree."""

from __future__ import annotations

from trl import GRPOTrainer

from .config import TreeGRPOConfig
from .mixin import TreeTrainerMixin


class TreeGRPOTrainer(TreeTrainerMixin, GRPOTrainer):
    """Drop-in for ``trl.GRPOTrainer``: same constructor arguments; pass a :class:`TreeGRPOConfig`
    (a plain ``GRPOConfig`` is accepted and gets the tree defaults). Every GRPO loss type, ``beta``,
    ``num_iterations``, gradient checkpointing, PEFT, tools / environments / ``rollout_func`` work as
    in TRL; what the tree cannot compute exactly is refused at construction."""

    _tag_names = ["trl", "grpo", "trl_tree"]

    def __init__(self, model, reward_funcs=None, args=None, *rest, **kwargs):
        args = _tree_args(args, TreeGRPOConfig, model, "GRPO")
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._check_tree_support()


def _tree_args(args, config_cls, model, suffix):
    """A tree config from ``args`` (None, TRL's config or already a tree config)."""
    if isinstance(args, config_cls):
        return args
    if args is None:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
        return config_cls(output_dir=f"{name.split('/')[-1]}-Tree{suffix}")
    # TRL's config is already validated and derived (__post_init__ ran); copy it as it stands and
    # add the tree fields' defaults rather than re-running the checks on derived values
    import dataclasses

    tree = config_cls.__new__(config_cls)
    tree.__dict__.update(args.__dict__)
    for f in dataclasses.fields(config_cls):
        if f.name.startswith("tree_") and f.name not in tree.__dict__:
            setattr(tree, f.name, f.default)
    tree._check_tree_fields()
    return tree
