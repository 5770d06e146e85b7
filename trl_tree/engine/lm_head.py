"""Score each unique prediction once with TRL's chunked fused log-prob head (and a value head).

A prediction is (source hidden state, next token). In the forest every unique token except a
root's first is predicted exactly once, from the token before it on its path; a fork token's
hidden state is gathered once per child (never re-run through the layer stack). TRL's
``ChunkedLogProbFunction`` projects through the LM head in vocabulary tiles, so the
``[P, vocab]`` logits are never materialised, forward or backward.
"""

from __future__ import annotations

import torch
from trl.kernels import ChunkedLogProbFunction
from trl.kernels.chunked_logprob import OPTIONAL_OUTPUTS

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
        for name, kept in parts.head_outputs.items():
            kept.append(torch.zeros(0, dtype=torch.bool if name == "is_top1" else torch.float32, device=hidden.device))
        # nothing to score (single-token sequences): an empty result still connected to the model, so
        # a backward leaves zero gradients where autograd on the untreed path leaves them too
        anchor = hidden.sum() + weight.sum() + (bias.sum() if bias is not None else 0)
        empty = hidden.new_zeros(0, dtype=torch.float32) + anchor.float() * 0
        return empty, (empty.clone() if with_entropy else None)  # both connected: a backward may take either
    src = hidden.index_select(0, pred_src).to(weight.device)
    if parts.head_fp32:  # TRL's cast_lm_head_to_fp32: fp32 hidden states and head, autocast off
        with torch.autocast(src.device.type, enabled=False):
            weight, bias = weight.float(), bias.float() if bias is not None else None
            _zero3_status(parts.lm_head, weight, bias)
            return _apply(src.float(), weight, bias, parts, targets, temperature, with_entropy)
    _zero3_status(parts.lm_head, weight, bias)
    return _apply(src, weight, bias, parts, targets, temperature, with_entropy)


def _zero3_status(head: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Under DeepSpeed ZeRO-3, TRL's kernel asks each tensor it was handed for its ZeRO-3 status in
    its backward (``maybe_gather_lm_head_ctx`` reads ``ds_status``), which a detached or cast copy
    of the head's parameter lacks: the copy says what its parameter says (whole, where the trainers
    hold the model whole for their tree calls, so the kernel gathers nothing)."""
    for tensor, param in ((weight, head.weight), (bias, getattr(head, "bias", None))):
        if tensor is not None and tensor is not param and hasattr(param, "ds_status"):
            tensor.ds_status = param.ds_status


def score_values(hidden: torch.Tensor, value_head: torch.nn.Module, pred_src: torch.Tensor) -> torch.Tensor:
    """``[P]`` float32 values of ``value_head`` read at ``hidden[pred_src]``: a critic's V(s) for the
    state before each scored token — the same source positions the log-probs are predicted from."""
    src = hidden.index_select(0, pred_src)
    weight = next(value_head.parameters(), None)
    if weight is not None and weight.device != src.device:
        src = src.to(weight.device)
    out = value_head(src)
    if out.dim() == 2 and out.shape[-1] == 1:
        out = out.squeeze(-1)
    if out.shape != (src.shape[0],):
        raise ValueError(f"the value head must map hidden states [n, H] to one value each ([n] or [n, 1]), got "
                         f"{tuple(out.shape)} for n={src.shape[0]}")
    return out.float()


def score_rows(
    hidden: torch.Tensor,
    parts: ModelParts,
    pred_src: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    head_grad: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(logps, entropies, values)`` at the predictions ``pred_src``: the LM head's (unless the call
    scores values only, ``parts.scores_logps`` False: then None, None) and ``parts.value_head``'s
    (None without one). ``head_grad`` as in :func:`score_predictions` (the LM head only)."""
    values = score_values(hidden, parts.value_head, pred_src) if parts.value_head is not None else None
    if not parts.scores_logps:
        return None, None, values
    logp, ent = score_predictions(hidden, parts, pred_src, targets, temperature, with_entropy, head_grad)
    return logp, ent, values


def _apply(src, weight, bias, parts: ModelParts, targets, temperature: float, with_entropy: bool):
    # the entropy may be asked twice: differentiable (with_entropy) and as a by-product (a constant)
    outputs = tuple(dict.fromkeys((("entropy",) if with_entropy else ()) + tuple(parts.head_outputs)))
    out = ChunkedLogProbFunction.apply(
        src,
        weight,
        bias,
        targets,
        temperature,
        VOCAB_CHUNK_SIZE,
        parts.final_logit_softcapping,
        parts.logit_scale,
        outputs,
    )
    for name, kept in parts.head_outputs.items():  # the head's by-products, kept for the caller
        kept.append(out[1 + OPTIONAL_OUTPUTS.index(name)].detach())
    return out[0], (out[1] if with_entropy else None)
