"""The tree behind TRL's fused LM head: ``model(..., labels=..., fused_lm_head=True)`` answered by
the tree engine.

TRL 1.16's offline trainers (DPO; SFT too) patch the model's ``forward`` with a fused LM head
(``trl.trainer.utils.add_fused_lm_head``) and build their losses and metrics from its per-token
outputs: ``log_probs``, ``entropy``, ``mean_logits``, ``is_top1``, ``log_sum_sq_probs``, each
``(batch, length - 1)`` and zero where the label is -100. Wrapping that forward once more keeps
the trainer's loss code exactly as it is — DPO's dozen loss types, its reference passes (a
reference model, the PEFT base with adapters disabled, precomputed log-probs), its metrics — and
changes only where the numbers come from: the rows of the batch become one forest (a prompt's
chosen and rejected answers share it), scored once per unique token, scattered back into the
layout TRL expects. Because the call still runs inside the distributed wrapper's forward, DDP's
gradient hooks see the packed pass's backward as they see stock's.

Calls the tree cannot express exactly (other inputs than ``input_ids``/``attention_mask``,
pre-shifted labels, labels that are not the inputs' next tokens are refused by ``SFTRows``) run
TRL's own fused forward.
"""

from __future__ import annotations

import types
import weakref

import torch

from ..offline.sft_rows import SFTRows

#: the keyword arguments a tree call reproduces; anything else runs TRL's own forward
#: (``output_router_logits``: an MoE model's load-balancing loss, computed over the tree)
TREE_KWARGS = {"input_ids", "attention_mask", "use_cache", "return_dict", "output_router_logits"}


def install_tree_head(trainer, causal_lm: torch.nn.Module, head_outputs: tuple[str, ...], policy: bool) -> None:
    """Wrap ``causal_lm.forward`` (TRL's fused forward, already installed) so that fused calls run
    through the trainer's tree. ``policy``: the trained model (its calls log the ``tree/`` metrics
    and may carry gradients); otherwise a frozen reference."""
    original = causal_lm.forward
    owner = weakref.ref(trainer)

    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        tree = owner()
        plain = (fused_lm_head and not args and shift_labels is None and labels is not None
                 and set(kwargs) <= TREE_KWARGS and kwargs.get("input_ids") is not None)
        if tree is None or tree.args.tree_mode == "off" or not plain:
            return original(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                            num_items_in_batch=num_items_in_batch, **kwargs)
        input_ids = kwargs["input_ids"]
        batch = rows_of(tree, input_ids, kwargs.get("attention_mask"), labels)
        if batch.empty:  # nothing labelled: TRL's forward gives the zeros, connected to the model
            return original(fused_lm_head=True, labels=labels, num_items_in_batch=num_items_in_batch, **kwargs)
        # as TRL's fused forward: router logits where asked for, or where the model's config asks for them
        aux = policy and kwargs.get("output_router_logits",
                                    getattr(self.config.get_text_config(), "output_router_logits", False))
        return tree_fused_outputs(tree, self, batch, input_ids.shape, labels, num_items_in_batch, head_outputs,
                                  policy, aux_loss=bool(aux))

    causal_lm.forward = types.MethodType(forward, causal_lm)


def rows_of(trainer, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor) -> SFTRows:
    """The batch's ``SFTRows``, kept for the next call on the very same tensors: DPO's reference
    call follows the policy's on them, and rebuilding the rows would read the ids back from the GPU,
    waiting there for the policy's queued forward (the GPU then idles while the host lays them out).
    Labels made again from the same ids (DPO's one-pass step builds them before stock's reference
    call does) are compared by value: that call comes first in its step, nothing queued to wait for."""
    tensors = (input_ids, attention_mask, labels)
    versions = tuple(None if t is None else t._version for t in tensors)  # unchanged in place since
    cached = getattr(trainer, "_tree_rows_cache", None)
    if (cached is not None and all(a is b for a, b in zip(cached[0][:2], tensors[:2])) and cached[1][:2] == versions[:2]
            and (cached[0][2] is labels and cached[1][2] == versions[2] or torch.equal(cached[0][2], labels))):
        return cached[2]
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    # an MoE policy's load-balancing loss counts every real token, labelled or not (SFTRows.every_token)
    batch = SFTRows.from_batch({"input_ids": input_ids, "attention_mask": mask, "labels": labels},
                               type(trainer).__name__, every_token=bool(getattr(trainer, "aux_loss_enabled", False)))
    trainer._tree_rows_cache = (tensors, versions, batch)
    return batch


def tree_fused_outputs(trainer, model, batch: SFTRows, shape: torch.Size, labels: torch.Tensor,
                       num_items_in_batch, head_outputs: tuple[str, ...], policy: bool, aux_loss: bool = False):
    """TRL's ``FusedCausalLMOutput`` for the batch, from the tree (packed: one autograd pass; dfs or a
    token budget: the bridge to the engine's own backward); ``aux_loss``: with the MoE load-balancing
    loss over the batch's real tokens (``aux_loss``, and in ``loss`` times the config's
    ``router_aux_loss_coef``, as TRL's fused forward)."""
    from trl.trainer.utils import FusedCausalLMOutput

    differentiable = torch.is_grad_enabled() and policy
    logps, entropies, extra, forests, aux = trainer._offline_scores(model, batch.rows, shape[1], differentiable,
                                                                    head_outputs, aux_loss=aux_loss)
    if policy and torch.is_grad_enabled():
        trainer._log_forests(forests, aux_loss)
    layout = (shape[0], shape[1] - 1)
    log_probs = place_on_batch(batch, logps, layout)
    label_mask = labels[:, 1:] != -100
    loss = -log_probs.sum() / (label_mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
    if aux is not None:
        loss = loss + getattr(model.config.get_text_config(), "router_aux_loss_coef", 0.0) * aux
    return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=place_on_batch(batch, entropies, layout),
                               label_mask=label_mask, aux_loss=aux,
                               **{name: place_on_batch(batch, extra[name], layout) for name in head_outputs})


def place_on_batch(batch: SFTRows, grid: torch.Tensor, layout: tuple[int, int]) -> torch.Tensor:
    """A rows' grid of scores, masked, in the batch's ``(B, L - 1)`` layout where TRL's fused head puts
    its outputs (differentiable)."""
    mask = batch.mask
    return batch.to_batch(grid * mask.to(grid.dtype) if grid.dtype != torch.bool else grid & mask.bool(), layout)
