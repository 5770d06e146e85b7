"""Activation-memory model of the engine's calls: ``mode="auto"`` and the depth-first walk's groups.

Analytic, from the model's config (documented in docs/architecture.md, "Choosing the mode" and
"How large a dfs group is"), checked against GPU measurements (docs/benchmarks):

- per token and layer, a decoder layer keeps ``(8·hidden + 4·intermediate + 4·kv_heads·head_dim)``
  values for its backward (norm inputs, q/k/v, attention output, MLP gate/up/act/down inputs),
  and its backward briefly adds ``3·intermediate`` gradient temporaries (down-projection input,
  gate and up); under gradient checkpointing only the layer input (``hidden`` values) is kept per
  layer, plus one layer's full activations and temporaries while it is recomputed; a packed call
  that keeps its attention outputs for the recompute (``attention/kept.py``) also keeps, per token
  and layer, the attention output (``heads·head_dim`` values) and its fp32 log-sum-exp (``heads``);
- the LM head (TRL's chunked log-prob kernel) holds one ``[min(rows, 4096), 32768]`` logit tile, the
  gathered hidden rows and their fp32 gradient; where it differentiates the weight, a full-size
  fp32 weight-gradient buffer and its cast — a fixed cost that on small models with large
  vocabularies can outweigh a sequence's activations;
- the depth-first walk's stack holds, per slot, every layer's K and V (model dtype); pushed slots
  also their fp32 gradients and, with ``keep_graph``, the kept layer inputs;
- a forward without graph (``tree_logprobs``) holds only one layer's live tensors at a time
  (``3·intermediate + 3·hidden`` values per token: the MLP's activation, up projection and their
  product, the residual stream), the head's tile and the stack.

Three uses. ``runs_padded``: where the tree would save less than it costs (little sharing and
little padding), a packed call runs as the padded batch stock runs. ``choose_mode`` (``mode="auto"``): packed whenever its activations fit the memory budget,
else dfs with the largest chunk that fits; measured, packed was faster than dfs wherever it fit
(docs/benchmarks), so time does not enter. ``GroupBudget``: how many tokens
of small sibling subtrees the walk may run in one call at a given stack depth, so that a unit
stays within the memory of one forward+backward of the longest single sequence, or a small
fixed share of the GPU where that is larger (``WALK_UNIT_FLOOR_SHARE``), or a given budget. Fewer,
larger calls are what makes the launch-bound walk fast on small models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .forest import PrefixForest, ScoringPlan
from .model_parts import head_dim_of, intermediate_size_of, kv_heads_of

#: A forest runs as a right-padded ``(B, L)`` batch through the model's own dense attention — what
#: stock's padded batch computes, none of the tree's varlen attention, gathers and index uploads —
#: when that batch holds at most this many times the forest's unique tokens: there sharing and
#: padding save less than the tree's own overheads cost (measured: docs/benchmarks/README.md,
#: "Where nothing is shared"). 1.0 would take only batches with nothing to save.
PADDED_BATCH_MAX_RATIO = 1.025

#: chunk sizes tried for dfs, largest first
CHUNK_CANDIDATES = (16384, 8192, 4096, 2048, 1024, 512, 256)
#: TRL's chunked log-prob kernel: rows per projection tile (``TOKEN_CHUNK_SIZE``) and our vocabulary tile
HEAD_ROW_TILE = 4096
HEAD_VOCAB_TILE = 32768


#: The walk's units may take at least this share of the GPU's memory (``walk_unit_floor``), even where
#: one forward+backward of the longest sequence is less: sized by that bound alone, short sequences
#: on a large card make many small units whose launches, not their FLOPs, set the step's time
#: (docs/benchmarks/notes.md §32). The bound stays independent of the tree's size, which is what
#: the walk is for; where the longest sequence needs more, its bound rules as before.
WALK_UNIT_FLOOR_SHARE = 0.05


def walk_unit_floor(device: torch.device) -> int | None:
    """Bytes a walk's unit may use whatever the longest sequence (``WALK_UNIT_FLOOR_SHARE`` of a
    CUDA device's memory); None elsewhere (the CPU walks the bound of the longest sequence)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory * WALK_UNIT_FLOOR_SHARE)


def runs_padded(forest: PrefixForest, router: bool = False) -> bool:
    """The no-sharing rule, the one place it is decided: whether a packed call of ``forest`` runs as
    a right-padded ``(B, L)`` batch (``packed.padded_batch``) instead of the tree. ``router``: the
    model has an MoE router, whose load-balancing loss would count the padding; such calls stay
    packed."""
    if router:
        return False
    padded = forest.num_sequences * forest.max_depth
    return padded <= PADDED_BATCH_MAX_RATIO * forest.num_unique_tokens


@dataclass(frozen=True)
class ModeChoice:
    mode: str
    chunk_size: int | None
    estimated_bytes: int


@dataclass(frozen=True)
class ActivationModel:
    """Bytes one call of the engine holds for the backward, by kind (see the module docstring)."""

    kept_per_token: int  # through the whole layer stack, alive until the backward
    transient_per_token: int  # one layer's recompute under checkpointing (0 without)
    kv_per_token: int  # K and V of every layer in the walk's stack
    kv_grad_per_token: int  # their fp32 gradient slots (pushed nodes only)
    forward_per_token: int  # one layer's live tensors in a forward without graph (MLP act, up, product; residuals)
    hidden_size: int
    vocab_size: int
    dtype_bytes: int

    @classmethod
    def of(cls, config, gradient_checkpointing: bool, dtype_bytes: int = 2,
           keep_attention: bool = False) -> "ActivationModel":
        h = config.hidden_size
        head_dim = head_dim_of(config)
        kv = kv_heads_of(config) * head_dim
        layers = config.num_hidden_layers
        layer_saved = (8 * h + 4 * intermediate_size_of(config) + 4 * kv) * dtype_bytes
        backward_temporaries = 3 * intermediate_size_of(config) * dtype_bytes
        if gradient_checkpointing:
            kept, transient = layers * h * dtype_bytes, layer_saved + backward_temporaries
            if keep_attention:
                heads = config.num_attention_heads
                kept += layers * heads * (head_dim * dtype_bytes + 4)
        else:
            kept, transient = layers * layer_saved, backward_temporaries
        forward = (3 * intermediate_size_of(config) + 3 * h) * dtype_bytes
        return cls(kept, transient, layers * 2 * kv * dtype_bytes, layers * 2 * kv * 4, forward, h,
                   config.vocab_size, dtype_bytes)

    def head(self, rows: int, weight_grad: bool) -> int:
        """One LM-head call over ``rows`` predictions, forward and backward."""
        tile = min(rows, HEAD_ROW_TILE) * min(self.vocab_size, HEAD_VOCAB_TILE) * self.dtype_bytes
        per_row = self.hidden_size * (2 * self.dtype_bytes + 4)  # gathered rows, fp32 gradient, its cast
        weight = self.vocab_size * self.hidden_size * (4 + self.dtype_bytes) if weight_grad else 0
        return tile + rows * per_row + weight

    def call(self, tokens: int, head_rows: int, weight_grad: bool) -> int:
        """One forward+backward over ``tokens`` scoring ``head_rows`` predictions: the kept
        activations, then the larger of a layer's recompute and the head (they never overlap)."""
        return tokens * self.kept_per_token + max(tokens * self.transient_per_token, self.head(head_rows, weight_grad))

    def single_sequence(self, length: int, scored: int | None = None) -> int:
        """The untreed reference: one sequence's forward+backward, its head differentiating the
        weight over its ``scored`` predictions (TRL's head scores the completion only)."""
        return self.call(length, length if scored is None else scored, True)

    def stack(self, slots: int, pushed_slots: int, keep_graph: bool) -> int:
        kept = self.kept_per_token if keep_graph else 0
        return slots * self.kv_per_token + pushed_slots * (self.kv_grad_per_token + kept)

    def forward_unit(self, tokens: int, depth: int) -> int:
        """A forward-only group (``tree_logprobs``): nothing kept for a backward — the stack's K/V,
        one layer's activations and the head's logit tile at a time."""
        return tokens * self.forward_per_token + self.head(tokens, False) + (depth + tokens) * self.kv_per_token

    def unit(self, tokens: int, depth: int, keep_graph: bool) -> int:
        """A dfs group of ``tokens`` below a pushed prefix of ``depth`` tokens (the head's weight
        gradient is deferred to after the walk, so units never hold it)."""
        return self.call(tokens, tokens, False) + self.stack(depth + tokens, depth, keep_graph)


def estimate_bytes(config, tokens: int, gradient_checkpointing: bool, stack_slots: int = 0,
                   keep_attention: bool = False, head_rows: int | None = None) -> int:
    """Activation bytes of one forward+backward over ``tokens`` scoring ``head_rows`` predictions
    (default: one per token) with the LM head's weight gradient — what :meth:`ActivationModel.call`
    counts for the untreed step and the walk too, so that the modes compare — plus a K/V stack of
    ``stack_slots`` with gradients; ``keep_attention``: a packed call keeping its attention outputs
    for the recompute. (The head was once left out here alone: at 1.5B that made a packed call
    read ~1.3 GiB lighter than the walk over the same rows.)"""
    m = ActivationModel.of(config, gradient_checkpointing, keep_attention=keep_attention)
    rows = tokens if head_rows is None else head_rows
    return m.call(tokens, rows, True) + m.stack(stack_slots, stack_slots, False)


def choose_mode(forest: PrefixForest, config, memory_budget: int, gradient_checkpointing: bool,
                keep_attention: bool = False) -> ModeChoice:
    """Packed if its activations fit ``memory_budget`` bytes, else dfs with the largest fitting chunk
    (``keep_attention``: packed keeps its attention outputs for the recompute, ``attention/kept.py``;
    counted only under gradient checkpointing, where there is a recompute)."""
    packed = estimate_bytes(config, forest.num_unique_tokens, gradient_checkpointing, keep_attention=keep_attention)
    if packed <= memory_budget:
        return ModeChoice("packed", None, packed)
    best = None
    for chunk in CHUNK_CANDIDATES:
        chunk = min(chunk, forest.max_depth)
        need = estimate_bytes(config, chunk, gradient_checkpointing, stack_slots=forest.max_depth + chunk)
        best = ModeChoice("dfs", chunk, need)
        if need <= memory_budget:
            return best
    return best  # the smallest chunk: the closest to the budget dfs can get


class GroupBudget:
    """Tokens of complete sibling subtrees one dfs call may take at a given stack depth.

    The largest ``n`` whose unit estimate (``ActivationModel.unit``) fits ``reference`` bytes —
    by default one forward+backward of the longest sequence (DESIGN's memory bound for the walk)
    or ``unit_floor`` bytes where that is more, or a caller's memory budget. Never below ``floor`` (the longest node, which the walk runs in one
    call anyway unless a ``chunk_size`` cuts it): the grouping only ever merges calls.
    """

    def __init__(self, model: ActivationModel, reference: int, keep_graph: bool, floor: int,
                 forward_only: bool = False, kept_model: ActivationModel | None = None) -> None:
        self.model, self.reference, self.keep_graph, self.floor = model, reference, keep_graph, floor
        self.forward_only = forward_only
        #: the same model with every layer's attention output kept for the recompute (``attention/kept.py``)
        self.kept_model = kept_model

    @classmethod
    def for_forest(cls, forest: PrefixForest, config, gradient_checkpointing: bool, keep_graph: bool,
                   dtype_bytes: int = 2, memory_budget: int | None = None, scoring: ScoringPlan | None = None,
                   forward_only: bool = False, unit_floor: int | None = None) -> "GroupBudget":
        """``scoring``: the walk's scoring plan, for the longest sequence's number of scored tokens;
        ``forward_only``: a ``tree_logprobs`` walk (no graph), whose groups can be much larger under
        the same bound; ``unit_floor``: bytes a unit may use without a ``memory_budget`` even where
        the longest sequence needs less (``walk_unit_floor``)."""
        model = ActivationModel.of(config, gradient_checkpointing, dtype_bytes)
        longest = int(forest.seq_lengths.argmax())
        scored = int((scoring.seq_idx == longest).sum()) if scoring is not None else None
        reference = memory_budget if memory_budget is not None else max(
            model.single_sequence(forest.max_depth, scored), unit_floor or 0)
        kept = ActivationModel.of(config, True, dtype_bytes, keep_attention=True) if gradient_checkpointing else None
        return cls(model, reference, keep_graph, int(forest.node_length.max()), forward_only, kept)

    def unit_bytes(self, tokens: int, depth: int) -> int:
        if self.forward_only:
            return self.model.forward_unit(tokens, depth)
        return self.model.unit(tokens, depth, self.keep_graph)

    def keeps_attention(self, tokens: int, depth: int) -> bool:
        """Whether a unit of ``tokens`` below ``depth`` still fits when it also keeps its attention
        outputs for the checkpointed recompute (the recompute then skips the attention kernels):
        units are sized without them, so the largest groups run without, the smaller ones with."""
        if self.kept_model is None or self.forward_only:
            return False
        return self.kept_model.unit(tokens, depth, self.keep_graph) <= self.reference

    def __call__(self, depth: int) -> int:
        lo, hi = 0, 1
        while self.unit_bytes(hi, depth) <= self.reference and hi < 1 << 40:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # the estimate grows with the tokens: largest fitting n in [lo, hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.unit_bytes(mid, depth) <= self.reference else (lo, mid)
        return max(lo, self.floor)


def default_memory_budget(device: torch.device) -> int | None:
    """80% of the free memory of a CUDA device; None (no limit) elsewhere."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * 0.8)


# ---------------------------------------------------------------------- FLOPs of a step
@dataclass
class StepCost:
    """What one policy forward+backward runs: tokens through the layer stack, LM-head rows, and
    Σ visible keys over all queries (attention pairs)."""

    tokens: int
    predictions: int
    attention_pairs: int


def layer_weights(config) -> int:
    """Weights of one decoder layer's matrix products: the query, key, value and output projections
    and the gated MLP's three (norms and biases aside)."""
    h, heads, head_dim = config.hidden_size, config.num_attention_heads, head_dim_of(config)
    kv, inter = kv_heads_of(config), intermediate_size_of(config)
    return h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h + 3 * h * inter


def step_flops(cost: StepCost, config, gradient_checkpointing: bool, attention_recompute: bool = True) -> float:
    """FLOPs of forward + backward (+ the recompute under gradient checkpointing).

    Body: 2 FLOPs per weight per token forward; backward twice that. LM head: 2·H·V per row.
    Attention: QKᵀ and PV, 4·heads·head_dim per visible (query, key) pair forward.
    ``attention_recompute=False``: the recompute skips the attention (its outputs were kept,
    ``attention/kept.py``).
    """
    h = config.hidden_size
    heads = config.num_attention_heads
    head_dim = head_dim_of(config)
    layers = config.num_hidden_layers
    body_fwd = 2 * layer_weights(config) * layers * cost.tokens
    attn_fwd = 4 * heads * head_dim * layers * cost.attention_pairs
    head_fwd = 2 * h * config.vocab_size * cost.predictions
    passes = 3 + (1 if gradient_checkpointing else 0)  # fwd + bwd (2x) [+ recompute]
    attention_passes = passes - (1 if gradient_checkpointing and not attention_recompute else 0)
    # the fused head recomputes its tiles in backward: fwd + recompute + 2 gradient GEMMs
    return passes * body_fwd + attention_passes * attn_fwd + 4 * head_fwd
