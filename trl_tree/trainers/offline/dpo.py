"""``TreeDPOTrainer``: TRL's ``DPOTrainer`` with the policy's and the reference's log-probs from a prefix tree.

TRL concatenates each micro-batch's chosen and rejected rows, so every prompt runs twice through
the policy and twice more through the reference. Here the rows are one forest (``fused_forward``:
the tree answers TRL's fused-head calls), so a prompt runs once per model; TRL's loss code — every
``loss_type``, ``loss_weights``, ``ld_alpha``, the f-divergences, WPO weights — and its metrics run
unchanged on the tree's numbers.
"""

from __future__ import annotations

import torch
from peft import PeftModel
from trl import DPOTrainer

from ..config import TreeDPOConfig, as_tree_config
from .data_checks import checked_train_dataset, warn_dropped_content
from .dpo_stock_loss import NON_MODEL_KEYS, OUTPUT_NAMES, stock_loss, takes_the_batch, with_reference
from .dpo_walk import one_pass_loss, walks_in_one_pass
from ..asynchronous.fused_forward import install_tree_head
from ..tree_calls import TreeCallsMixin


class TreeDPOTrainer(TreeCallsMixin, DPOTrainer):
    """Drop-in for ``trl.DPOTrainer``: same constructor arguments; pass a :class:`TreeDPOConfig` (a
    plain ``DPOConfig`` is accepted and gets the tree defaults). A separate reference model, the
    PEFT base with adapters disabled, and ``precompute_ref_log_probs`` all run through the tree;
    what it cannot compute exactly is refused at construction."""

    _tag_names = ["trl", "dpo", "trl_tree"]

    def __init__(self, model, ref_model=None, args=None, *rest, **kwargs):
        args = as_tree_config(args, TreeDPOConfig, model, "DPO")
        if args.tree_mode != "off":  # before stock's constructor, which acts on it
            self._refuse({"activation_offloading (its hooks on saved tensors are not verified with the tree's "
                          "backward)": bool(args.activation_offloading)})
        dataset = checked_train_dataset(type(self).__name__, DPOTrainer.__init__, (model, ref_model, args, *rest),
                                        kwargs, args)
        super().__init__(model, ref_model, args, *rest, **kwargs)
        warn_dropped_content(type(self).__name__, dataset, self.processing_class)
        self._install_tree_heads()
        self._setup_tree()
        if args.tree_mode != "off":
            from .sft_sampler import announce_grouping

            announce_grouping(self, pairs=True)

    def _get_train_sampler(self, train_dataset=None):
        if self.args.tree_mode == "off" or self.args.tree_shuffle != "groups":
            return super()._get_train_sampler(train_dataset)
        from .sft_sampler import PrefixGroupedSampler, pair_sequences

        found = pair_sequences(train_dataset if train_dataset is not None else self.train_dataset)
        if found is None:
            raise ValueError(f"{type(self).__name__}: tree_shuffle='groups' reads the tokenised pairs (prompt_ids, "
                             "chosen_ids, rejected_ids), which this dataset does not have")
        return PrefixGroupedSampler.for_trainer(self, None, sequences=found[0])

    def _install_tree_heads(self) -> None:
        """Once: the policy's and the reference's fused heads answered by the tree (before the
        reference log-probs are precomputed, which happens inside stock's constructor)."""
        if getattr(self, "_tree_heads_installed", False) or self.args.tree_mode == "off":
            return
        self._tree_heads_installed = True
        policy = self._unwrapped(self.model)
        policy = policy.get_base_model() if isinstance(policy, PeftModel) else policy
        outputs = ("mean_logits", "is_top1") + (("log_sum_sq_probs",) if self.use_weighting else ())
        install_tree_head(self, policy, outputs, policy=True)
        if getattr(self, "ref_model", None) is not None:
            install_tree_head(self, self._unwrapped(self.ref_model), (), policy=False)

    def _precompute_ref_logps(self, dataset, name, batch_size):
        self._install_tree_heads()
        return super()._precompute_ref_logps(dataset, name, batch_size)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if walks_in_one_pass(self, inputs, return_outputs):  # dfs: the walk back-propagates as it scores
            loss = one_pass_loss(self, model, inputs, num_items_in_batch)
            if loss is not None:
                return loss
        if self._graphs_by_hand() and self.args.tree_mode == "packed" and torch.is_grad_enabled():
            self._tree_sync_pending = True  # the replayed call runs past DDP: its gradients averaged below
        if self.args.tree_mode == "packed" and takes_the_batch(self, inputs, return_outputs):
            return self._loss_before_metrics(self._past_ddp(model), inputs)
        return super().compute_loss(self._past_ddp(model), inputs, return_outputs, num_items_in_batch)

    def _loss_before_metrics(self, model, inputs: dict) -> torch.Tensor:
        """Packed: stock's loss on the tree's outputs, returned for its backward; its metrics, which
        read numbers back from the GPU, are logged once that backward is queued (``training_step``).
        Logged inside the loss as stock does, they would drain the GPU's queue between the forward
        and the backward, and the backward's many small launches would then run with nothing queued
        ahead of them."""
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        model_kwargs = {k: v for k, v in inputs.items() if k not in NON_MODEL_KEYS}
        if self.aux_loss_enabled:  # as stock's _compute_loss: the MoE policy's load-balancing loss
            model_kwargs["output_router_logits"] = True
        outputs = model(**model_kwargs, use_cache=False, labels=labels, fused_lm_head=True)
        inputs = with_reference(self, inputs)
        given = {name: getattr(outputs, name) for name in OUTPUT_NAMES if getattr(outputs, name, None) is not None}
        loss = stock_loss(self, inputs, given, muted=True)
        self._tree_metrics_pending = (inputs, {name: value.detach() for name, value in given.items()})
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._tree_metrics_pending = None
        loss = self._offline_training_step(model, inputs, num_items_in_batch)
        if self._tree_metrics_pending is not None:  # stock's metrics of the loss above, as stock logs them
            pending, self._tree_metrics_pending = self._tree_metrics_pending, None
            with torch.no_grad():
                stock_loss(self, *pending, muted=False)
        return loss

    def _after_backward(self, model) -> None:
        if self._tree_sync_pending:  # the replayed call ran past DDP: its gradients averaged here
            self._tree_sync_pending = False
            self._sync_gradients(self._unwrapped(model))

