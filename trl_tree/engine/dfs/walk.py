"""Execute a :class:`WalkPlan`: the depth-first forward/backward over a forest.

Per step:

- ``push`` (a node with children): forward; its K/V stay in their stack slots for the subtree.
  With ``keep_graph=False`` (default) the forward runs without a graph and the node is recomputed
  with grad at ``pop`` (one extra forward of internal nodes, memory of one unit at a time);
  with ``keep_graph=True`` the graph is kept until ``pop`` (no recompute, memory of the path).
- ``group`` (complete small subtrees): forward, score, backward at once.
- ``pop``: backward of the node — its own loss terms, plus the K/V gradient its descendants left
  in its slots (injected by the unit attention's backward).

The LM head's weight gradient is not taken unit by unit: TRL's head kernel allocates a full-size
fp32 weight-gradient buffer per call, which would sit on top of the unit's activations, the K/V
stack and the model's gradients at every unit. Units score their rows against a constant head
(gradient to the hidden states only) and record each row's final hidden state and incoming
gradient; after the last unit, when only the gradients remain, one head call over all rows
back-propagates into the weight (the same sum, one buffer, at the walk's quietest moment).

Every per-token loss term is fixed before the walk (``token_loss`` is called on each unit's terms
and must be elementwise: term n may depend only on ``logps[n]``, ``seq_idx[n]``, ``pos[n]``) — or,
for a loss on whole sequences (``tree_backward(coupled=...)``), on the terms of its own group, which
the engine then checks the plan keeps in one unit (``keeps_groups``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .._device import upload
from ..attention.backends import DFS_BACKENDS, resolve_dfs_backend  # noqa: F401  (the walk's rule, kept importable here)
from ..attention.buckets import bucket
from ..attention.dispatch import install
from ..attention.kept import KeptAttention
from ..backward_hooks import last_backward_starts
from ..forest import PrefixForest, ScoringPlan
from ..lm_head import score_predictions, score_rows
from ..model_parts import ModelParts
from ..packed import call_token_loss, tree_forward
from .buckets import padded_stack_size
from .graphs import UnitReplay, WalkGraphs
from .plan import WalkPlan, plan_walk, unit_layout
from .stack import KVStack, UnitAttentionMetadata


class DepthFirstWalk:
    """One walk of one forest: holds the plan, the K/V stack and every unit's device tensors.

    All index tensors (tokens, positions, attention segments, scoring rows, loss-term indices)
    are built on the CPU and uploaded in one copy before the first kernel, so the walk itself
    never makes the CPU wait for the GPU (``_device.upload``).
    """

    def __init__(self, parts: ModelParts, forest: PrefixForest, scoring: ScoringPlan, backend: str,
                 temperature: float, chunk_size: int | None, group_tokens: Callable[[int], int] | None = None,
                 graphs: WalkGraphs | None = None, buckets: bool = False, merge_pops: bool = False,
                 keeps_attention: Callable[[int, int], bool] | None = None) -> None:
        """``merge_pops``: a pop recomputes its node with its first group of children (``plan_walk``;
        a training walk that recomputes pushed nodes, ``keep_graph=False``). ``keeps_attention(tokens,
        depth)``: whether a unit of that size keeps its attention outputs for the checkpointed
        recompute (``attention/kept.py``; the memory model's ``GroupBudget.keeps_attention``);
        None: no unit does."""
        self.parts = parts
        self.scoring = scoring
        self.backend = backend
        self.temperature = temperature
        buckets = buckets and graphs is not None
        self.plan: WalkPlan = plan_walk(forest, scoring, chunk_size, group_tokens, merge_pops,
                                        merge_long_nodes=not buckets)
        self.device = parts.device
        self.graphs = graphs  # replay units from CUDA graphs where captured (``dfs/graphs.py``)
        units = self.plan.units
        slots = self.plan.stack_size
        grad_slots = max((u.depth + u.pushed_tokens for u in units), default=0)
        if buckets:  # the units padded to buckets read and write more slots (``dfs/buckets.py``)
            slots, grad_slots = (max(a, b) for a, b in zip((slots, grad_slots), padded_stack_size(units)))
        if graphs is not None:  # the model's kept stack: the graphs are captured against its buffers
            self.stack = graphs.stack_for(parts.num_layers, slots, grad_slots)
        else:
            self.stack = KVStack(parts.num_layers, slots, grad_slots)
        layouts = [unit_layout(self.plan.forest, u) for u in units]
        # a unit keeps its attention where its padded size would still fit (one rule for both layouts)
        keeps = [keeps_attention is not None and u.scored
                 and keeps_attention(bucket(u.num_tokens) if buckets else u.num_tokens, u.depth) for u in units]
        self.metas = UnitAttentionMetadata.build_all(self.plan.forest, units, self.stack, backend, self.device, layouts,
                                                     keeps)
        rows_src, rows_targets = self._upload_scoring()
        #: per unit, ``(meta, src, targets)`` padded to buckets: what a replay uses where the unit's own
        #: shape has no graph (free-length rollouts)
        self.padded: list[tuple] | None = None
        if buckets:
            metas, src, targets = UnitAttentionMetadata.build_padded(
                self.plan.forest, units, self.stack, backend, self.device, layouts, rows_src, rows_targets, keeps)
            self.padded = list(zip(metas, src, targets))
        install(parts.causal_lm.config._attn_implementation)

    def _unit(self, u: int) -> tuple:
        return self.metas[u], self.src[u], self.targets[u]

    def _padded_unit(self, u: int) -> tuple | None:
        return self.padded[u] if self.padded is not None else None

    def _upload_scoring(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per unit: its scoring rows (global ids), their sources (unit-relative) and targets, and
        its loss terms (row inside the unit, sequence, position). Returns the host arrays of the
        rows' sources and targets, per unit (what the units padded to buckets start from)."""
        plan, scoring = self.plan, self.scoring
        row_pos = np.empty(scoring.num_predictions, dtype=np.int64)  # a row's index inside its unit
        arrays, rows_src, rows_targets = [], [], []
        for u, rows in enumerate(plan.rows_of_unit):
            row_pos[rows] = np.arange(rows.shape[0])
            rows_src.append(scoring.pred_src[rows] - plan.units[u].start)
            rows_targets.append(plan.forest.tokens[scoring.pred_dst[rows]])
            arrays += [rows, rows_src[-1], rows_targets[-1]]
        for terms in plan.terms_of_unit:
            arrays += [row_pos[scoring.gather[terms]], scoring.seq_idx[terms], scoring.pos[terms]]
        arrays.append(plan.forest.tokens[scoring.pred_dst])  # every row's target in row order (deferred head)
        if self.parts.router is not None:  # MoE: each token's multiplicity, sliced per unit at its forward
            arrays.append(plan.forest.multiplicity)
        *tensors, self.all_targets = upload(arrays, torch.int64, self.device)
        if self.parts.router is not None:
            self.all_targets, multiplicity = tensors.pop(), self.all_targets
            self.unit_weights = [multiplicity[u.start : u.end] for u in plan.units]
        n = len(plan.units)
        self.rows = tensors[0 : 3 * n : 3]
        self.src = tensors[1 : 3 * n : 3]
        self.targets = tensors[2 : 3 * n : 3]
        self.term_row = tensors[3 * n :: 3]
        self.term_seq = tensors[3 * n + 1 :: 3]
        self.term_pos = tensors[3 * n + 2 :: 3]
        return rows_src, rows_targets

    # ------------------------------------------------------------------ pieces
    def _forward(self, u: int) -> torch.Tensor:
        meta = self.metas[u]
        meta.calls = 0
        # kept for the recompute of a forward with grad (consumed by its backward, layer by layer)
        meta.kept = KeptAttention(self.parts.tree_calls) if meta.keep_attention and torch.is_grad_enabled() else None
        if self.parts.router is not None:
            self.parts.router_weights = self.unit_weights[u]
        return tree_forward(self.parts, meta.input_ids, meta)

    def _score(self, u: int, hidden: torch.Tensor, with_entropy: bool, head_grad: bool = True):
        """``(logps, entropies, values)`` of the unit's rows (``lm_head.score_rows``)."""
        return score_rows(hidden, self.parts, self.src[u], self.targets[u], self.temperature, with_entropy,
                          head_grad)

    def _unit_loss(self, u: int, hidden: torch.Tensor, token_loss: Callable, head: _DeferredHead | None = None,
                   with_entropy: bool = False) -> torch.Tensor:
        """The unit's loss terms, plus a zero anchor on the hidden states so the backward reaches
        every layer's attention (where descendants' K/V gradients enter) even with no terms.
        With ``head``, the LM head is a constant here and ``head`` records what its gradient needs.
        ``with_entropy``: ``token_loss`` also takes the entropies (differentiable)."""
        logp, ent, values = self._score(u, hidden, with_entropy, head_grad=head is None)
        # zero-valued, but connects every layer and the heads like the untreed graph does
        anchor = hidden.sum() * 0
        for scored in (logp, values):
            if scored is not None:
                anchor = anchor + scored.sum() * 0
        hidden_rows = hidden.index_select(0, self.src[u]) if head is not None else None
        # the head's by-products of the unit's rows (``tree_backward(head_outputs=...)``), for its terms
        extra = {name: kept.pop() for name, kept in self.parts.head_outputs.items()} if logp is not None else {}
        return self._terms_loss(u, logp, ent, values, anchor, hidden_rows, token_loss, head, with_entropy, extra)

    def _terms_loss(self, u: int, logp, ent, values, anchor: torch.Tensor, hidden_rows: torch.Tensor | None,
                    token_loss: Callable, head: _DeferredHead | None, with_entropy: bool,
                    extra: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The unit's loss from its scored rows (eager or replayed): its terms plus ``anchor``."""
        if head is not None:
            logp, ent = head.record(self.rows[u], hidden_rows, logp, ent)
        if self.term_row[u].shape[0] == 0:
            return anchor.float() + self._router_term()
        rows = self.term_row[u]
        pick = [x.index_select(0, rows) if x is not None else None for x in (logp, ent, values)]
        extra = {name: x.index_select(0, rows) for name, x in (extra or {}).items()}
        out = call_token_loss(token_loss, *pick, self.term_seq[u], self.term_pos[u], with_entropy,
                              self.parts.scores_logps, extra)
        return out.sum() + anchor + self._router_term()

    def _router_term(self) -> torch.Tensor | float:
        """The unit's share of the MoE load-balancing loss in a piecewise backward (``trl_tree.engine.router``)."""
        term = self.parts.router.take_term() if self.parts.router is not None else None
        return 0.0 if term is None else term

    # ------------------------------------------------------------------ walks
    @torch.no_grad()
    def logprobs(self, with_entropy: bool) -> tuple[torch.Tensor | None, ...]:
        """Per-row ``(logps, entropies, values, extra)`` from a forward-only walk (pops are no-ops);
        None for what the call does not score; ``extra``: the head's by-products ``parts.head_outputs``
        asks for, in order (no unit is then replayed: the replayed head computes none)."""
        if self.plan.merged:
            raise ValueError("a forward-only walk scores every unit at its push or group: plan it without merge_pops")
        P = self.scoring.num_predictions
        parts = self.parts

        def buffer(wanted: bool):
            return torch.zeros(P, dtype=torch.float32, device=self.device) if wanted else None

        out = (buffer(parts.scores_logps), buffer(parts.scores_logps and with_entropy),
               buffer(parts.value_head is not None))
        extra = [torch.zeros(P, dtype=torch.bool if name == "is_top1" else torch.float32, device=self.device)
                 for name in parts.head_outputs]
        replay = self._replay(with_entropy) if not extra else None
        for step in self.plan.steps:
            if step.op == "pop":
                continue
            u = step.unit
            scores = replay.forward(self._unit(u), self._padded_unit(u)) if replay is not None else None
            if scores is None:
                hidden = self._forward(u)
                if not self.rows[u].shape[0]:
                    continue
                scores = self._score(u, hidden, with_entropy)
                for target, kept in zip(extra, parts.head_outputs.values()):
                    target[self.rows[u]] = kept.pop()
            for target, scored in zip(out, scores):
                if target is not None:
                    target[self.rows[u]] = scored
        if self.graphs is not None:
            self.graphs.dirty = False
        return (*out, extra)

    def _replay(self, with_entropy: bool) -> UnitReplay | None:
        """The unit graphs for this walk (None without); the kept stack is marked in use."""
        if self.graphs is None:
            return None
        self.graphs.dirty = True
        return UnitReplay(self.graphs, self.parts, self.temperature, with_entropy)

    def backward(self, token_loss: Callable, keep_graph: bool, with_entropy: bool = False) -> float:
        """Forward, loss and backward of every unit in depth-first order, then the LM head's weight
        gradient in one call; returns the loss value. ``with_entropy``: ``token_loss`` takes the
        entropies as a fourth argument."""
        if keep_graph and self.plan.merged:
            raise ValueError("keep_graph=True keeps a pushed node's graph until its pop, which a merged pop "
                             "recomputes: plan the walk without merge_pops")
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        kept: dict[int, torch.Tensor] = {}
        head = (_DeferredHead(self.scoring.num_predictions, self.device, with_entropy) if self._head_trains()
                else None)
        # replayed pushes are recomputed at their pop (engine: no keep_graph); the replayed head computes
        # no by-products, so a walk that hands them to its loss runs eagerly
        replay = self._replay(with_entropy) if not self.parts.head_outputs else None
        last = len(self.plan.steps) - 1
        for i, step in enumerate(self.plan.steps):
            u = step.unit
            if i == last:  # the root's pop: after its backward (and the deferred head's) every gradient is final
                last_backward_starts()
            if replay is not None and step.op == "push":
                if replay.forward(self._unit(u), self._padded_unit(u)) is None:
                    with torch.no_grad():
                        self._forward(u)
                continue
            if replay is not None:
                total += self._replayed_unit(replay, u, token_loss, head, with_entropy)
                continue
            if step.op == "push":
                if keep_graph:
                    with torch.enable_grad():
                        kept[u] = self._unit_loss(u, self._forward(u), token_loss, head, with_entropy)
                else:
                    with torch.no_grad():
                        self._forward(u)
                continue
            if step.op == "pop" and keep_graph:
                loss = kept.pop(u)
            else:
                with torch.enable_grad():
                    loss = self._unit_loss(u, self._forward(u), token_loss, head, with_entropy)
            if loss.requires_grad:
                loss.backward()
            total += loss.detach().double()
        if self.graphs is not None:
            self.graphs.dirty = False  # every gradient slot was consumed at its owner's pop
        elif head is not None:
            self.stack.release()  # the head call below is then the only thing alive besides the gradients
        if head is not None:
            kept, self.parts.head_outputs = self.parts.head_outputs, {}  # the units scored every by-product
            try:
                head.backward(self.parts, self.all_targets, self.temperature)
            finally:
                self.parts.head_outputs = kept
        return float(total)

    def _replayed_unit(self, replay: UnitReplay, u: int, token_loss: Callable, head: _DeferredHead | None,
                       with_entropy: bool) -> torch.Tensor:
        """Forward, loss and backward of unit ``u`` from its graphs (eagerly where not captured); the
        loss value. Its own function so that nothing of the unit's autograd graph outlives it: a
        node alive at the next unit's capture would tie the capture to this stream (``dfs/graphs.py``)."""
        with torch.enable_grad():
            scores = replay.train(self._unit(u), head is None, self._padded_unit(u))
            if scores is None:
                loss = self._unit_loss(u, self._forward(u), token_loss, head, with_entropy)
            else:
                logp, ent, anchor, hidden_rows = scores
                loss = self._terms_loss(u, logp, ent, None, anchor, hidden_rows, token_loss, head, with_entropy)
        loss.backward()
        return loss.detach().double()

    def _head_trains(self) -> bool:
        head = self.parts.lm_head
        if head is None or not self.parts.scores_logps:
            return False
        bias = getattr(head, "bias", None)
        return head.weight.requires_grad or (bias is not None and bias.requires_grad)


class _DeferredHead:
    """Per scoring row: its final hidden state and the gradients its log-prob (and entropy) received."""

    def __init__(self, num_rows: int, device: torch.device, with_entropy: bool = False) -> None:
        self.hidden: torch.Tensor | None = None  # [P, H], allocated at the first unit (dtype of the model)
        self.grad = torch.zeros(num_rows, dtype=torch.float32, device=device)
        self.ent_grad = torch.zeros(num_rows, dtype=torch.float32, device=device) if with_entropy else None
        self.num_rows = num_rows

    def record(self, rows: torch.Tensor, hidden_rows: torch.Tensor, logp: torch.Tensor,
               ent: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.hidden is None:
            self.hidden = hidden_rows.new_zeros(self.num_rows, hidden_rows.shape[-1])
        self.hidden[rows] = hidden_rows.detach()
        logp = _TapGrad.apply(logp, self.grad, rows)
        if ent is not None and self.ent_grad is not None:
            ent = _TapGrad.apply(ent, self.ent_grad, rows)
        return logp, ent

    def backward(self, parts: ModelParts, targets: torch.Tensor, temperature: float) -> None:
        """One head call over every row (hidden states constant): gradients of weight and bias only.
        Every unit records (each runs its loss), so ``hidden`` exists by now."""
        with torch.enable_grad():
            index = torch.arange(self.num_rows, device=self.grad.device)
            logp, ent = score_predictions(self.hidden, parts, index, targets, temperature, self.ent_grad is not None)
            outputs, grads = [logp], [self.grad.to(logp.dtype)]
            if ent is not None:
                outputs.append(ent)
                grads.append(self.ent_grad.to(ent.dtype))
            torch.autograd.backward(outputs, grads)


class _TapGrad(torch.autograd.Function):
    """Identity on the log-probs whose backward also writes their gradient into ``buffer[rows]``."""

    @staticmethod
    def forward(ctx, logp, buffer, rows):
        ctx.buffer, ctx.rows = buffer, rows
        return logp.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.buffer.index_add_(0, ctx.rows, grad.float())
        return grad, None, None
