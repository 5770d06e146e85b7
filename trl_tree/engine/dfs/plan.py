"""The depth-first walk as a list of steps over *units*, computed on the CPU before any compute.

A unit is one model call: a contiguous packed range ``[start, end)`` whose tokens all hang below
the same cached prefix (the current root path, depth ``depth``). Two kinds:

- a *pushed* node: one node (or chunk of one) with children; its K/V stay on the stack while its
  subtree is walked, and it is back-propagated last (``push`` ... ``pop``);
- a *group*: complete subtrees of consecutive siblings (leaves in the simplest case) that fit the
  group budget; forwarded, scored and back-propagated in one call (siblings sharing the cached
  prefix run together, AREAL-DTA's batching of leaves generalised to small subtrees).

*Merged pops* (``merge_pops``, a training walk that recomputes its pushed nodes): a pushed node's
recompute at its pop takes its first group of children along, when both fit the budget at the
node's depth. The node is then forwarded alone at its push (its K/V for the other children), and
the pop's one call recomputes it and runs the first group's forward and backward: a small prompt's
recompute rides in a large call instead of being a call of its own (GRPO's 256-token prompt
otherwise costs a whole latency-bound model call).

The group budget is ``chunk_size`` when one is given: nodes longer than it were already cut into
chains (``PrefixForest.split_nodes``), so no unit is larger than it and peak activation memory is
bounded by the chunk plus the K/V of the current path. Without one it is ``group_tokens(depth)``
— the memory model's ``GroupBudget``, which sizes groups to the longest sequence's footprint — or
the longest node. A run of siblings is cut into the fewest groups, balanced (16 leaves that need
two calls go 8 + 8, not 13 + 3: the same number of launches, a lower peak).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..forest import PrefixForest, ScoringPlan


@dataclass(frozen=True)
class Unit:
    start: int  # packed range [start, end)
    end: int
    depth: int  # cached prefix length (stack slots [0, depth) hold the root path)
    node_lo: int  # node ids [node_lo, node_hi) inside the unit (pre-order makes them contiguous)
    node_hi: int
    #: leading tokens whose stack slots collect their descendants' K/V gradients: all of a pushed
    #: node's, none of a group's; a merged pop's are its node's, followed by its first group
    pushed_tokens: int
    #: False for a push whose pop is a merged unit: forward only, its rows are scored by that unit
    scored: bool = True

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def pushed(self) -> bool:
        return self.pushed_tokens > 0


@dataclass(frozen=True)
class Step:
    op: str  # "push" (forward, K/V stay), "pop" (backward of a pushed unit), "group" (forward+backward)
    unit: int


@dataclass
class WalkPlan:
    forest: PrefixForest  # chunked
    units: list[Unit]
    steps: list[Step]
    stack_size: int  # slots the K/V stack needs: max over units of depth + tokens
    rows_of_unit: list[np.ndarray]  # scoring rows whose source hidden state is in the unit
    terms_of_unit: list[np.ndarray]  # loss terms answered by those rows (indices into plan.gather)

    @property
    def num_calls(self) -> int:
        """Model calls that are not only a recompute: pushes, groups and merged pops."""
        return sum(1 for s in self.steps if s.op != "pop" or self.units[s.unit].num_tokens > self.units[s.unit].pushed_tokens)

    @property
    def merged(self) -> bool:
        """Some pop is a merged unit (its push is another, forward-only unit)."""
        return any(not u.scored for u in self.units)


def plan_walk(forest: PrefixForest, scoring: ScoringPlan, chunk_size: int | None,
              group_tokens: Callable[[int], int] | None = None, merge_pops: bool = False,
              merge_long_nodes: bool = True) -> WalkPlan:
    """Cut ``forest`` into units and order them depth-first (children before a node's backward).

    ``group_tokens(depth)``: how many tokens a group below a prefix of ``depth`` tokens may hold
    (used only without ``chunk_size``, which is a hard bound). ``merge_pops``: a pop recomputes its
    node together with the node's first group of children where they fit (module docstring); only
    for a walk that recomputes pushed nodes with grad at their pop. ``merge_long_nodes=False``: only
    where the group's nodes gather no more of the node's keys than the group has tokens (a walk padded
    to buckets, ``dfs/buckets.py``: there a merged pop's shape varies with its group where a pushed
    node's pop alone repeats, so its graphs take longer to be captured, and a long node's own call is
    not latency-bound: measured, merging it gained nothing in the step)."""
    if chunk_size is not None:
        forest = forest.split_nodes(chunk_size)
        group_tokens = None
    longest_node = int(forest.node_length.max())

    def budget_at(depth: int) -> int:
        if chunk_size is not None:
            return chunk_size
        return group_tokens(depth) if group_tokens is not None else longest_node

    n = forest.num_nodes
    children: list[list[int]] = [[] for _ in range(n)]
    roots: list[int] = []
    for v, p in enumerate(forest.node_parent.tolist()):
        (children[p] if p >= 0 else roots).append(v)
    node_start = forest.node_start
    sub_end_tok = forest.subtree_end[node_start]  # packed end of each node's subtree
    sub_tokens = sub_end_tok - node_start
    # last node id of each subtree (pre-order): the node just before the first node past it
    node_sub_hi = np.searchsorted(node_start, sub_end_tok, side="left")

    units: list[Unit] = []
    steps: list[Step] = []

    def add_group(group: list[int]) -> None:
        first, last = group[0], group[-1]
        units.append(Unit(int(node_start[first]), int(sub_end_tok[last]), int(forest.node_depth[first]),
                          first, int(node_sub_hi[last]), 0))
        steps.append(Step("group", len(units) - 1))

    def merged_pop(c: int, kid_items: list[tuple[str, object]]) -> Unit | None:
        """Node ``c`` and its first group of children as one unit, where it fits (then the group is
        taken out of ``kid_items``)."""
        if not merge_pops or not kid_items or kid_items[0][0] != "group":
            return None
        group = kid_items[0][1]
        first, last = group[0], group[-1]  # type: ignore[index]
        length = int(forest.node_length[c])
        end = int(sub_end_tok[last])
        if end - int(node_start[c]) > budget_at(int(forest.node_depth[c])):
            return None
        # every node of the group gathers the node's keys in the merged call
        if not merge_long_nodes and length * (int(node_sub_hi[last]) - first) > end - int(node_start[first]):
            return None
        del kid_items[0]
        return Unit(int(node_start[c]), end, int(forest.node_depth[c]), c, int(node_sub_hi[last]), length)

    def items(kids: list[int]) -> list[tuple[str, object]]:
        """Siblings in order: runs of small subtrees become balanced groups, larger ones are walked."""
        if not kids:
            return []
        budget = budget_at(int(forest.node_depth[kids[0]]))
        out: list[tuple[str, object]] = []
        run: list[int] = []
        for c in kids:
            if sub_tokens[c] <= budget:
                run.append(c)
                continue
            out += [("group", g) for g in _balanced_groups(run, sub_tokens, budget)]
            run = []
            out.append(("node", c))
        out += [("group", g) for g in _balanced_groups(run, sub_tokens, budget)]
        return out

    # explicit stack of (sibling iterator, unit to pop when it is exhausted): chains of chunks can
    # be thousands deep, too deep for recursion
    walk: list[tuple[object, int | None]] = [(iter(items(roots)), None)]
    while walk:
        iterator, pop_unit = walk[-1]
        item = next(iterator, None)  # type: ignore[call-overload]
        if item is None:
            walk.pop()
            if pop_unit is not None:
                steps.append(Step("pop", pop_unit))
            continue
        what, x = item
        if what == "group":
            add_group(x)  # type: ignore[arg-type]
            continue
        c = x  # type: ignore[assignment]
        kid_items = items(children[c])
        pop = merged_pop(c, kid_items)
        length = int(forest.node_length[c])
        units.append(Unit(int(node_start[c]), int(node_start[c]) + length, int(forest.node_depth[c]), c, c + 1,
                          length, scored=pop is None))
        steps.append(Step("push", len(units) - 1))
        if pop is not None:
            units.append(pop)
        walk.append((iter(kid_items), len(units) - 1))

    stack_size = max(u.depth + u.num_tokens for u in units)
    # scoring rows by the (scoring) unit holding their source token; terms by their row's unit
    scoring_units = np.asarray([i for i, u in enumerate(units) if u.scored])
    unit_starts = np.asarray([units[i].start for i in scoring_units])
    order = np.argsort(unit_starts, kind="stable")
    sorted_starts = unit_starts[order]
    unit_of_row = scoring_units[order[np.searchsorted(sorted_starts, scoring.pred_src, side="right") - 1]]
    rows_of_unit = _bucket(unit_of_row, len(units))
    terms_of_unit = _bucket(unit_of_row[scoring.gather], len(units)) if scoring.num_terms else [
        np.zeros(0, dtype=np.int64) for _ in units]
    return WalkPlan(forest, units, steps, stack_size, rows_of_unit, terms_of_unit)


def _greedy_groups(run: list[int], sizes: np.ndarray, budget: int) -> list[list[int]]:
    groups: list[list[int]] = []
    total = budget + 1
    for c in run:
        if total + int(sizes[c]) > budget:
            groups.append([])
            total = 0
        groups[-1].append(c)
        total += int(sizes[c])
    return groups


def _balanced_groups(run: list[int], sizes: np.ndarray, budget: int) -> list[list[int]]:
    """Consecutive groups of ``run`` (each item fits ``budget``): as few as greedy packing needs,
    with the smallest largest group that keeps that count (greedy's group count only falls as the
    budget grows, so a bisection over the budget finds it)."""
    if not run:
        return []
    count = len(_greedy_groups(run, sizes, budget))
    total = int(sum(int(sizes[c]) for c in run))
    lo = max(max(int(sizes[c]) for c in run), -(-total // count)) - 1  # infeasible or unknown
    hi = budget  # feasible
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(_greedy_groups(run, sizes, mid)) <= count else (mid, hi)
    return _greedy_groups(run, sizes, hi)


def _bucket(keys: np.ndarray, n: int) -> list[np.ndarray]:
    order = np.argsort(keys, kind="stable")
    bounds = np.searchsorted(keys[order], np.arange(n + 1))
    return [order[bounds[i] : bounds[i + 1]] for i in range(n)]


def unit_layout(forest: PrefixForest, unit: Unit) -> dict[str, np.ndarray | int]:
    """Unit-local arrays: tokens, positions, the in-unit varlen segments, the mask rule.

    Every query of a unit sees the whole cached prefix (stack slots ``[0, depth)``: pushed nodes
    sit at their depths), so attention splits into that prefix, one dense rectangle, and the
    unit's own tree: per node, its in-unit ancestors and itself (``kv_local``: rows of the unit's
    own tokens, which sit at stack slots ``depth + (packed index - start)``).
    """
    a, b = unit.start, unit.end
    cu_q = forest.cu_seqlens_q[unit.node_lo : unit.node_hi + 1].astype(np.int64)
    cu_k = forest.cu_seqlens_k[unit.node_lo : unit.node_hi + 1].astype(np.int64)
    seg = forest.kv_index[cu_k[0] : cu_k[-1]]
    own = seg >= a  # a node's root path lists the prefix first, then in-unit ancestors, itself last
    node_of_entry = np.repeat(np.arange(cu_k.shape[0] - 1), np.diff(cu_k))
    own_len = np.bincount(node_of_entry[own], minlength=cu_k.shape[0] - 1)
    cu_own = np.zeros(own_len.shape[0] + 1, dtype=np.int64)
    np.cumsum(own_len, out=cu_own[1:])
    q_len = np.diff(cu_q)
    return {
        "tokens": forest.tokens[a:b],
        "position_ids": forest.position_ids[a:b],
        "subtree_end": np.minimum(forest.subtree_end[a:b], b) - a,
        "kv_local": seg[own] - a,
        "cu_seqlens_q": cu_q - cu_q[0],
        "cu_seqlens_k": cu_own,
        "max_seqlen_q": int(q_len.max()),
        "max_seqlen_k": int(own_len.max()),
    }


def keeps_groups(plan: WalkPlan, scoring: ScoringPlan, groups: np.ndarray) -> bool:
    """Whether every group of sequences (``groups[i]``: sequence ``i``'s group id) has all its loss
    terms in one unit — what a loss coupling a group's terms (``tree_backward(coupled=...)``) needs
    to be computed unit by unit, as the walk back-propagates each unit before the next one's forward."""
    _, group_of = np.unique(groups, return_inverse=True)
    unit_of = np.full(int(group_of.max(initial=-1)) + 1, -1, dtype=np.int64)
    for u, terms in enumerate(plan.terms_of_unit):
        here = np.unique(group_of[scoring.seq_idx[terms]])
        if (unit_of[here] >= 0).any():  # a group met again: its terms are split over units
            return False
        unit_of[here] = u
    return True
