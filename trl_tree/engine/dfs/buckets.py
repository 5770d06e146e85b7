"""The walk's units padded to buckets, so that units of free-length rollouts share CUDA graphs.

Why: a unit's graph replays one *unit signature* (``dfs/graphs.py``): its token count, the depth
of the prefix it hangs below, its segment count and maximum lengths, its scored rows. With
free-length completions no two groups of leaves hold the same number of tokens and no two prompts
have the same length, so nothing would replay and the walk would stay bound by the host on small
models. Padded as the packed layouts are (``attention/buckets.py``), units of similar size share a
signature and replay one graph (``cuda_graphs="buckets"`` with ``mode="dfs"``).

What is padded, and why every real number stays what it was:

- *Tokens*: up to ``bucket(n)`` (1/8 octave). The pad rows are appended to the unit's last segment
  (its last node's queries and keys), so no segment is added: causal attention means no real query
  sees a pad key, and a single-node unit stays one dense causal block. Pad rows are token 0 at
  position 0 (finite everywhere), never scored, so they receive exactly zero gradient and give none.
- *The own part's keys* (a group of subtrees, where a node's keys are its in-unit path): the gather
  index grows to a bucket; the extra entries lie past the last segment and are never read. Their
  rows of the kernel's key gradient are undefined (FlashAttention leaves them unwritten), so the
  scatter index sends them to a discarded row.
- *Depth*: the prefix is read from the stack as slots ``[0, power_of_two(d))`` while the kernel's
  ``cu_seqlens_k = [0, d]`` (device data) bounds what it attends; the prefix key gradient's rows past
  ``d`` are undefined too and are masked before they reach the ancestors' gradient slots. The
  unit's own K/V go to slots ``d + arange(n_b)`` (device data) instead of a slice. The prefix then
  runs on the varlen kernel (cuDNN's dense rectangle would read every slot).
- *Segments*: a unit of several nodes gets empty segments (no rows, no keys) up to a power of two:
  the kernels skip them, and groups of a few more or fewer leaves share a bucket.
- *Scored rows*: up to the tokens' bucket when the unit scores at least half its tokens (a group of
  leaves), else up to ``bucket(rows)``; pad rows read the first pad token (or row 0) and are cut
  off before the loss.
- The kernels' maximum segment lengths go up to a power of two (they only size the grids).

A padded unit costs the compute of its pad tokens (at most 12.5%, about 6% on average): the
price of a replay, paid only where a unit's exact shape has no graph (``dfs/graphs.py``).
"""

from __future__ import annotations

import numpy as np

from ..attention.buckets import _power_of_two, bucket
from .plan import Unit

#: a group's token budget is scaled by this when its units are padded, so that a padded group
#: (at most 9/8 of its tokens) stays within the memory the budget was sized for
PADDED_BUDGET_SCALE = 8 / 9


def padded_depth(depth: int) -> int:
    """The prefix slots a padded unit reads: a power of two (0 for a root unit). The kernel attends
    only the real depth, so a coarse bound costs nothing but stack slots, and prompts of different
    lengths share a bucket."""
    return _power_of_two(depth) if depth else 0


def padded_pushed_tokens(unit: Unit) -> int:
    """The leading own rows whose gradient slots a padded unit reads: all ``bucket(tokens)`` of a
    pushed node, as its pad rows' slots are never written; a merged pop's node rounded up to a bucket
    (the group's slots past its node are empty when it pops), so that prompts of nearby lengths
    share a graph."""
    n_b = bucket(unit.num_tokens)
    if unit.pushed_tokens >= unit.num_tokens:
        return n_b
    return min(bucket(unit.pushed_tokens), n_b) if unit.pushed_tokens else 0


def padded_unit_layout(layout: dict, unit: Unit, rows_src: np.ndarray, rows_targets: np.ndarray) -> dict:
    """``layout`` (``plan.unit_layout``) and the unit's scored rows (unit-relative sources, targets)
    padded to buckets (see the module docstring). Adds ``depth`` (padded), ``own_slots``,
    ``kv_scatter`` (None where each node sees only itself), ``own_only``, ``pushed_tokens``, ``src``
    and ``targets``."""
    n = unit.num_tokens
    n_b = bucket(n)
    pad = n_b - n
    kv = layout["kv_local"]
    own_only = kv.shape[0] == n  # each node sees only itself: no gather
    cu_q = layout["cu_seqlens_q"].copy()
    cu_k = layout["cu_seqlens_k"].copy()
    cu_q[-1] += pad
    cu_k[-1] += pad
    segments = cu_q.shape[0] - 1
    if segments > 1:  # empty segments up to a power of two (a one-node unit stays one causal block)
        empty = _power_of_two(segments) - segments
        cu_q = np.concatenate([cu_q, np.full(empty, cu_q[-1])])
        cu_k = np.concatenate([cu_k, np.full(empty, cu_k[-1])])
    pad_rows = np.arange(n, n_b, dtype=np.int64)
    if own_only:
        gather, scatter = np.arange(n_b, dtype=np.int64), None
    else:
        kv = np.concatenate([kv, pad_rows])  # the pad rows close the last node's keys
        extra = bucket(kv.shape[0]) - kv.shape[0]
        gather = np.concatenate([kv, np.zeros(extra, np.int64)])  # past the last segment: never read
        scatter = np.concatenate([kv, np.full(extra, n_b, np.int64)])  # their undefined gradients: row n_b, dropped
    rows = rows_src.shape[0]
    # a group of leaves scores nearly every token: its rows pad to its tokens' bucket, one number fewer
    # to tell units apart; a unit scoring few rows (a prompt) pads them to their own bucket
    rows_b = (n_b if n_b >= rows >= n // 2 else bucket(rows)) if rows else 0
    first_pad = n if pad else 0
    d = unit.depth
    return {
        "tokens": np.concatenate([layout["tokens"], np.zeros(pad, np.int64)]),
        "position_ids": np.concatenate([layout["position_ids"], np.zeros(pad, np.int64)]),
        "subtree_end": np.concatenate([layout["subtree_end"], pad_rows + 1]),  # the reference mask: itself only
        "kv_local": gather,
        "kv_scatter": scatter,
        "own_only": own_only,
        "cu_seqlens_q": cu_q,
        "cu_seqlens_k": cu_k,
        "max_seqlen_q": _power_of_two(int(np.diff(cu_q).max())),
        "max_seqlen_k": _power_of_two(int(np.diff(cu_k).max())),
        "depth": padded_depth(d),
        "real_depth": d,
        "own_slots": d + np.arange(n_b, dtype=np.int64),
        "pushed_tokens": padded_pushed_tokens(unit),
        "src": np.concatenate([rows_src, np.full(rows_b - rows, first_pad, np.int64)]),
        "targets": np.concatenate([rows_targets, np.zeros(rows_b - rows, np.int64)]),
    }


def padded_stack_size(units: list[Unit]) -> tuple[int, int]:
    """``(slots, grad_slots)`` the K/V stack needs for ``units`` padded: a unit reads slots
    ``[0, padded depth)`` and writes ``[depth, depth + bucket(tokens))``; gradients reach slots
    ``[0, padded depth)`` from every unit and the slots of pushed tokens."""
    slots = max(max(padded_depth(u.depth), u.depth + bucket(u.num_tokens)) for u in units)
    grad_slots = max([padded_depth(u.depth) for u in units] + [u.depth + padded_pushed_tokens(u) for u in units])
    return slots, grad_slots
