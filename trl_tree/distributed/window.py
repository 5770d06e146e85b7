"""One set of trees per gradient-accumulation window, each tree computed whole on one rank.

Why: TRL lays a generation batch out so that the tree loses sharing in two places. Across ranks,
each process gets a contiguous slice of rows, so a prompt group straddles ranks whenever a slice
is not a multiple of ``num_generations`` and every rank computes the prompt. Within a rank, each
micro-step sees ``per_device_train_batch_size`` rows — often 1–2 for long contexts — so a group
is cut into several small forests. Yet the micro-steps of one accumulation window all run at the
same parameters, and the update is a sum over them and over ranks. So a window:

1. gathers every rank's rows of the window (token ids and lengths: the only bulk data moved);
2. cuts them into trees (rows of one prompt), costs each tree from its lengths and depths
   (``balance``: FLOPs with the attention term), and places whole trees on ranks with the most
   even of LPT / Karmarkar–Karp / contiguous ranges — every rank computes the same plan;
3. forward, without a graph: each rank scores the trees it owns and sends each row's per-token
   results (log-probs, entropies, values) to the rank that holds the row in TRL's layout, where
   TRL's loss code runs unchanged, micro-step by micro-step;
4. each micro-step's loss gradient with respect to those per-token results is kept (the bridge,
   ``trainers.bridge``); at the window's last micro-step they go back to the owners, which run one
   tree backward each (``token_loss = g · logp``), and the gradients are averaged as DDP would.

Where the loss is a sum of per-token terms (``separable_loss``: GRPO's and PPO's policy loss in
most settings), steps 3–4 become one pass (:meth:`TreeWindow.one_pass`): at the window's first
micro-step every row's loss constants (advantage, old and reference log-probs, the normaliser's
weight) go to the trees' owners, which run forward and backward at once and send the log-probs
home, where TRL's loss code then runs for its value and metrics only.

Rows never change hands in TRL's layout — only who computes their tokens — so every loss
normaliser, advantage and metric is stock TRL's, and the update equals the untreed one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..engine._profiling import profiled
from ..engine.cost_model import StepCost, step_flops
from ..engine.forest import PrefixForest, trie_key
from .balance import balance, imbalance
from .exchange import RankExchange
from .grouping import split_into_calls
from ..engine.rows import PaddedRows

#: busiest rank over mean above which a tree is cut in two to balance the ranks
SPLIT_ABOVE = 1.05

#: a pass's forward over the owned rows: (rows, calls, forests, rope_length) -> padded per-token
#: results on ``rows`` (None where the pass has none of a kind)
Score = Callable[[PaddedRows, list, list, int], Sequence[torch.Tensor | None]]
#: a pass's backward over the owned rows: (rows, calls, forests, rope_length, padded gradients)
Backward = Callable[[PaddedRows, list, list, int, Sequence[torch.Tensor | None], bool], None]
#: a one-pass pass over the owned rows: (rows, calls, forests, rope_length, padded per-token constants
#: ``(B, T, K)``, whether it is the last group of calls) -> padded per-token results, as ``Score``
OnePass = Callable[[PaddedRows, list, list, int, torch.Tensor, bool], Sequence[torch.Tensor | None]]


@dataclass
class WindowRow:
    """One row of the window: where TRL holds it and what it is."""

    rank: int
    micro: int
    row: int
    tokens: np.ndarray
    score_from: int
    width: int  # its micro-batch's padded width (what a length-dependent RoPE sees in stock TRL)

    @property
    def scored(self) -> int:
        return len(self.tokens) - self.score_from


def group_step_cost(prompt_len: int, completion_lens: Sequence[int]) -> StepCost:
    """What one prompt group's tree runs, from lengths alone: the prompt once, each completion on
    top (their own shared prefixes ignored — an upper bound), the attention term Σ depth over the
    unique tokens (a token at depth ``d`` sees ``d`` keys)."""
    p = prompt_len
    pairs = p * (p + 1) // 2 + sum(c * (2 * p + c + 1) // 2 for c in completion_lens)
    return StepCost(tokens=p + sum(completion_lens), predictions=sum(completion_lens), attention_pairs=pairs)


@dataclass
class _Pass:
    backward: Backward | None  # None: a forward-only pass (the placed old / reference log-probs)
    dtypes: list[torch.dtype | None]  # of each kind of output (None: the pass has none)
    outputs: list[list[torch.Tensor | None]]  # per micro-step, per kind: padded on the micro-step's rows
    grads: list[list[torch.Tensor | None]]  # per micro-step, per kind


class TreeWindow:
    """The plan and the passes (policy, critic) of one window. Every rank builds it from its own
    micro-batches (``micro_rows``, ``widths``) in the same collective call."""

    def __init__(self, micro_rows: list[PaddedRows], widths: list[int], exchange: RankExchange, config,
                 gradient_checkpointing: bool, token_budget: int | None, split_by_width: bool,
                 stock_two_pass: bool, one_pass: bool = False, fill_ranks: bool = False) -> None:
        self.micro_rows, self.exchange, self.token_budget = micro_rows, exchange, token_budget
        gathered = [decode_payload(v) for v in exchange.all_gather_ints(encode_payload(micro_rows, widths))]
        self.rows = [WindowRow(rank, m, i, tokens, first, rank_widths[m])
                     for rank, (micros, rank_widths) in enumerate(gathered)
                     for m, micro in enumerate(micros) for i, (tokens, first) in enumerate(micro)]
        prompts = [row.tokens[: row.score_from].tobytes() for row in self.rows]  # hashable, cheap to hash
        units: dict[tuple, list[int]] = {}
        for g, row in enumerate(self.rows):
            units.setdefault((row.width if split_by_width else None, prompts[g]), []).append(g)
        self.units = list(units.values())

        def flops(rows: list[int], two_pass: bool) -> float:
            cost = group_step_cost(self.rows[rows[0]].score_from, [self.rows[g].scored for g in rows])
            extra = step_flops(cost, config, False) / 3 if two_pass else 0.0  # the forward without a graph
            return step_flops(cost, config, gradient_checkpointing) + extra

        # the window's policy pass: one forward+backward where the loss is separable (``one_pass``), else two
        self.units, costs, bins = self._place(self.units, lambda u: flops(u, not one_pass), exchange.world,
                                              fill_ranks)
        self.imbalance = imbalance(costs, bins)
        self.rank_costs = [sum(costs[u] for u in b) for b in bins]
        self.owner = [0] * len(self.rows)
        for rank, b in enumerate(bins):
            for u in b:
                for g in self.units[u]:
                    self.owner[g] = rank
        # what TRL's own layout costs each rank: micro-step by micro-step, a forest per micro-batch
        stock = [0.0] * exchange.world
        pieces: dict[tuple, list[int]] = {}
        for g, row in enumerate(self.rows):
            pieces.setdefault((row.rank, row.micro, prompts[g]), []).append(g)
        for key, rows in pieces.items():
            stock[key[0]] += flops(rows, stock_two_pass)
        self.stock_rank_costs = stock
        self.stock_imbalance = imbalance(stock, [[r] for r in range(exchange.world)])
        self.owned = [g for g, r in enumerate(self.owner) if r == exchange.rank]
        self.home = [g for g, row in enumerate(self.rows) if row.rank == exchange.rank]
        self.passes: dict[str, _Pass] = {}
        self._by_width = split_by_width
        self._layout = None

    @property
    def idle_ranks(self) -> list[int]:
        """The ranks that own no tree in this window (fewer trees than ranks, even after a cut)."""
        return [rank for rank, cost in enumerate(self.rank_costs) if cost == 0]

    # ------------------------------------------------------------------ plan

    def _place(self, units: list[list[int]], cost: Callable[[list[int]], float], ranks: int,
               fill_ranks: bool = False):
        """Whole trees onto ranks (``balance``); while the busiest rank carries more than
        ``SPLIT_ABOVE`` × the mean, its heaviest tree is cut in two (rows in trie order, so each
        half keeps its shared prefixes; each half pays the prompt again) where that lowers the
        busiest rank's cost — few large trees over many ranks cannot be balanced whole.

        ``fill_ranks`` (FSDP2, which cannot run a window that leaves a rank without a tree): then
        the heaviest tree is cut on until every rank owns one, whether or not that lowers the
        busiest rank's cost — the other choice there is no window at all. Elsewhere an idle rank
        is kept where cutting does not pay: the cost model undervalues a prompt computed twice
        (measured: two agentic tasks cut over four ranks ran slower than left whole on two)."""
        costs = [cost(u) for u in units]
        bins, _, worst = balance(costs, ranks)

        def cut(u: int):
            rows = sorted(units[u], key=lambda g: trie_key(self.rows[g].tokens))
            halves = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
            trial_costs = costs[:u] + [cost(h) for h in halves] + costs[u + 1 :]
            return (units[:u] + halves + units[u + 1 :], trial_costs, *balance(trial_costs, ranks)[::2])

        for _ in range(2 * ranks):
            totals = [sum(costs[u] for u in b) for b in bins]
            if worst <= SPLIT_ABOVE:
                break
            busiest = max(range(ranks), key=totals.__getitem__)
            cuttable = [u for u in bins[busiest] if len(units[u]) > 1]
            if not cuttable:
                break
            trial, trial_costs, trial_bins, trial_worst = cut(max(cuttable, key=costs.__getitem__))
            if max(sum(trial_costs[i] for i in b) for b in trial_bins) >= max(totals):
                break
            units, costs, bins, worst = trial, trial_costs, trial_bins, trial_worst
        # ``balance`` leaves no rank idle once there are as many trees as ranks (LPT, tried first, gives
        # each idle rank the next tree, and a tie keeps it), so only cutting can fill one
        while fill_ranks and any(not b for b in bins):
            cuttable = [u for u in range(len(units)) if len(units[u]) > 1]
            if not cuttable:  # fewer rows than ranks
                break
            units, costs, bins, worst = cut(max(cuttable, key=costs.__getitem__))
        return units, costs, bins

    @property
    def pays(self) -> bool:
        """Whether the placed trees cost the busiest rank less than TRL's layout does."""
        return max(self.rank_costs) < max(self.stock_rank_costs)

    @profiled("trl_tree.window.layout")
    def layout(self, device: torch.device) -> tuple[PaddedRows, list[tuple[list, list[PrefixForest], int]]]:
        """The owned rows and their tree calls: ``[(calls, forests, rope_length)]``, one entry per
        padded width where a length-dependent RoPE needs it (``split_by_width``; else one entry at
        the widest), calls cut by ``token_budget``. A row with nothing to score (a completion masked
        whole) is left out: it adds no token to the flat per-token vectors either way."""
        if self._layout is None:
            scored = [g for g in self.owned if self.rows[g].scored > 0]
            owned = PaddedRows.from_host([self.rows[g].tokens for g in scored],
                                         [self.rows[g].score_from for g in scored], device)
            by_width: dict[int, list[int]] = {}
            for i, g in enumerate(scored):
                by_width.setdefault(self.rows[g].width, []).append(i)
            if not self._by_width and by_width:
                by_width = {max(by_width): list(range(len(scored)))}
            groups = []
            for width in sorted(by_width):
                index = by_width[width]
                calls = [[index[j] for j in call] for call in split_into_calls([owned.host[i] for i in index],
                                                                                 self.token_budget)]
                # built from the host's arrays: the device copies are not read back
                groups.append((calls, [PrefixForest.from_sequences([owned.host[i] for i in c]) for c in calls],
                               width))
            self._layout = owned, groups
        return self._layout

    @property
    def forests(self) -> list[PrefixForest]:
        """The forests this rank computes (built on first use)."""
        return [f for _, forests, _ in self._layout[1] for f in forests] if self._layout else []

    # ------------------------------------------------------------------ passes
    @profiled("trl_tree.window.forward")
    def forward(self, name: str, score: Score, backward: Backward | None, device: torch.device) -> None:
        """Run a pass's forward on the owned trees and bring each row's results home; ``backward``
        (None for a forward-only pass) runs at :meth:`backward` with the rows' loss gradients."""
        if name in self.passes:
            raise RuntimeError(f"the window's {name!r} pass already ran its forward")
        owned, groups = self.layout(device)
        results = _summed(score(owned, calls, forests, rope_length) for calls, forests, rope_length in groups)
        self._bring_home(name, results, backward, device)

    @profiled("trl_tree.window.one_pass")
    def one_pass(self, name: str, constants: list[torch.Tensor], run: OnePass, device: torch.device) -> None:
        """A pass whose loss is a sum of per-token terms (``separable_loss``): each micro-step's
        per-token ``constants`` (padded ``(B, T, K)`` on its rows) go to the trees' owners, which run
        forward and backward at once (``run``), and each row's results come home as a forward's do.
        Nothing is left for :meth:`backward`: the gradients are already in ``.grad``."""
        if name in self.passes:
            raise RuntimeError(f"the window's {name!r} pass already ran")
        owned, groups = self.layout(device)
        width = constants[0].shape[-1] if constants else 0
        parts = [rows.flat(c.float()) if rows.sequences else torch.zeros(0, width, device=device)
                 for rows, c in zip(self.micro_rows, constants)]
        mine = self._send(torch.cat(parts), True, device, torch.float32)
        padded = torch.zeros(*owned.shape, width, device=device)
        if owned.sequences:
            padded.index_put_(owned.positions([list(range(len(owned.sequences)))]), torch.cat(mine))
        results = _summed(run(owned, calls, forests, rope_length, padded, k == len(groups) - 1)
                          for k, (calls, forests, rope_length) in enumerate(groups))
        if results is None:  # nothing to compute here: the kinds of results, empty
            results = list(run(owned, [], [], 0, padded, True))
        # every rank ran ``run`` (if only on nothing), so every rank knows the kinds: no agreement needed
        self._bring_home(name, results, None, device, [None if r is None else r.dtype for r in results])

    @profiled("trl_tree.window.bring_home")
    def _bring_home(self, name: str, results: list[torch.Tensor | None] | None, backward: Backward | None,
                    device: torch.device, dtypes: list[torch.dtype | None] | None = None) -> None:
        """Send each owned row's per-token ``results`` to the row's home rank; keep them as the pass
        ``name``. The kinds of one dtype travel together (one all-to-all); ``dtypes``: the kinds,
        where every rank knows them (else the ranks agree on them first)."""
        owned, _ = self.layout(device)
        if dtypes is None:
            dtypes = self._agree(None if results is None else [None if r is None else r.dtype for r in results])
        outputs: list[list[torch.Tensor | None]] = [[None] * len(dtypes) for _ in self.micro_rows]
        for dtype in dict.fromkeys(d for d in dtypes if d is not None):
            kinds = [k for k, d in enumerate(dtypes) if d == dtype]
            flats = [owned.flat(results[k]) if results is not None and results[k] is not None
                     else torch.zeros(len(owned.rows), dtype=dtype, device=device) for k in kinds]
            home_flat = self._send(torch.stack(flats, dim=-1), False, device, dtype)
            for m, rows in enumerate(self.micro_rows):
                for j, k in enumerate(kinds):
                    part = home_flat[m][:, j]
                    outputs[m][k] = rows.to_padded([part], [list(range(len(rows.sequences)))]) if rows.sequences \
                        else part.new_zeros(rows.shape)
        self.passes[name] = _Pass(backward, dtypes, outputs, [[None] * len(dtypes) for _ in self.micro_rows])

    def outputs(self, name: str, micro: int) -> list[torch.Tensor | None]:
        return self.passes[name].outputs[micro]

    def add_grads(self, name: str, micro: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Keep micro-step ``micro``'s loss gradients with respect to the pass's outputs."""
        kept = self.passes[name].grads[micro]
        for k, g in enumerate(grads):
            if g is not None:
                kept[k] = g.detach() if kept[k] is None else kept[k] + g.detach()

    @profiled("trl_tree.window.backward")
    def backward(self, device: torch.device) -> None:
        """Send every pass's gradients to the trees' owners and run each pass's tree backward."""
        owned, groups = self.layout(device)
        for p in self.passes.values():
            if p.backward is None:
                continue
            flags = [any(g[k] is not None for g in p.grads) for k in range(len(p.dtypes))]
            present = self._agree([p.dtypes[k] if f else None for k, f in enumerate(flags)])
            if not any(d is not None for d in present):
                continue  # the loss did not depend on this pass
            padded: list[torch.Tensor | None] = []
            for k, dtype in enumerate(present):
                if dtype is None:
                    padded.append(None)
                    continue
                parts = [rows.flat(g[k]).to(dtype) if g[k] is not None
                         else torch.zeros(len(rows.rows), dtype=dtype, device=device)
                         for rows, g in zip(self.micro_rows, p.grads)]
                mine = self._send(torch.cat(parts), True, device, dtype)
                padded.append(owned.to_padded([torch.cat(mine)], [list(range(len(owned.sequences)))])
                              if owned.sequences else None)
            if owned.sequences:
                for k, (calls, forests, rope_length) in enumerate(groups):
                    p.backward(owned, calls, forests, rope_length, padded, k == len(groups) - 1)
            else:  # no tree here: the backward's collectives (the average's buckets) still go out now
                p.backward(owned, [], [], 0, padded, True)
        self.passes.clear()

    # ------------------------------------------------------------------ exchange
    def _agree(self, dtypes: list[torch.dtype | None] | None) -> list[torch.dtype | None]:
        """Which kinds of per-token values any rank has, and their dtype (a rank that owns no tree,
        or whose micro-steps gave no gradient, learns them from the others)."""
        every = [d for d in self.exchange.all_gather_object(dtypes) if d is not None]
        if not every:
            return []
        return [next((d[k] for d in every if d[k] is not None), None) for k in range(len(every[0]))]

    @profiled("trl_tree.window.exchange")
    def _send(self, flat: torch.Tensor | None, to_owners: bool, device: torch.device,
              dtype: torch.dtype) -> list[torch.Tensor]:
        """Move per-token values between the rows' two places: from the trees' owners to the rows'
        home ranks (results; ``flat`` in owned-row order, None where this rank owns nothing), or back
        (``to_owners``: loss gradients, ``flat`` in home-row order). Returns what arrives here in the
        receiving order: one tensor per micro-step at home, one per row at the owner."""
        sources, targets = (self.home, self.owned) if to_owners else (self.owned, self.home)
        dest_of = (lambda g: self.owner[g]) if to_owners else (lambda g: self.rows[g].rank)
        src_of = (lambda g: self.rows[g].rank) if to_owners else (lambda g: self.owner[g])
        counts = [self.rows[g].scored for g in sources]
        if flat is None:
            flat = torch.zeros(sum(counts), dtype=dtype, device=device)
        trailing = tuple(flat.shape[1:])  # per-token vectors (a one-pass's constants) move whole
        per_token = max(int(np.prod(trailing)), 1) if trailing else 1
        pieces = list(flat.to(dtype).split(counts)) if counts else []
        send = [[] for _ in range(self.exchange.world)]
        for g, piece in zip(sources, pieces):
            send[dest_of(g)].append(piece)
        send_t = [torch.cat(s).reshape(-1) if s else torch.zeros(0, dtype=dtype, device=device) for s in send]
        recv_sizes = [0] * self.exchange.world
        for g in targets:
            recv_sizes[src_of(g)] += self.rows[g].scored
        received = self.exchange.all_to_all(send_t, [n * per_token for n in recv_sizes])
        received = [r.view(-1, *trailing) for r in received]
        # targets arrive grouped by source rank, each group in target order: put them back in order
        cursor = [0] * self.exchange.world
        by_target = []
        for g in targets:
            s, n = src_of(g), self.rows[g].scored
            by_target.append(received[s][cursor[s] : cursor[s] + n])
            cursor[s] += n
        if to_owners:
            return by_target
        out, start = [], 0
        for m, rows in enumerate(self.micro_rows):
            n = len(rows.sequences)
            chunk = by_target[start : start + n]
            out.append(torch.cat(chunk) if chunk else torch.zeros(0, *trailing, dtype=dtype, device=device))
            start += n
        return out


def _summed(per_group) -> list[torch.Tensor | None] | None:
    """The padded per-token results of a pass's groups of calls (one per padded width), kind by
    kind, added: each group fills only its own rows' cells. None where there was no group."""
    results = None
    for out in per_group:
        out = list(out)
        results = out if results is None else [b if a is None else a if b is None else a + b
                                               for a, b in zip(results, out)]
    return results


def encode_payload(micro_rows: list[PaddedRows], widths: list[int]) -> np.ndarray:
    """What a rank sends every other when a window opens, as one int64 array: the number of
    micro-steps and their padded widths, then per micro-step its row count, the rows' lengths and
    score offsets, then every row's tokens (one read-back per micro-batch)."""
    header: list[int] = [len(micro_rows), *widths]
    tokens: list[np.ndarray] = []
    for rows in micro_rows:
        seqs = rows.host_sequences()
        header += [len(seqs), *(len(t) for t in seqs), *(int(f) for f in rows.score_from)]
        tokens += seqs
    return np.concatenate([np.asarray(header, np.int64), *tokens]) if tokens else np.asarray(header, np.int64)


def decode_payload(values: np.ndarray) -> tuple[list[list[tuple[np.ndarray, int]]], list[int]]:
    """:func:`encode_payload` read back: per micro-step its rows' ``(tokens, score_from)``, and the widths."""
    n = int(values[0])
    widths = [int(w) for w in values[1 : 1 + n]]
    at, shapes = 1 + n, []
    for _ in range(n):
        rows = int(values[at])
        lengths, firsts = values[at + 1 : at + 1 + rows], values[at + 1 + rows : at + 1 + 2 * rows]
        shapes.append((lengths.tolist(), firsts.tolist()))
        at += 1 + 2 * rows
    micros = []
    for lengths, firsts in shapes:
        micro = []
        for length, first in zip(lengths, firsts):
            micro.append((values[at : at + length], int(first)))
            at += length
        micros.append(micro)
    if at != len(values):
        raise ValueError(f"a window's payload of {len(values)} values decoded to {at}: it was not encode_payload's")
    return micros, widths
