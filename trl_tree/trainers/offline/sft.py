"""``TreeSFTTrainer``: TRL's ``SFTTrainer`` with each micro-batch's loss computed over a prefix tree.

Stock's loss is ``sum(-log p(label)) / num_items_in_batch`` over the labelled tokens (``dft``
weights each term by its detached probability); the tree computes the same log-probs, each shared
token's forward run once, and the Trainer's normalisation, gradient accumulation and logging are
untouched. What differs is only how the micro-batch's forward and backward run and, opt-in, which
samples meet in a micro-batch (``tree_shuffle='groups'``, ``sft_sampler``).
"""

from __future__ import annotations

import logging

import torch
from trl import SFTTrainer

from ..config import TreeSFTConfig, as_tree_config
from .data_checks import checked_train_dataset, warn_dropped_content
from .sft_rows import SFTRows
from ..tree_calls import TreeCallsMixin

logger = logging.getLogger(__name__)


class TreeSFTTrainer(TreeCallsMixin, SFTTrainer):
    """Drop-in for ``trl.SFTTrainer``: same constructor arguments; pass a :class:`TreeSFTConfig` (a
    plain ``SFTConfig`` is accepted and gets the tree defaults). Language-modelling, prompt-completion
    and conversational datasets (tools included), ``assistant_only_loss``, ``completion_only_loss``,
    ``loss_type`` 'nll' and 'dft', ``max_length``, ``padding_free`` and ``packing`` (every strategy:
    each packed sample is a sequence of the tree), PEFT, gradient checkpointing and evaluation run
    through the tree with stock's numbers; what it cannot compute exactly is refused at construction."""

    _tag_names = ["trl", "sft", "trl_tree"]

    def __init__(self, model, args=None, *rest, **kwargs):
        args = as_tree_config(args, TreeSFTConfig, model, "SFT")
        if args.tree_mode != "off":  # before stock's constructor, which acts on some of them (offloading)
            self._refuse(self._refused_settings(args))
        dataset = checked_train_dataset(type(self).__name__, SFTTrainer.__init__, (model, args, *rest), kwargs, args)
        super().__init__(model, args, *rest, **kwargs)
        warn_dropped_content(type(self).__name__, dataset, self.processing_class)
        self._setup_tree()
        if args.tree_mode != "off":
            from .sft_sampler import announce_grouping

            announce_grouping(self)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _refused_settings(args) -> dict[str, bool]:
        """The config's settings the tree cannot compute exactly (checked before stock's constructor)."""
        return {
            "label_smoothing_factor (it needs every logit of every position)": args.label_smoothing_factor > 0,
            "use_liger_kernel (its kernels patch the model's modules; not verified on the tree)":
                bool(args.use_liger_kernel),
            "activation_offloading (its hooks on saved tensors are not verified with the tree's backward)":
                bool(args.activation_offloading),
            "tree_cuda_graphs (not built for SFT's trainer yet; the DPO and RL trainers take it)":
                bool(args.tree_cuda_graphs),
        }

    def _check_trainer_support(self) -> None:
        refusals = {
            "a vision dataset": getattr(self, "_is_vision_dataset", False),
            "compute_loss_func (it receives the model's logits, which the tree never builds)":
                self.compute_loss_func is not None,
        }
        parallel = self.accelerator.parallelism_config
        if parallel is not None:
            refusals["context or sequence parallelism (the tree holds whole sequences on one rank)"] = bool(
                getattr(parallel, "cp_enabled", False) or getattr(parallel, "sp_enabled", False))
        self._refuse(refusals)

    # ------------------------------------------------------------------ the loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.args.tree_mode == "off" or return_outputs:  # compute_metrics wants logits: stock's forward
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        aux_enabled = bool(getattr(self, "aux_loss_enabled", False))
        batch = SFTRows.from_batch(inputs, type(self).__name__, every_token=aux_enabled)
        if batch.empty:  # no labelled token: stock's forward gives the zero loss with its graph
            return super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        logps, entropies, top1, aux = self._tree_scores(model, batch.rows, inputs, aux_enabled)
        mask = batch.mask
        per_token_loss = -logps * mask
        if self.args.loss_type == "dft":
            per_token_loss = per_token_loss * logps.exp().detach()
        num_tokens = mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        if aux is not None:  # stock's: a per-micro-batch mean, averaged over the accumulation by the loss
            steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + self.router_aux_loss_coef * aux / steps
        self._log_sft_metrics(mode, inputs, mask, entropies, top1)
        if aux is not None:
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux.detach()).mean().item())
        return loss

    def _tree_scores(self, model, rows, inputs: dict, aux_loss: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(logps, entropies, is_top1, aux)`` of the samples on their ``(samples, scored)`` grid
        (``_offline_scores``; ``logps`` and the MoE load-balancing loss ``aux`` carry the gradient;
        ``aux`` is None without ``aux_loss``)."""
        # the widest position stock's forward shows a length-dependent RoPE
        positions = inputs.get("position_ids")
        width = int(positions.max()) + 1 if positions is not None else inputs["input_ids"].shape[1]
        logps, entropies, extra, forests, aux = self._offline_scores(
            model, rows, max(width, max(len(s) for s in rows.sequences)), torch.is_grad_enabled(), ("is_top1",),
            aux_loss=aux_loss)
        self._log_forests(forests, aux_loss)
        return logps, entropies, extra["is_top1"], aux

    def _log_sft_metrics(self, mode: str, inputs: dict, mask: torch.Tensor, entropies: torch.Tensor,
                         top1: torch.Tensor) -> None:
        """Stock's ``entropy``, ``mean_token_accuracy`` and ``num_tokens`` (every sample's tokens,
        as stock counts them: the tree's saving shows in ``tree/dedup_ratio``, not here)."""
        gather = self.accelerator.gather_for_metrics
        num_valid = gather(mask.sum()).sum()
        entropy_sum = gather((entropies * mask).sum()).sum()
        num_correct = gather((top1.float() * mask).sum()).sum()
        self._metrics[mode]["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append((num_correct / num_valid).item() if num_valid > 0 else 0.0)
        if mode == "train":
            if "attention_mask" in inputs:
                num_tokens_in_batch = gather(inputs["attention_mask"].sum()).sum().item()
            else:
                positions = inputs["position_ids"]
                num_tokens_in_batch = gather(torch.tensor(positions.size(1), device=positions.device)).sum().item()
            self._total_train_tokens += num_tokens_in_batch // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

    # ------------------------------------------------------------------ the step
    def training_step(self, model, inputs, num_items_in_batch=None):
        return self._offline_training_step(model, inputs, num_items_in_batch)

    def _get_train_sampler(self, train_dataset=None):
        if self.args.tree_mode == "off" or self.args.tree_shuffle != "groups":
            return super()._get_train_sampler(train_dataset)
        from .sft_sampler import PrefixGroupedSampler

        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return PrefixGroupedSampler.for_trainer(self, dataset)
