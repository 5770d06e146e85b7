"""CUDA-graph replay of the packed training call: the forward to the log-probs, and its backward.

Why: on small models the packed step waits on the host, not the GPU. A tree step launches
thousands of kernels over only a few thousand unique tokens, and each launch costs tens of
microseconds of Python, dispatcher and autograd time, so the GPU idles for much of the step. A
CUDA graph replays the same kernels with one launch, which brings the step close to the GPU's own
kernel time (measured: ``python -m trl_tree.bench.graphs``; docs/benchmarks/README.md and notes.md
§9-17). Replayed calls also run the root split's dense blocks on cuDNN at head_dim 64
(``partial.CUDNN_GRAPHED_MIN_HEAD_DIM``).

What is captured, per *layout signature* (every Python-level number the forward reads: token,
node, key and prediction counts, the kernels' maximum lengths, the root split's shapes, the
temperature, the model's training/adapter state): two graphs sharing one memory pool.

- forward: the packed model call and TRL's fused head, from static input buffers (tokens, tree
  metadata, prediction indices) to static log-probs (and entropies, and the head's by-products a
  call asks for: ``parts.head_outputs``, DPO's metrics);
- backward: from static output-gradient buffers back into one gradient buffer per trainable
  parameter (the parameters' ``.grad`` are pointed at those buffers while it is captured).

The loss is *not* captured. An autograd function replays the forward, hands back copies of the
log-probs, and on backward copies the incoming gradient in and replays the backward, which adds
into the gradient buffers; those become the parameters' ``.grad`` (accumulating in place, as
eager autograd does; ``GraphRunner.replay_backward``). So a graph never freezes user code or the
tensors a loss closes over (advantages, old log-probs): any loss, any number of accumulated
micro-batches, exactly the numbers of the eager call.

When: a signature is captured the second time it is seen; the first call runs eagerly. A
training run whose micro-batches never repeat a layout (GRPO with free-length completions) pays
only that bookkeeping and never captures; layouts that repeat — fixed-length rollouts, an agent
whose turns have fixed shapes, the benchmarks — replay. With ``cuda_graphs="buckets"`` a layout
that does not repeat replays the graphs of its layout padded to buckets (``attention/buckets.py``);
that pays on host-bound small models and costs more than it saves on larger ones, hence opt-in
(docs/benchmarks/notes.md §17).

Rules a replay keeps (each checked, never a wrong number): the forward replayed last must be the
one whose backward runs (the pool holds one step's activations), so the backward of an earlier
graphed call after a later one's forward raises; models wrapped for DDP/FSDP and parameters with
gradient hooks are refused (their hooks would run only while capturing). Several processes: call
the unwrapped model and average the gradients by hand, as the trainers do under DDP
(``TreeTrainerMixin._graphs_by_hand``); there the captured calls run on views of the parameters
(``GRADS_BY_AUTOGRAD_GRAD``), since DDP pins each parameter's AccumulateGrad node to the stream it
was made on. Cost in memory: the pool (one step's activations and the checkpoint recompute's
temporaries, as in the eager step, kept between steps) plus one gradient-sized buffer per
trainable parameter (under several processes, the pool also holds the captured gradients).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from .attention.dispatch import install
from .attention.kept import KeptAttention
from .attention.metadata import TreeAttentionMetadata
from .forest import PrefixForest, ScoringPlan
from .lm_head import score_predictions
from .model_parts import ModelParts, trainable_parameters
from .packed import tree_forward

#: graph pairs kept per model (least recently used dropped first); all share one memory pool, so
#: a pair costs its static buffers, not a step's activations (free-length runs use several buckets)
GRAPH_CACHE_SIZE = 8
#: with ``cuda_graphs="buckets"``, replay a layout that does not repeat from the graphs of its bucket
#: (``attention/buckets.py``); False turns that off everywhere
BUCKETS = True
#: capture a layout's own graphs when it repeats (False: buckets only — how ``check_gpu`` checks them)
EXACT_LAYOUTS = True
#: capture a layout at this sighting (the first ones run eagerly): a layout seen once is not worth
#: a capture, which costs a warm-up step plus the capture itself
CAPTURE_AT_SIGHTING = 2
#: layouts remembered as seen but not captured (least recently seen forgotten first): a run whose
#: layouts never repeat must not grow this without bound
SIGHTINGS_KEPT = 64
#: eager runs on a side stream before a capture (PyTorch's rule: lazy initialisations — cuBLAS
#: workspaces, cuDNN plans, Triton autotuning — must happen outside the graph)
WARMUP_RUNS = 2
#: backends whose kernels a graph can hold (flex compiles its block mask on first use)
GRAPH_BACKENDS = ("torch_flash", "flash", "sdpa", "eager")

#: how a captured backward hands the parameters' gradients to their buffers: False — autograd
#: accumulates into them (the buffers are ``.grad`` while capturing; no extra kernel); True — the
#: captured calls run on views of the parameters (swapped into their modules for the forward and
#: the backward, the checkpointed recompute included), ``torch.autograd.grad`` returns the views'
#: gradients and one multi-tensor add puts them in the buffers. None: True where
#: ``torch.distributed`` is initialised. Why: DDP keeps every parameter's AccumulateGrad node alive
#: from its construction, tied to the stream it was made on; a captured backward that reaches such
#: a node makes that stream wait on the capturing one, which CUDA refuses
#: (``cudaErrorStreamCaptureImplicit``, seen with 2 GPUs); the views' gradients stop short of it.
GRADS_BY_AUTOGRAD_GRAD: bool | None = None

_WRAPPERS_REFUSED = ("DistributedDataParallel", "FullyShardedDataParallel", "DeepSpeedEngine")


class _CudaGraph:
    """One ``torch.cuda.CUDAGraph`` in a shared pool: ``capture(fn)`` runs ``fn`` under capture, on
    ``stream`` (the runner's: see ``_capture``)."""

    def __init__(self, pool, stream=None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool, self.stream = pool, stream

    def capture(self, fn: Callable[[], object], runs_now: bool = True) -> object:
        with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream):  # records fn's kernels, runs none
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class EagerReplay:
    """Stand-in for a CUDA graph where there is none (CPU tests): ``replay`` runs the captured
    function again, and ``refresh`` copies that run's outputs into the first run's tensors, which
    is what a graph's replay leaves in its static outputs. Everything around the graph — static
    buffers, signatures, the autograd function, the gradient buffers — is the code that runs on the
    GPU."""

    def __init__(self, pool=None, stream=None) -> None:
        self.fn: Callable[[], object] | None = None

    def capture(self, fn: Callable[[], object], runs_now: bool = True) -> object:
        """Run ``fn`` now only where its results are needed as the static outputs (``runs_now``):
        a CUDA capture runs nothing, and the backward writes into buffers that may hold gradients."""
        self.fn = fn
        return fn() if runs_now else None

    def replay(self) -> None:
        with torch.enable_grad():  # an autograd function's forward runs without; the rerun must build a graph
            self.fn()


#: what builds a graph on a device without CUDA graphs; tests set ``EagerReplay``
CPU_STAND_IN: type | None = None


def _new_graph(device: torch.device, pool, stream=None):
    if device.type == "cuda":
        return _CudaGraph(pool, stream)
    if CPU_STAND_IN is not None:
        return CPU_STAND_IN(pool, stream)
    raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, not {device.type}")


def check_graphable(parts: ModelParts, backend: str, params: tuple[torch.nn.Parameter, ...],
                    wrapper: str | None) -> None:
    """Refuse what a replay would get wrong (hooks that run only while capturing) or cannot run
    (``wrapper``: the name of a distributed wrapper around the model, if any)."""
    if parts.device.type != "cuda" and CPU_STAND_IN is None:
        raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, not {parts.device.type}")
    if wrapper is not None:
        raise ValueError(
            f"cuda_graphs=True cannot run a model wrapped in {wrapper}: its gradient hooks and collectives would "
            "run only while capturing. Call the unwrapped model and average the gradients yourself (the trainers' "
            "tree_cuda_graphs does so under DDP), or use cuda_graphs=False")
    if backend not in GRAPH_BACKENDS:
        raise ValueError(f"cuda_graphs=True runs the {', '.join(GRAPH_BACKENDS)} backends, not {backend!r}")
    for p in params:
        hooks = (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()
        # a hook that marks itself skippable (the trainers' overlapped average: it only starts early what
        # its finish() does anyway) may be left out of a replay
        if p._backward_hooks or any(not getattr(h, "skippable_in_replay", False) for h in hooks):
            raise ValueError("cuda_graphs=True: a trainable parameter has a gradient hook, which a replayed "
                             "backward would skip; remove it or use cuda_graphs=False")


def _layout_signature(value, path: str = "") -> tuple:
    """Every Python-level number of the metadata (tensors by shape and dtype: their values are data
    the replay copies in). Anything else in the metadata that a capture would freeze is refused."""
    if isinstance(value, torch.Tensor):
        return (path, "tensor", tuple(value.shape), value.dtype)
    if value is None or isinstance(value, (bool, int, float, str)):
        return (path, value)
    if isinstance(value, tuple):
        return (path, tuple(_layout_signature(v, f"{path}[{i}]") for i, v in enumerate(value)))
    if dataclasses.is_dataclass(value):
        return (path, type(value).__name__,
                tuple(_layout_signature(getattr(value, f.name), f"{path}.{f.name}") for f in _data_fields(value)))
    raise TypeError(f"cuda_graphs: cannot tell the layout of {path} ({type(value).__name__})")


#: metadata fields that are not its layout (its call counter, caches, kept outputs); a metadata class
#: with others names them in its ``NOT_LAYOUT``
NOT_LAYOUT = ("calls", "_cache", "kept")


def _data_fields(value) -> list:
    """The metadata's fields that describe the layout."""
    skipped = getattr(value, "NOT_LAYOUT", NOT_LAYOUT)
    return [f for f in dataclasses.fields(value) if f.name not in skipped]


def _copy_layout(static, new) -> None:
    """Copy every tensor of ``new`` into the same place of ``static`` (same signature)."""
    if isinstance(static, torch.Tensor):
        static.copy_(new)
    elif isinstance(static, tuple):
        for s, n in zip(static, new):
            _copy_layout(s, n)
    elif dataclasses.is_dataclass(static):
        for f in _data_fields(static):
            _copy_layout(getattr(static, f.name), getattr(new, f.name))


def _module_state(modules: tuple[torch.nn.Module, ...], adapters: tuple[torch.nn.Module, ...]) -> tuple:
    """Python-side switches a forward reads that a capture would freeze: train/eval of every module,
    and PEFT's adapter switches (``disable_adapter()``, the active adapter) of its adapter layers."""
    return (tuple(m.training for m in modules),
            tuple((m._disable_adapters, str(m._active_adapter)) for m in adapters))


@dataclass(eq=False)
class _GraphPair:
    """The two graphs of one layout and their static tensors."""

    tokens: torch.Tensor
    pred_src: torch.Tensor
    targets: torch.Tensor
    meta: TreeAttentionMetadata
    outputs: tuple = ()  # static (log-probs[, entropies][, head by-products]) the forward graph writes
    live: tuple = ()  # the outputs of the latest forward run (the graph's, or the stand-in's)
    grad_outputs: tuple = ()  # static gradients of the outputs the backward graph reads
    forward: object = None
    backward: object = None
    generation: int = -1  # the runner's replay count at this pair's last forward
    views: dict = field(default_factory=dict)  # id(parameter) -> the view the captured calls ran on (by views)


@dataclass(eq=False)
class GraphRunner:
    """The captured graph pairs of one model, their shared pool and gradient buffers."""

    params: tuple[torch.nn.Parameter, ...]
    modules: tuple[torch.nn.Module, ...] = ()  # the outer model's modules (itself first), looked at per call; weak proxies
    adapters: tuple[torch.nn.Module, ...] = ()  # those with PEFT's adapter switches
    outer: object = None  # a weak reference to the outer model they were listed from
    wrapper: str | None = None  # the class name of a distributed wrapper among them (refused)
    grad_buffers: tuple[torch.Tensor, ...] = ()
    pairs: OrderedDict = field(default_factory=OrderedDict)
    sightings: OrderedDict = field(default_factory=OrderedDict)  # signature -> times seen, not captured
    pool: object = None
    stream: object = None  # the CUDA stream every warm-up and capture runs on (see _capture)
    generation: int = 0  # forward replays so far (any pair): the pool holds the latest one's activations
    captures: int = 0

    def prepare_capture(self, device: torch.device, grad_buffers: bool = True) -> None:
        """What a capture needs first: the gradient buffers (with ``grad_buffers``), the shared pool
        and the runner's stream (CUDA)."""
        if grad_buffers and not self.grad_buffers:
            self.grad_buffers = tuple(torch.zeros_like(p) for p in self.params)
        if self.pool is None and device.type == "cuda":
            self.pool = torch.cuda.graph_pool_handle()
        if self.stream is None and device.type == "cuda":
            self.stream = torch.cuda.Stream(device)

    def backward_into_buffers(self, outputs: list[tuple[torch.Tensor, torch.Tensor]], into_buffers: bool) -> None:
        """Autograd's backward of ``(output, gradient)`` pairs with every parameter's ``.grad`` its buffer
        (capturing: autograd adds in place into the buffer, what the graph records) or None (warming
        up: into throw-away gradients, since the buffers may be ``.grad`` holding accumulated ones)."""
        saved = [p.grad for p in self.params]
        try:
            for p, b in zip(self.params, self.grad_buffers):
                p.grad = b if into_buffers else None
            torch.autograd.backward([o for o, _ in outputs], [g for _, g in outputs])
        finally:
            for p, g in zip(self.params, saved):
                p.grad = g

    def parameter_views(self) -> dict[int, torch.Tensor]:
        """A view of every trainable parameter, by the parameter's id: what a capture under several
        processes runs on (``GRADS_BY_AUTOGRAD_GRAD``), swapped into the modules by ``_swapped_in``."""
        return {id(p): p.view_as(p) for p in self.params}

    def backward_through_views(self, outputs: list[tuple[torch.Tensor, torch.Tensor]], slots: list,
                               views: dict[int, torch.Tensor], into_buffers: bool) -> None:
        """``torch.autograd.grad`` of ``(output, gradient)`` pairs with respect to ``views`` (the
        checkpointed recompute meets the same views, swapped in at ``slots``), added into the buffers
        (capturing) or thrown away (warming up): the gradients never reach the parameters'
        AccumulateGrad nodes, which DDP ties to the stream they were made on."""
        with _swapped_in(slots, views):
            grads = torch.autograd.grad([o for o, _ in outputs], [views[id(p)] for p in self.params],
                                        [g for _, g in outputs], allow_unused=True)
        if into_buffers:
            got = [(b, g) for b, g in zip(self.grad_buffers, grads) if g is not None]
            torch._foreach_add_([b for b, _ in got], [g for _, g in got])

    def capture(self, pair, device: torch.device, forward: Callable[[], tuple],
                backward: Callable[..., None] | None = None, warm_up_on_cpu: bool = False,
                around_warm_ups: Callable[[], AbstractContextManager] = nullcontext) -> None:
        """Warm ``forward`` (and ``backward(into_buffers=False)``) up, then capture them into
        ``pair.forward`` (static outputs: ``pair.outputs``) and ``pair.backward``, in this runner's
        pool; the caller sets the grad mode. Warm-ups run on CUDA (lazy initialisations must happen
        outside a graph), on the CPU stand-in only with ``warm_up_on_cpu``, inside
        ``around_warm_ups()`` (what must undo their side effects)."""
        from .attention.fa4_ahead import compiling_in_place

        with compiling_in_place():  # FA4's kernels, built here: the capture records what the warm-ups ran
            self._warm_up_and_capture(pair, device, forward, backward, warm_up_on_cpu, around_warm_ups)

    def _warm_up_and_capture(self, pair, device, forward, backward, warm_up_on_cpu, around_warm_ups) -> None:
        cuda = device.type == "cuda"
        if cuda or warm_up_on_cpu:
            with around_warm_ups():
                # Warm-up and capture on one stream, the runner's. Autograd runs a parameter's gradient
                # accumulation on the stream its AccumulateGrad node was made on, and that node lives as
                # long as a graph refers to it: a warm-up on another stream whose graph were still alive
                # would pull the capture's accumulations onto that stream (a cross-stream join recorded
                # in the backward graph, and PyTorch's "AccumulateGrad node's stream" warning).
                if cuda:
                    self.stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(self.stream) if cuda else nullcontext():
                    for _ in range(WARMUP_RUNS):
                        forward()
                        if backward is not None:
                            backward(into_buffers=False)
                pair.live = ()  # the warm-up's graph: gone before the capture makes its own
                if cuda:
                    torch.cuda.current_stream(device).wait_stream(self.stream)
        pair.forward = _new_graph(device, self.pool, self.stream)
        pair.outputs = tuple(pair.forward.capture(forward))
        if backward is not None:
            scored = pair.outputs[: len(pair.grad_outputs)]  # the by-products after them take no gradient
            if [(o.shape, o.dtype) for o in scored] != [(g.shape, g.dtype) for g in pair.grad_outputs]:
                raise RuntimeError("cuda_graphs: the fused head's outputs are not fp32 [P]; cannot capture this call")
            pair.backward = _new_graph(device, self.pool, self.stream)
            pair.backward.capture(backward, runs_now=False)
        if cuda:
            # The captured call's autograd graph is spent: its backward is recorded and its saved tensors
            # are back in the pool, as every pair's activations are (the generation check keeps a pair's
            # backward next to its own forward). Keeping the graph would keep the parameters'
            # AccumulateGrad nodes, made on the runner's stream, and every later eager backward would
            # accumulate on that stream and wait for it. The replays need only the outputs' storage.
            pair.outputs = tuple(o.detach() for o in pair.outputs)
            pair.live = ()
        self.captures += 1
        # the captured forward's results are in the static outputs; the first replay must run it again
        pair.generation = -1

    def replay_forward(self, pair: _GraphPair) -> int:
        self.generation += 1
        pair.forward.replay()
        pair.generation = self.generation
        return self.generation

    def replay_backward(self, pair: _GraphPair, generation: int, grads: tuple) -> None:
        """Replay the backward graph, which adds this call's parameter gradients into the buffers.

        The buffers *are* the parameters' ``.grad`` wherever autograd would have created one: a
        parameter without a gradient gets its (zeroed) buffer, one whose ``.grad`` is already its
        buffer accumulates in place — no copy, as eager autograd — and a ``.grad`` that is some other
        tensor gets the buffer added to it. So ``zero_grad`` (to None or in place), gradient
        accumulation and clipping behave as without graphs. One thing differs: after
        ``zero_grad(set_to_none=True)`` the next step's ``.grad`` reuses the same storage."""
        if pair.generation != generation or self.generation != generation:
            raise RuntimeError(
                "cuda_graphs: the backward of a graphed tree call ran after a later graphed forward, which "
                "overwrote the activations it needs; run each call's backward before the next call, or use "
                "cuda_graphs=False")
        for static, g in zip(pair.grad_outputs, grads):
            if g is None:
                static.zero_()
            else:
                static.copy_(g)
        owned = [p.grad is b for p, b in zip(self.params, self.grad_buffers)]
        if not all(owned):
            torch._foreach_zero_([b for b, o in zip(self.grad_buffers, owned) if not o])
        pair.backward.replay()
        foreign = []
        for p, b, o in zip(self.params, self.grad_buffers, owned):
            if o:
                continue
            if p.grad is None:
                p.grad = b
            else:
                foreign.append((p.grad, b))
        if foreign:
            torch._foreach_add_([g for g, _ in foreign], [b for _, b in foreign])


class _ReplayedScores(torch.autograd.Function):
    """Log-probs (and entropies) from a replayed forward graph; backward replays the backward graph,
    which accumulates into the parameters' gradients itself (see ``GraphRunner.replay_backward``).
    ``inputs``: what the node hangs off so that its outputs require grad (the parameters, or one
    fresh leaf: ``dfs/graphs.py`` says why); they get no gradient from it."""

    @staticmethod
    def forward(ctx, runner: GraphRunner, pair, *inputs):
        ctx.runner, ctx.pair, ctx.num_inputs = runner, pair, len(inputs)
        ctx.generation = runner.replay_forward(pair)
        out = tuple(o.detach().clone() for o in pair.outputs)
        ctx.mark_non_differentiable(*out[len(pair.grad_outputs):])  # the head's by-products
        return out

    @staticmethod
    def backward(ctx, *grads):
        ctx.runner.replay_backward(ctx.pair, ctx.generation, grads)
        return (None, None, *(None for _ in range(ctx.num_inputs)))


_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _grads_by_autograd_grad() -> bool:
    if GRADS_BY_AUTOGRAD_GRAD is not None:
        return GRADS_BY_AUTOGRAD_GRAD
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _parameter_slots(modules: tuple[torch.nn.Module, ...], params: tuple[torch.nn.Parameter, ...]) -> list:
    """Every ``(module, name, parameter)`` holding a trainable parameter (a tied one appears twice)."""
    trainable = {id(p) for p in params}
    seen, slots = set(), []
    for m in modules:
        if id(m) in seen:
            continue
        seen.add(id(m))
        slots += [(m, n, p) for n, p in m._parameters.items() if p is not None and id(p) in trainable]
    return slots


@contextmanager
def _swapped_in(slots: list, views: dict):
    """The modules hold ``views[id(parameter)]`` in place of their parameters meanwhile."""
    for m, n, p in slots:
        m._parameters[n] = views[id(p)]
    try:
        yield
    finally:
        for m, n, p in slots:
            m._parameters[n] = p


def _reentrant_checkpointing(modules: tuple[torch.nn.Module, ...]) -> bool:
    """Whether HF's checkpointing function of any layer is the reentrant kind (read from the modules'
    dicts: ``getattr`` of a missing attribute goes through ``Module.__getattr__`` and an exception,
    per module and per call)."""
    return any(getattr(m.__dict__.get("_gradient_checkpointing_func"), "keywords", {}).get("use_reentrant", False)
               for m in modules)


def _runner(parts: ModelParts) -> GraphRunner:
    params = trainable_parameters(parts.causal_lm)
    runner = _RUNNERS.get(parts.causal_lm)
    if runner is None or len(runner.params) != len(params) or any(a is not b for a, b in zip(runner.params, params)):
        runner = GraphRunner(params)
        _RUNNERS[parts.causal_lm] = runner
    if runner.outer is None or runner.outer() is not parts.outer:  # the same model, called through another wrapper
        modules = (parts.outer, *parts.outer.modules())
        runner.wrapper = next((type(m).__name__ for m in modules if type(m).__name__ in _WRAPPERS_REFUSED), None)
        # weak: the runner is the value of a weak-keyed entry whose key is the model; a strong reference
        # from it back to the model would keep the entry, the model, its graphs and their memory forever
        proxies: dict[int, object] = {}
        runner.modules = tuple(proxies.setdefault(id(m), weakref.proxy(m)) for m in modules)
        runner.adapters = tuple(p for p, m in zip(runner.modules, modules) if hasattr(m, "_disable_adapters"))
        runner.outer = weakref.ref(parts.outer)
    return runner


def graphed_scores(parts: ModelParts, forest: PrefixForest, plan: ScoringPlan, backend: str, temperature: float,
                   with_entropy: bool, tokens: torch.Tensor, pred_src: torch.Tensor, targets: torch.Tensor,
                   meta: TreeAttentionMetadata, keep: bool, checkpointing: bool,
                   bucketed: Callable[[], tuple] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Per-prediction log-probs (and entropies), ``plan.pred_src`` order, from a replayed graph pair;
    None when neither this layout nor its bucket is (yet) captured — the caller then runs eagerly.

    ``tokens``, ``pred_src``, ``targets`` and ``meta`` are the call's arrays and tree metadata,
    already on the device (a capture keeps them as its static inputs; a replay copies them in);
    ``keep`` whether the call keeps its attention outputs for the checkpointed recompute;
    ``bucketed`` makes the same call's inputs padded to buckets (``attention/buckets.py``:
    ``(tokens, pred_src, targets, meta)``). Which graphs serve, in this order: the layout's own, if
    captured; its bucket's, if captured; the layout's own, captured now at its second sighting
    (fixed-length rollouts, ``num_iterations > 1``); its bucket's, captured now at the bucket's
    second sighting (free-length completions of similar sizes); else none."""
    runner = _runner(parts)
    check_graphable(parts, backend, runner.params, runner.wrapper)
    if checkpointing and _grads_by_autograd_grad() and _reentrant_checkpointing(runner.modules):
        raise ValueError(
            "cuda_graphs=True with several processes takes the gradients with torch.autograd.grad (see "
            "graphs.GRADS_BY_AUTOGRAD_GRAD), which reentrant gradient checkpointing does not support; use "
            "gradient_checkpointing_kwargs={'use_reentrant': False} (TRL's and transformers' default) or cuda_graphs=False")
    state = (backend, (with_entropy, *parts.head_outputs), float(temperature), keep, checkpointing,
             torch.is_autocast_enabled(parts.device.type), _module_state(runner.modules, runner.adapters))
    inputs = (tokens, pred_src, targets, meta)
    signature = (*state, forest.num_unique_tokens, plan.num_predictions, _layout_signature(meta))
    pair = runner.pairs.get(signature) if EXACT_LAYOUTS else None
    padded = bucket_signature = None
    if pair is None and bucketed is not None and BUCKETS:
        padded = bucketed()
        bucket_signature = (*state, "bucket", padded[0].shape[0], padded[1].shape[0], _layout_signature(padded[3]))
        pair = runner.pairs.get(bucket_signature)
        if pair is not None:
            signature, inputs = bucket_signature, padded
    if pair is None:
        if not (EXACT_LAYOUTS and _sighted(runner, signature)):
            if padded is None or not _sighted(runner, bucket_signature):
                return None
            signature, inputs = bucket_signature, padded
        pair = _capture(runner, parts, _GraphPair(*inputs), temperature, with_entropy, keep)
        runner.pairs[signature] = pair
        while len(runner.pairs) > GRAPH_CACHE_SIZE:
            runner.pairs.popitem(last=False)
    else:
        runner.pairs.move_to_end(signature)
        for static, new in zip((pair.tokens, pair.pred_src, pair.targets), inputs[:3]):
            static.copy_(new)
        _copy_layout(pair.meta, inputs[3])
    out = _ReplayedScores.apply(runner, pair, *runner.params)
    P = plan.num_predictions  # a bucket's padded predictions are cut off here (their gradient is zero)
    for kept, extra in zip(parts.head_outputs.values(), out[len(pair.grad_outputs):]):
        kept.append(extra[:P])  # where the eager head leaves its by-products
    return out[0][:P], (out[1][:P] if with_entropy else None)


def _sighted(runner: GraphRunner, signature: tuple) -> bool:
    """Count a sighting of an uncaptured ``signature``; True when it is due for capture."""
    seen = runner.sightings.pop(signature, 0) + 1
    if seen >= CAPTURE_AT_SIGHTING and runner.params:
        return True
    runner.sightings[signature] = seen
    while len(runner.sightings) > SIGHTINGS_KEPT:
        runner.sightings.popitem(last=False)
    return False


def _capture(runner: GraphRunner, parts: ModelParts, pair: _GraphPair, temperature: float, with_entropy: bool,
             keep: bool) -> _GraphPair:
    """Warm up, then capture the pair's forward and backward graphs into the runner's pool."""
    install(parts.causal_lm.config._attn_implementation)
    meta = pair.meta

    by_views = _grads_by_autograd_grad()
    slots = _parameter_slots(runner.modules, runner.params) if by_views else []

    def forward() -> tuple:
        meta.calls = 0
        meta._cache.clear()  # masks built lazily from the static tensors: inside the graph, every replay
        meta.kept = KeptAttention(parts.tree_calls) if keep else None
        pair.views = runner.parameter_views() if by_views else {}
        with _swapped_in(slots, pair.views):
            hidden = tree_forward(parts, pair.tokens.unsqueeze(0), meta)
            logp, ent = score_predictions(hidden, parts, pair.pred_src, pair.targets, temperature, with_entropy)
        extra = tuple(kept.pop() for kept in parts.head_outputs.values())  # static outputs, not the caller's
        pair.live = ((logp, ent) if with_entropy else (logp,)) + extra
        if pair.outputs:  # a stand-in's rerun: leave the values where a graph's replay would
            for static, new in zip(pair.outputs, pair.live):
                static.detach().copy_(new.detach())
        return pair.live

    def backward(into_buffers: bool = True) -> None:
        outputs = [(o, g) for o, g in zip(pair.live, pair.grad_outputs) if o.requires_grad]
        if by_views:
            runner.backward_through_views(outputs, slots, pair.views, into_buffers)
        else:
            runner.backward_into_buffers(outputs, into_buffers)
        meta.kept = None

    device = parts.device
    runner.prepare_capture(device)
    # log-probs and entropies are fp32 [P] (TRL's fused head); allocated here, outside the pool
    pair.grad_outputs = tuple(torch.zeros(pair.pred_src.shape[0], dtype=torch.float32, device=device)
                              for _ in range(2 if with_entropy else 1))
    with torch.enable_grad():
        runner.capture(pair, device, forward, backward)
    pair.views = {}
    return pair
