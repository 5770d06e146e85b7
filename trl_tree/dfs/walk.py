"""Execute a :class:`WalkPlan`: the depth-first forward/backward over a forest.

Per step:

- ``push`` (a node with children): forward; its K/V stay in their stack slots for the subtree.
  With ``keep_graph=False`` (default) the forward runs without a graph and the node is recomputed
  with grad at ``pop`` (one extra forward of internal nodes, memory of one unit at a time);
  with ``keep_graph=True`` the graph is kept until ``pop`` (no recompute, memory of the path).
- ``group`` (complete small subtrees): forward, score, backward at once.
- ``pop``: backward of the node — its own loss terms, plus the K/V gradient its descendants left
  in its slots (injected by the unit attention's backward).

Every per-token loss term is fixed before the walk (``token_loss`` is called on each unit's terms
and must be elementwise: term n may depend only on ``logps[n]``, ``seq_idx[n]``, ``pos[n]``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..attention.dispatch import install
from ..engine import check_loss_terms, tree_forward
from ..forest import PrefixForest, ScoringPlan
from ..lm_head import score_predictions
from ..model_parts import ModelParts
from .plan import WalkPlan, plan_walk, unit_layout
from .stack import KVStack, UnitAttentionMetadata

DFS_BACKENDS = ("torch_flash", "sdpa", "eager")


def resolve_dfs_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    from ..attention.backends import backend_available

    if requested == "auto":
        if backend_available("torch_flash", device, dtype)[0]:
            return "torch_flash"
        return "sdpa"
    if requested in ("flash", "flex"):
        raise ValueError(
            f"attn_backend={requested!r} is not available in mode='dfs' (its kernel would need the K/V "
            f"stack interface); use one of {', '.join(DFS_BACKENDS)} or 'auto'"
        )
    ok, why = backend_available(requested, device, dtype)  # also rejects unknown names
    if not ok:
        raise ValueError(why)
    return requested


class DepthFirstWalk:
    """One walk of one forest: holds the plan, the K/V stack and the scoring bookkeeping."""

    def __init__(self, parts: ModelParts, forest: PrefixForest, scoring: ScoringPlan, backend: str,
                 temperature: float, chunk_size: int | None) -> None:
        self.parts = parts
        self.scoring = scoring
        self.backend = backend
        self.temperature = temperature
        self.plan: WalkPlan = plan_walk(forest, scoring, chunk_size)
        self.device = parts.device
        self.stack = KVStack(parts.num_layers, self.plan.stack_size)
        # position of each scoring row inside its unit's row list
        self.row_pos = np.empty(scoring.num_predictions, dtype=np.int64)
        for rows in self.plan.rows_of_unit:
            self.row_pos[rows] = np.arange(rows.shape[0])
        # pushed units' metadata, kept from push to pop so the recompute does not rebuild it
        self._pushed: dict[int, tuple[UnitAttentionMetadata, np.ndarray]] = {}
        install(parts.causal_lm.config._attn_implementation)

    # ------------------------------------------------------------------ pieces
    def _forward(self, u: int) -> torch.Tensor:
        unit = self.plan.units[u]
        cached = self._pushed.pop(u, None)
        if cached is None:
            layout = unit_layout(self.plan.forest, unit)
            meta = UnitAttentionMetadata.build(layout, self.stack, unit.depth, self.plan.forest.max_depth,
                                               self.backend, self.device)
            cached = (meta, layout["tokens"])
        meta, tokens = cached
        meta.calls = 0
        if unit.pushed:
            self._pushed[u] = cached
        return tree_forward(self.parts, tokens, meta)

    def _release(self, u: int) -> None:
        """A popped unit's metadata is no longer needed."""
        self._pushed.pop(u, None)

    def _score(self, u: int, hidden: torch.Tensor, with_entropy: bool):
        rows = self.plan.rows_of_unit[u]
        src = torch.from_numpy(self.scoring.pred_src[rows] - self.plan.units[u].start).to(self.device)
        targets = torch.from_numpy(self.plan.forest.tokens[self.scoring.pred_dst[rows]]).to(self.device)
        return score_predictions(hidden, self.parts, src, targets, self.temperature, with_entropy)

    def _unit_loss(self, u: int, hidden: torch.Tensor, token_loss: Callable) -> torch.Tensor:
        """The unit's loss terms, plus a zero anchor on the hidden states so the backward reaches
        every layer's attention (where descendants' K/V gradients enter) even with no terms."""
        logp, _ = self._score(u, hidden, False)
        terms = self.plan.terms_of_unit[u]
        # zero-valued, but connects every layer and the LM head like the untreed graph does
        anchor = hidden.sum() * 0 + logp.sum() * 0
        if terms.shape[0] == 0:
            return anchor.float()
        local = torch.from_numpy(self.row_pos[self.scoring.gather[terms]]).to(self.device)
        lp = logp.index_select(0, local)
        seq_idx = torch.from_numpy(self.scoring.seq_idx[terms]).to(self.device)
        pos = torch.from_numpy(self.scoring.pos[terms]).to(self.device)
        out = token_loss(lp, seq_idx, pos)
        check_loss_terms(out, lp)
        return out.sum() + anchor

    # ------------------------------------------------------------------ walks
    @torch.no_grad()
    def logprobs(self, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-row log-probs (and entropies) from a forward-only walk (pops are no-ops)."""
        P = self.scoring.num_predictions
        logp = torch.zeros(P, dtype=torch.float32, device=self.device)
        ent = torch.zeros(P, dtype=torch.float32, device=self.device) if with_entropy else None
        for step in self.plan.steps:
            if step.op == "pop":
                self._release(step.unit)
                continue
            hidden = self._forward(step.unit)
            rows = torch.from_numpy(self.plan.rows_of_unit[step.unit]).to(self.device)
            if rows.numel():
                lp, en = self._score(step.unit, hidden, with_entropy)
                logp[rows] = lp
                if ent is not None:
                    ent[rows] = en
        return logp, ent

    def backward(self, token_loss: Callable, keep_graph: bool) -> float:
        """Forward, loss and backward of every unit in depth-first order; returns the loss value."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        kept: dict[int, torch.Tensor] = {}
        for step in self.plan.steps:
            u = step.unit
            if step.op == "push":
                if keep_graph:
                    with torch.enable_grad():
                        kept[u] = self._unit_loss(u, self._forward(u), token_loss)
                else:
                    with torch.no_grad():
                        self._forward(u)
                continue
            if step.op == "pop" and keep_graph:
                loss = kept.pop(u)
            else:
                with torch.enable_grad():
                    loss = self._unit_loss(u, self._forward(u), token_loss)
            if step.op == "pop":
                self._release(u)
            if loss.requires_grad:
                loss.backward()
            total += loss.detach().double()
        return float(total)
