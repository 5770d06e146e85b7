"""The packed pass: one forward over a forest's unique tokens under tree attention.

Tree Training's tree packing: the U unique tokens in DFS pre-order, one row, tree attention, the
hidden states of the unique tokens. Autograd sums the branches' gradients into shared tokens by
itself, so the backward is an ordinary one and works under HF gradient checkpointing, DDP and PEFT.
Below the walk (``dfs/``), which runs its units through :func:`tree_forward`, and the CUDA graphs
(``graphs.py``), which capture it; above them the entry points (``engine.py``) choose among all three.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ._device import upload
from .attention import backends
from .attention.dispatch import install
from .attention.kept import KeptAttention
from .attention.metadata import TREE_KWARG, DenseCausalBatch, TreeAttentionMetadata, TreeCall
from .attention.partial import PARTIAL_KERNELS, dense_kernels
from .attention.support import attention_features
from .call_gate import before_model_call
from .cost_model import runs_padded
from .forest import PrefixForest
from .layout import LAYOUT
from .model_parts import ModelParts, activation_checkpointing, capture_last_hidden_state, rope_length_hint
from .router import record_router_logits

logger = logging.getLogger(__name__)


def check_loss_terms(terms: object, logp: torch.Tensor) -> None:
    """``token_loss`` must return one term per log-prob; anything else would be summed wrongly."""
    if not isinstance(terms, torch.Tensor) or terms.shape != logp.shape:
        raise ValueError(
            f"token_loss must return one loss term per log-prob (a tensor of shape {tuple(logp.shape)}), got "
            f"{tuple(terms.shape) if isinstance(terms, torch.Tensor) else type(terms).__name__}"
        )


TokenLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@contextmanager
def model_call(parts: ModelParts):
    """Around one call of the model: capture the backbone's final hidden state (yielded list), show a
    length-dependent RoPE the length it must use (``rope_length_hint``) and, with ``parts.router``
    set, record the router logits and hand them over with ``parts.router_weights`` (the call's
    unique tokens' multiplicities) after the call."""
    before_model_call(parts.outer)  # a gate (block-by-block gathering) lines the ranks' calls up first
    sink = [] if parts.router is not None else None
    with capture_last_hidden_state(parts.backbone) as captured, rope_length_hint(parts), \
            record_router_logits(parts.backbone, sink):
        yield captured
    if sink is not None:
        parts.router.on_forward(sink, parts.router_weights)


def _router_kwargs(parts: ModelParts) -> dict:
    """The model must not compute its own load-balancing loss (it would read the placeholder mask as
    its padding mask); the engine records the router logits itself."""
    return {"output_router_logits": False} if hasattr(parts.causal_lm.config.get_text_config(),
                                                      "output_router_logits") else {}


def _call_kwargs(parts: ModelParts) -> dict:
    """What every model call gets besides its inputs: no cache; no logits from a causal LM (the
    engine applies its heads itself; a value-only call goes to the backbone, which makes none)."""
    kwargs = {"use_cache": False, **_router_kwargs(parts)}
    if not parts.calls_backbone:
        kwargs["logits_to_keep"] = torch.zeros(0, dtype=torch.long, device=parts.device)
    return kwargs


def tree_forward(parts: ModelParts, input_ids: torch.Tensor, meta) -> torch.Tensor:
    """Final hidden states ``[n, H]`` of ``input_ids [1, n]`` (on the model's device) run as one packed
    row under tree metadata ``meta``.

    The outer module is called (DDP hooks, PEFT adapters run); no logits are requested; the hidden
    state comes from a hook on the backbone. Afterwards every layer must have attended through
    the tree dispatcher, else the model would have mixed branches and we refuse the result.
    """
    device = parts.device
    # a 4-D placeholder makes HF skip building its own O(n²) mask; tree attention ignores it
    placeholder_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    with model_call(parts) as captured:
        parts.outer(
            input_ids=input_ids,
            position_ids=meta.position_ids,
            attention_mask=placeholder_mask,
            **_call_kwargs(parts),
            **{TREE_KWARG: TreeCall(meta)},
        )
    _check_every_layer(parts, meta, captured)
    return captured[-1][0]


def _check_every_layer(parts: ModelParts, meta, captured: list) -> None:
    if meta.calls != parts.tree_calls or not captured:
        raise ValueError(
            f"{type(parts.causal_lm).__name__}: {meta.calls} of its {parts.tree_calls} attention layers and mixers "
            "ran through the tree (attention through transformers' AttentionInterface); the tree engine needs every "
            "one to (a model with hand-written or non-softmax attention would silently mix branches)"
        )


def keeps_attention(parts: ModelParts, backend: str, keep_attention: bool | None = None,
                    checkpointing: bool | None = None) -> bool:
    """Whether a packed call that builds a graph keeps its attention outputs for the recompute:
    asked to (``keep_attention``; None: ``LAYOUT.keep_attention``), the model recomputes its layers
    (checkpointing on, training mode — HF recomputes only then) and the backend's function can hand
    them back (the partial-kernel FlashAttention path). ``checkpointing``: :func:`checkpointing_on`'s
    answer where the caller has it already (it walks the model's modules)."""
    return torch.is_grad_enabled() and recomputes_kept_attention(parts, backend, keep_attention, checkpointing)


def recomputes_kept_attention(parts: ModelParts, backend: str, keep_attention: bool | None = None,
                               checkpointing: bool | None = None) -> bool:
    """:func:`keeps_attention` whatever the grad mode: the walk asks before its units enable grad
    (inside the Trainer, from autograd's backward, where grad is off)."""
    return (wants_kept_attention(keep_attention) and backend in PARTIAL_KERNELS
            and (checkpointing_on(parts) if checkpointing is None else checkpointing) and parts.causal_lm.training)


def wants_kept_attention(keep_attention: bool | None) -> bool:
    """The caller's ``keep_attention``, or the engine default ``LAYOUT.keep_attention`` for None."""
    return LAYOUT.keep_attention if keep_attention is None else keep_attention


def dense_blocks(parts: ModelParts, backend: str, graphed: bool = False) -> bool:
    """Whether a split's single-segment blocks run on a dense kernel (cuDNN) for this model here
    (``graphed``: in a call replayed from a CUDA graph, where cuDNN serves smaller heads too)."""
    return dense_kernels(backend, parts.device, parts.compute_dtype, parts.head_dim, graphed=graphed) is not None


@dataclass(frozen=True)
class PaddedBatch:
    """A forest as a right-padded ``(B, L)`` batch: ``tokens`` ``[B·L]`` (sequences in input order,
    padded with token 0 after their end) and ``rows`` ``[U]``, the flat row of each unique token's
    first occurrence, or None where row ``r`` is unique token ``r`` (B sequences of one length that
    share nothing: the packed layout is the batch itself)."""

    length: int
    tokens: np.ndarray
    rows: np.ndarray | None


def takes_padded_path(forest: PrefixForest, router: bool = False) -> bool:
    """Whether a packed call of ``forest`` takes the padded path: the cost model's rule
    (``cost_model.runs_padded``; a MoE router's loss keeps calls packed) under the layout switch
    (``LAYOUT.dense_unshared_batches``) — what the engine does and what the trainers log."""
    return LAYOUT.dense_unshared_batches and runs_padded(forest, router=router)


def runs_as_padded_batch(parts: ModelParts, forest: PrefixForest) -> bool:
    """:func:`takes_padded_path` for a call of the model behind ``parts``."""
    return takes_padded_path(forest, router=parts.router is not None)


def padded_batch(parts: ModelParts, forest: PrefixForest) -> PaddedBatch | None:
    """The forest as the padded batch stock would run, where the cost model says that is the cheaper
    exact path (``cost_model.runs_padded``), else None.

    Exact: right padding sits after every real token, so under causal attention no real token sees a
    pad, and each token keeps its true position; a token shared by several sequences has the same
    hidden state in each (the same causal prefix), so reading its first occurrence is the tree's
    value, and autograd's gradient through that one occurrence is the tree's gradient."""
    if not runs_as_padded_batch(parts, forest):
        return None
    global _PADDED_ANNOUNCED
    if not _PADDED_ANNOUNCED:
        _PADDED_ANNOUNCED = True
        logger.info("trl_tree: a call with little to share (%d sequences x %d tokens padded, %d unique tokens) runs "
                    "as a padded batch, as stock does (cost_model.runs_padded; said once)", forest.num_sequences,
                    forest.max_depth, forest.num_unique_tokens)
    length, lengths = forest.max_depth, forest.seq_lengths
    if forest.num_unique_tokens == forest.num_tokens == forest.num_sequences * length \
            and forest.num_nodes == forest.num_sequences:
        return PaddedBatch(length, forest.tokens, None)
    flat = (np.repeat(np.arange(forest.num_sequences, dtype=np.int64) * length, lengths)
            + np.arange(forest.num_tokens, dtype=np.int64) - np.repeat(forest.seq_offsets[:-1], lengths))
    tokens = np.zeros(forest.num_sequences * length, dtype=np.int64)
    tokens[flat] = forest.tokens[forest.seq_packed_index]
    rows = np.empty(forest.num_unique_tokens, dtype=np.int64)
    rows[forest.seq_packed_index[::-1]] = flat[::-1]  # the last write wins: each token's first occurrence
    return PaddedBatch(length, tokens, rows)


#: the padded path was announced (logged once per process)
_PADDED_ANNOUNCED = False


def _padded_hidden_states(parts: ModelParts, batch: PaddedBatch, tokens: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """The padded batch through the model's own causal attention; the dispatcher still applies the
    tree's refusals and the every-layer check, so a model behaves the same on any batch. ``tokens``:
    the forest's tokens already on the device (used where the batch is the packed layout itself)."""
    if batch.rows is None and tokens is not None:
        input_ids, rows = tokens, None
    else:
        input_ids, *rest = upload([batch.tokens] + ([batch.rows] if batch.rows is not None else []), torch.int64,
                                  parts.device)
        rows = rest[0] if rest else None
    meta = DenseCausalBatch(max_depth=batch.length)
    with model_call(parts) as captured:
        parts.outer(input_ids=input_ids.view(-1, batch.length), **_call_kwargs(parts),
                    **{TREE_KWARG: TreeCall(meta)})
    _check_every_layer(parts, meta, captured)
    hidden = captured[-1].reshape(-1, captured[-1].shape[-1])
    return hidden if rows is None else hidden.index_select(0, rows)


def packed_hidden_states(parts: ModelParts, forest: PrefixForest, attn_backend: str = "auto",
                         tokens: torch.Tensor | None = None, keep_attention: bool | None = None,
                         meta: TreeAttentionMetadata | None = None, checkpointing: bool | None = None
                         ) -> torch.Tensor:
    """Final hidden states ``[U, H]`` of the forest's unique tokens from one packed forward
    (``tokens``: ``forest.tokens`` already on the device, else uploaded here; ``keep_attention``:
    see :func:`keeps_attention`; ``meta``: the forest's metadata if already built;
    ``checkpointing``: :func:`checkpointing_on`'s answer if the caller has it)."""
    backend = (meta.backend if meta is not None else  # resolved when it was built (a graphed call's choice)
               backends.resolve_backend(attn_backend, parts.device, parts.compute_dtype,  # validates the request too
                               hidden_size=parts.hidden_size, **attention_features(parts.causal_lm.config)))
    install(parts.causal_lm.config._attn_implementation)
    batch = padded_batch(parts, forest)
    if batch is not None:  # little to share: stock's padded batch is the cheaper exact path
        return _padded_hidden_states(parts, batch, tokens)
    if tokens is None:
        (tokens,) = upload([forest.tokens], torch.int64, parts.device)
    if meta is None:
        meta = tree_metadata(parts, forest, backend)
    if keeps_attention(parts, backend, keep_attention, checkpointing):
        meta.kept = KeptAttention(parts.tree_calls)
    return tree_forward(parts, tokens.unsqueeze(0), meta)


def tree_metadata(parts: ModelParts, forest: PrefixForest, backend: str, graphed: bool = False,
                  rechoose: TreeAttentionMetadata | None = None) -> TreeAttentionMetadata:
    """The forest's packed-layout metadata on the model's device, with the engine's layout choices
    (``graphed``: those of a call replayed from a CUDA graph, see :func:`dense_blocks`; an eager
    call takes cuDNN only for dense shapes it has seen before, ``partial.dense_shape_seen``).
    ``rechoose``: this forest's metadata already uploaded (with other choices): share its arrays."""
    config = parts.causal_lm.config
    dense_key = None if graphed else (parts.head_dim, str(parts.compute_dtype),
                                      getattr(config, "num_attention_heads", None),
                                      getattr(config, "num_key_value_heads", None))
    choices = dict(root_split=LAYOUT.root_split, dense=dense_blocks(parts, backend, graphed), dense_key=dense_key)
    if rechoose is not None:
        return rechoose.rechosen(forest, **choices)
    return TreeAttentionMetadata.from_forest(forest, parts.device, backend, **choices)


def checkpointing_on(parts: ModelParts) -> bool:
    """Whether the model recomputes its layers in backward (HF activation checkpointing)."""
    return activation_checkpointing(parts.causal_lm)


def call_token_loss(token_loss: Callable, logp: torch.Tensor | None, ent: torch.Tensor | None,
                    values: torch.Tensor | None, seq_idx: torch.Tensor, pos: torch.Tensor, with_entropy: bool,
                    scores_logps: bool = True, extra: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """A loss's terms by the engine's calling convention: the scored quantity first (log-probs, or
    the values of a value-only call), then ``seq_idx``, ``pos``, the entropies with
    ``with_entropy``, ``values=`` where values are read beside the log-probs, and the head's
    by-products ``extra`` (``tree_backward(head_outputs=...)``) as keywords; checked to be one
    term each."""
    if not scores_logps:
        terms = token_loss(values, seq_idx, pos)
        check_loss_terms(terms, values)
        return terms
    args = (logp, seq_idx, pos, ent) if with_entropy else (logp, seq_idx, pos)
    keywords = dict(extra or {})
    if values is not None:
        keywords["values"] = values
    terms = token_loss(*args, **keywords)
    check_loss_terms(terms, logp)
    return terms
