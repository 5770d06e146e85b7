"""The untreed computation the tree must reproduce: each sequence through the stock model.

This is the definition of "the same numbers" (DESIGN, "Exactness"): every sequence is run on its
own through the model's own attention, full logits, ``log_softmax`` in fp32. Tests, the demo and
the GPU check compare against it; it is deliberately naive.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._inputs import SequenceLike, normalize_score_from, normalize_sequences
from .model_parts import model_parts


def right_pad(seqs: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of a right-padded batch (pad id 0), as TRL's padded path runs it."""
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


def untreed_logprobs(
    model: torch.nn.Module,
    seqs: Sequence[SequenceLike],
    temperature: float = 1.0,
    return_entropy: bool = False,
    score_from: int | Sequence[int] | None = None,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Same contract as :func:`trl_tree.tree_logprobs`, one sequence at a time, no tree."""
    arrays, _ = normalize_sequences(seqs)
    first = normalize_score_from(score_from, [a.shape[0] for a in arrays])
    parts = model_parts(model)
    device = parts.device
    logps, entropies = [], []
    for arr, start in zip(arrays, first.tolist()):
        ids = torch.from_numpy(arr).to(device).unsqueeze(0)
        logits = parts.outer(input_ids=ids, use_cache=False).logits[0, start - 1 : -1].float() / temperature
        logprobs = torch.log_softmax(logits, dim=-1)
        logps.append(logprobs.gather(-1, ids[0, start:, None]).squeeze(-1))
        if return_entropy:
            entropies.append(-(logprobs.exp() * logprobs).sum(-1))
    return (logps, entropies) if return_entropy else logps


def untreed_backward(
    model: torch.nn.Module,
    seqs: Sequence[SequenceLike],
    token_loss,
    temperature: float = 1.0,
    score_from: int | Sequence[int] | None = None,
) -> float:
    """Same contract as :func:`trl_tree.tree_backward`, one sequence at a time, no tree."""
    logps = untreed_logprobs(model, seqs, temperature=temperature, score_from=score_from)
    firsts = normalize_score_from(score_from, [len(s) for s in seqs]).tolist()
    total = 0.0
    for i, (lp, first) in enumerate(zip(logps, firsts)):
        n = lp.shape[0]
        pos = torch.arange(first - 1, first - 1 + n, device=lp.device)
        seq_idx = torch.full((n,), i, dtype=torch.long, device=lp.device)
        loss = token_loss(lp, seq_idx, pos).sum()
        if loss.requires_grad:
            loss.backward()
        total += float(loss.detach())
    return total
