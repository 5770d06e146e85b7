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
    def forward(ctx, anchor, run_backward, present: tuple[bool, ...], *tensors):
        ctx.run_backward, ctx.present = run_backward, present
        ctx.first_like = (tensors[0].shape, tensors[0].dtype, tensors[0].device)
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        grads = [g if here else None for g, here in zip(grads, ctx.present)]
        if all(g is None for g in grads):
            return (None,) * (3 + len(grads))
        if grads[0] is None:
            shape, dtype, device = ctx.first_like
            grads[0] = torch.zeros(shape, dtype=dtype, device=device)
        ctx.run_backward(*grads)
        return (None,) * (3 + len(grads))


def bridge(
    logps: torch.Tensor, entropies: torch.Tensor | None,
    run_backward: Callable[..., None],
    aux: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``logps`` (and ``entropies``, the MoE load-balancing loss ``aux``, a shared critic's
    ``values``) unchanged in value, but a backward through them calls ``run_backward(dLoss/dlogps,
    dLoss/dentropies, dLoss/daux, dLoss/dvalues)`` — None for what is absent or got no gradient.
    ``logps`` may be a critic's values (a value-only bridge)."""
    anchor = torch.zeros((), device=logps.device, requires_grad=True)
    given = (logps, entropies, aux, values)
    present = tuple(t is not None for t in given)
    inputs = [(t if t is not None else logps.new_zeros(0)).detach() for t in given]
    outputs = _Bridge.apply(anchor, run_backward, present, *inputs)
    return tuple(out if here else None for out, here in zip(outputs, present))
