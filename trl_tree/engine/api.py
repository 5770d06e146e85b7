"""Public entry points: ``tree_logprobs``, ``tree_backward`` (and the critic's ``tree_values``,
``tree_value_backward``) over a prefix forest.

Each call validates the model against the sequences, resolves ``mode="auto"`` with the cost model,
then runs one of three ways that compute the same numbers: the packed pass (``packed.py``: one
forward over the unique tokens, the LM head on the unique predictions only, then a gather back to
every (sequence, position)), its CUDA-graph replay (``graphs.py``), or the depth-first walk
(``dfs/``). This module sits above all three and is the only one that chooses among them.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from contextvars import ContextVar

import numpy as np
import torch

from ._device import upload
from ._inputs import SequenceLike
from ._profiling import profiled
from .attention import backends
from .attention.buckets import BucketedLayout
from .attention.support import attention_features
from .backward_hooks import last_backward_starts
from .call_gate import calls_close
from .cost_model import GroupBudget, choose_mode, default_memory_budget, walk_unit_floor
from .dfs.buckets import PADDED_BUDGET_SCALE
from .dfs.graphs import walk_graphs
from .dfs.plan import keeps_groups
from .dfs.walk import DepthFirstWalk
from .forest import PrefixForest, ScoringPlan
from .graphs import graphed_scores
from .layout import LAYOUT, layout_choices  # noqa: F401  (layout_choices: where the benchmarks found it)
from .lm_head import score_rows
from .model_parts import (
    ModelParts,
    active_dropout,
    dropout_rate,
    is_dropout_site,
    model_parts,
    value_model_parts,
    walk_refusal,
)
from .options import TreeOptions, merge_deprecated
from .packed import (  # noqa: F401  (tree_forward, call_token_loss, TokenLoss: importable from here as before)
    TokenLoss,
    call_token_loss,
    checkpointing_on,
    keeps_attention,
    packed_hidden_states,
    recomputes_kept_attention,
    runs_as_padded_batch,
    tree_forward,
    tree_metadata,
    wants_kept_attention,
)
from .router import RouterAux

MODES = ("packed", "dfs", "auto")
#: what ``tree_logprobs(head_outputs=...)`` can return besides log-probs and entropies
HEAD_OUTPUTS = ("is_top1", "mean_logits", "log_sum_sq_probs")
#: and what ``tree_backward(head_outputs=...)`` can hand its loss: the entropies too, as constants (a
#: metric: unlike ``with_entropy``, no gradient flows through them)
BACKWARD_HEAD_OUTPUTS = HEAD_OUTPUTS + ("entropy",)

#: set True by a ``tree_backward`` that had to score first: a coupled loss whose groups the walk's
#: units split (``_linearised_loss``). Never reset here: a caller sets it False before its calls
#: and reads it after (the trainers' ``tree/passes``).
scored_first: ContextVar[bool] = ContextVar("scored_first", default=False)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")


def _check_temperature(temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and temperature > 0 and temperature != float("inf")):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")


def prepare(model: torch.nn.Module, seqs: Sequence[SequenceLike] | PrefixForest, rope_length: int | None = None,
            lm_head_fp32: bool = False, router: RouterAux | None = None, value_head: torch.nn.Module | None = None,
            values_only: bool = False) -> tuple[ModelParts, PrefixForest]:
    """Validate the model and the sequences against each other; build the forest.

    ``value_head``: also read values at the scored positions (``values_only``: only values, from the
    backbone of ``model`` — ``model_parts.value_model_parts``).

    ``rope_length``: the length a length-dependent RoPE (dynamic NTK, LongRoPE) chooses its
    frequencies for (``model_parts.rope_length_hint``); None: the longest sequence, what a padded
    batch of these sequences shows it. ``lm_head_fp32``: score in fp32 outside autocast.
    ``router``: collect (or back-propagate) the MoE load-balancing loss (``trl_tree.engine.router``)."""
    if values_only:
        if value_head is None:
            raise TypeError("a value-only call needs a value_head")
        parts = value_model_parts(model, value_head)
    else:
        parts = model_parts(model)
        if value_head is not None:
            if not isinstance(value_head, torch.nn.Module):
                raise TypeError(f"value_head must be a torch.nn.Module, got {type(value_head).__name__}")
            parts.value_head = value_head
    forest = seqs if isinstance(seqs, PrefixForest) else PrefixForest.from_sequences(seqs)
    lo, hi = int(forest.tokens.min()), int(forest.tokens.max())
    if lo < 0 or hi >= parts.vocab_size:
        bad = lo if lo < 0 else hi
        seq = next(i for i in range(forest.num_sequences) if bad in forest.sequence(i))
        raise ValueError(
            f"sequence {seq} holds token id {bad}, outside the model's vocabulary [0, {parts.vocab_size})"
        )
    if parts.absolute_positions and parts.max_positions is not None and forest.max_depth > parts.max_positions:
        # a learned position table has no row for such a depth (RoPE models compute any length, as stock does)
        seq = int(forest.seq_lengths.argmax())
        raise ValueError(
            f"sequence {seq} has {forest.max_depth} tokens, more than the {parts.max_positions} rows of the "
            f"model's position embeddings (max_position_embeddings)"
        )
    if parts.attention_chunk is not None and forest.max_depth > parts.attention_chunk:
        # past a chunk, a chunked layer's token no longer sees the tokens of earlier chunks: not the tree's mask
        seq = int(forest.seq_lengths.argmax())
        raise ValueError(
            f"sequence {seq} has {forest.max_depth} tokens, more than the model's attention_chunk_size "
            f"({parts.attention_chunk}): its chunked-attention layers would restart at the chunk's boundary, which "
            "the tree does not compute; shorter sequences are exact (full attention within one chunk)"
        )
    if rope_length is not None and (isinstance(rope_length, bool) or not isinstance(rope_length, int)
                                    or rope_length < forest.max_depth):
        raise ValueError(f"rope_length must be an int >= the longest sequence ({forest.max_depth}), got "
                         f"{rope_length!r}")
    if not isinstance(lm_head_fp32, bool):
        raise TypeError(f"lm_head_fp32 must be True or False, got {lm_head_fp32!r}")
    _check_dropout(parts)
    if parts.length_dependent_rope:
        parts.rope_length = rope_length if rope_length is not None else forest.max_depth
    parts.head_fp32 = lm_head_fp32
    if router is not None:
        if not isinstance(router, RouterAux):
            raise TypeError(f"router must be a trl_tree.engine.router.RouterAux, got {type(router).__name__}")
        parts.router = router
    return parts, forest


#: per model: weak references to its dropout modules and attention modules with a dropout rate (found
#: once; their rates are read on every training call, the walk over the whole model is not repeated).
#: Weak: a strong reference from a value to a submodule keeps the key alive wherever the submodule
#: reaches back to the model — FSDP2's hooks do (each layer's parameter group holds the modules) — and
#: the model, its parameters and their memory would outlive every trainer that used it
_DROPOUT_SITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_dropout(parts: ModelParts) -> None:
    """Refuse a training-mode call where dropout would draw masks: the tree would draw one per
    unique token, the untreed computation one per sequence — a different, correlated noise."""
    model = parts.causal_lm if parts.scores_logps else parts.backbone  # a value model's own head is not run
    if not model.training:
        return
    sites = _DROPOUT_SITES.get(model)
    if sites is None:
        sites = tuple(weakref.ref(m) for m in model.modules() if is_dropout_site(m))
        _DROPOUT_SITES[model] = sites
    if any(m is not None and m.training and dropout_rate(m) > 0 for m in (site() for site in sites)):
        raise ValueError(
            f"dropout is active in training mode ({', '.join(active_dropout(model))}); the tree computes a shared "
            "token once and cannot draw one dropout mask per sequence. Set the rates to 0 (TRL's disable_dropout=True "
            "covers nn.Dropout modules; attention dropout is the config's attention_dropout) or call model.eval()"
        )


def _score(
    parts: ModelParts,
    forest: PrefixForest,
    plan: ScoringPlan,
    opts: TreeOptions,
    temperature: float,
    return_entropy: bool,
    extra: tuple[np.ndarray, ...] = (),
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, list[torch.Tensor]]:
    """Per-term log-probs (and entropies; and values with ``parts.value_head``; a value-only call
    has no log-probs), flat in sequence order (``plan.gather`` order), and the ``extra`` int64
    arrays on the device. Every index array goes up in one copy before the forward
    (``_device.upload``): an upload after it would make the host wait for the whole forward.
    ``opts.cuda_graphs``: a call that builds a graph replays captured CUDA graphs where it can
    (``trl_tree.engine.graphs``); where it cannot (a dense unshared batch, a layout not captured yet) the
    eager call runs on the same uploaded arrays and metadata — its choices made again where a graph
    may run other kernels than an eager call (dense blocks: ``dense_blocks``, ``tree_metadata``), so
    that eager calls keep the eager choice."""
    host_targets = forest.tokens[plan.pred_dst]
    moe = (forest.multiplicity,) if parts.router is not None else ()  # the router loss's token weights
    tokens, pred_src, targets, gather, *extra_t = upload(
        [forest.tokens, plan.pred_src, host_targets, plan.gather, *moe, *extra], torch.int64, parts.device)
    if moe:
        parts.router_weights = extra_t.pop(0)
    meta = scores = checkpointing = None
    cuda_graphs, keep_attention = opts.cuda_graphs, opts.keep_attention
    # a length-dependent RoPE reads the call's length on the host (dynamic NTK), router logits are recorded
    # by hooks, hybrid mixers gather through tables built at the call: such calls run eagerly
    if (cuda_graphs and torch.is_grad_enabled() and not runs_as_padded_batch(parts, forest)
            and not parts.length_dependent_rope and parts.router is None and parts.value_head is None
            and not parts.mixer_layers):
        backend = backends.resolve_backend(opts.attn_backend, parts.device, parts.compute_dtype,
                                           hidden_size=parts.hidden_size, graphed=True,
                                           **attention_features(parts.causal_lm.config))
        meta = tree_metadata(parts, forest, backend, graphed=True)
        checkpointing = checkpointing_on(parts)
        scores = graphed_scores(parts, forest, plan, backend, temperature, return_entropy, tokens, pred_src,
                                targets, meta, keeps_attention(parts, backend, keep_attention, checkpointing),
                                checkpointing,
                                bucketed=(_bucketed_inputs(parts, forest, plan.pred_src, host_targets, backend)
                                          if cuda_graphs == "buckets" else None))
        if scores is None and meta.dense:  # the eager call makes the eager choices, on the same arrays
            meta = tree_metadata(parts, forest, backend, rechoose=meta)
    if scores is None:
        hidden = packed_hidden_states(parts, forest, opts.attn_backend, tokens, keep_attention, meta, checkpointing)
        scores = score_rows(hidden, parts, pred_src, targets, temperature, return_entropy)
    else:
        scores = (*scores, None)
    return (*(x.index_select(0, gather) if x is not None else None for x in scores), extra_t)


def _bucketed_inputs(parts: ModelParts, forest: PrefixForest, pred_src: np.ndarray, targets: np.ndarray,
                     backend: str):
    """What makes the call's inputs padded to buckets (``attention/buckets.py``) when a graph needs
    them, or None where padding could change an outcome: a sliding-window model (a padded maximum
    length could pass its window and be refused where the real one is not)."""
    if getattr(parts.causal_lm.config, "sliding_window", None):
        return None

    def make():
        return BucketedLayout.pad(forest, pred_src, targets).to_device(parts.device, backend)

    return make


def _resolve_auto(mode: str, parts: ModelParts, forest: PrefixForest, opts: TreeOptions) -> tuple[str, TreeOptions]:
    """``mode="auto"``: packed when its activations fit the memory budget, else dfs with the largest
    chunk that fits, unless ``opts`` names one (cost_model)."""
    if mode != "auto":
        return mode, opts
    budget = opts.memory_budget if opts.memory_budget is not None else default_memory_budget(parts.device)
    if budget is None:
        return "packed", opts
    choice = choose_mode(forest, parts.causal_lm.config.get_text_config(), budget, checkpointing_on(parts),
                         keep_attention=wants_kept_attention(opts.keep_attention))
    if opts.chunk_size is None and choice.chunk_size is not None:
        opts = opts.replace(chunk_size=choice.chunk_size)
    return choice.mode, opts


def _dfs_walk(parts: ModelParts, forest: PrefixForest, plan: ScoringPlan, opts: TreeOptions, temperature: float,
              keep_graph: bool, forward_only: bool = False):
    """The walk; without ``opts.chunk_size`` its groups are sized by the memory model (``GroupBudget``):
    one forward+backward of the longest sequence or a small share of the GPU where that is larger
    (``cost_model.walk_unit_floor``), or ``opts.memory_budget`` when given.
    ``opts.cuda_graphs``: its units replay CUDA graphs where captured (``dfs/graphs.py``). A training
    walk that recomputes its pushed nodes merges each pop with a group where it fits (``dfs/plan.py``),
    and its units keep their attention outputs for the checkpointed recompute where the memory model
    lets them (``opts.keep_attention`` as for packed calls; ``GroupBudget.keeps_attention``)."""
    cuda_graphs = False if parts.mixer_layers else opts.cuda_graphs  # hybrid mixers: eager units, own slots
    features = attention_features(parts.causal_lm.config)
    backend = backends.resolve_dfs_backend(opts.attn_backend, parts.device, parts.compute_dtype,
                                           hidden_size=parts.hidden_size, graphed=bool(cuda_graphs), **features)
    graphs = walk_graphs(parts, backend, features) if cuda_graphs else None
    group_tokens = None
    if opts.chunk_size is None:
        group_tokens = GroupBudget.for_forest(
            forest, parts.causal_lm.config.get_text_config(), checkpointing_on(parts), keep_graph,
            dtype_bytes=parts.compute_dtype.itemsize, memory_budget=opts.memory_budget, scoring=plan,
            forward_only=forward_only, unit_floor=walk_unit_floor(parts.device))
    budget = group_tokens
    keeps = None
    if budget is not None and not forward_only and recomputes_kept_attention(parts, backend, opts.keep_attention):
        keeps = budget.keeps_attention
    buckets = graphs is not None and cuda_graphs == "buckets"
    if buckets and budget is not None:  # a padded group stays within the memory its budget was sized for

        def group_tokens(depth: int) -> int:
            return max(int(budget(depth) * PADDED_BUDGET_SCALE), budget.floor)

    return DepthFirstWalk(parts, forest, plan, backend, temperature, opts.chunk_size, group_tokens, graphs, buckets,
                          merge_pops=LAYOUT.merge_pops and not forward_only and not keep_graph, keeps_attention=keeps)


def tree_logprobs(
    model: torch.nn.Module,
    seqs: Sequence[SequenceLike] | PrefixForest,
    mode: str = "packed",
    *,
    options: TreeOptions | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    score_from: int | Sequence[int] | None = None,
    rope_length: int | None = None,
    lm_head_fp32: bool = False,
    router: RouterAux | None = None,
    value_head: torch.nn.Module | None = None,
    head_outputs: Sequence[str] = (),
    **deprecated_knobs: object,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], ...]:
    """Per-token log-probs of every sequence, computing each shared token once.

    ``logps[i][j] = log p(seqs[i][j + 1] | seqs[i][: j + 1])`` (logits divided by ``temperature``),
    ``len(logps[i]) == len(seqs[i]) - 1``. With ``score_from`` (an int or one per sequence) only
    tokens ``seqs[i][score_from[i]:]`` are scored — e.g. the completion after a prompt — and
    ``logps[i]`` has ``len(seqs[i]) - score_from[i]`` entries. ``return_entropy=True`` also returns
    the entropy of each scored position's distribution.

    ``mode="packed"``: one forward over the unique tokens; differentiable. ``mode="dfs"``: a
    depth-first walk with a K/V stack (memory bounded by the longest path; its calls sized by the
    memory model or ``options.chunk_size``); forward only, the result carries no graph.
    ``mode="auto"``: packed if its activations fit ``options.memory_budget`` bytes (default: 80% of
    the free GPU memory; unlimited on CPU), else dfs with the largest chunk that fits
    (``trl_tree.engine.cost_model``).

    ``options``: a :class:`trl_tree.TreeOptions` — the attention kernel, memory, kept attention and
    CUDA graphs; none of them changes a number (``cuda_graphs=True``: a packed call that builds a
    graph replays CUDA graphs of its forward and backward once its layout has been seen before,
    ``trl_tree.engine.graphs``; "buckets": layouts that do not repeat replay the graphs of their layout
    padded to buckets; with ``mode="dfs"`` the walk's units replay theirs, ``dfs/graphs.py``). The
    knobs were keyword arguments before (``attn_backend=``, ``chunk_size=``, …) and still are, deprecated.

    ``rope_length``: for a RoPE whose frequencies depend on the length (dynamic NTK, LongRoPE), the
    length they are chosen for — a trainer passes its padded batch's width, which is what the
    untreed padded forward shows them; None: the longest sequence. Other models ignore it.
    ``lm_head_fp32=True``: the LM head computes in fp32 outside autocast (TRL's
    ``cast_lm_head_to_fp32``). ``router``: a :class:`trl_tree.engine.router.RouterAux` that receives
    every call's router logits (an MoE model's load-balancing loss, ``router.loss()``).
    ``value_head``: a critic's head on the policy's trunk (hidden ``[n, H]`` -> ``[n, 1]``); the same
    forward also gives ``values[i][j]``, the head at the state that predicts ``logps[i][j]``, returned
    last: ``(logps, values)`` or ``(logps, entropies, values)``. ``head_outputs``: by-products of
    TRL's fused head per scored token, returned last in the order named: ``"is_top1"`` (bool: the
    target is the head's most likely token; SFT's token accuracy), ``"mean_logits"`` (DPO's
    ``logits/*``), ``"log_sum_sq_probs"`` (WPO's weights); a packed call with grad replays them from
    its CUDA graph like the log-probs, a walk's units that compute them replay none.
    """
    opts = merge_deprecated(options, deprecated_knobs, "tree_logprobs", FORWARD_KNOBS)
    logp, ent, values, plan, extra = _forward_scores(model, seqs, mode, opts, temperature, return_entropy,
                                                     score_from, rope_length, lm_head_fp32, router, value_head,
                                                     values_only=False, head_outputs=tuple(head_outputs))
    counts = plan.counts.tolist()
    out = [list(logp.split(counts))]
    if return_entropy:
        out.append(list(ent.split(counts)))
    if value_head is not None:
        out.append(list(values.split(counts)))
    out += [list(x.split(counts)) for x in extra]
    return out[0] if len(out) == 1 else tuple(out)


def tree_values(
    model: torch.nn.Module,
    seqs: Sequence[SequenceLike] | PrefixForest,
    value_head: torch.nn.Module,
    mode: str = "packed",
    *,
    options: TreeOptions | None = None,
    score_from: int | Sequence[int] | None = None,
    rope_length: int | None = None,
    **deprecated_knobs: object,
) -> list[torch.Tensor]:
    """A critic's values over the tree, each shared token computed once: ``values[i][j]`` is
    ``value_head`` applied to the final hidden state of ``seqs[i][: j + 1]`` — the state before the
    token ``logps[i][j]`` of :func:`tree_logprobs` scores (same ``score_from``, same shapes).

    ``model``'s backbone runs, called directly, with no LM head: a ``*ForTokenClassification``
    value model, or a causal LM (its trunk under whatever PEFT adapter is active — a critic
    adapter). Modes, ``options`` and the other arguments as in :func:`tree_logprobs` (value calls
    run eagerly: ``options.cuda_graphs`` must be off); packed calls with grad enabled are
    differentiable (the backbone's and the head's parameters)."""
    opts = _value_options(merge_deprecated(options, deprecated_knobs, "tree_values", VALUE_FORWARD_KNOBS),
                          "tree_values")
    _, _, values, plan, _ = _forward_scores(model, seqs, mode, opts, 1.0, False, score_from, rope_length, False, None,
                                         value_head, values_only=True)
    return list(values.split(plan.counts.tolist()))


#: the knobs each entry point took as keyword arguments (deprecated there now)
FORWARD_KNOBS = ("attn_backend", "chunk_size", "memory_budget", "keep_attention", "cuda_graphs")
BACKWARD_KNOBS = (*FORWARD_KNOBS, "keep_graph")
VALUE_FORWARD_KNOBS = ("attn_backend", "chunk_size", "memory_budget", "keep_attention")
VALUE_BACKWARD_KNOBS = (*VALUE_FORWARD_KNOBS, "keep_graph")


def _value_options(opts: TreeOptions, entry_point: str) -> TreeOptions:
    if opts.cuda_graphs:
        raise ValueError(f"{entry_point}() runs eagerly: CUDA graphs replay the policy's scoring only; "
                         "pass options with cuda_graphs=False")
    return opts


def _prepared_call(model, seqs, mode: str, opts: TreeOptions, temperature, score_from, rope_length, lm_head_fp32,
                   router, value_head, values_only: bool):
    """What every entry point does first: check the arguments, validate the model against the
    sequences (``prepare``), resolve ``mode="auto"``, plan the scoring; returns
    ``(parts, forest, mode, opts, plan)``."""
    _check_mode(mode)
    _check_temperature(temperature)
    parts, forest = prepare(model, seqs, rope_length, lm_head_fp32, router, value_head, values_only)
    mode, opts = _resolve_auto(mode, parts, forest, opts)
    why = walk_refusal(parts) if mode == "dfs" else None
    if why is not None:
        raise ValueError(f"{why}; mode='packed' computes it exactly")
    return parts, forest, mode, opts, forest.scoring_plan(score_from)


@profiled("trl_tree.tree_forward")
def _forward_scores(model, seqs, mode: str, opts: TreeOptions, temperature, return_entropy, score_from, rope_length,
                    lm_head_fp32, router, value_head, values_only: bool, head_outputs: tuple[str, ...] = ()):
    """Flat ``(logps, entropies, values, plan, extra)`` of :func:`tree_logprobs` / :func:`tree_values`
    (``extra``: the ``head_outputs`` asked for, in their order)."""
    parts, forest, mode, opts, plan = _prepared_call(model, seqs, mode, opts, temperature, score_from, rope_length,
                                                     lm_head_fp32, router, value_head, values_only)
    _check_head_outputs(head_outputs, values_only)
    parts.head_outputs = {name: [] for name in head_outputs}
    gather = torch.from_numpy(plan.gather).to(parts.device)
    if mode == "dfs":
        walk = _dfs_walk(parts, forest, plan, opts, temperature, False, forward_only=True)
        *rows, extra = walk.logprobs(return_entropy)
        logp, ent, values = (x.index_select(0, gather) if x is not None else None for x in rows)
    else:
        logp, ent, values, _ = _score(parts, forest, plan, opts, temperature, return_entropy)
        extra = [torch.cat(parts.head_outputs[name]) for name in head_outputs]
    extra = [x.index_select(0, gather) for x in extra]  # per prediction -> per term, like the log-probs
    return logp, ent, values, plan, extra


def tree_backward(
    model: torch.nn.Module,
    seqs: Sequence[SequenceLike] | PrefixForest,
    token_loss: TokenLoss,
    mode: str = "packed",
    *,
    options: TreeOptions | None = None,
    temperature: float = 1.0,
    score_from: int | Sequence[int] | None = None,
    rope_length: int | None = None,
    lm_head_fp32: bool = False,
    router: RouterAux | None = None,
    with_entropy: bool = False,
    value_head: torch.nn.Module | None = None,
    coupled: Sequence[int] | None = None,
    head_outputs: Sequence[str] = (),
    **deprecated_knobs: object,
) -> float:
    """Back-propagate ``sum_i sum_j token_loss(logps[i][j], i, j)`` through the tree.

    ``token_loss(logps [n], seq_idx [n], pos [n]) -> [n]`` gets the scored terms (``pos`` is the
    prediction index ``j`` of ``tree_logprobs``) and must be elementwise: ``mode="dfs"`` calls it
    once per unit of the walk. Afterwards every parameter's ``.grad`` holds (accumulated onto what
    was there) exactly what autograd leaves for that sum computed sequence by sequence without a
    tree. Returns the loss value. ``with_entropy=True``: ``token_loss(logps, seq_idx, pos,
    entropies)`` also gets each scored position's entropy, differentiable (an entropy bonus).
    A non-finite loss raises ``FloatingPointError`` after the backward, naming the sequences
    whose terms are not finite (packed mode): the gradients it left are not finite either.

    ``mode`` as in :func:`tree_logprobs`; ``mode="dfs"`` walks depth-first, each call bounded by the
    memory model (``cost_model.GroupBudget``: one forward+backward of the longest sequence, or
    ``options.memory_budget``) or by ``options.chunk_size``. ``options`` as there, and
    ``options.keep_graph=True`` keeps each pushed node's graph until its backward instead of
    recomputing it (one forward less per inner node, memory of the whole path); ``None`` (default)
    keeps it when the model uses gradient checkpointing, where a kept graph is only each layer's
    input — the size of the K/V stack. With ``options.cuda_graphs`` the loss stays eager, only the
    model's forward and backward are replayed; in dfs, unit by unit, pushed nodes recomputed at
    their pop, so ``keep_graph=True`` is refused. ``rope_length``, ``lm_head_fp32`` as there;
    ``router`` after ``router.set_backward(grad)``: the MoE load-balancing loss's share of every
    piece is back-propagated with it (``trl_tree.engine.router``). ``value_head``: a critic's head on the
    policy's trunk, read in the same forward (see :func:`tree_logprobs`); ``token_loss`` then also
    gets the values, as keyword ``values``.

    ``coupled``: a group id per sequence, for a loss on whole sequences (DPO's: a function of each
    pair's summed log-probs). ``token_loss`` may then couple the terms of one group, and every call
    of it gets all the terms of the groups it sees: packed mode calls it once; the walk calls it per
    unit where its plan keeps each group's terms in one unit (one pass, ``dfs.plan.keeps_groups``),
    and otherwise scores the forest first (a forward-only walk), takes each term's gradient from one
    call of ``token_loss`` on all the terms, and walks with those gradients (two passes; the same
    gradients). The return value is then the sum of that one call's terms. ``head_outputs``: the
    head's by-products of :func:`tree_logprobs` (``"is_top1"``, ``"mean_logits"``,
    ``"log_sum_sq_probs"``) and ``"entropy"``, handed to ``token_loss`` as keywords of those names
    (constants: a loss's metrics, WPO's weights; ``with_entropy`` is the differentiable entropy); a
    packed call replays them from its CUDA graph, a walk that hands them over replays none.
    """
    opts = merge_deprecated(options, deprecated_knobs, "tree_backward", BACKWARD_KNOBS)
    return _backward(model, seqs, token_loss, mode, opts, temperature, score_from, rope_length, lm_head_fp32, router,
                     with_entropy, value_head, values_only=False, coupled=coupled, head_outputs=tuple(head_outputs))


def tree_value_backward(
    model: torch.nn.Module,
    seqs: Sequence[SequenceLike] | PrefixForest,
    value_loss: TokenLoss,
    value_head: torch.nn.Module,
    mode: str = "packed",
    *,
    options: TreeOptions | None = None,
    score_from: int | Sequence[int] | None = None,
    rope_length: int | None = None,
    **deprecated_knobs: object,
) -> float:
    """Back-propagate ``sum_i sum_j value_loss(values[i][j], i, j)`` (the values of
    :func:`tree_values`) through a critic's backbone and ``value_head``; the contract of
    :func:`tree_backward` otherwise (elementwise ``value_loss``, gradients accumulated onto
    ``.grad``, the loss value returned). A PPO value loss is elementwise in the values — a clipped
    squared error against fixed returns, over a fixed number of tokens — so the critic's whole
    update runs in one pass, without a second forward."""
    opts = _value_options(merge_deprecated(options, deprecated_knobs, "tree_value_backward", VALUE_BACKWARD_KNOBS),
                          "tree_value_backward")
    return _backward(model, seqs, value_loss, mode, opts, 1.0, score_from, rope_length, False, None, False,
                     value_head, values_only=True)


@profiled("trl_tree.tree_backward")
def _backward(model, seqs, token_loss, mode: str, opts: TreeOptions, temperature, score_from, rope_length,
              lm_head_fp32, router, with_entropy, value_head, values_only: bool, coupled=None,
              head_outputs: tuple[str, ...] = ()) -> float:
    """:func:`tree_backward` and :func:`tree_value_backward`."""
    if not callable(token_loss):
        raise TypeError(f"token_loss must be callable, got {type(token_loss).__name__}")
    _check_head_outputs(head_outputs, values_only, BACKWARD_HEAD_OUTPUTS)
    parts, forest, mode, opts, plan = _prepared_call(model, seqs, mode, opts, temperature, score_from, rope_length,
                                                     lm_head_fp32, router, value_head, values_only)
    parts.head_outputs = {name: [] for name in head_outputs}
    groups = _coupled_groups(coupled, forest, value_head)
    if mode == "dfs":
        keep_graph = opts.keep_graph
        if keep_graph and opts.cuda_graphs:
            raise ValueError("keep_graph=True keeps a pushed node's graph across its subtree, which replayed units "
                             "cannot (they share one memory pool, one unit's activations at a time); use "
                             "keep_graph=None or False with cuda_graphs")
        if keep_graph and calls_close():
            raise ValueError("keep_graph=True keeps a pushed node's graph until its pop, across other calls of the "
                             "model; gathered block by block (tree_gather='block') every call's backward must follow "
                             "it: pass keep_graph=None or False, or gather the model whole")
        if keep_graph is None:  # replayed pushes are recomputed at their pop (dfs/graphs.py); a gate needs closed calls
            keep_graph = checkpointing_on(parts) and not opts.cuda_graphs and not calls_close()
        walk = _dfs_walk(parts, forest, plan, opts, temperature, keep_graph)
        linearised = None
        if groups is not None and not keeps_groups(walk.plan, plan, groups):
            del walk  # its K/V stack; the scoring walk takes its own
            linearised = _linearised_loss(parts, forest, plan, opts, temperature, token_loss, with_entropy)
            scored_first.set(True)
            token_loss = linearised[0]
            parts.head_outputs = {}  # the linear loss needs none: the walk may replay its units
            walk = _dfs_walk(parts, forest, plan, opts, temperature, keep_graph)
        total = walk.backward(token_loss, keep_graph, with_entropy)
        if linearised is not None:
            total = linearised[1]
        if not math.isfinite(total):
            raise FloatingPointError(f"token_loss gave a non-finite loss ({total}) in mode='dfs'; the gradients "
                                     "it left in .grad are not finite")
        return total
    with torch.enable_grad():
        logp, ent, values, (seq_idx, pos) = _score(parts, forest, plan, opts, temperature, with_entropy,
                                                   extra=(plan.seq_idx, plan.pos))
        terms = call_token_loss(token_loss, logp, ent, values, seq_idx, pos, with_entropy, parts.scores_logps,
                                _head_outputs_per_term(parts, plan, logp))
        loss = terms.sum()
        router_term = router.take_term() if router is not None else None
        if router_term is not None:
            loss = loss + router_term
        if loss.requires_grad:
            last_backward_starts()
            loss.backward()
    total = float(loss.detach())
    if not math.isfinite(total):
        bad = torch.unique(seq_idx[~torch.isfinite(terms.detach())]).tolist()
        raise FloatingPointError(
            f"token_loss gave a non-finite loss ({total}): non-finite terms in sequence(s) {bad[:16]}"
            f"{' ...' if len(bad) > 16 else ''}; the gradients it left in .grad are not finite"
        )
    return total


def _check_head_outputs(head_outputs: tuple[str, ...], values_only: bool, known: tuple[str, ...] = HEAD_OUTPUTS
                        ) -> None:
    unknown = [name for name in head_outputs if name not in known]
    if unknown:
        raise ValueError(f"head_outputs: {unknown} are not among {known}")
    if head_outputs and values_only:
        raise ValueError("head_outputs asks the LM head, which a value-only call does not run")


def _head_outputs_per_term(parts: ModelParts, plan: ScoringPlan, logp: torch.Tensor) -> dict[str, torch.Tensor]:
    """A packed call's head by-products (per prediction, as scored) spread over its terms."""
    if not parts.head_outputs:
        return {}
    (gather,) = upload([plan.gather], torch.int64, logp.device)  # after the forward: without waiting for it
    return {name: torch.cat(kept).index_select(0, gather) for name, kept in parts.head_outputs.items()}


def _coupled_groups(coupled, forest: PrefixForest, value_head) -> np.ndarray | None:
    """``coupled`` checked: one integer group id per sequence of ``forest``."""
    if coupled is None:
        return None
    groups = np.asarray(coupled)
    if groups.shape != (forest.num_sequences,) or not np.issubdtype(groups.dtype, np.integer):
        raise ValueError(f"coupled must give one integer group id per sequence ({forest.num_sequences}), got "
                         f"{groups.dtype} of shape {groups.shape}")
    if value_head is not None:
        raise ValueError("coupled (a loss on whole sequences) is not supported with a value head")
    return groups


def _linearised_loss(parts: ModelParts, forest: PrefixForest, plan: ScoringPlan, opts: TreeOptions,
                     temperature: float, token_loss, with_entropy: bool):
    """For a walk whose units split a coupled group: every term's log-prob (and entropy) from a
    forward-only walk, the gradient of ``token_loss`` on all of them at once, and the elementwise
    loss ``g * logp (+ h * entropy)`` that gives the walk exactly those gradients. Returns that loss
    and the value of ``token_loss``'s sum."""
    walk = _dfs_walk(parts, forest, plan, opts, temperature, False, forward_only=True)
    *rows, extra = walk.logprobs(with_entropy)
    del walk
    gather, seq_idx, pos = upload([plan.gather, plan.seq_idx, plan.pos], torch.int64, parts.device)
    logp, ent = (x.index_select(0, gather).detach().requires_grad_() if x is not None else None for x in rows[:2])
    extra = {name: x.index_select(0, gather) for name, x in zip(parts.head_outputs, extra)}
    wrt = [logp] + ([ent] if with_entropy else [])
    with torch.enable_grad():
        terms = call_token_loss(token_loss, logp, ent, None, seq_idx, pos, with_entropy, True, extra)
        grads = torch.autograd.grad(terms.sum(), wrt, allow_unused=True)
    g, *h = (torch.zeros_like(x) if d is None else d.detach() for x, d in zip(wrt, grads))
    h = h[0] if h else None
    counts = plan.counts.astype(np.int64)
    offsets = np.cumsum(counts) - counts  # each sequence's first term
    first = np.zeros_like(offsets)  # the position of that term
    first[counts > 0] = plan.pos[offsets[counts > 0]]
    offsets_t, first_t = upload([offsets, first], torch.int64, parts.device)

    def linear(lp, seq, p, en=None, **_):
        n = offsets_t[seq] + p - first_t[seq]
        out = lp * g[n]
        return out if h is None else out + en * h[n]

    return linear, float(terms.detach().sum())
