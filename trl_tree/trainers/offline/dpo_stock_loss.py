"""TRL's own DPO loss on outputs the tree computed, with its metrics logged — or muted.

TRL 1.16's ``DPOTrainer._compute_loss`` calls the model, then builds the loss (every ``loss_type``,
``loss_weights``, ``ld_alpha``, the f-divergences, WPO's weights) and logs its metrics, which read
numbers back from the GPU (``.item()``, gathers). Two of the tree's steps need that code apart from
its model call: the depth-first walk evaluates the loss on each unit's pairs (``dpo_walk``), and the
packed step returns the loss before its backward and logs the metrics after it, so that the GPU is
not drained between the forward and the backward (``TreeDPOTrainer.compute_loss``). Both run stock's
code itself through a view of the trainer: the model's call answers with the given outputs, the
reference log-probs are taken as precomputed (they are in the inputs), and — muted — the metrics go
to a scratch dict, read as nothing, with no GPU sync and no collective.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from trl import DPOTrainer

from ..asynchronous.fused_forward import TREE_KWARGS

#: what stock's ``_compute_loss`` keeps out of the model's call
NON_MODEL_KEYS = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}
#: the fused head's outputs stock's loss and metrics read (``aux_loss``: an MoE policy's)
OUTPUT_NAMES = ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs", "aux_loss")


def takes_the_batch(trainer, inputs: dict, return_outputs: bool) -> bool:
    """Whether a micro-batch's loss can be computed apart from stock's ``_compute_loss`` call: a
    training step (metrics logged once), on a batch the tree's fused head answers as it is."""
    keys = set(inputs) - NON_MODEL_KEYS
    return (torch.is_grad_enabled() and trainer.model.training and not return_outputs and trainer.args.n_gpu <= 1
            and keys <= TREE_KWARGS and "input_ids" in keys and "attention_mask" in keys)


def with_reference(trainer, inputs: dict) -> dict:
    """``inputs`` with the reference's log-probs: precomputed, or from stock's own reference call
    (a reference model, or the PEFT base with its adapters disabled), which the tree answers."""
    if not trainer.precompute_ref_logps:
        ref_model = trainer.ref_model if trainer.ref_model is not None else trainer.model
        chosen, rejected = trainer.compute_ref_log_probs(ref_model, inputs)
        inputs = {**inputs, "ref_chosen_logps": chosen, "ref_rejected_logps": rejected}
    return inputs


def stock_loss(trainer, inputs: dict, outputs: dict, muted: bool) -> torch.Tensor:
    """TRL's ``DPOTrainer._compute_loss`` on given per-token outputs (``log_probs``, and what else the
    fused head gives: ``entropy``, ``mean_logits``, ``is_top1``, ``log_sum_sq_probs``) with the
    reference log-probs in ``inputs``; ``muted``: its metrics go nowhere (absent outputs read as
    nothing) and cost no GPU sync or collective."""
    view = _StockView(trainer, muted)
    return DPOTrainer._compute_loss(view, _GivenOutputs(outputs, muted), inputs, False)


class _GivenOutputs:
    """Stands for the policy in stock's loss: its fused-head call returns the given outputs."""

    def __init__(self, outputs: dict, muted: bool) -> None:
        absent = _Nothing() if muted else None
        self.outputs = type("Outputs", (), {name: outputs.get(name, absent) for name in OUTPUT_NAMES})

    def __call__(self, *args, **kwargs):
        return self.outputs


class _StockView:
    """The trainer as stock's ``_compute_loss`` reads it: reference log-probs precomputed (they are in
    the inputs); ``muted``, metrics and token counts into a scratch dict and gathers answered by
    nothing."""

    def __init__(self, trainer, muted: bool) -> None:
        own = {"precompute_ref_logps": True}
        if muted:
            own.update(_metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0,
                       accelerator=_MutedAccelerator(trainer.accelerator))
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "_own", own)

    def __getattr__(self, name):
        own = object.__getattribute__(self, "_own")
        return own[name] if name in own else getattr(object.__getattribute__(self, "_trainer"), name)

    def __setattr__(self, name, value):
        if name in self._own:
            self._own[name] = value
        else:
            setattr(self._trainer, name, value)


class _MutedAccelerator:
    def __init__(self, accelerator) -> None:
        self.device = accelerator.device

    def gather(self, tensor):
        return _Nothing()

    gather_for_metrics = gather


class _Nothing:
    """A metric nobody reads: every operation gives nothing, ``item()`` 0 and comparisons False."""

    def __getitem__(self, key):
        return self

    def chunk(self, chunks, dim=0):
        return (self,) * chunks

    def item(self):
        return 0

    def __gt__(self, other):
        return False

    def _self(self, *args, **kwargs):
        return self

    detach = sum = mean = float = bool = _self
    __mul__ = __rmul__ = __truediv__ = __and__ = __sub__ = __add__ = _self
