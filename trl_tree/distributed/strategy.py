"""One object per way a model is distributed, behind the one small interface the tree trainers call.

Why: the tree's calls are not the wrapper's own single forward and backward — a walk, calls cut by a
token budget and an accumulation window's trees run many calls per step, a different number on each
rank — so each distributed engine needs the same few things done its own way: the model held whole
for a sequence of tree calls, a micro-step begun and ended, the step's gradients reduced once, and
what trains beside the policy (PPO's critic) placed beside it. Spread through the trainers as
``if fsdp2 / if zero_stage`` branches, those decisions could not be read in one place and step state
was left behind on an error. Here each engine is one class:

* :class:`Replicated` — one process, or DDP: the tree's own backward runs past DDP's forward and its
  gradients are averaged by hand (``grad_sync``) where there are several processes;
* :class:`FSDP1` — refuses what runs the engine's own backward (it can run packed calls only);
* :class:`FSDP2` — the model gathered once for a sequence of tree calls, or block by block inside
  each call with the ranks' calls lined up (``tree_gather``: ``gathering.py``, ``lockstep.py``),
  gradients accumulated unreduced and reduced once per optimizer step (``fsdp.py``);
* :class:`DeepSpeedZeRO` — the step's gradients kept local and reduced once, ZeRO-3's model held
  whole from a step's first tree call to its end (``deepspeed.py``).

The contract every rank relies on: :meth:`Strategy.hold` is collective under the sharded engines,
so the trainers enter it at the same points on every rank, around every sequence of tree calls
whose count can differ between ranks (a window's passes, a walk, calls under a budget) — inside it a
rank's calls make no collective, or (gathered block by block) their collectives are lined up by
one agreement per call, and every other collective inside it is a sync point (``call_gate``). Every
step-scoped state (reduction blocks, gathered parameters, removed hooks, FSDP2's settings) is
restored in ``finally``: :meth:`Strategy.micro_step` ends the micro-step whether its body returned
or raised.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Callable, Iterable, Iterator

import torch

from . import deepspeed as zero
from . import fsdp, gathering
from .lockstep import CallLockstep, needs_lockstep

logger = logging.getLogger(__name__)


class Strategy:
    """What a tree trainer asks of the engine its model is distributed with (see the module docstring)."""

    #: how the docs and the refusals name the engine
    name = "one process"
    #: the engine's own backward (dfs, budgets, windows, replayed graphs) runs under it
    runs_own_backward = True
    #: the tree's gradients are averaged by hand (``grad_sync``) over the processes: DDP's way
    averages_by_hand = True
    #: a window cuts trees until every rank owns one, and a window that would still leave a rank
    #: without a tree is not run (its calls gather and reduce on the owners only)
    fills_ranks = False
    #: the critic's values take a second pass even where one graph would do (its calls gathered once)
    critic_second_pass = False
    #: saving what trains beside the policy is collective (every rank gathers, the saving ranks write)
    collective_save = False
    #: TRL's asynchronous GRPO trainer runs under it (TRL 1.16: not under FSDP1 or DeepSpeed)
    runs_trl_async = True

    def __init__(self, accelerator, gather: str = "auto") -> None:
        self.accelerator = accelerator
        #: ``tree_gather``: how a sharded model is gathered for the calls (``gathering.py``)
        self.gather = gather
        #: per model id, its :class:`~trl_tree.distributed.gathering.Gathering` once chosen
        self.gatherings: dict[int, gathering.Gathering] = {}

    def _chosen(self, model, make: Callable[[], gathering.Gathering]) -> gathering.Gathering:
        """``model``'s gathering: made by ``make`` at its first hold, logged then, kept after."""
        chosen = self.gatherings.get(id(model))
        if chosen is None:
            chosen = self.gatherings[id(model)] = make()
            logger.info("%s: %s", type(model).__name__, chosen.reason)
        return chosen

    # ------------------------------------------------------------------ construction
    def refusal(self, args) -> str | None:
        """Why the engine cannot run these settings' tree calls exactly (None: it can); said at construction."""
        return None

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Make ``model`` ready for the engine's own preparation (Accelerate's ``prepare``); nothing here."""

    def loads_on_meta(self) -> bool:
        """Whether ranks past the first hold a just-loaded model on the meta device until the engine
        hands them rank 0's weights (FSDP2's low-memory loading): nothing to broadcast then."""
        return False

    # ------------------------------------------------------------------ calls
    def hold(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """``model`` whole for a sequence of tree calls; collective under a sharded engine."""
        return contextlib.nullcontext()

    def scoring(self, model: torch.nn.Module, graph: bool) -> contextlib.AbstractContextManager:
        """A sequence of scoring calls; ``graph``: they build an autograd graph whose backward runs
        later through the wrapper's hooks (one call per micro-step on every rank)."""
        return self.hold(model)

    def backward_done(self, model: torch.nn.Module) -> None:
        """A tree backward of ``model`` accumulated gradients that await the step's one reduction."""

    def release(self) -> None:
        """Give back what is held whole across calls (before generation gathers the model its own way)."""

    # ------------------------------------------------------------------ what trains beside the policy
    # PPO's critic (``trainers/online/critic.py``): where it lives and who reduces it, decided here alone.
    def place_critic(self, critic, policy: torch.nn.Module, trainer_name: str) -> None:
        """At construction, after the critic's weights were made equal on every rank: put it where this
        engine trains it (its flags ``sharded`` / ``in_engine``, the value model sharded or registered)."""

    def averages_critic_by_hand(self, critic) -> bool:
        """Whether the critic's trainable parameters outside the engine's (a head beside sharded models)
        are averaged by hand over the processes; the trainer gives that average a communicator of its
        own where the engine's collectives run on the default one."""
        return self.averages_by_hand

    def critic_group_with_optimizer(self, critic, policy: torch.nn.Module) -> bool:
        """When the optimizer is built: whether the critic's parameter group joins it now (else at
        :meth:`critic_prepared`); DeepSpeed joins the critic's modules to the policy here."""
        return True

    def critic_prepared(self, critic, policy: torch.nn.Module) -> bool:
        """Once the policy is prepared (before the scheduler reads the optimizer's groups): whether the
        critic's group is to be added now."""
        return False

    def critic_hold(self, critic_model: torch.nn.Module, policy) -> contextlib.AbstractContextManager:
        """The critic's backbone model whole for a sequence of calls."""
        return self.hold(critic_model)

    def critic_backward_done(self, critic, policy: torch.nn.Module) -> None:
        """A critic backward accumulated gradients that await the step's one reduction."""

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float):
        """Clip ``params``' gradients together, one norm over all (the policy's and the critic's)."""
        return self.accelerator.clip_grad_norm_(params, max_norm)

    # ------------------------------------------------------------------ micro-steps
    @contextlib.contextmanager
    def micro_step(self, defer_step: bool = True) -> Iterator[None]:
        """A micro-step of the trainer: begun, and ended in ``finally`` — at the optimizer step's last
        micro-step the one reduction (and, under DeepSpeed, the step); after an error the step's
        state is given back without reducing or stepping. ``defer_step``: the trainer, not the
        wrapper's backward, reduces and steps (the tree's modes)."""
        self.begin_micro_step(defer_step)
        try:
            yield
        except BaseException:
            self.abandon_step()
            raise
        self.end_micro_step(self.accelerator.sync_gradients)

    def begin_micro_step(self, defer_step: bool = True) -> None:
        """What a micro-step needs before its first call."""

    def end_micro_step(self, closes_step: bool) -> None:
        """After the micro-step's last backward; ``closes_step``: the optimizer step's last micro-step."""

    def settle(self) -> None:
        """At the optimizer step's last micro-step, before the trainer's checks read the gradients: make
        them final where that can come before the step (FSDP2's reduction; DeepSpeed's reduction and
        step are one, at :meth:`end_micro_step`)."""

    def abandon_step(self) -> None:
        """After an error inside a micro-step: every held or blocked state given back, nothing reduced."""
        self.release()


class Replicated(Strategy):
    """One process, or DDP: every rank holds the whole model; nothing to hold or gather."""

    def __init__(self, accelerator, gather: str = "auto") -> None:
        super().__init__(accelerator, gather)
        if accelerator.num_processes > 1:
            self.name = "DDP"

    def place_critic(self, critic, policy, trainer_name: str) -> None:
        """A critic adapter lives in the policy's DDP module without taking part in its forward: DDP is
        told not to wait for its gradients (averaged by hand with the rest of the critic's)."""
        if critic.kind != "adapter" or self.accelerator.num_processes == 1:
            return
        from torch.nn.parallel import DistributedDataParallel

        ignore = getattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", None)
        if ignore is None:  # pragma: no cover - a torch without DDP's one way to leave parameters out
            raise ValueError(f"{trainer_name}: torch {torch.__version__}'s DDP has no "
                             "_set_params_and_buffers_to_ignore_for_model, which keeps DDP from waiting for the "
                             "critic adapter's gradients; use critic='separate' or 'shared' under DDP")
        adapter = {id(p) for p in critic.adapter_params.values()}
        ignore(policy, [n for n, p in policy.named_parameters() if id(p) in adapter])


class FSDP1(Strategy):
    """FSDP1: the one wrapper the engine's own backward is not built for; packed calls run through it."""

    name = "FSDP1 (fsdp_version: 1)"
    runs_own_backward = False
    averages_by_hand = False
    runs_trl_async = False

    def refusal(self, args) -> str | None:
        if args.tree_mode == "dfs" or args.tree_token_budget is not None:
            return ("tree_mode='dfs' and tree_token_budget run the backward inside the engine and synchronise "
                    f"gradients themselves, which is done for DDP, FSDP2 and DeepSpeed, not {self.name}; use "
                    "tree_mode='packed' without tree_token_budget, or FSDP2 (fsdp_version: 2)")
        return None

    def place_critic(self, critic, policy, trainer_name: str) -> None:
        raise ValueError(f"{trainer_name}: the critic trains under DDP (gradients averaged by hand), FSDP2 (sharded, "
                         f"reduced by FSDP2 once per step) and DeepSpeed (in the policy's engine), not {self.name}; "
                         "use examples/accelerate/fsdp2.yaml, deepspeed_zero3.yaml or multi_gpu.yaml")


class FSDP2(Strategy):
    """FSDP2 (``fully_shard``): a sequence of tree calls runs on the model gathered once
    (``fsdp.gathered``) or block by block inside each call (``fsdp.block_held``; ``tree_gather``,
    chosen per model by :meth:`gathering_of`), gradients accumulated unreduced; the models whose
    gradients wait are reduced once, at the optimizer step's last micro-step
    (``fsdp.reduce_gradients``) — the policy and a separate value model alike, on one process too."""

    name = "FSDP2"
    averages_by_hand = False
    fills_ranks = True
    critic_second_pass = True
    collective_save = True

    def __init__(self, accelerator, gather: str = "auto") -> None:
        super().__init__(accelerator, gather)
        self._pending: dict[int, torch.nn.Module] = {}
        self._lockstep: CallLockstep | None = None

    def refusal(self, args) -> str | None:
        missing = fsdp.missing_support() or fsdp.offload_refusal(getattr(self.accelerator.state, "fsdp_plugin", None))
        if missing is None and getattr(args, "tree_gather", "auto") == "block" and args.tree_mode == "dfs" \
                and args.tree_keep_graph:
            return ("tree_keep_graph=True keeps a walk's pushed node's graph across its subtree's calls, which "
                    "gathering block by block cannot (each call's backward must follow it); leave tree_keep_graph "
                    "at None, or set tree_gather='whole'")
        return missing

    def hold(self, model):
        if not self.gathering_of(model).block:
            return fsdp.gathered(model)
        return fsdp.block_held(model, self.lockstep())

    def gathering_of(self, model) -> gathering.Gathering:
        """Whole or block by block for ``model``, chosen at its first hold (``gathering.choose``) and kept."""
        return self._chosen(model, lambda: gathering.choose(self.gather, fsdp.whole_bytes(model),
                                                            self._to_allocate(model), self.accelerator.device))

    def lockstep(self) -> CallLockstep | None:
        """The agreement that lines the ranks' calls up (None on one process)."""
        if self._lockstep is None and needs_lockstep():
            self._lockstep = CallLockstep(self.accelerator.device)
        return self._lockstep

    def _to_allocate(self, model) -> int:
        """What the step will still allocate beside the whole model, in bytes: the trainable
        parameters' accumulated gradients whole (fp32), and an Adam-like optimizer's two fp32 moments
        per local shard where no optimizer has state yet (the first step)."""
        params = [p for p in model.parameters() if p.requires_grad]
        stateless = all(not getattr(o, "state", None) for o in getattr(self.accelerator, "_optimizers", []))
        local = sum((p.to_local() if fsdp.is_sharded(p) else p).numel() for p in params)
        return gathering.step_allocation(sum(p.numel() for p in params if p.grad is None), local, stateless)

    def scoring(self, model, graph: bool):
        # a graph's backward runs through FSDP2's own hooks after the calls: only the root's parameters
        # (read by the fused head past the model's forward) are kept; a sequence without a graph is held
        return fsdp.root_unsharded(model, reshard_after=False) if graph else self.hold(model)

    def backward_done(self, model) -> None:
        if fsdp.fsdp_modules(model):
            self._pending[id(model)] = model

    @property
    def pending(self) -> bool:
        """Whether gradients of a tree backward await the step's reduction."""
        return bool(self._pending)

    def end_micro_step(self, closes_step: bool) -> None:
        if closes_step:
            self.reduce()

    def settle(self) -> None:
        self.reduce()

    def reduce(self) -> None:
        """The one reduction of every model whose tree gradients wait (collective: every rank has the
        same models waiting, since every rank runs the same passes)."""
        pending, self._pending = list(self._pending.values()), {}
        for model in pending:
            fsdp.reduce_gradients(model, self.accelerator.device)

    def abandon_step(self) -> None:
        self._pending = {}

    def prepare_model(self, model) -> None:
        dropped = fsdp.wrap_only_present_layers(model)
        if dropped:
            logger.info("%s: FSDP2 wraps the layer classes it holds; %s, listed in its _no_split_modules but absent "
                        "from it, left out of the list", type(model).__name__, ", ".join(dropped))

    def loads_on_meta(self) -> bool:
        return bool(getattr(self.accelerator.state.fsdp_plugin, "cpu_ram_efficient_loading", False))

    def place_critic(self, critic, policy, trainer_name: str) -> None:
        """Every critic kind trains sharded: a value model sharded as Accelerate shards the policy, an
        adapter with the policy it lives in; only a head outside both stays whole (averaged by hand)."""
        critic.sharded = True
        if critic.model is not None:
            self.prepare_model(critic.model)  # as the policy is, before Accelerate's wrap policy reads it
            critic.model = fsdp.shard_as_accelerate(self.accelerator, critic.model)
            critic.head = critic.model.score

    def averages_critic_by_hand(self, critic) -> bool:
        # a head beside the sharded models stays whole: averaged by hand, on a communicator of its own (on
        # FSDP2's group its all-reduces, launched from the backward's hooks, would fall among the all-gathers
        # and reduce-scatters in an order that need not be every rank's)
        return critic.kind != "separate"

    def critic_group_with_optimizer(self, critic, policy) -> bool:
        return False  # Accelerate swaps the optimizer's parameters for the policy's shards, knowing no other model

    def critic_prepared(self, critic, policy) -> bool:
        if critic.model is not None:
            fsdp.resharded(critic.model)  # the optimizer takes the sharded parameters
        critic.refresh_adapter(policy)
        return True

    def critic_backward_done(self, critic, policy) -> None:
        self.backward_done(critic.model if critic.kind == "separate" else policy)

    def clip_grad_norm(self, params, max_norm: float):
        """One norm over sharded gradients (DTensors) and whole ones beside them (a value head): each
        kind's norm taken apart, the total from both, every gradient scaled by one number. Accelerate
        1.10's ``clip_grad_norm_`` hands both kinds to one foreach op, which refuses to mix them."""
        grads = [p.grad for p in params if p.grad is not None]
        sharded = [g for g in grads if fsdp.is_sharded(g)]
        whole = [g for g in grads if not fsdp.is_sharded(g)]
        if not sharded or not whole:
            return self.accelerator.clip_grad_norm_(params, max_norm)
        device = whole[0].device
        parts = []
        for kind in (sharded, whole):
            norm = torch.nn.utils.get_total_norm(kind)
            parts.append(fsdp.full_tensor(norm).float().to(device))
        total = torch.linalg.vector_norm(torch.stack(parts))
        scale = min(1.0, float(max_norm) / (float(total) + 1e-6))
        if scale < 1.0:
            with torch.no_grad():
                for g in grads:
                    g.mul_(scale)
        return total


class DeepSpeedZeRO(Strategy):
    """DeepSpeed ZeRO-1/2/3: the step's gradients kept local in DeepSpeed's one-reduction block from
    its first micro-step to its last (``deepspeed.StepReduction``), then the reduction and
    ``engine.step()``; under ZeRO-3 an engine's parameters held whole from the step's first tree call
    (``deepspeed.WholeParameters``). The engine is read again at each micro-step: a second
    ``train()`` builds a new one. ``engines``: the candidates that may hold a model the trainer
    calls (the policy's engine, a reference model's)."""

    averages_by_hand = False
    runs_trl_async = False

    def __init__(self, accelerator, stage: int, engines: Callable[[], Iterable] = tuple, gather: str = "auto") -> None:
        super().__init__(accelerator, gather)
        self.stage = stage
        self.name = f"DeepSpeed ZeRO-{stage}"
        self.collective_save = stage == 3
        self._engines = engines
        self._reduction: zero.StepReduction | None = None
        self._whole: dict[int, zero.WholeParameters] = {}

    def refusal(self, args) -> str | None:
        missing = zero.missing_support(self.accelerator)
        if missing is None and self.stage == 3 and getattr(args, "tree_gather", "auto") == "block":
            return ("tree_gather='block' gathers the model block by block inside the tree's calls under FSDP2; under "
                    "DeepSpeed ZeRO-3 the tree holds the model whole through a step's calls (docs/multi_gpu.md, "
                    "memory). Use FSDP2 (examples/accelerate/fsdp2.yaml) for block-by-block gathering, or "
                    "tree_gather='auto' / 'whole'")
        return missing

    def engine_of(self, model):
        """The DeepSpeed engine that holds ``model``, or None."""
        if zero.is_engine(model):
            return model
        for candidate in self._engines():
            if zero.is_engine(candidate) and candidate.module is model:
                return candidate
        return None

    @contextlib.contextmanager
    def hold(self, model):
        """ZeRO-3: ``model``'s engine whole for the calls inside; kept until the optimizer step ends
        where they build a graph (its backward reads them, and later micro-steps call the model
        again), given back at the end otherwise."""
        engine = self.engine_of(model) if self.stage == 3 else None
        if engine is None:
            yield
            return
        self._chosen(model, lambda: self._held_whole(engine))
        holder = self._whole.get(id(engine))
        if holder is None or holder.engine is not engine:
            holder = self._whole[id(engine)] = zero.WholeParameters(engine)
        was_held = holder.held
        holder.hold()
        try:
            yield
        finally:
            if not was_held and not torch.is_grad_enabled():
                holder.release()

    def _held_whole(self, engine) -> gathering.Gathering:
        """ZeRO-3 holds the model whole through a step's calls; where that would not fit by ``tree_gather``'s
        rule (the whole parameters and their whole gradients, kept local until the step's one reduction,
        against the free GPU memory), say so before it runs out of memory, and what gathers block by block."""
        reason = "DeepSpeed ZeRO-3: held whole through a step's tree calls (block by block is FSDP2's)"
        device = self.accelerator.device
        if device.type != "cuda" or not torch.cuda.is_available():
            return gathering.Gathering(False, reason)
        sizes = [(getattr(p, "ds_numel", p.numel()) * p.dtype.itemsize, p.requires_grad)
                 for p in zero.engine_parameters(engine)]
        whole, grads = sum(n for n, _ in sizes), sum(n for n, trains in sizes if trains)
        free, total = torch.cuda.mem_get_info(device)
        figures = gathering.memory_figures(whole, grads, free, total)
        if gathering.fits_whole(whole, grads, free):
            return gathering.Gathering(False, f"{reason}; {figures}")
        warnings.warn(
            f"{reason}, but the whole model and its gradients ({(whole + grads) / 2**30:.1f} GiB) take more than "
            f"{gathering.WHOLE_SHARE:.0%} of this GPU's free memory ({figures}): the step may run out of "
            "memory. FSDP2 (examples/accelerate/fsdp2.yaml) gathers block by block inside the tree's calls, as "
            "stock does (tree_gather; docs/multi_gpu.md)", stacklevel=2)
        return gathering.Gathering(False, f"{reason}; would not fit: {figures}")

    def scoring(self, model, graph: bool):
        return self.hold(model)

    def place_critic(self, critic, policy, trainer_name: str) -> None:
        """Every critic parameter is the policy's engine's: its modules join the policy while DeepSpeed
        builds the engine (:meth:`critic_group_with_optimizer`), one ZeRO optimizer reduces, clips and
        steps both."""
        plugin = self.accelerator.state.deepspeed_plugin
        if "optimizer" in (plugin.deepspeed_config or {}):
            raise ValueError(f"{trainer_name}: the DeepSpeed config names an optimizer, which DeepSpeed builds over "
                             "the policy's parameters alone; remove its 'optimizer' block (the trainer builds the "
                             "optimizer from optim/learning_rate with the critic's parameter group)")
        critic.in_engine = True

    def critic_group_with_optimizer(self, critic, policy) -> bool:
        zero.join_modules(policy, critic.modules())  # before DeepSpeed builds its engine around both
        return True

    def critic_prepared(self, critic, policy) -> bool:
        """Once the engine holds the critic's parameters, the policy is the policy alone again
        (generation, saving and vLLM's weight sync read it)."""
        wrapped = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        if wrapped is not None:
            zero.separate_joined(wrapped.engine)
        return False

    def critic_hold(self, critic_model, policy):
        return self.hold(policy)  # the critic's parameters are the policy's engine's

    def release(self) -> None:
        for holder in self._whole.values():
            holder.release()

    def begin_micro_step(self, defer_step: bool = True) -> None:
        if not defer_step:
            return
        zero.defer_steps(self.accelerator)
        engine = self.accelerator.deepspeed_engine_wrapped.engine
        if self._reduction is None or self._reduction.engine is not engine:  # a new train() built a new engine
            self._reduction = zero.StepReduction(engine)
            self._whole = {k: h for k, h in self._whole.items() if not h.held}
        self._reduction.start()

    def end_micro_step(self, closes_step: bool) -> None:
        """At the optimizer step's last micro-step: the gradients a rank did not compute filled with
        zeros (before the release: ZeRO-3's are whole-sized), ZeRO-3's whole parameters partitioned
        again, then the one reduction and ``engine.step()``."""
        if not closes_step:
            return
        reduction = self._reduction
        try:
            if reduction is not None:
                reduction.fill_missing()
        finally:
            self.release()
        if reduction is not None:
            reduction.finish()

    def abandon_step(self) -> None:
        try:
            self.release()
        finally:
            if self._reduction is not None:
                self._reduction.abandon()


def strategy_for(accelerator, engines: Callable[[], Iterable] = tuple, gather: str = "auto") -> Strategy:
    """The :class:`Strategy` of an Accelerate run (``engines``: see :class:`DeepSpeedZeRO`; ``gather``:
    ``tree_gather``, how a sharded model is gathered for the calls)."""
    kind = accelerator.distributed_type.value
    if kind == "DEEPSPEED":
        return DeepSpeedZeRO(accelerator, zero.deepspeed_stage(accelerator), engines, gather)
    if kind == "FSDP":
        return FSDP2(accelerator, gather) if getattr(accelerator, "is_fsdp2", False) else FSDP1(accelerator, gather)
    return Replicated(accelerator, gather)
