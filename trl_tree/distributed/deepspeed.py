"""DeepSpeed ZeRO (stages 1-3) around the engine's own backward: gradients kept local through an
optimizer step and reduced once; under ZeRO-3 the parameters held whole through a step's tree
calls.

Why: DeepSpeed reduces each parameter's gradient from a hook on its accumulation, once per
``engine.backward`` — ZeRO-2 asserts that no parameter's gradient arrives twice in one backward.
The engine's walk (dfs), calls cut by a token budget and an accumulation window's trees deliver a
parameter's gradient many times per micro-step, some of them outside ``engine.backward`` (a
one-pass call scores and differentiates in the loss's forward; a window's backward runs after the
micro-step's). And under ZeRO-3 a parameter is whole only inside its module's forward and
backward hooks, while the tree reads weights outside them (the fused LM head reads the head's
weight after the trunk; the walk calls layers in its own order, many times).

So, for a tree trainer under DeepSpeed:

* :class:`StepReduction` keeps the gradients local from an optimizer step's first micro-step to
  its last, through DeepSpeed's own ``engine.coalesce_grad_reduction`` (its hooks skip the
  reduction; the block's exit runs one reduction pass over what accumulated) — the step's one
  reduction, as DDP's ``no_sync`` accumulation gives; then ``engine.step()``.
  :func:`defer_steps` takes the step out of Accelerate's ``DeepSpeedEngineWrapper.backward``: the
  trainer steps after the step's last tree backward (a window's runs after the micro-step's own).
* :class:`WholeParameters` (ZeRO-3) gathers every parameter of an engine's module once, with the
  engine's module hooks removed meanwhile — TRL's way for generation
  (``trl.models.utils.remove_hooks``/``add_hooks``) — from the step's first tree call to its end
  (or until TRL generates), so once per optimizer step; the gradients stay whole on the parameters
  until the step's reduction. The price is the whole model in memory through the step (2 bytes per
  parameter in bf16) plus its whole gradients, the same price the FSDP2 path pays (``fsdp.py``).

* :func:`join_modules` / :func:`separate_joined` put what trains beside the model (PPO's critic)
  into the model's engine: attached to the model while ``deepspeed.initialize`` builds the engine
  (ZeRO converts, partitions and names every parameter of its module, and its optimizer's groups
  must hold nothing else), taken out again once it is built, so that what sees the model —
  generation, saving, vLLM's weight sync — sees the model alone. One engine then clips, reduces
  and steps both together, as one optimizer does under DDP.

All of it needs DeepSpeed's ``coalesce_grad_reduction`` (0.19.8 has it).
"""

from __future__ import annotations

import contextlib

import torch

#: the attribute under which :func:`join_modules` attaches modules to a model, and where
#: :func:`separate_joined` keeps them on the engine afterwards
JOINED = "trl_tree_joined"


def deepspeed_stage(accelerator) -> int | None:
    """The ZeRO stage of an Accelerate run under DeepSpeed; None under anything else."""
    if accelerator.distributed_type.value != "DEEPSPEED":
        return None
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return int(getattr(plugin, "zero_stage", 0) or 0) if plugin is not None else 0


def missing_support(accelerator=None) -> str | None:
    """Why the installed DeepSpeed, or the launch's DeepSpeed settings, cannot run the tree's one
    reduction per step (None: they can). DeepSpeed's ``coalesce_grad_reduction`` exists for every
    stage but raises ``NotImplementedError`` inside for ZeRO stage 0 and for its ``BF16_Optimizer``
    wrapper (ZeRO-1 with bf16 parameters and fp32 gradient accumulation): read from the launch's
    config here, so that they are refused at construction rather than at the first step."""
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError:  # pragma: no cover - a DeepSpeed launch without DeepSpeed fails earlier
        return "DeepSpeed is not installed"
    if not hasattr(DeepSpeedEngine, "coalesce_grad_reduction"):
        import deepspeed

        return (f"DeepSpeed {deepspeed.__version__} has no engine.coalesce_grad_reduction, which keeps the tree's "
                "gradients local until the step's one reduction; install deepspeed>=0.19.8")
    if accelerator is None:
        return None
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None) or {}
    stage = deepspeed_stage(accelerator)
    if stage == 0:
        return ("DeepSpeed's ZeRO stage 0 has no gradient-reduction block (engine.coalesce_grad_reduction raises "
                "for it), which the tree's one reduction per step is built on; use zero_stage 1, 2 or 3, or DDP "
                "(examples/accelerate/multi_gpu.yaml)")
    zero_cfg = config.get("zero_optimization") or {}
    offloaded = [key for key in ("offload_optimizer", "offload_param")
                 if str((zero_cfg.get(key) or {}).get("device", "none") or "none").lower() not in ("none", "auto")]
    if offloaded:
        return (f"DeepSpeed's {' and '.join(offloaded)} (ZeRO-Offload) is not supported by the tree, whose one "
                "reduction per step and held parameters were not run with offloaded state; drop the offload, or use "
                "FSDP2 with tree_gather='block' for stock's memory per GPU (docs/multi_gpu.md)")
    accum = str((config.get("data_types") or {}).get("grad_accum_dtype", "") or "").lower()
    enabled = (config.get("bf16") or {}).get("enabled")
    bf16 = enabled is True or str(enabled).lower() == "true" or accelerator.mixed_precision == "bf16"
    if stage == 1 and bf16 and accum in ("fp32", "float32", "float", "torch.float32"):
        return ("DeepSpeed wraps ZeRO-1 with bf16 parameters and fp32 gradient accumulation (data_types."
                "grad_accum_dtype: fp32) in its BF16_Optimizer, which has no gradient-reduction block "
                "(engine.coalesce_grad_reduction raises for it); use ZeRO-2 (zero_stage: 2), or drop "
                "grad_accum_dtype")
    return None


def is_engine(model) -> bool:
    """Whether ``model`` is a ``DeepSpeedEngine`` or a subclass of it (DeepSpeed is imported only where
    it already is: without it nothing can be an engine)."""
    import sys

    if "deepspeed" not in sys.modules:
        return False
    from deepspeed.runtime.engine import DeepSpeedEngine

    return isinstance(model, DeepSpeedEngine)


def join_modules(model: torch.nn.Module, modules: dict[str, torch.nn.Module]) -> None:
    """Attach ``modules`` to ``model`` (as ``model.trl_tree_joined``) before ``deepspeed.initialize``
    builds its engine: their parameters become the engine's (converted and partitioned under ZeRO-3,
    named for ZeRO's optimizer, cast and placed as the model). Idempotent."""
    joined = model._modules.get(JOINED)
    if joined is None:
        model.add_module(JOINED, torch.nn.ModuleDict(modules))
        return
    for name, module in modules.items():
        if name not in joined:
            joined[name] = module


def separate_joined(engine) -> None:
    """Take the modules :func:`join_modules` attached out of the engine's module again, now that the
    engine holds their parameters; the engine keeps them (:func:`engine_parameters`). Idempotent."""
    joined = engine.module._modules.pop(JOINED, None)
    if joined is not None:
        engine.__dict__[JOINED] = joined


def engine_parameters(engine) -> list[torch.nn.Parameter]:
    """Every parameter an engine holds: its module's and those of the modules joined to it."""
    params = {id(p): p for p in engine.module.parameters()}
    joined = engine.__dict__.get(JOINED)
    if joined is not None:
        params.update({id(p): p for p in joined.parameters()})
    return list(params.values())


def zero3_parameters(params) -> list[torch.nn.Parameter]:
    """The parameters of ``params`` that ZeRO-3 partitions."""
    return [p for p in params if hasattr(p, "ds_id")]


def whole(params, modifier_rank: int | None = None):
    """ZeRO-3's partitioned parameters among ``params`` whole for the block (``modifier_rank``: the
    rank whose writes are kept); a no-op where none is partitioned. Collective."""
    partitioned = zero3_parameters(params)
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank)


def defer_steps(accelerator) -> None:
    """Swap the accelerator's DeepSpeed wrapper (Accelerate's ``DeepSpeedEngineWrapper``) for one
    whose ``backward`` does not step: ``engine.step()`` runs where the trainer calls
    :meth:`StepReduction.finish`, after the step's last tree backward. Once, after
    ``accelerator.prepare`` made the wrapper."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is None or getattr(wrapped, "defers_step", False):
        return
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    class DeferredStep(DeepSpeedEngineWrapper):
        defers_step = True

        def backward(self, loss, sync_gradients=True, **kwargs):
            self.engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
            self.engine.backward(loss, **kwargs)

    accelerator.deepspeed_engine_wrapped = DeferredStep(wrapped.engine)


class StepReduction:
    """One optimizer step's gradients kept local on an engine's parameters and reduced once
    (``engine.coalesce_grad_reduction``, held open from the step's first micro-step to its last)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._block = None

    def start(self) -> None:
        """Keep the gradients local from here on (idempotent within a step)."""
        if self._block is None:
            self._block = self.engine.coalesce_grad_reduction()
            self._block.__enter__()

    def fill_missing(self) -> None:
        """Zeros for every trainable parameter this rank computed no gradient for (a window may give
        it no tree), so that every rank reduces the same parameters — its collectives the same.
        Under ZeRO-3, while the model is held whole (:class:`WholeParameters`): a gradient is
        whole-sized, and a partitioned parameter takes none."""
        if self._block is None:
            return
        optimizer = self.engine.optimizer
        for param in engine_parameters(self.engine):
            if param.requires_grad and _local_grad(optimizer, param) is None:
                param.grad = torch.zeros(getattr(param, "ds_shape", param.shape), dtype=param.dtype,
                                         device=self.engine.device)

    def finish(self) -> None:
        """The step's one reduction (after :meth:`fill_missing`), then ``engine.step()`` (clipping,
        the optimizer, zeroing, the scheduler)."""
        if self._block is None:
            return
        optimizer = self.engine.optimizer
        if getattr(optimizer, "use_grad_accum_attribute", False):
            optimizer.fill_grad_accum_attribute()  # ZeRO-1's fp32 accumulation reads grad_accum
        block, self._block = self._block, None
        block.__exit__(None, None, None)
        self.engine.set_gradient_accumulation_boundary(is_boundary=True)
        self.engine.step()

    def abandon(self) -> None:
        """After an error inside the step: the reduction block closed (DeepSpeed's exit leaves the
        engine outside it) and what accumulated dropped, with no ``engine.step()``: the step is lost,
        the engine usable again."""
        if self._block is None:
            return
        block, self._block = self._block, None
        try:
            block.__exit__(None, None, None)
        finally:
            self.engine.zero_grad()


def _local_grad(optimizer, param):
    getter = getattr(optimizer, "get_gradient_for_reduction", None)
    grad = getter(param) if getter is not None else None
    return grad if grad is not None else param.grad


class WholeParameters:
    """ZeRO-3: every parameter of an engine (:func:`engine_parameters`) gathered once and its module hooks removed,
    until :meth:`release` (re-entrant: nested holds of the same engine gather once)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._gathered = None
        self._start_hook = None

    @property
    def held(self) -> bool:
        return self._gathered is not None

    def hold(self) -> None:
        if self._gathered is not None:
            return
        import deepspeed
        from trl.models.utils import remove_hooks

        gathered = deepspeed.zero.GatheredParameters(engine_parameters(self.engine))
        gathered.__enter__()
        self._gathered = gathered
        remove_hooks(self.engine)
        self._start_hook = _take_start_hook(self.engine)

    def release(self) -> None:
        """Partition the parameters again (their gradients stay whole until the step's reduction)
        and put the engine's hooks back."""
        if self._gathered is None:
            return
        from trl.models.utils import add_hooks

        gathered, self._gathered = self._gathered, None
        gathered.__exit__(None, None, None)
        add_hooks(self.engine)
        start, self._start_hook = self._start_hook, None
        _put_back_start_hook(start)


def _put_back_start_hook(start) -> None:
    """Register ZeRO-3's start-of-forward hook again (``(offload, hook)`` from :func:`_take_start_hook`),
    first among the module's pre-hooks, where DeepSpeed registered it: it resets the step's parameter
    coordinator, which the fetch hook that TRL's ``add_hooks`` put back then reads."""
    if start is not None:
        offload, hook = start
        offload.fwd_pre_hook = offload.module.register_forward_pre_hook(hook, prepend=True)


def _take_start_hook(engine):
    """Remove ZeRO-3's start-of-forward hook from the engine's module (TRL's ``remove_hooks`` leaves
    it): it resets the parameter coordinator's step with a collective check that the ranks agree,
    and a window calls the model on the trees' owners only, so the ranks' collectives would differ
    (measured: four ranks, three without a tree, waiting for ever). Returns ``(offload, hook)`` to
    register again, or None."""
    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", optimizer)
    handle = getattr(offload, "fwd_pre_hook", None)
    if handle is None:
        return None
    hook = offload.module._forward_pre_hooks.get(handle.id)
    handle.remove()
    return (offload, hook) if hook is not None else None
