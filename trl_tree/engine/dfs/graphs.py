"""CUDA-graph replay of the depth-first walk's units (``cuda_graphs=True`` with ``mode="dfs"``).

Why: the walk calls the whole model once per unit, and on small and medium models each call costs
more host time (Python, dispatcher, autograd: thousands of kernel launches) than GPU time, so the
GPU idles between units (docs/benchmarks/notes.md §8-9). Units of one shape repeat — the equal
groups a GRPO group's completions are cut into, the same forest in the next micro-batch or the
next ``num_iterations`` pass, an agent's turns of fixed shape — and replaying their kernels from a
CUDA graph takes the host out. Units of free-length rollouts do not repeat; with
``cuda_graphs="buckets"`` they replay the graphs of the unit padded to buckets (``dfs/buckets.py``).

What is captured, per *unit signature* (every Python-level number the unit's forward reads: its
tokens, depth, scored rows, segment counts and maximum lengths, plus the call's state as for the
packed graphs: backend, temperature, checkpointing, autocast, train/eval and adapter switches):

- a *forward* graph — the unit's forward without autograd (a pushed node's forward, a forward-only
  walk's units): writes the unit's K/V into the stack and scores its rows;
- a *train* pair — the unit's forward with autograd to its rows' scores, and its backward from
  static score gradients into the parameters' gradient buffers and the stack's K/V gradient slots.
  The token loss stays eager between the two, as in the packed graphs (``trl_tree.engine.graphs``): any
  elementwise loss, closing over any tensors, gives the eager numbers.

What a replay relies on, and how it is kept:

- The K/V stack is static memory: one per model, kept between walks, grown (and every unit graph
  dropped) when a walk needs more slots. A walk on a new stack runs eagerly, which allocates its
  buffers outside any capture.
- All graphs share the packed runner's memory pool and gradient buffers (``graphs.GraphRunner``),
  so a unit's backward must run before the next unit's forward: a pushed node is therefore
  forwarded without a graph at its push and recomputed with one at its pop (``keep_graph=False``:
  one more forward of inner nodes, the price of the replay).
- Warm-up runs before a capture execute the unit's backward, which would add to the stack's
  gradient slots and clear the unit's own; the slots are saved before and restored after.
- Replays need nothing the host reads from the GPU; calls that do (a sliding window's per-node
  paths) or that hooks record (a MoE router's loss), a critic's value head and a length-dependent
  RoPE run their units eagerly — the same numbers, without the replay.
- Several processes replay as the packed graphs do: the captured backward takes the gradients of
  views of the parameters (``graphs.GRADS_BY_AUTOGRAD_GRAD``), never reaching their AccumulateGrad
  nodes, which DDP ties to the stream they were made on. Reentrant checkpointing cannot hand
  gradients to ``torch.autograd.grad``, so under several processes it runs the units eagerly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .. import graphs as packed_graphs
from ..attention.dispatch import install
from ..attention.kept import KeptAttention
from ..lm_head import score_rows
from ..model_parts import ModelParts, activation_checkpointing
from ..packed import tree_forward
from .stack import KVStack, UnitAttentionMetadata

#: unit graphs kept per model (least recently used dropped first); they share one memory pool, so
#: a graph costs its static inputs (the unit's token and index arrays), not its activations
UNIT_GRAPH_CACHE_SIZE = 64
#: stack slots are allocated in multiples of this, so that walks of slightly different sizes
#: keep one stack (a new stack drops every unit graph)
STACK_SLOT_QUANTUM = 1024
#: unit shapes remembered as seen but not captured (least recently seen forgotten first)
SIGHTINGS_KEPT = 4 * UNIT_GRAPH_CACHE_SIZE

@dataclass(eq=False)
class _UnitGraph:
    """One unit's graph (forward) or graph pair (train) and its static tensors."""

    meta: UnitAttentionMetadata  # static: its tensors are the graph's inputs
    src: torch.Tensor
    targets: torch.Tensor
    train: bool
    outputs: tuple = ()  # static scores (log-probs[, entropies]) and, train: the zero anchor
    hidden_rows: torch.Tensor | None = None  # static final hidden states of the rows (deferred LM head)
    views: dict = field(default_factory=dict)  # several processes: the parameters' views the capture ran on
    live: tuple = ()
    grad_outputs: tuple = ()
    forward: object = None
    backward: object = None
    generation: int = -1
    walk: int = -1  # the last walk that used it


@dataclass(eq=False)
class WalkGraphs:
    """The unit graphs of one model and the K/V stack they are captured against."""

    runner: packed_graphs.GraphRunner
    stack: KVStack | None = None
    units: OrderedDict = field(default_factory=OrderedDict)
    dirty: bool = False  # a walk started and has not finished: gradient slots may hold leftovers
    walks: int = 0  # walks so far (a graph records the last one that used it)
    sightings: OrderedDict = field(default_factory=OrderedDict)  # signature -> times seen, not captured
    replayed: int = 0  # units served by a graph (captures included), since the graphs were made
    eager: int = 0  # units run eagerly (no graph yet, or one that cannot be kept)

    def stack_for(self, num_layers: int, slots: int, grad_slots: int) -> KVStack:
        """The kept stack, or a larger new one (every unit graph dropped: they hold the old buffers).
        A new stack is at least as large as the old one both ways: walks that alternate between more
        slots and more gradient slots (a forward-only walk's larger groups, then a training walk's
        deeper pushes) would otherwise replace it, and drop every graph, on every walk."""
        s = self.stack
        if s is None or len(s.k) != num_layers or s.slots < slots or s.grad_slots < grad_slots:
            q = STACK_SLOT_QUANTUM
            if s is not None and len(s.k) == num_layers:
                slots, grad_slots = max(slots, s.slots), max(grad_slots, s.grad_slots)
            self.stack = KVStack(num_layers, -(-slots // q) * q, -(-grad_slots // q) * q)
            self.units.clear()
            self.dirty = False
        elif self.dirty:
            self.stack.zero_grads()
        return self.stack


_WALK_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def walk_graphs(parts: ModelParts, backend: str, features: dict) -> WalkGraphs | None:
    """This model's unit graphs, or None where its units cannot be replayed (they run eagerly);
    ``features``: its attention's variants (``attention.support.attention_features``)."""
    if (parts.router is not None or parts.value_head is not None or parts.length_dependent_rope
            or not parts.scores_logps):
        return None
    if features["window"] or features["softcap"] is not None or features["sinks"]:
        return None
    runner = packed_graphs._runner(parts)
    if packed_graphs._grads_by_autograd_grad() and packed_graphs._reentrant_checkpointing(runner.modules):
        return None  # several processes take the gradients with autograd.grad, which reentrant checkpointing cannot
    packed_graphs.check_graphable(parts, backend, runner.params, runner.wrapper)
    state = _WALK_GRAPHS.get(parts.causal_lm)
    if state is None or state.runner is not runner:
        state = WalkGraphs(runner)
        _WALK_GRAPHS[parts.causal_lm] = state
    return state


def unit_graph_stats(model: torch.nn.Module) -> dict[str, int] | None:
    """How the walk's units of ``model`` ran since its unit graphs were made: ``graphs`` kept now
    (``padded``: of units padded to buckets), units ``replayed`` (captures included) and run
    ``eager``; None if its walk never replayed. For benchmarks and for a user asking whether
    ``cuda_graphs`` pays on their rollouts."""
    state = _WALK_GRAPHS.get(model)
    if state is None:
        return None
    padded = sum(1 for g in state.units.values() if g.meta.own_slots is not None)
    return {"graphs": len(state.units), "padded": padded, "replayed": state.replayed, "eager": state.eager}


def _static_meta(meta: UnitAttentionMetadata, stack: KVStack) -> UnitAttentionMetadata:
    """A copy of ``meta`` whose layout tensors belong to the graph (its static inputs)."""
    tensors = {f.name: getattr(meta, f.name).clone() for f in packed_graphs._data_fields(meta)
               if isinstance(getattr(meta, f.name), torch.Tensor)}
    return dataclasses.replace(meta, **tensors, stack=stack, calls=0, pairs=None, _mask=None, _windowed={},
                               graphed=True)


class UnitReplay:
    """What a walk asks of the unit graphs: a replayed unit, or None (run it eagerly)."""

    def __init__(self, state: WalkGraphs, parts: ModelParts, temperature: float, with_entropy: bool) -> None:
        self.state, self.parts, self.temperature, self.with_entropy = state, parts, temperature, with_entropy
        # a new stack's buffers are made by its first walk, eagerly: never inside a capture's warm-up
        self.ready = {train: state.stack.allocated(grads=train) for train in (False, True)}
        state.walks += 1
        runner = state.runner
        self.call_state = (float(temperature), with_entropy, activation_checkpointing(parts.causal_lm),
                           torch.is_autocast_enabled(parts.device.type),
                           packed_graphs._module_state(runner.modules, runner.adapters))

    def _signature(self, meta: UnitAttentionMetadata, src: torch.Tensor, train: bool, head_grad: bool) -> tuple:
        return ("dfs-unit", train, head_grad, *self.call_state, tuple(src.shape), packed_graphs._layout_signature(meta))

    def _sighted(self, signature: tuple, train: bool) -> bool:
        """Count a sighting of an uncaptured ``signature``; True when it is due for capture now."""
        state = self.state
        seen = state.sightings.pop(signature, 0) + 1
        # a full cache whose oldest graph served this walk or the last one keeps its graphs: walks
        # of more shapes than it holds would otherwise capture them all anew every time (LRU
        # under cyclic access); the shapes it cannot hold run eagerly
        full = (len(state.units) >= UNIT_GRAPH_CACHE_SIZE
                and next(iter(state.units.values())).walk >= state.walks - 1)
        ready = self.ready[train]
        if seen >= packed_graphs.CAPTURE_AT_SIGHTING and ready and not full and state.runner.params:
            return True
        state.sightings[signature] = min(seen, packed_graphs.CAPTURE_AT_SIGHTING - 1) if ready else seen
        while len(state.sightings) > SIGHTINGS_KEPT:
            state.sightings.popitem(last=False)
        return False

    def _graph(self, unit: tuple, train: bool, head_grad: bool, padded: tuple | None) -> _UnitGraph | None:
        """The graph that serves ``unit`` = ``(meta, src, targets)``, its inputs copied in; ``padded``:
        the same unit padded to buckets (``dfs/buckets.py``), or None. In this order, as the packed
        graphs (``graphs.graphed_scores``): the unit's own graph, if captured; its bucket's, if
        captured; its own, captured now at its second sighting (units of one shape in a walk, the
        same forest again); its bucket's, captured now at the bucket's second sighting (free-length
        rollouts); else None (run it eagerly)."""
        state = self.state
        signature = self._signature(unit[0], unit[1], train, head_grad)
        graph = state.units.get(signature) if packed_graphs.EXACT_LAYOUTS else None
        inputs = unit
        padded_signature = None
        if graph is None and padded is not None and packed_graphs.BUCKETS:
            padded_signature = self._signature(padded[0], padded[1], train, head_grad)
            graph = state.units.get(padded_signature)
            if graph is not None:
                signature, inputs = padded_signature, padded
        if graph is None:
            if not (packed_graphs.EXACT_LAYOUTS and self._sighted(signature, train)):
                if padded_signature is None or not self._sighted(padded_signature, train):
                    state.eager += 1
                    return None
                signature, inputs = padded_signature, padded
            meta, src, targets = inputs
            graph = _UnitGraph(_static_meta(meta, state.stack), src.clone(), targets.clone(), train)
            self._capture(graph, head_grad)
            state.units[signature] = graph
            while len(state.units) > UNIT_GRAPH_CACHE_SIZE:
                state.units.popitem(last=False)
        else:
            meta, src, targets = inputs
            state.units.move_to_end(signature)
            packed_graphs._copy_layout(graph.meta, meta)
            graph.src.copy_(src)
            graph.targets.copy_(targets)
        graph.walk = state.walks
        state.replayed += 1
        return graph

    def forward(self, unit: tuple, padded: tuple | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """A forward-only unit ``(meta, src, targets)`` replayed (``padded``: the same unit padded
        to buckets, or None): its K/V written into the stack, and its rows' ``(logps, entropies)``
        (None for entropies not asked); None: not captured (run it eagerly)."""
        graph = self._graph(unit, False, False, padded)
        if graph is None:
            return None
        self.state.runner.replay_forward(graph)  # the pool's activations are this graph's now
        rows = unit[1].shape[0]  # a padded graph's pad rows are cut off
        logp, *rest = graph.outputs
        return logp[:rows], (rest[0][:rows] if self.with_entropy else None)

    def train(self, unit: tuple, head_grad: bool, padded: tuple | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
        """A training unit ``(meta, src, targets)`` replayed (``padded`` as in :meth:`forward`):
        ``(logps, entropies, anchor, hidden_rows)`` whose backward replays the unit's backward graph
        (``graphs._ReplayedScores``; ``anchor``: a zero that reaches every layer, so the backward runs
        even without loss terms; ``hidden_rows``: the rows' final hidden states, constant). A padded
        graph's pad rows are cut off here: their gradient is zero. None: not captured (run it eagerly)."""
        graph = self._graph(unit, True, head_grad, padded)
        if graph is None:
            return None
        # the autograd node hangs off a fresh leaf, not the parameters: an edge to a parameter would keep
        # its AccumulateGrad node — made on this stream — alive into the next unit's capture, whose
        # backward would then accumulate on this stream (CUDA refuses: cudaErrorStreamCaptureImplicit)
        leaf = torch.zeros((), device=graph.src.device, requires_grad=True)
        out = packed_graphs._ReplayedScores.apply(self.state.runner, graph, leaf)
        rows = unit[1].shape[0]
        logp, *rest = out
        ent = rest[0][:rows] if self.with_entropy else None
        return logp[:rows], ent, rest[-1], graph.hidden_rows[:rows]

    # ------------------------------------------------------------------ capture
    def _capture(self, graph: _UnitGraph, head_grad: bool) -> None:
        """Warm up, then capture the unit's graph(s) into the runner's pool (``GraphRunner.capture``)."""
        parts, runner, meta, stack = self.parts, self.state.runner, graph.meta, self.state.stack
        install(parts.causal_lm.config._attn_implementation)
        with_entropy, temperature = self.with_entropy, self.temperature
        # several processes: the captured backward takes the gradients of views of the parameters (as the
        # packed graphs do, ``graphs.GRADS_BY_AUTOGRAD_GRAD``): DDP ties each parameter's AccumulateGrad
        # node to the stream it was made on, which a captured backward must not reach
        by_views = graph.train and packed_graphs._grads_by_autograd_grad()
        slots = packed_graphs._parameter_slots(runner.modules, runner.params) if by_views else []

        def forward() -> tuple:
            meta.calls = 0
            # kept for the recompute inside the captured backward (``attention/kept.py``)
            meta.kept = KeptAttention(parts.tree_calls) if meta.keep_attention and graph.train else None
            meta._mask = None  # the reference backends' mask, built from the static tensors inside the graph
            graph.views = runner.parameter_views() if by_views else {}
            with packed_graphs._swapped_in(slots, graph.views):
                hidden = tree_forward(parts, meta.input_ids, meta)
                logp, ent, _ = score_rows(hidden, parts, graph.src, graph.targets, temperature, with_entropy,
                                          head_grad)
            scored = (logp, ent) if with_entropy else (logp,)
            if not graph.train:
                live = scored
            else:
                anchor = hidden.sum() * 0  # zero-valued; connects every layer, like the eager walk's anchor
                for s in scored:
                    anchor = anchor + s.sum() * 0
                live = (*scored, anchor.float())
                rows = hidden.index_select(0, graph.src).detach()
                if graph.hidden_rows is None:
                    graph.hidden_rows = rows
                else:  # a stand-in's rerun: leave the values where a graph's replay would
                    graph.hidden_rows.copy_(rows)
            graph.live = live
            if graph.outputs:
                for static, new in zip(graph.outputs, live):
                    static.detach().copy_(new.detach())
            return live

        def backward(into_buffers: bool = True) -> None:
            outputs = [(o, g) for o, g in zip(graph.live, graph.grad_outputs) if o.requires_grad]
            if by_views:
                runner.backward_through_views(outputs, slots, graph.views, into_buffers)
            else:
                runner.backward_into_buffers(outputs, into_buffers)
            meta.kept = None

        device = parts.device
        runner.prepare_capture(device, grad_buffers=graph.train)
        if graph.train:
            rows = graph.src.shape[0]
            graph.grad_outputs = (*(torch.zeros(rows, dtype=torch.float32, device=device)
                                    for _ in range(2 if with_entropy else 1)),
                                  torch.zeros((), dtype=torch.float32, device=device))

        @contextlib.contextmanager
        def gradient_slots_kept():
            # the warm-ups run the unit for real: its backward adds into the prefix's gradient slots
            # and clears its own, and the walk still needs both as they are now (warmed up on the CPU
            # stand-in too, so that the tests see this)
            saved = stack.saved_grads(meta.depth + meta.num_tokens) if graph.train else None
            yield
            if saved is not None:
                stack.restore_grads(saved)

        with torch.enable_grad() if graph.train else torch.no_grad():
            runner.capture(graph, device, forward, backward if graph.train else None, warm_up_on_cpu=True,
                           around_warm_ups=gradient_slots_kept)
