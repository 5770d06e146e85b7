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
An entropy bonus goes the same way: the loss's gradient with respect to each entropy, ``h``, is
handed over too, and the engine's token loss becomes ``g · logp + h · entropy``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _Bridge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, logps, entropies, aux, run_backward, has_entropies: bool, has_aux: bool):
        ctx.run_backward, ctx.has_entropies, ctx.has_aux = run_backward, has_entropies, has_aux
        ctx.logps_like = (logps.shape, logps.dtype, logps.device)
        return logps.clone(), entropies.clone(), aux.clone()

    @staticmethod
    def backward(ctx, grad_logps, grad_entropies, grad_aux):
        grad_entropies = grad_entropies if ctx.has_entropies else None
        grad_aux = grad_aux if ctx.has_aux else None
        if grad_logps is None and grad_entropies is None and grad_aux is None:
            return (None,) * 7
        if grad_logps is None:
            shape, dtype, device = ctx.logps_like
            grad_logps = torch.zeros(shape, dtype=dtype, device=device)
        ctx.run_backward(grad_logps, grad_entropies, grad_aux)
        return (None,) * 7


def bridge(
    logps: torch.Tensor, entropies: torch.Tensor | None,
    run_backward: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], None],
    aux: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``logps`` (and ``entropies``, and the MoE load-balancing loss ``aux``) unchanged in value, but
    a backward through them calls ``run_backward(dLoss/dlogps, dLoss/dentropies or None,
    dLoss/daux or None)``."""
    anchor = torch.zeros((), device=logps.device, requires_grad=True)
    ent = entropies if entropies is not None else logps.new_zeros(0)
    aux_in = aux if aux is not None else logps.new_zeros(0)
    out_logps, out_ent, out_aux = _Bridge.apply(anchor, logps.detach(), ent.detach(), aux_in.detach(), run_backward,
                                                entropies is not None, aux is not None)
    return out_logps, (out_ent if entropies is not None else None), (out_aux if aux is not None else None)
