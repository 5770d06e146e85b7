"""Hand the gradient of TRL's loss with respect to the log-probs to the tree engine's backward.

The depth-first walk (and a packed micro-batch cut into several calls under a token budget) cannot
keep one autograd graph from the parameters to the loss: its memory bound comes from running each
piece's backward before the next piece's forward. So the trainer runs in two passes:

1. a forward-only pass gives every log-prob; TRL's own loss code runs on them as if they were the
   model's output, through :class:`_Bridge`, whose output requires grad;
2. when the Trainer calls ``backward`` on that loss, autograd reaches :class:`_Bridge` with
   ``g = dLoss/dlogp`` for every (row, completion token) — the per-token weights, now all known —
   and the bridge runs ``tree_backward`` with ``token_loss = g * logp``.

By the chain rule the parameters receive exactly ``dLoss/dθ = Σ g · dlogp/dθ``, whatever the loss
type (token- or sequence-level ratios, clipping, KL to the reference, VESPO's weights...): TRL's
loss code is reused unchanged, and the Trainer's gradient-accumulation scaling, AMP loss scaling and
``training_step``'s detached loss all pass through ``g``. The price is one extra forward-only pass.
Gradients with respect to the entropies cannot be routed this way (the engine's token loss sees
log-probs only), so an entropy bonus is refused up front and a non-zero entropy gradient here is an
error, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _Bridge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, logps, entropies, run_backward):
        ctx.run_backward = run_backward
        return logps.clone(), entropies.clone()

    @staticmethod
    def backward(ctx, grad_logps, grad_entropies):
        if grad_entropies is not None and bool(grad_entropies.ne(0).any()):
            raise RuntimeError(
                "the loss depends on the entropies' gradient (an entropy bonus), which the tree's two-pass "
                "backward cannot route; use tree_mode='packed' without tree_token_budget"
            )
        if grad_logps is not None:
            ctx.run_backward(grad_logps)
        return None, None, None, None


def bridge(
    logps: torch.Tensor, entropies: torch.Tensor | None, run_backward: Callable[[torch.Tensor], None]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logps`` (and ``entropies``) unchanged in value, but a backward through them calls
    ``run_backward(dLoss/dlogps)``."""
    anchor = torch.zeros((), device=logps.device, requires_grad=True)
    ent = entropies if entropies is not None else logps.new_zeros(())
    out_logps, out_ent = _Bridge.apply(anchor, logps.detach(), ent.detach(), run_backward)
    return out_logps, (out_ent if entropies is not None else None)
