"""TRL GRPO's policy loss (also PPO's, which is GRPO's) as a sum of per-token terms, and RLOO's as a
sum of per-sequence terms — what lets the tree's backward run in one pass.

Why: the two-pass bridge (``bridge.py``) runs a forward without a graph to get every log-prob, lets
TRL's loss code take its gradient, then walks the tree again with those gradients. Where the loss
is ``Σ_t w_t · φ(logp_t; constants_t)`` — each term a function of its own token's log-prob and of
constants the rollouts fixed (advantage, old and reference log-probs, importance-sampling
correction, the micro-batch's normaliser) — the tree can compute each term's gradient as it scores
the token, and the first pass goes: one forward and one backward, as packed mode's single graph,
for the depth-first walk and for accumulation windows (whose trees are computed away from the rows'
own micro-steps).

RLOO's ratio is per sequence (the exponential of its summed log-probs), so its terms couple a
sequence's tokens: :class:`RLOOSequenceLoss` is handed to the engine as a loss on whole sequences
(``tree_backward(coupled=...)``), which a packed call takes in one pass and the walk in one pass
where its plan keeps each sequence's terms in one unit (else it scores first, inside the engine).

This is a second statement of TRL's formula, so it is used only for the settings written out here
(``why_not`` lists the rest: a sequence-level ratio, VESPO's sequence weights, the off-policy mask,
the entropy mask or bonus, the MoE auxiliary loss, an unknown loss type), and the trainer tests
compare its update with stock TRL's for every loss type it takes. Everything else keeps the
two-pass bridge, which reuses TRL's code unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: loss types whose per-token term is written out in :meth:`GRPOTokenLoss.terms`
SEPARABLE_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")

#: the constants of one token, in this order along the last dimension of :meth:`GRPOTokenLoss.constants`
#: (``old`` is NaN where TRL takes the log-prob itself, detached: ``old_per_token_logps`` is None)
CONSTANTS = ("weight", "advantage", "old", "ref", "is_ratio")


#: why neither loss is written out with TRL's MoE load-balancing term
AUX_LOSS = "the MoE load-balancing loss is a function of the whole micro-batch's routing"


def why_not_separable(trainer) -> str | None:
    """Why ``trainer``'s policy loss is not a sum of per-token terms this module writes out (None: it is)."""
    loss_type = getattr(trainer, "loss_type", None)
    if loss_type not in SEPARABLE_LOSS_TYPES:
        return f"loss_type={loss_type!r} is not one of {SEPARABLE_LOSS_TYPES}"
    if getattr(trainer, "importance_sampling_level", "token") != "token":
        return "importance_sampling_level='sequence' couples a sequence's tokens through its ratio"
    if getattr(trainer, "off_policy_mask_threshold", None) is not None:
        return "off_policy_mask_threshold masks sequences by their mean log-ratio"
    if getattr(trainer, "top_entropy_quantile", 1.0) < 1.0:
        return "top_entropy_quantile < 1 masks tokens by an entropy quantile of the micro-batch"
    if getattr(trainer, "_entropy_bonus_enabled", False):
        return "the entropy bonus (not written out here)"
    if getattr(trainer, "aux_loss_enabled", False):
        return AUX_LOSS
    return None


@dataclass(frozen=True)
class GRPOTokenLoss:
    """TRL GRPO's ``_compute_loss`` for one token: ``weight · (is_ratio · policy_term + beta · kl)``."""

    coupled = False  # each term a function of its own token's log-prob

    loss_type: str
    epsilon_low: float
    epsilon_high: float
    delta: float | None
    beta: float
    bias_correction_kl: bool
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    is_correction: bool  # vLLM's importance-sampling correction multiplies the policy term

    @staticmethod
    def why_not(trainer) -> str | None:
        return why_not_separable(trainer)

    @classmethod
    def of(cls, trainer) -> GRPOTokenLoss:
        args = trainer.args
        loss_type = trainer.loss_type
        return cls(
            loss_type=loss_type, epsilon_low=float(trainer.epsilon_low), epsilon_high=float(trainer.epsilon_high),
            delta=args.delta, beta=float(trainer.beta),
            bias_correction_kl=bool(getattr(args, "use_bias_correction_kl", False)),
            sapo_temperature_pos=float(getattr(args, "sapo_temperature_pos", 1.0)),
            sapo_temperature_neg=float(getattr(args, "sapo_temperature_neg", 1.0)),
            is_correction=bool(getattr(trainer, "use_vllm", False)
                               and getattr(trainer, "vllm_importance_sampling_correction", False)),
        )

    def constants(self, trainer, inputs: dict) -> torch.Tensor:
        """A micro-step's ``(B, T, len(CONSTANTS))`` float32 constants from TRL's buffered ``inputs``
        (what its ``_compute_loss`` reads), in training mode: each token's weight is its mask times the
        loss type's normaliser and the accumulation scaling, exactly as TRL divides."""
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        mask = mask.float()
        rows, width = mask.shape
        accumulation = trainer.current_gradient_accumulation_steps
        if self.loss_type in ("grpo", "sapo"):
            weight = mask / mask.sum(-1, keepdim=True).clamp(min=1.0) / rows / accumulation
        elif self.loss_type == "bnpo":
            weight = mask / mask.sum().clamp(min=1.0) / accumulation
        elif self.loss_type == "dr_grpo":
            weight = mask / (rows * trainer.max_completion_length) / accumulation
        elif self.loss_type == "luspo":
            weight = mask / rows / accumulation
        else:  # dapo, cispo: num_items_in_batch spans the generation batch
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
            normalizer = normalizer * accumulation / trainer.args.steps_per_generation
            weight = mask / normalizer
        advantages = inputs["advantages"].float()
        advantages = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).expand(rows, width)
        old = inputs.get("old_per_token_logps")
        old = torch.full_like(mask, float("nan")) if old is None else old.float()
        ref = inputs["ref_per_token_logps"].float() if self.beta != 0.0 else torch.zeros_like(mask)
        if self.is_correction:
            is_ratio = inputs["importance_sampling_ratio"].float().expand(rows, width)
        else:
            is_ratio = torch.ones_like(mask)
        return torch.stack([weight, advantages, old, ref, is_ratio], dim=-1)

    def terms(self, logp: torch.Tensor, constants: torch.Tensor, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        """Each token's share of the loss, differentiable in ``logp`` (``[n]``; ``constants`` ``[n, 5]``)."""
        weight, advantage, old, ref, is_ratio = constants.unbind(-1)
        logp = logp.float()
        old = torch.where(torch.isnan(old), logp.detach(), old)
        ratio = torch.exp(logp - old)
        if self.loss_type == "cispo":
            policy = -torch.clamp(ratio, max=self.epsilon_high).detach() * advantage * logp
        elif self.loss_type == "sapo":
            temperature = torch.where(advantage > 0, torch.full_like(advantage, self.sapo_temperature_pos),
                                      torch.full_like(advantage, self.sapo_temperature_neg))
            policy = -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * advantage
        else:
            clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
            unclipped = ratio if self.delta is None else torch.clamp(ratio, max=self.delta)
            policy = -torch.min(unclipped * advantage, clipped * advantage)
        if self.is_correction:
            policy = policy * is_ratio
        if self.beta != 0.0:
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            if self.bias_correction_kl:
                kl = kl * ratio
            policy = policy + self.beta * kl
        return weight * policy


@dataclass(frozen=True)
class RLOOSequenceLoss:
    """TRL RLOO's ``_compute_loss``: per sequence ``-min(r·A, clip(r)·A)`` with ``r = exp(Σ_t logp_t
    - old)``, averaged over the micro-batch's rows and divided by the accumulation steps (the
    Trainer's scaling: RLOO's loss is not scaled for them). Constants per token: the row's weight
    ``1 / (rows · accumulation)``, advantage and old summed log-prob, and the completion mask."""

    epsilon_low: float
    epsilon_high: float

    coupled = True  # a sequence's terms together: the engine hands all of them to one call

    @staticmethod
    def why_not(trainer) -> str | None:
        """Why RLOO's loss is not written out here (None: it is)."""
        return AUX_LOSS if getattr(trainer, "aux_loss_enabled", False) else None

    @classmethod
    def of(cls, trainer) -> RLOOSequenceLoss:
        return cls(epsilon_low=float(trainer.epsilon_low), epsilon_high=float(trainer.epsilon_high))

    def constants(self, trainer, inputs: dict) -> torch.Tensor:
        mask = inputs["completion_mask"].float()
        rows, width = mask.shape
        weight = torch.full_like(mask, 1.0 / (rows * trainer.current_gradient_accumulation_steps))
        advantages = inputs["advantages"].float().reshape(rows, 1).expand(rows, width)
        old = inputs["old_logps"].float().reshape(rows, 1).expand(rows, width)
        return torch.stack([weight, advantages, old, mask], dim=-1)

    def terms(self, logp: torch.Tensor, constants: torch.Tensor, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        """Every term of the sequences present (all of each: ``coupled``): each sequence's loss spread
        evenly over its terms, so that their sum is the loss and its gradient flows through the sum."""
        weight, advantage, old, mask = constants.unbind(-1)
        logp = logp.float()
        sequences, inverse = torch.unique(seq_idx, return_inverse=True)
        summed = torch.zeros(len(sequences), device=logp.device).index_add(0, inverse, logp * mask)
        count = torch.zeros(len(sequences), device=logp.device).index_add(0, inverse, torch.ones_like(logp))
        ratio = torch.exp(summed[inverse] - old)
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_sequence = -torch.min(ratio * advantage, clipped * advantage)
        return weight * per_sequence / count[inverse]


#: what a one-pass policy call takes: ``why_not(trainer)``, ``of(trainer)``, ``constants(trainer, inputs)`` and
#: ``terms(logp, constants, seq_idx)``
OnePassLoss = GRPOTokenLoss | RLOOSequenceLoss
