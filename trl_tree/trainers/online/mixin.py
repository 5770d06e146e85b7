"""What online RL adds to the tree calls of every trainer (``tree_calls.TreeCallsMixin``): what
``TreeGRPOTrainer``, ``TreeRLOOTrainer`` and ``TreePPOTrainer`` change in TRL's trainers — and nothing else.

Accumulation windows (whole trees of all micro-steps and ranks placed on ranks, ``window.py``), the
group-preserving shuffle, the policy's backward in one pass where its loss is written out
(``separable_loss.py``), and four overrides:

* ``_get_per_token_logps_and_entropies`` (TRL's hook for the policy loss forward, the old-policy
  log-probs and the reference log-probs, including the PEFT reference with the adapter disabled)
  runs the tree engine on the rows' real tokens instead of the padded batch;
* ``_prepare_inputs`` keeps TRL's buffering and cuts each fresh buffer again so that a prompt's
  group stays in one micro-batch (in TRL's shuffled order; with ``tree_token_budget``, balanced by
  unique tokens);
* ``training_step`` also times the step without generation, logged as ``tree/fwd_bwd_time``, and
  averages the gradients by hand where the tree's backward did not run through DDP (see
  ``_graphs_by_hand``);
* ``_compute_loss`` keeps TRL's inputs at hand for the policy's tree call, whose one-pass backward
  needs the loss's per-token constants (advantages, old and reference log-probs, the normaliser).

``tree_mode="off"`` delegates every one of them to TRL (the timing metric aside).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ...engine._profiling import profiled
from ...engine.api import scored_first
from ...engine.forest import PrefixForest
from ...engine.model_parts import model_parts, trainable_parameters
from .bridge import bridge
from ...distributed.exchange import RankExchange, exchange_group
from ...distributed.grouping import group_cost, join_rows, plan_windows, prompt_groups, take_rows
from ...engine.rows import PaddedRows
from .separable_loss import GRPOTokenLoss, OnePassLoss
from ..tree_calls import TreeCallsMixin
from ...distributed.window import TreeWindow

logger = logging.getLogger(__name__)

MULTIMODAL_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)


@dataclass
class _WindowState:
    """The open accumulation window: its trees (None: its micro-steps run on their own), the
    ``_step`` of its first and last micro-steps, its micro-batches' tokens and TRL's inputs."""

    window: TreeWindow | None
    first: int
    last: int
    input_ids: list[torch.Tensor]
    inputs: list[dict]  # TRL's buffered micro-batches: what each micro-step's loss reads
    closes_step: bool  # its last micro-step is the optimizer step's last


class TreeTrainerMixin(TreeCallsMixin):
    """Mixed in before a TRL online trainer (``class TreeGRPOTrainer(TreeTrainerMixin, GRPOTrainer)``):
    what online RL adds to the tree calls every trainer makes (``TreeCallsMixin``)."""

    # ------------------------------------------------------------------ construction
    def _setup_tree(self) -> None:
        """Called at the end of the trainers' ``__init__``: the step timers and the window's state,
        then the common construction (``TreeCallsMixin._setup_tree``)."""
        self._tree_step_seconds = 0.0
        self._tree_prepare_seconds = 0.0
        self._tree_window: _WindowState | None = None
        self._tree_micro_in_update = 0  # micro-steps run since the last optimizer step
        super()._setup_tree()

    def _check_trainer_support(self) -> None:
        """Online RL's own refusals: windows the wrapper cannot run, batch sizes that cut prompt
        groups; then the shuffle it will use, said once."""
        name = type(self).__name__
        if self.args.tree_window == "accumulation" and not self._strategy.runs_own_backward:
            raise ValueError(
                f"{name}: tree_window='accumulation' runs the window's backward inside the engine and synchronises "
                f"the gradients itself, which is done for DDP, FSDP2 and DeepSpeed, not {self._strategy.name}; use "
                "tree_window='micro_step' (or 'auto', which uses it there), or FSDP2 (fsdp_version: 2)"
            )
        self._check_whole_groups()
        args = self.args
        window_matters = args.tree_window == "accumulation" or self.accelerator.num_processes > 1 or \
            args.gradient_accumulation_steps > 1
        if self._windows_on() and window_matters and getattr(self, "aux_loss_enabled", False):
            self._window_misfit(
                "the MoE load-balancing loss (router_aux_loss_coef, on for mixture-of-experts models) is a function of "
                "each micro-batch's router statistics, so an accumulation window cannot merge micro-steps exactly: "
                "the tree shares tokens only within a micro-batch (a larger per_device_train_batch_size shares more). "
                "Set router_aux_loss_coef=0.0 to train with windows, or tree_window='micro_step'"
            )
        self._announce_shuffle()

    def _windows_on(self) -> bool:
        return (self.args.tree_mode != "off" and self.args.tree_window != "micro_step"
                and self._strategy.runs_own_backward and not getattr(self, "_tree_window_fallback", False))

    def _window_misfit(self, why: str) -> None:
        """A batch layout accumulation windows cannot hold: an error under ``tree_window='accumulation'``;
        under ``'auto'`` the trainer takes trees per micro-step, as stock TRL trains it, and says so once."""
        name = type(self).__name__
        if self.args.tree_window == "accumulation":
            raise ValueError(f"{name}: {why}")
        self._tree_window_fallback = True
        warnings.warn(f"{name}: {why}. tree_window='auto' computes trees per micro-step here, as stock TRL trains "
                      "this layout (tree_window='accumulation' refuses it)", stacklevel=4)

    def _check_whole_groups(self) -> None:
        """Refuse batch sizes with which accumulation windows cannot hold whole prompt groups; warn
        where ``tree_window='micro_step'`` splits groups between ranks or micro-steps."""
        args, name = self.args, type(self).__name__
        processes, per_device = self.accelerator.num_processes, args.per_device_train_batch_size
        accumulation, spg, g = args.gradient_accumulation_steps, args.steps_per_generation, self.num_generations
        if self._windows_on():
            if spg <= accumulation:
                return  # one window per generation batch: TRL keeps it a whole number of groups
            if spg % accumulation:
                self._window_misfit(
                    f"steps_per_generation={spg} is not a multiple of gradient_accumulation_steps="
                    f"{accumulation}, so an accumulation window would hold micro-steps of two generation batches. Set "
                    f"steps_per_generation to a multiple of {accumulation}, or tree_window='micro_step'"
                )
                return
            if (per_device * accumulation) % g:
                # TRL's group statistics need each group's rows contiguous over the processes, so a
                # process's window (per_device x accumulation rows) must itself hold whole groups
                step = g // math.gcd(g, per_device)
                self._window_misfit(
                    f"with {spg // accumulation} optimizer steps per generation batch, an optimizer step takes "
                    f"per_device_train_batch_size x gradient_accumulation_steps = {per_device} x {accumulation} rows "
                    f"of each process, not a multiple of num_generations={g}: prompt groups would be split between "
                    f"optimizer steps, each piece computing its prompt. Use gradient_accumulation_steps="
                    f"{step * math.ceil(accumulation / step)} (steps_per_generation a multiple of it), or "
                    f"steps_per_generation={accumulation} (one optimizer step per generation batch), or set "
                    "tree_window='micro_step' to train with split groups"
                )
                return
            if args.tree_shuffle == "rows":
                warnings.warn(
                    f"{name}: tree_shuffle='rows' is TRL's row shuffle over the whole generation batch, so the "
                    f"{spg // accumulation} optimizer steps of a generation batch split its prompt groups between them "
                    "(each piece computes its prompt); tree_shuffle='groups' keeps them whole", stacklevel=3,
                )
            return
        split = []
        if processes > 1 and (per_device * spg) % g:
            split.append(f"between processes ({per_device * spg} rows each)")
        if per_device % g:
            split.append(f"between micro-steps ({per_device} rows each)")
        elif args.tree_shuffle == "rows" and spg > 1:
            split.append("between micro-steps (tree_shuffle='rows' is TRL's row shuffle)")
        if split:
            warnings.warn(
                f"{name}: with tree_window='micro_step' prompt groups of num_generations={g} are split "
                f"{' and '.join(split)}, and each piece computes its prompt; tree_window='auto' or 'accumulation' "
                "computes every group whole on one rank", stacklevel=3,
            )

    def _regroups(self) -> bool:
        """Whether a training generation batch is cut into micro-batches by whole prompt groups
        (``tree_shuffle``) instead of TRL's own row shuffle."""
        args = self.args
        if args.tree_mode == "off" or args.tree_shuffle == "rows" or not self.model.training:
            return False
        return args.tree_shuffle == "groups" or not self._regrouping_changes()

    def _regrouping_changes(self) -> list[str]:
        """Why keeping prompt groups whole would change stock TRL's update here; [] where it cannot:
        rows move only between the micro-steps of one optimizer step, and every loss term is a sum
        over micro-batches that does not depend on which rows meet (TRL's micro-batches all hold the
        same number of rows, so a per-sequence mean over each is a global mean)."""
        args = self.args
        reasons = []
        if args.steps_per_generation > args.gradient_accumulation_steps:
            reasons.append(f"steps_per_generation={args.steps_per_generation} > gradient_accumulation_steps="
                           f"{args.gradient_accumulation_steps}: rows would move between optimizer steps")
        if args.steps_per_generation > 1:
            reasons.extend(self._per_micro_batch_terms())
        return reasons

    def _per_micro_batch_terms(self) -> list[str]:
        """The loss terms normalised or computed per micro-batch (GRPO's and RLOO's; PPO adds its value loss)."""
        terms = []
        if getattr(self, "loss_type", None) == "bnpo":
            terms.append("loss_type='bnpo' divides by the micro-batch's token count")
        if getattr(self, "top_entropy_quantile", 1.0) < 1.0:
            terms.append("top_entropy_quantile < 1 masks by an entropy quantile of the micro-batch")
        if getattr(self, "_entropy_bonus_enabled", False):
            terms.append("the entropy bonus is a token mean over the micro-batch")
        if getattr(self, "aux_loss_enabled", False):
            terms.append("the MoE load-balancing loss is a mean over the micro-batch")
        return terms

    def _announce_shuffle(self) -> None:
        """At construction: say what ``tree_shuffle='groups'`` changes against stock TRL, where it does."""
        if self.args.tree_mode == "off" or self.args.tree_shuffle != "groups":
            return
        changes = self._regrouping_changes()
        if changes:
            warnings.warn(
                f"{type(self).__name__}: tree_shuffle='groups' keeps prompt groups whole in a micro-batch, which "
                f"changes stock TRL's update here ({'; '.join(changes)}): the micro-batches hold other rows than "
                "TRL's shuffle gives them. The T/U it buys is logged at the first generation batch; "
                "tree_shuffle='auto' (the default) keeps stock's update", stacklevel=3,
            )

    def _log_regrouping_gain(self, batch: dict, plan: list[list[int]]) -> None:
        """Once, under ``tree_shuffle='groups'`` where it changes the update: the T/U of the regrouped
        micro-batches against TRL's row shuffle of the same rows (the same number of micro-batches)."""
        if self.args.tree_shuffle != "groups" or getattr(self, "_tree_gain_logged", False) \
                or not self._regrouping_changes():
            return
        self._tree_gain_logged = True
        sequences = [p[pm.bool()].tolist() + c[cm.bool()].tolist() for p, pm, c, cm in
                     zip(batch["prompt_ids"].cpu(), batch["prompt_mask"].cpu(), batch["completion_ids"].cpu(),
                         batch["completion_mask"].cpu())]
        per = len(sequences) // len(plan)
        rows = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(0)).tolist()

        def ratio(micro_batches):
            forests = [PrefixForest.from_sequences([sequences[i] for i in mb]) for mb in micro_batches]
            return sum(f.num_tokens for f in forests) / max(sum(f.num_unique_tokens for f in forests), 1)

        logger.warning(
            "%s: tree_shuffle='groups' gives micro-batches of T/U %.2f on this generation batch, TRL's row shuffle "
            "%.2f (the same rows in %d micro-batches)", type(self).__name__, ratio(plan),
            ratio([rows[k * per:(k + 1) * per] for k in range(len(plan))]), len(plan))

    # ------------------------------------------------------------------ micro-batches
    @profiled("trl_tree.prepare_inputs")
    def _prepare_inputs(self, generation_batch: dict[str, torch.Tensor | Any]) -> dict[str, torch.Tensor | Any]:
        """TRL's own buffering of a generation batch (its generation, shuffle, split and reuse across
        ``steps_per_generation`` and ``num_iterations``), its buffer then cut again group by group
        (see ``grouping``) when a fresh one was made for training."""
        start = time.perf_counter()
        try:
            buffered = self._buffered_inputs
            generate_every = self.args.steps_per_generation * self.num_iterations
            if not self.model.training or self._step % generate_every == 0 or buffered is None:
                self._strategy.release()  # ZeRO-3: TRL's generation gathers the parameters its own way
            inputs = super()._prepare_inputs(generation_batch)
            if not self._regroups() or self._buffered_inputs is buffered:
                return inputs
            # a fresh buffer: TRL's micro-batches, joined back in TRL's shuffled order (its one permutation
            # drawn: the random stream stays stock's), cut so that a prompt's group stays in one micro-batch
            batch = join_rows(self._buffered_inputs)
            if any(batch.get(k) is not None for k in MULTIMODAL_KEYS):
                raise ValueError(f"{type(self).__name__}: multimodal inputs are not supported by the tree")
            groups = prompt_groups(batch["prompt_ids"], batch["prompt_mask"])  # first appearance: TRL's order
            costs_of = None
            if self.args.tree_token_budget is not None:
                prompt_len = batch["prompt_mask"].sum(1).tolist()
                completion_len = batch["completion_mask"].sum(1).tolist()

                def costs_of(pieces):
                    return [group_cost(g, prompt_len, completion_len) for g in pieces]

            spg = self.args.steps_per_generation
            per_window = self.args.gradient_accumulation_steps if self._windows_on() else spg
            plan = plan_windows(groups, spg, per_window, costs_of, shuffle=False)
            self._log_regrouping_gain(batch, plan)
            self._buffered_inputs = [take_rows(batch, rows) for rows in plan]
            return self._buffered_inputs[self._step % spg]
        finally:
            self._tree_prepare_seconds += time.perf_counter() - start

    @profiled("trl_tree.training_step")
    def training_step(self, model, inputs, num_items_in_batch):
        self._tree_prepare_seconds = 0.0
        self._tree_sync_pending = False
        start = time.perf_counter()
        # the strategy's micro-step: at the optimizer step's last, its one reduction (FSDP2, DeepSpeed); on an
        # error (a non-finite loss, say) the step's state is given back in ``finally``
        with self._micro_step():
            loss = super().training_step(model, inputs, num_items_in_batch)
            self._close_window(model)
            self._tree_micro_in_update = 0 if self.accelerator.sync_gradients else self._tree_micro_in_update + 1
            if self._tree_sync_pending:  # the policy's tree call ran on the unwrapped model (_graphs_by_hand)
                self._tree_sync_pending = False
                self._sync_gradients(self._unwrapped(model))
            self._sync_other_gradients()
            if self.args.tree_mode != "off":
                if self.accelerator.sync_gradients:
                    self._strategy.settle()  # FSDP2: the step's reduction, so that the check reads reduced gradients
                self._check_finite(model, loss)
        self._add_step_time(start, loss, self._step % self.current_gradient_accumulation_steps == 0,
                            self._tree_prepare_seconds)
        return loss

    def _sync_other_gradients(self) -> None:
        """Average, at an optimizer step's last micro-step, the gradients of what trains beside the
        policy outside DDP (PPO's critic); inside the step's timed part, before the checks."""

    @profiled("trl_tree.check_finite")
    def _check_finite(self, model, loss: torch.Tensor) -> None:
        """Raise before the optimizer can write a non-finite loss or gradient into the model, naming the
        micro-batch. Under fp16 loss scaling an overflow is expected and the scaler skips the step (the
        Trainer's own handling), so nothing is raised there. The loss is checked at every micro-step;
        the gradients (a norm over every parameter) at the optimizer step's last only: a non-finite
        value stays so through the accumulation's sums, and a rank's micro-steps past the first often
        add nothing (a one-pass window took the whole backward at its first)."""
        if getattr(self.accelerator, "scaler", None) is not None:
            return
        finite_grads = True
        if self.accelerator.sync_gradients:
            grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # FSDP2: this rank's shard
                     for p in trainable_parameters(self._unwrapped(model)) if p.grad is not None]
            norms = torch._foreach_norm(grads) if grads else []
            finite_grads = bool(torch.stack(norms).isfinite().all()) if norms else True
        value = float(loss.detach())
        if math.isfinite(value) and finite_grads:
            return
        what = "loss" if not math.isfinite(value) else "gradient"
        micro_step = (self._step - 1) % self.args.steps_per_generation  # TRL counted this micro-step already
        buffered = self._buffered_inputs[micro_step] if self._buffered_inputs else None
        rows = len(buffered["prompt_ids"]) if buffered is not None else "?"
        raise FloatingPointError(
            f"{type(self).__name__}: non-finite {what} (loss {value}) at global step {self.state.global_step}, "
            f"micro-step {micro_step} of the generation batch ({rows} rows); the "
            "optimizer step is not taken. Check the rewards and advantages (a reward function returning nan/inf) "
            "and the loss settings; tree_mode='off' runs TRL's own path on the same data"
        )

    # ------------------------------------------------------------------ the loss in one pass
    @profiled("trl_tree.loss")
    def _compute_loss(self, model, inputs):
        """TRL's, with its ``inputs`` at hand for the policy's tree call: where the loss is a sum of
        per-token terms (``_one_pass_loss``), the call computes each term's gradient as it scores
        the token, without the two-pass bridge's forward first."""
        self._tree_loss_inputs = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._tree_loss_inputs = None

    #: the trainer's policy loss written out (``separable_loss``): GRPO's per-token terms here
    _one_pass_loss_class: type = GRPOTokenLoss

    def _one_pass_loss(self) -> OnePassLoss | None:
        """The policy loss written out where ``tree_one_pass`` is on and the settings allow it; None
        where the two-pass bridge runs (the reason is said once, in the log)."""
        if self.args.tree_mode == "off" or not getattr(self.args, "tree_one_pass", True):
            return None
        cached = self.__dict__.get("_tree_one_pass_loss")
        if cached is None:
            why = self._one_pass_loss_class.why_not(self)
            cached = (None if why else self._one_pass_loss_class.of(self), why)
            self._tree_one_pass_loss = cached
            if why and (self.args.tree_mode == "dfs" or self._windows_on()):
                logger.info("%s: the policy's tree backward runs in two passes (a forward first): %s",
                            type(self).__name__, why)
        return cached[0]

    def _one_pass_calls(self, model, rows: PaddedRows, calls, forests, loss: OnePassLoss, constants: torch.Tensor,
                        with_entropy: bool, call_kwargs: dict, sync: bool, final: bool | None = None,
                        closes_step: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each call's ``tree_backward`` with ``loss``'s per-token terms (``constants``: padded
        ``(B, T, K)`` on ``rows``); returns the padded log-probs (and entropies) it scored on the way,
        detached: their gradient is already in ``.grad``."""
        device = rows.rows.device
        logps = torch.zeros(rows.shape, device=device)
        entropies = torch.zeros(rows.shape, device=device) if with_entropy else None

        def make_loss(where, term_index):
            call_constants = constants[where]

            def token_loss(lp, seq_idx, pos, ent=None, entropy=None):
                index = term_index(seq_idx, pos)
                cell = (where[0][index], where[1][index])
                logps.index_put_(cell, lp.detach().float())
                if entropies is not None:
                    entropies.index_put_(cell, (entropy if entropy is not None else ent).detach().float())
                return loss.terms(lp, call_constants[index], seq_idx)

            return token_loss

        kwargs = {**self._mode_kwargs(), **call_kwargs}
        # the entropies are values for TRL's metrics: the head's by-product, without a gradient — except
        # where the walk replays CUDA graphs, whose head computes no by-products but the entropy it
        # differentiates (unused by the loss, so no gradient flows through it)
        replayed_walk = kwargs["mode"] == "dfs" and bool(kwargs["options"].cuda_graphs)
        if with_entropy and not replayed_walk:
            kwargs["head_outputs"] = ("entropy",)
        token = scored_first.set(False)
        try:
            self._walk_calls(model, rows, calls, forests, make_loss, kwargs, with_entropy and replayed_walk,
                             sync=sync, final=final, closes_step=closes_step, coupled=loss.coupled)
            # a coupled loss (RLOO's) whose sequences a walk's units split was scored first, in the engine
            self._metrics["train"]["tree/passes"].append(2.0 if scored_first.get() else 1.0)
        finally:
            scored_first.reset(token)
        return logps, entropies

    def _one_pass_inputs(self, input_ids: torch.Tensor) -> dict | None:
        """TRL's inputs of the loss being computed, where they are the micro-batch of ``input_ids``."""
        inputs = getattr(self, "_tree_loss_inputs", None)
        if inputs is None:
            return None
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        return inputs if ids.shape == input_ids.shape and torch.equal(ids, input_ids) else None

    # ------------------------------------------------------------------ log-probs
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        if self.args.tree_mode == "off":
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal,
            )
        present = sorted(k for k, v in multimodal.items() if v is not None)
        if present:
            raise ValueError(f"{type(self).__name__}: multimodal inputs ({', '.join(present)}) are not supported")
        # every rank holds the model whole for its tree calls (ZeRO-3; FSDP2 where they build no graph)
        with self._strategy.scoring(model, graph=torch.is_grad_enabled()):
            return self._tree_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                                  compute_entropy, compute_aux_loss)

    def _tree_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size,
                                  compute_entropy, compute_aux_loss):
        """``_get_per_token_logps_and_entropies`` through the tree: a window's, placed over the ranks,
        or the micro-batch's own calls."""
        differentiable = torch.is_grad_enabled()
        if differentiable and self.model.training:
            window, micro = self._window_for(input_ids, attention_mask, logits_to_keep, allowed=not compute_aux_loss)
            if window is not None:
                return self._window_policy(window, micro, model, compute_entropy)
        elif (self.model.training and self._windows_on() and self.accelerator.num_processes > 1
              and not compute_aux_loss):
            placed = self._placed_forward(model, input_ids, attention_mask, logits_to_keep, compute_entropy)
            if placed is not None:
                return placed
        rows, calls, forests = self._tree_layout(input_ids, attention_mask, logits_to_keep,
                                                 None if differentiable else batch_size)
        two_pass = self._two_pass(differentiable, len(calls))
        by_hand = differentiable and not two_pass and self._graphs_by_hand()
        if by_hand:
            self._tree_sync_pending = True
        # what stock's padded forward shows the model: its width (a length-dependent RoPE chooses by it)
        call_kwargs = self._call_kwargs(input_ids.shape[1])
        router = self._router() if compute_aux_loss else None
        value_head = self._joint_value_head() if differentiable else None
        loss = self._one_pass_loss() if two_pass and router is None and value_head is None else None
        inputs = self._one_pass_inputs(input_ids) if loss is not None else None
        if inputs is not None:  # a sum of per-token terms: forward and backward in one pass
            logps, entropies = self._one_pass_calls(self._unwrapped(model), rows, calls, forests, loss,
                                                    loss.constants(self, inputs), compute_entropy, call_kwargs,
                                                    sync=True)
            logps, entropies, _, _ = bridge(logps, entropies, _gradient_already_taken)
            self._log_forests(forests)
            return logps, entropies, None
        # a two-pass call's forward-only first pass replays graphs too, which DDP's wrapper refuses; it
        # runs none of DDP's hooks anyway (no graph is built), so it takes the unwrapped model
        unwrapped = by_hand or (two_pass and self._graphs_by_hand())
        with self.accelerator.autocast():
            logps, entropies, values = self._score_calls(
                self._unwrapped(model) if unwrapped else model, rows, calls, forests, compute_entropy,
                two_pass, router, call_kwargs, value_head)
        aux_loss = router.loss() if router is not None else None
        if two_pass:
            target = self._unwrapped(model)
            self._metrics["train"]["tree/passes"].append(2.0)

            def second_pass(grad_logps, grad_entropies, grad_aux, grad_values):
                self._tree_backward(target, rows, calls, forests, grad_logps, grad_entropies, router, grad_aux,
                                    call_kwargs, value_head, grad_values)

            logps, entropies, aux_loss, values = bridge(logps, entropies, second_pass, aux_loss, values)
        if value_head is not None:
            self._tree_joint_values = values
        if differentiable:
            self._log_forests(forests, router is not None)
        return logps, entropies, aux_loss

    # ------------------------------------------------------------------ accumulation windows
    def _window_for(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                    allowed: bool = True) -> tuple[TreeWindow | None, int]:
        """The window of the current micro-step and its index there — opened (a collective call on
        every rank) at the window's first micro-step — or ``(None, 0)`` where micro-steps run on
        their own (``tree_window``, the cost model's choice, a MoE load-balancing loss, which TRL
        computes per micro-batch)."""
        if not self._windows_on() or self._buffered_inputs is None:
            return None, 0
        state = self._tree_window
        if state is None:
            state = self._open_window(allowed)
        micro = self._step - state.first
        if state.window is None:
            return None, 0
        expected = state.input_ids[micro]
        # TRL's loss over the buffered micro-batch itself makes its ids from that batch: no comparison
        # (a wait for the GPU) needed; anything else is compared token by token
        own_batch = getattr(self, "_tree_loss_inputs", None) is state.inputs[micro]
        if expected.shape != input_ids.shape or not (own_batch or torch.equal(expected, input_ids)):
            raise RuntimeError(
                f"{type(self).__name__}: the policy's loss forward at micro-step {micro} of the accumulation window "
                "is not over the buffered micro-batch's prompt+completion tokens; tree_window='accumulation' cannot "
                "place it. Set tree_window='micro_step'"
            )
        return state.window, micro

    @profiled("trl_tree.window.open")
    def _open_window(self, allowed: bool) -> _WindowState:
        args = self.args
        spg = args.steps_per_generation
        first = self._step % spg
        remaining = max(self.current_gradient_accumulation_steps - self._tree_micro_in_update, 1)
        n = min(remaining, spg - first)
        micro_inputs = self._buffered_inputs[first : first + n]
        input_ids = [torch.cat([b["prompt_ids"], b["completion_ids"]], dim=1) for b in micro_inputs]
        exchange = RankExchange(self.accelerator.process_index, self.accelerator.num_processes, exchange_group())
        window = None
        worth_trying = args.tree_window == "accumulation" or exchange.world > 1 or n > 1
        closes_step = n == remaining
        if allowed and worth_trying:
            rows = [PaddedRows.from_padded(ids, torch.cat([b["prompt_mask"], b["completion_mask"]], dim=1),
                                           b["completion_ids"].shape[1]) for ids, b in zip(input_ids, micro_inputs)]
            stock_two_pass = self._two_pass()
            window = self._new_window(self.model, rows, [ids.shape[1] for ids in input_ids], exchange,
                                      bool(args.gradient_checkpointing), stock_two_pass,
                                      one_pass=self._window_one_pass() is not None)
            metrics = self._metrics["train"]
            metrics["tree/rank_imbalance_stock"].append(window.stock_imbalance)
            if (args.tree_window == "auto" and not window.pays) or self._idle_ranks_refused(window):
                metrics["tree/rank_imbalance"].append(window.stock_imbalance)
                window = None
            else:
                metrics["tree/rank_imbalance"].append(window.imbalance)
        self._tree_window = _WindowState(window, self._step, self._step + n - 1, input_ids, micro_inputs, closes_step)
        return self._tree_window

    def _window_policy(self, window: TreeWindow, micro: int, model, compute_entropy: bool):
        """The policy's log-probs (entropies, a shared critic's values) of micro-step ``micro`` from
        the window's trees, through the bridge whose backward keeps their gradients for the window's
        one tree backward."""
        target = self._unwrapped(model)
        device = self.accelerator.device
        value_head = self._joint_value_head()
        loss = self._window_one_pass()
        if "policy" not in window.passes and loss is not None:
            state = self._tree_window

            def run(rows, calls, forests, rope_length, constants, last):
                return *self._one_pass_calls(target, rows, calls, forests, loss, constants, compute_entropy,
                                            self._call_kwargs(rope_length), sync=False, final=last,
                                            closes_step=state.closes_step), None  # no values

            with self._strategy.hold(target):
                window.one_pass("policy", [loss.constants(self, inputs) for inputs in state.inputs], run, device)
            self._log_forests(window.forests)
        if "policy" not in window.passes:
            self._metrics["train"]["tree/passes"].append(2.0)

            def backward(rows, calls, forests, rope_length, grads, last):
                grad_logps, grad_entropies, grad_values = grads
                if grad_logps is None:
                    grad_logps = torch.zeros(rows.shape, device=device)
                self._tree_backward(target, rows, calls, forests, grad_logps, grad_entropies, None, None,
                                    self._call_kwargs(rope_length), value_head, grad_values, sync=False, final=last)

            with self._strategy.hold(target):
                window.forward("policy", self._window_scorer(target, compute_entropy, value_head), backward, device)
            self._log_forests(window.forests)
        logps, entropies, values = window.outputs("policy", micro)
        if loss is not None:  # one pass: TRL's loss runs on these for its value and metrics only
            logps, entropies, _, _ = bridge(logps, entropies, _gradient_already_taken)
            return logps, entropies, None

        def keep(grad_logps, grad_entropies, grad_aux, grad_values):
            window.add_grads("policy", micro, [grad_logps, grad_entropies, grad_values])

        logps, entropies, _, values = bridge(logps, entropies, keep, None, values)
        if value_head is not None:
            self._tree_joint_values = values
        return logps, entropies, None

    def _placed_forward(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                        compute_entropy: bool):
        """A forward without a graph over every process's rows (the generation batch's old-policy and
        reference log-probs), each tree computed whole on one rank and the results brought back to
        the rows' own ranks — the placement of an accumulation window, forward only. Every process
        computes these passes at the same moment, so the collective calls line up."""
        rows = PaddedRows.from_padded(input_ids, attention_mask, logits_to_keep)
        exchange = RankExchange(self.accelerator.process_index, self.accelerator.num_processes, exchange_group())
        window = self._new_window(model, [rows], [input_ids.shape[1]], exchange, False, stock_two_pass=False)
        if self._idle_ranks_refused(window):
            return None
        target = self._unwrapped(model)
        # held on every rank around the whole pass: a rank's trees take their own number of calls (and walk
        # units), so calls that gathered the sharded model themselves would not line up between ranks
        with self._strategy.hold(target):
            window.forward("forward", self._window_scorer(target, compute_entropy), None, self.accelerator.device)
        self._metrics["train"]["tree/rank_imbalance_forward"].append(window.imbalance)
        logps, entropies, _ = window.outputs("forward", 0)
        return logps, entropies, None

    def _window_models(self) -> list[torch.nn.Module]:
        """The models a window's backward calls (the policy; PPO adds a separate value model)."""
        return [self._unwrapped(self.model)]

    @contextlib.contextmanager
    def _window_held(self):
        """Every model of the window's backward held whole on every rank (``Strategy.hold``): a rank's
        share of the window's trees takes its own number of calls."""
        with contextlib.ExitStack() as stack:
            for model in self._window_models():
                stack.enter_context(self._strategy.hold(model))
            yield

    def _idle_ranks_refused(self, window: TreeWindow) -> bool:
        """Under FSDP2, a window that leaves a rank without trees is not run: its calls gather and
        reduce the sharded model on the trees' owners only, so the ranks' collectives would differ
        and they would wait for each other (measured: a four-GPU W4 PPO step that never ended). The
        placement cuts trees until every rank owns one there (``TreeWindow(fill_ranks=True)``), so
        this is left for a window of fewer rows than ranks: its micro-steps run their own trees on
        their own rows, as ``tree_window="micro_step"`` does — exact, with less sharing; said once."""
        if not self._strategy.fills_ranks or not window.idle_ranks:
            return False
        if not getattr(self, "_tree_idle_ranks_said", False):
            self._tree_idle_ranks_said = True
            logger.warning(
                "%s: an accumulation window would leave rank(s) %s without a tree under FSDP2, where a window's "
                "calls gather and reduce the sharded model on the trees' owners only; such windows run their "
                "micro-steps' own trees instead (tree_window='micro_step'). More rows per window than ranks have "
                "trees (gradient_accumulation_steps, per_device_train_batch_size) keep every rank busy",
                type(self).__name__, window.idle_ranks)
        return True

    def _new_window(self, model, micro_rows: list[PaddedRows], widths: list[int], exchange: RankExchange,
                    gradient_checkpointing: bool, stock_two_pass: bool, one_pass: bool = False) -> TreeWindow:
        """A window over ``micro_rows`` for ``model`` (its config costs the trees; a length-dependent
        RoPE keeps rows of different padded widths in different calls)."""
        parts = model_parts(model)
        # FSDP2 runs no window that leaves a rank without a tree (``_idle_ranks_refused``): there the
        # trees are cut until every rank owns one
        return TreeWindow(micro_rows, widths, exchange, parts.causal_lm.config.get_text_config(),
                          gradient_checkpointing, self.args.tree_token_budget, bool(parts.length_dependent_rope),
                          stock_two_pass, one_pass, fill_ranks=self._strategy.fills_ranks or self._tree_fill_ranks)

    def _window_one_pass(self) -> OnePassLoss | None:
        """The per-token loss of a window's policy pass in one pass; None with a critic on the
        policy's trunk (its values' gradient is the value loss's, not written out here)."""
        return self._one_pass_loss() if self._joint_value_head() is None else None

    def _window_scorer(self, target, compute_entropy: bool, value_head=None):
        """A window pass's forward over its owned rows: the tree calls without a graph (``_score_calls``)."""
        def score(rows, calls, forests, rope_length):
            with self.accelerator.autocast():
                return self._score_calls(target, rows, calls, forests, compute_entropy, True, None,
                                         self._call_kwargs(rope_length), value_head)
        return score

    def _close_window(self, model) -> None:
        """At the window's last micro-step: the trees' backward on their owners, then DDP's average."""
        state = self._tree_window
        if state is None or self._step - 1 < state.last:
            return
        self._tree_window = None
        if state.window is None or not state.window.passes:
            return
        with self._window_held():
            state.window.backward(self.accelerator.device)
        self._sync_gradients(self._unwrapped(model))


def _gradient_already_taken(*grads) -> None:
    """The bridge's backward after a one-pass call: its gradients are already in ``.grad``."""
