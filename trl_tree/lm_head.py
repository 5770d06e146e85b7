"""Score each unique prediction once with TRL's chunked fused log-prob head.

A prediction is (source hidden state, next token). In the forest every unique token except a
root's first is predicted exactly once, from the token before it on its path; a fork token's
hidden state is gathered once per child (never re-run through the layer stack). TRL's
``ChunkedLogProbFunction`` projects through the LM head in vocabulary tiles, so the
``[P, vocab]`` logits are never materialised, forward or backward.
"""

from __future__ import annotations

import torch
from trl.kernels import ChunkedLogProbFunction

from .model_parts import ModelParts

#: vocabulary tile of the fused head (TRL's own default)
VOCAB_CHUNK_SIZE = 32768


def score_predictions(
    hidden: torch.Tensor,
    parts: ModelParts,
    pred_src: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    head_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of ``targets`` under the LM head applied to ``hidden[pred_src]``.

    ``hidden`` is ``[U, H]``; returns ``[P]`` float32 tensors. ``head_grad=False`` treats the head's
    weight and bias as constants: the backward then only reaches ``hidden`` and skips TRL's
    full-size fp32 weight-gradient buffer (the depth-first walk defers that gradient to one call).
    """
    weight = parts.lm_head.weight
    bias = getattr(parts.lm_head, "bias", None)
    if not head_grad:
        weight = weight.detach()
        bias = bias.detach() if bias is not None else None
    if pred_src.numel() == 0:
        # nothing to score (single-token sequences): an empty result still connected to the model, so
        # a backward leaves zero gradients where autograd on the untreed path leaves them too
        anchor = hidden.sum() + weight.sum() + (bias.sum() if bias is not None else 0)
        empty = hidden.new_zeros(0, dtype=torch.float32) + anchor.float() * 0
        return empty, (empty.detach() if with_entropy else None)
    src = hidden.index_select(0, pred_src).to(weight.device)
    if parts.head_fp32:  # TRL's cast_lm_head_to_fp32: fp32 hidden states and head, autocast off
        with torch.autocast(src.device.type, enabled=False):
            return _apply(src.float(), weight.float(), bias.float() if bias is not None else None, parts, targets,
                          temperature, with_entropy)
    return _apply(src, weight, bias, parts, targets, temperature, with_entropy)


def _apply(src, weight, bias, parts: ModelParts, targets, temperature: float, with_entropy: bool):
    out = ChunkedLogProbFunction.apply(
        src,
        weight,
        bias,
        targets,
        temperature,
        VOCAB_CHUNK_SIZE,
        parts.final_logit_softcapping,
        parts.logit_scale,
        ("entropy",) if with_entropy else (),
    )
    return out[0], (out[1] if with_entropy else None)
