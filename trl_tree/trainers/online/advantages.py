"""PPO's per-token quantities from a rollout: token rewards, GAE advantages and returns, whitening.

Plain tensor functions over ``(B, T)`` completion-aligned tensors and a ``mask`` of the tokens
that count (completion tokens, minus tool/environment output in multi-turn rollouts). Masked
tokens are *not steps* of the trajectory: they get no reward, no advantage, no return, and GAE
links each counted token to the next counted one, so an agent's action before a tool call
bootstraps from its next action, not from the tool's output tokens. Each function is checked
against a textbook loop in the tests.

Whitening statistics can span processes: ``reduce`` sums a tensor over them (the trainer passes
``accelerator.reduce(..., "sum")``), so every rank whitens with the statistics of the whole
generation batch, whatever the number of processes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KL_ESTIMATORS = ("k1", "k3")

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def masked_mean(x: torch.Tensor, mask: torch.Tensor, reduce: Reduce = _identity) -> torch.Tensor:
    """Mean of ``x`` over the tokens of ``mask`` (on every process, through ``reduce``)."""
    m = mask.to(x.dtype)
    totals = reduce(torch.stack([(x * m).sum(), m.sum()]))
    return totals[0] / totals[1].clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, reduce: Reduce = _identity,
                  eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked tokens, with the unbiased (Bessel) variance
    as TRL's PPO used; ``shift_mean=False`` adds the mean back (rewards keep their level). Values
    outside the mask are whitened too; callers zero them."""
    m = mask.to(x.dtype)
    mean = masked_mean(x, mask, reduce)
    totals = reduce(torch.stack([((x - mean) ** 2 * m).sum(), m.sum()]))
    count = totals[1]
    var = totals[0] / count.clamp(min=1.0)
    var = torch.where(count > 1, var * count / (count - 1).clamp(min=1.0), var)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


def kl_penalty(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token KL estimate of the rollout policy from the reference: ``k1 = log p - log p_ref``,
    ``k3 = (r - 1) - log r`` with ``r = p_ref / p`` (non-negative, lower variance)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    log_ratio = ref_logps - logps
    return -log_ratio if estimator == "k1" else log_ratio.exp() - 1 - log_ratio


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Per row, the index of its last counted token (-1 for a row with none)."""
    T = mask.shape[1]
    idx = torch.arange(T, device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), idx, torch.full_like(idx, -1)).max(dim=1).values


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """``r_t = -kl_coef * kl_t`` on every counted token, plus the sequence's score on its last
    counted token (a row without counted tokens gets nothing)."""
    m = mask.to(scores.dtype)
    rewards = torch.zeros_like(m) if kl is None or kl_coef == 0 else -kl_coef * kl.to(scores.dtype) * m
    last = last_token_index(mask)
    has = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has]
    rewards[rows, last[has]] += scores[has]
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Generalised advantage estimation over each row's counted tokens:
    ``A_t = delta_t + gamma * lam * A_next``, ``delta_t = r_t + gamma * V_next - V_t``, where
    ``next`` is the row's next counted token (none after the last: ``V = A = 0``, the episode ends).
    Zero on tokens outside ``mask``."""
    B, T = rewards.shape
    keep = mask.bool()
    advantages = torch.zeros_like(rewards)
    running = rewards.new_zeros(B)
    next_value = rewards.new_zeros(B)
    for t in reversed(range(T)):
        step = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * running
        running = torch.where(keep[:, t], step, running)
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(keep[:, t], step, torch.zeros_like(step))
    return advantages


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       cliprange_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``0.5 * max((V - R)^2, (clip(V, V_old ± c) - R)^2)`` and whether the clipped term won."""
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped - returns) ** 2
    return 0.5 * torch.maximum(loss_unclipped, loss_clipped), loss_clipped > loss_unclipped


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       reduce: Reduce = _identity) -> float:
    """``1 - Var(R - V) / Var(R)`` over the counted tokens: how much of the returns the critic predicts."""
    m = mask.to(values.dtype)

    def var(x):
        mean = masked_mean(x, mask, reduce)
        return masked_mean((x - mean) ** 2, m, reduce)

    var_returns = var(returns)
    if float(var_returns) == 0.0:
        return float("nan")
    return float(1 - var(returns - values) / var_returns)
