"""Group-preserving shuffle and micro-batch forming for a generation batch.

TRL shuffles the rows of a generation batch across prompt groups before cutting it into
``steps_per_generation`` micro-batches, so a micro-batch usually holds one or two completions of
each prompt and the tree finds almost nothing to share. Here the rows are grouped by their prompt
tokens, the *groups* are shuffled (the same stochasticity over which prompts train together), and
every micro-batch keeps TRL's row count, so TRL's per-micro-batch loss normalisers mean exactly
what they meant. With a token budget the groups are also spread over the micro-batches by their
unique-token cost (longest-processing-time first), so no micro-batch is much heavier than another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..engine._device import upload
from ..engine.forest import common_prefix, trie_key


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Row indices grouped by identical (unpadded) prompt, in order of first appearance."""
    keys: dict[tuple[int, ...], list[int]] = {}
    ids, mask = prompt_ids.detach().cpu(), prompt_mask.detach().cpu().bool()
    for i in range(ids.shape[0]):
        keys.setdefault(tuple(ids[i][mask[i]].tolist()), []).append(i)
    return list(keys.values())


def group_cost(group: list[int], prompt_len: list[int], completion_len: list[int]) -> int:
    """Unique tokens of one group's forest, up to completions' own shared prefixes."""
    return prompt_len[group[0]] + sum(completion_len[i] for i in group)


def plan_micro_batches(
    groups: list[list[int]],
    num_batches: int,
    costs: list[int] | None = None,
    generator: torch.Generator | None = None,
    shuffle: bool = True,
) -> list[list[int]]:
    """Cut the rows of ``groups`` into ``num_batches`` equal-sized micro-batches, groups kept whole.

    Groups are first put in random order (``torch.randperm``, so the trainer's seed governs it;
    ``shuffle=False``: in the given order, e.g. TRL's own shuffled order).
    Without ``costs`` they are laid end to end and cut into equal slices (a group is split only
    where it straddles a cut). With ``costs`` each group goes, heaviest first, to the lightest
    micro-batch that still has room for all its rows; a group that fits nowhere whole is spread
    over the remaining room.
    """
    num_rows = sum(len(g) for g in groups)
    if num_batches < 1 or num_rows % num_batches:
        raise ValueError(f"{num_rows} rows cannot be cut into {num_batches} equal micro-batches")
    per_batch = num_rows // num_batches
    order = torch.randperm(len(groups), generator=generator).tolist() if shuffle else list(range(len(groups)))
    groups = [groups[k] for k in order]
    if costs is None:
        flat = [i for g in groups for i in g]
        return [flat[b * per_batch : (b + 1) * per_batch] for b in range(num_batches)]
    costs = [costs[k] for k in order]
    batches: list[list[int]] = [[] for _ in range(num_batches)]
    load = [0] * num_batches
    leftovers: list[int] = []
    for k in sorted(range(len(groups)), key=lambda k: -costs[k]):  # stable: ties keep the random order
        room = [b for b in range(num_batches) if per_batch - len(batches[b]) >= len(groups[k])]
        if not room:
            leftovers.extend(groups[k])
            continue
        b = min(room, key=lambda b: load[b])
        batches[b].extend(groups[k])
        load[b] += costs[k]
    for i in leftovers:
        b = min((b for b in range(num_batches) if len(batches[b]) < per_batch), key=lambda b: load[b])
        batches[b].append(i)
    return batches


def join_rows(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """The batch TRL's ``split_tensor_dict`` cut into ``batches``, joined back in their order: per-row
    entries (tensors with a batch dimension, lists) concatenated; scalars, None and other values as the
    first batch holds them (every piece holds the same)."""
    out: dict[str, Any] = {}
    for key, value in batches[0].items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            out[key] = torch.cat([b[key] for b in batches])
        elif isinstance(value, (list, tuple)):
            out[key] = [row for b in batches for row in b[key]]
        else:
            out[key] = value
    return out


def take_rows(batch: dict[str, Any], index: list[int]) -> dict[str, Any]:
    """Rows ``index`` of every per-row entry of a TRL batch dict; scalars pass unchanged."""
    out: dict[str, Any] = {}
    on: dict[torch.device, torch.Tensor] = {}  # the index, uploaded once per device, without a wait
    for key, value in batch.items():
        if value is None or (isinstance(value, torch.Tensor) and value.dim() == 0):
            out[key] = value
        elif isinstance(value, torch.Tensor):
            if value.device not in on:
                (on[value.device],) = upload([np.asarray(index, dtype=np.int64)], torch.int64, value.device)
            out[key] = value.index_select(0, on[value.device])
        elif isinstance(value, (list, tuple)):
            out[key] = [value[i] for i in index]
        else:
            out[key] = value
    return out


def split_into_calls(sequences: Sequence, budget: int | None) -> list[list[int]]:
    """Cut rows (lists or int arrays of token ids) into tree calls of at most ``budget`` unique
    tokens each (all in one call if None).

    Rows are taken in sorted (trie) order, so each call is a run of neighbours and its unique
    tokens are exactly the sum over its rows of ``len(row) - LCP(row, previous row in the call)``.
    A row longer than the budget on its own gets a call of its own (the depth-first walk bounds its
    memory; packed mode cannot do better than one sequence).
    """
    keys = [trie_key(s) for s in sequences]
    order = sorted(range(len(sequences)), key=keys.__getitem__)
    if budget is None:
        return [order] if order else []
    calls: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        seq = np.asarray(sequences[i], dtype=np.int64)
        shared = common_prefix(np.asarray(sequences[current[-1]], dtype=np.int64), seq) if current else 0
        cost = len(seq) - shared
        if current and used + cost > budget:
            calls.append(current)
            current, used, cost = [], 0, len(seq)
        current.append(i)
        used += cost
    if current:
        calls.append(current)
    return calls



def plan_windows(groups: list[list[int]], steps_per_generation: int, accumulation: int,
                 costs_of: Callable[[list[list[int]]], list[int]] | None = None,
                 generator: torch.Generator | None = None, shuffle: bool = True) -> list[list[int]]:
    """``plan_micro_batches`` for several optimizer steps per generation batch: the groups, in
    random order, laid end to end and cut into ``steps_per_generation / accumulation`` windows of
    equal rows (whole groups where the window's row count is a multiple of the group size), each
    window cut into its ``accumulation`` micro-batches. ``costs_of(pieces)``: the costs of the
    groups (or pieces of groups) of one window, for the token budget's balancing; None: no costs."""
    windows = steps_per_generation // accumulation
    if windows <= 1 or steps_per_generation % accumulation:
        return plan_micro_batches(groups, steps_per_generation, costs_of(groups) if costs_of else None, generator,
                                  shuffle)
    order = torch.randperm(len(groups), generator=generator).tolist() if shuffle else list(range(len(groups)))
    laid = [(k, i) for k in order for i in groups[k]]
    per_window = len(laid) // windows
    plan: list[list[int]] = []
    for w in range(windows):
        pieces: dict[int, list[int]] = {}
        for k, i in laid[w * per_window : (w + 1) * per_window]:
            pieces.setdefault(k, []).append(i)
        window = list(pieces.values())
        plan.extend(plan_micro_batches(window, accumulation, costs_of(window) if costs_of else None, generator,
                                       shuffle))
    return plan
