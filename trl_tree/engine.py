"""Public entry points: ``tree_logprobs`` and ``tree_backward`` over a prefix forest.

``mode="packed"`` (Tree Training's tree packing): one forward over the U unique tokens in DFS
pre-order, tree attention, the LM head on the unique predictions only, then a gather back to every
(sequence, position). Autograd sums the branches' gradients into shared tokens by itself, so the
backward is an ordinary one and works under HF gradient checkpointing, DDP and PEFT.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ._inputs import SequenceLike
from .attention.backends import resolve_backend
from .attention.dispatch import install
from .attention.metadata import TREE_KWARG, TreeAttentionMetadata
from .forest import PrefixForest, ScoringPlan
from .lm_head import score_predictions
from .model_parts import ModelParts, capture_last_hidden_state, model_parts

MODES = ("packed", "dfs")

TokenLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _check_mode(mode: str) -> None:
    if mode == "dfs":
        raise NotImplementedError(
            "mode='dfs' (the depth-first walk with a K/V stack) is not available yet; use mode='packed'"
        )
    if mode != "packed":
        raise ValueError(f"unknown mode {mode!r}; choose 'packed'")


def _check_temperature(temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and temperature > 0 and temperature != float("inf")):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")


def prepare(model: torch.nn.Module, seqs: Sequence[SequenceLike] | PrefixForest) -> tuple[ModelParts, PrefixForest]:
    """Validate the model and the sequences against each other; build the forest."""
    parts = model_parts(model)
    forest = seqs if isinstance(seqs, PrefixForest) else PrefixForest.from_sequences(seqs)
    lo, hi = int(forest.tokens.min()), int(forest.tokens.max())
    if lo < 0 or hi >= parts.vocab_size:
        bad = lo if lo < 0 else hi
        seq = next(i for i in range(forest.num_sequences) if bad in forest.sequence(i))
        raise ValueError(
            f"sequence {seq} holds token id {bad}, outside the model's vocabulary [0, {parts.vocab_size})"
        )
    if parts.max_positions is not None and forest.max_depth > parts.max_positions:
        seq = int(forest.seq_lengths.argmax())
        raise ValueError(
            f"sequence {seq} has {forest.max_depth} tokens, more than the model's max_position_embeddings "
            f"({parts.max_positions})"
        )
    return parts, forest


def packed_hidden_states(
    parts: ModelParts, forest: PrefixForest, attn_backend: str = "auto"
) -> torch.Tensor:
    """Final hidden states ``[U, H]`` of the forest's unique tokens from one packed forward."""
    device = parts.device
    backend = resolve_backend(attn_backend, device, parts.compute_dtype)
    install(parts.causal_lm.config._attn_implementation)
    meta = TreeAttentionMetadata.from_forest(forest, device, backend)
    input_ids = torch.from_numpy(forest.tokens).to(device).unsqueeze(0)
    # a 4-D placeholder makes HF skip building its own O(U²) mask; tree attention ignores it
    placeholder_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    with capture_last_hidden_state(parts.backbone) as captured:
        parts.outer(
            input_ids=input_ids,
            position_ids=meta.position_ids,
            attention_mask=placeholder_mask,
            use_cache=False,
            logits_to_keep=torch.zeros(0, dtype=torch.long, device=device),
            **{TREE_KWARG: meta},
        )
    if meta.calls != parts.num_layers or not captured:
        raise ValueError(
            f"{type(parts.causal_lm).__name__}: {meta.calls} of its {parts.num_layers} layers ran their attention "
            "through transformers' AttentionInterface; the tree engine needs every layer to (a model with "
            "hand-written or non-softmax attention would silently mix branches)"
        )
    return captured[-1][0]


def _score(
    parts: ModelParts,
    forest: PrefixForest,
    plan: ScoringPlan,
    attn_backend: str,
    temperature: float,
    return_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-term log-probs (and entropies), flat in sequence order (``plan.gather`` order)."""
    hidden = packed_hidden_states(parts, forest, attn_backend)
    device = hidden.device
    pred_src = torch.from_numpy(plan.pred_src).to(device)
    targets = torch.from_numpy(forest.tokens[plan.pred_dst]).to(device)
    logp, ent = score_predictions(hidden, parts, pred_src, targets, temperature, return_entropy)
    gather = torch.from_numpy(plan.gather).to(device)
    return logp.index_select(0, gather), (ent.index_select(0, gather) if ent is not None else None)


def tree_logprobs(
    model: torch.nn.Module,
    seqs: Sequence[SequenceLike] | PrefixForest,
    mode: str = "packed",
    attn_backend: str = "auto",
    temperature: float = 1.0,
    return_entropy: bool = False,
    score_from: int | Sequence[int] | None = None,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-token log-probs of every sequence, computing each shared token once.

    ``logps[i][j] = log p(seqs[i][j + 1] | seqs[i][: j + 1])`` (logits divided by ``temperature``),
    ``len(logps[i]) == len(seqs[i]) - 1``. With ``score_from`` (an int or one per sequence) only
    tokens ``seqs[i][score_from[i]:]`` are scored — e.g. the completion after a prompt — and
    ``logps[i]`` has ``len(seqs[i]) - score_from[i]`` entries. Differentiable in ``"packed"`` mode.
    ``return_entropy=True`` also returns the entropy of each scored position's distribution.
    """
    _check_mode(mode)
    _check_temperature(temperature)
    parts, forest = prepare(model, seqs)
    plan = forest.scoring_plan(score_from)
    logp, ent = _score(parts, forest, plan, attn_backend, temperature, return_entropy)
    counts = plan.counts.tolist()
    logps = list(logp.split(counts))
    if return_entropy:
        return logps, list(ent.split(counts))
    return logps


def tree_backward(
    model: torch.nn.Module,
    seqs: Sequence[SequenceLike] | PrefixForest,
    token_loss: TokenLoss,
    mode: str = "packed",
    attn_backend: str = "auto",
    temperature: float = 1.0,
    score_from: int | Sequence[int] | None = None,
) -> float:
    """Back-propagate ``sum_i sum_j token_loss(logps[i][j], i, j)`` through the tree.

    ``token_loss(logps [n], seq_idx [n], pos [n]) -> [n]`` is called once on all scored terms
    (``pos`` is the prediction index ``j`` of ``tree_logprobs``). Afterwards every parameter's
    ``.grad`` holds (accumulated onto what was there) exactly what autograd leaves for that sum
    computed sequence by sequence without a tree. Returns the loss value.
    """
    _check_mode(mode)
    _check_temperature(temperature)
    if not callable(token_loss):
        raise TypeError(f"token_loss must be callable, got {type(token_loss).__name__}")
    parts, forest = prepare(model, seqs)
    plan = forest.scoring_plan(score_from)
    with torch.enable_grad():
        logp, _ = _score(parts, forest, plan, attn_backend, temperature, False)
        device = logp.device
        seq_idx = torch.from_numpy(plan.seq_idx).to(device)
        pos = torch.from_numpy(plan.pos).to(device)
        terms = token_loss(logp, seq_idx, pos)
        if not isinstance(terms, torch.Tensor) or terms.shape != logp.shape:
            raise ValueError(
                f"token_loss must return one loss term per log-prob (a tensor of shape {tuple(logp.shape)}), got "
                f"{tuple(terms.shape) if isinstance(terms, torch.Tensor) else type(terms).__name__}"
            )
        loss = terms.sum()
        if loss.requires_grad:
            loss.backward()
    return float(loss.detach())
