"""What every tree trainer needs, whatever it trains on: a micro-batch's rows as forests, their
scoring through the engine, and the engine's backward.

Why a mixin of its own: the online RL trainers (GRPO, RLOO, PPO: ``mixin.py`` adds accumulation
windows, placement of trees on ranks, the group-preserving shuffle and the old/reference passes)
and the offline ones (SFT, DPO) share exactly this — the padded batch cut into tree calls, each
call a ``PrefixForest``, log-probs scattered back into the padded layout, the second pass that
back-propagates per-token weights through the tree, gradients synchronised by hand where the
engine's backward did not run through the distributed wrapper, and the construction-time refusals
of what the tree cannot compute exactly.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings

import numpy as np
import torch
from torch.profiler import record_function

from ..engine.attention.support import attention_refusal
from ..engine.backward_hooks import before_last_backward
from ..engine.compile import compile_layers
from ..engine.api import tree_backward, tree_logprobs
from ..engine.forest import PrefixForest
from ..distributed.strategy import Strategy, strategy_for
from ..engine.model_parts import active_dropout, model_parts, trainable_parameters
from ..engine.packed import takes_padded_path
from .online.bridge import bridge
from ..distributed.exchange import reduction_group
from ..distributed.grad_sync import GradientAverager
from ..distributed.grouping import group_cost, split_into_calls
from ..engine.rows import PaddedRows

logger = logging.getLogger(__name__)


class TreeCallsMixin:
    """Mixed in before a TRL trainer; the trainer calls ``_setup_tree()`` at the end of its ``__init__``."""

    #: the step timer waits for the whole device, not the compute stream (``bench.trainer``'s
    #: ``+sharedgroup``, which measures what the stream's wait and the average's own communicator buy)
    _tree_timer_waits_for_device = False
    #: the by-hand average's all-reduces start during the backward that makes their gradients final
    #: (False: right after it; ``bench.trainer``'s ``+afterbwd``)
    _tree_launch_in_backward = True
    #: a window's trees cut until every rank owns one under DDP and DeepSpeed too (FSDP2 always does:
    #: it cannot run a window with an idle rank); ``bench.trainer``'s ``+fill``, to measure whether it
    #: pays there
    _tree_fill_ranks = False

    # ------------------------------------------------------------------ construction
    def _setup_tree(self) -> None:
        """Refuse what the tree cannot compute, compile the layers where asked."""
        self._tree_sync_pending = False
        self._tree_layout_cache = None
        self._check_tree_support()
        # before the Trainer's prepare wraps it (every mode: stock's own path needs it too, e.g. Qwen3.5 under FSDP2)
        self._strategy.prepare_model(self.model)
        # the by-hand gradient average's communicator, made here, where every rank passes at once
        self._tree_reduce_group = (reduction_group(self.accelerator.device) if self.accelerator.num_processes > 1
                                   and self._strategy.averages_by_hand else None)
        if self.args.tree_compile_layers:  # every mode: with "off", TRL's own step on the same compiled layers
            for model in (self.model, getattr(self, "ref_model", None)):
                if model is not None:
                    compile_layers(self._unwrapped(model))

    def _check_tree_support(self) -> None:
        """Refuse, at construction, what the tree cannot compute exactly — never a wrong number later."""
        args = self.args
        name = type(self).__name__
        if args.tree_mode == "off":
            return
        if getattr(self, "_is_vlm", False):
            raise ValueError(f"{name}: vision-language models are not supported by the tree; set tree_mode='off'")
        self._refuse_prompt_learning(self.model)
        parts = model_parts(self.model)  # clear errors now for a model the tree cannot run (attention, layer types)
        self._refuse_dropout(self.model, "the model")
        if getattr(self, "aux_loss_enabled", False):
            self._router()  # a load-balancing loss asked of a model without experts: refused now, not at a step
        # the precision the steps run in: bf16/fp16 mixed precision runs them under autocast
        compute_dtype = parts.compute_dtype_under(torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None)
        why = attention_refusal(parts.causal_lm, args.tree_attn_backend, parts.device, compute_dtype, args.tree_mode)
        if why is not None:
            raise ValueError(f"{name}: {why}")
        if parts.absolute_positions:
            warnings.warn(
                f"{name}: {type(parts.causal_lm).__name__} has absolute position embeddings. The tree gives every token "
                "its true position (its depth), as generation does; stock TRL's training forward passes no position "
                "ids, so a left-padded prompt's tokens sit at shifted positions there. The tree's log-probs are the "
                "right ones and differ from stock TRL's for padded rows (docs/trainers.md)",
                stacklevel=3,
            )
        if self.args.tree_cuda_graphs and not self._strategy.averages_by_hand:
            raise ValueError(
                f"{name}: tree_cuda_graphs replays the backward outside the distributed wrapper and averages the "
                f"gradients itself, which is done for DDP only, not {self._strategy.name}; set "
                "tree_cuda_graphs=False"
            )
        why = self._strategy.refusal(args)
        if why is not None:
            raise ValueError(f"{name}: {why}; or tree_mode='off'")
        self._check_trainer_support()

    def _refuse_prompt_learning(self, model) -> None:
        """Refuse a PEFT prompt-learning adapter (prompt tuning, p-tuning's prompt encoder, prefix
        tuning), at construction. Its virtual tokens (or prefix K/V) enter through ``PeftModel``'s
        own forward, which concatenates them to the padded batch; the tree calls the base model on
        its packed tokens and never sees them, so its numbers would not be stock's (measured: a
        different loss with prompt tuning, a crash under dfs)."""
        configs = getattr(getattr(model, "module", model), "peft_config", None)  # under DDP: its module
        kinds = [str(getattr(c, "peft_type", type(c).__name__)).split(".")[-1] for c in (configs or {}).values()
                 if getattr(c, "is_prompt_learning", False)]
        if kinds:
            raise ValueError(
                f"{type(self).__name__}: the tree does not support PEFT prompt-learning adapters ({', '.join(kinds)}): "
                "their virtual tokens are prepended by PeftModel's forward to the padded batch, which the tree's calls "
                "do not run, so the numbers would not be stock's. Use an adapter on the weights (LoRA and its kin), "
                "or tree_mode='off' for stock's path")

    def _check_trainer_support(self) -> None:
        """What a kind of trainer refuses besides (its batch layouts, its settings); nothing here."""

    def _refuse(self, refusals: dict[str, bool]) -> None:
        """Raise for the first setting of ``refusals`` (``{what, with the reason: is it set}``) that is on."""
        refused = [what for what, on in refusals.items() if on]
        if refused:
            raise ValueError(f"{type(self).__name__}: the tree does not support {refused[0]}; use tree_mode='off' "
                             "for stock's path")

    @property
    def _strategy(self) -> Strategy:
        """The engine the model is distributed with (``distributed/strategy.py``): what holds it whole
        for a sequence of tree calls, begins and ends a micro-step and reduces once per step. Made on
        first use: the launch fixes it."""
        strategy = self.__dict__.get("_tree_strategy")
        if strategy is None:
            def engines():
                return (getattr(self, "model_wrapped", None), getattr(self, "deepspeed", None),
                        getattr(self, "ref_model", None))

            strategy = self.__dict__["_tree_strategy"] = strategy_for(self.accelerator, engines,
                                                                          getattr(self.args, "tree_gather", "auto"))
        return strategy

    def _defers_deepspeed_step(self) -> bool:
        """Whether the trainer, not Accelerate's ``backward``, reduces and steps under DeepSpeed: the
        tree's modes; ``tree_mode="off"`` is stock's step."""
        return self.args.tree_mode != "off"

    def _micro_step(self):
        """A micro-step under the strategy: begun, ended in ``finally`` (``Strategy.micro_step``)."""
        return self._strategy.micro_step(self._defers_deepspeed_step())

    def _two_pass(self, differentiable: bool = True, calls: int | None = None) -> bool:
        """Whether a differentiable tree call takes two passes (a forward, then the engine's own
        backward through ``bridge``): the walk (dfs), and rows cut into several calls; one graph
        otherwise. ``calls``: how many this micro-batch took; None asks whether any may (a token
        budget may cut one). The one answer every trainer asks."""
        if not differentiable:
            return False
        if calls is None:
            return self.args.tree_mode == "dfs" or self.args.tree_token_budget is not None
        return self.args.tree_mode == "dfs" or calls > 1

    def _past_ddp(self, model):
        """The model a stock loss calls for the policy's fused head: with the two-pass backward (dfs,
        ``tree_token_budget``) or replayed CUDA graphs (``_graphs_by_hand``) under DDP, the unwrapped
        one. Run through DDP's forward, its reducer would wait for one gradient per parameter, which
        the engine's walk delivers many times over (and a replayed backward not at all); past it, the
        gradients are averaged by hand (``_sync_gradients``), as the SFT and GRPO trainers' calls,
        which never enter DDP's forward, always have."""
        from torch.nn.parallel import DistributedDataParallel

        if (self._two_pass() or self._graphs_by_hand()) and isinstance(model, DistributedDataParallel):
            return self._unwrapped(model)
        return model

    def _refuse_dropout(self, model: torch.nn.Module, what: str) -> None:
        """Refuse ``model`` (the policy, a value model) with active dropout, at construction."""
        dropout = active_dropout(model)
        if dropout:
            raise ValueError(
                f"{type(self).__name__}: dropout is active in {what} ({', '.join(dropout[:4])}"
                f"{' ...' if len(dropout) > 4 else ''}); the tree computes a shared token once and cannot draw one "
                "dropout mask per sequence as the untreed batch does. Set disable_dropout=True (it zeroes nn.Dropout "
                "modules; TRL leaves them on by default) and the config's attention_dropout to 0, or use "
                "tree_mode='off'"
            )

    def _call_kwargs(self, rope_length: int) -> dict:
        """What a tree call of the policy takes besides the mode: the width stock's padded forward shows
        a length-dependent RoPE, and TRL's ``cast_lm_head_to_fp32``."""
        return dict(rope_length=rope_length, lm_head_fp32=bool(getattr(self.args, "cast_lm_head_to_fp32", False)))

    def _joint_value_head(self):
        """A value head to read in the same forward as the policy's log-probs (a critic on the
        policy's trunk, ``TreePPOTrainer``); the values land in ``_tree_joint_values``. None here."""
        return None

    def _router(self):
        """A collector of the MoE load-balancing loss over the tree (``trl_tree.engine.router``)."""
        from ..engine.router import RouterAux

        config = self.model.config.get_text_config()
        num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        if not num_experts:  # e.g. a dense Qwen3-Next (num_experts=0) keeps its default coefficient
            declared = getattr(config, "num_experts", getattr(config, "num_local_experts", None))
            raise ValueError(
                f"{type(self.model).__name__} asks for the MoE load-balancing loss (router_aux_loss_coef="
                f"{getattr(self, 'router_aux_loss_coef', None)}) but has no experts (num_experts={declared}); there "
                "is nothing to balance: set router_aux_loss_coef=0.0 in the trainer's config (stock TRL fails on "
                "this model too, inside the model's load_balancing_loss_func)")
        return RouterAux(num_experts, config.num_experts_per_tok)

    def _graphs_by_hand(self) -> bool:
        """Whether the policy's tree call runs on the unwrapped model, its gradients averaged by hand.

        With ``tree_cuda_graphs`` and several processes: a replayed backward cannot run DDP's
        gradient hooks (they would run only while capturing), so the call bypasses DDP's forward —
        its eager fallback too, so that every rank takes the same path whatever it has captured —
        and ``training_step`` averages the gradients at each synchronising step (``_sync_gradients``,
        as the two-pass backward does): accumulated over the micro-steps, then averaged once, which
        is what DDP's ``no_sync`` accumulation gives.
        """
        return self.args.tree_cuda_graphs and self.accelerator.num_processes > 1

    def _tree_layout(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                     batch_size: int | None) -> tuple[PaddedRows, list[list[int]], list[PrefixForest]]:
        """The rows of a padded batch, cut into tree calls (``_tree_calls``) and built into forests —
        once for the same rollouts: the old-policy, reference (and critic) passes of a generation
        batch, and the policy (and critic) passes of a micro-batch's loss, reuse the last layout
        when their tokens, mask and chunking are the same."""
        key = (logits_to_keep, batch_size, tuple(input_ids.shape))
        cached = self._tree_layout_cache
        if (cached is not None and cached[0] == key and torch.equal(cached[1], input_ids)
                and torch.equal(cached[2], attention_mask)):
            return cached[3]
        rows = PaddedRows.from_padded(input_ids, attention_mask, logits_to_keep)
        calls = self._tree_calls(rows, batch_size)
        layout = rows, calls, [PrefixForest.from_sequences(rows.subset(call)[0]) for call in calls]
        self._tree_layout_cache = (key, input_ids, attention_mask, layout)
        return layout

    def _tree_calls(self, rows: PaddedRows, batch_size: int | None) -> list[list[int]]:
        """Rows of each tree call: one call, cut by ``tree_token_budget`` when set; under no_grad
        TRL's ``batch_size`` chunks bound memory as in TRL (groups kept together by sorting)."""
        seqs = [s.tolist() for s in rows.sequences]
        budget = self.args.tree_token_budget
        calls = split_into_calls(seqs, budget)
        if budget is not None and len(calls) > 1:  # one call holds every group whole
            self._warn_budget_splits_groups(seqs, rows.score_from, budget)
        if budget is None and batch_size is not None and batch_size < len(seqs):
            order = calls[0]
            calls = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        return calls

    def _warn_budget_splits_groups(self, seqs: list[list[int]], score_from: list[int], budget: int) -> None:
        """Warn once when ``tree_token_budget`` cuts prompt groups apart: their prompts are then
        computed once per call (T/U falls towards 1 where the budget is below one sequence)."""
        if getattr(self, "_tree_budget_warned", False):
            return
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (seq, first) in enumerate(zip(seqs, score_from)):
            groups.setdefault(tuple(seq[:first]), []).append(i)
        completion_len = [len(seq) - first for seq, first in zip(seqs, score_from)]
        needed = max(group_cost(rows, score_from, completion_len) for rows in groups.values())
        if needed > budget:
            self._tree_budget_warned = True
            longest = max(len(s) for s in seqs)
            warnings.warn(
                f"tree_token_budget={budget} is smaller than a prompt group's unique tokens (up to {needed}"
                f"{'; one sequence alone has ' + str(longest) if longest > budget else ''}): groups are cut into "
                f"several calls and their prompts computed once per call{', T/U = 1' if longest > budget else ''}. "
                f"A budget of at least {needed} keeps every group in one call",
                stacklevel=2,
            )

    def _mode_kwargs(self) -> dict:
        """The mode, the sampling temperature and the config's ``TreeOptions`` of every policy call."""
        return {"mode": self.args.tree_mode, "temperature": getattr(self, "temperature", 1.0),
                "options": self.args.tree_options()}

    def _score_calls(self, model, rows, calls, forests, compute_entropy, no_graph, router=None, call_kwargs=None,
                     value_head=None, head_outputs: tuple[str, ...] = ()):
        """Padded ``(logps, entropies or None, values or None)`` of the rows, call by call;
        ``head_outputs`` (``tree_logprobs``'s: ``is_top1``, ``mean_logits``, ...) land in the dict
        ``_tree_head_outputs``, padded the same way."""
        lps, ents, vals = [], [], []
        extra: dict[str, list] = {name: [] for name in head_outputs}
        kwargs = {**self._mode_kwargs(), **(call_kwargs or {})}
        if value_head is not None:  # the graphs replay the LM head only
            kwargs["options"] = kwargs["options"].replace(cuda_graphs=False)
        graph = not no_graph and torch.is_grad_enabled()
        with self._strategy.scoring(model, graph), torch.no_grad() if no_graph else contextlib.nullcontext():
            for call, forest in zip(calls, forests):
                out = tree_logprobs(model, forest, return_entropy=compute_entropy,
                                    score_from=rows.subset(call)[1], router=router, value_head=value_head,
                                    head_outputs=head_outputs, **kwargs)
                out = list(out) if isinstance(out, tuple) else [out]
                lps.append(torch.cat(out.pop(0)))
                if compute_entropy:
                    ents.append(torch.cat(out.pop(0)))
                if value_head is not None:
                    vals.append(torch.cat(out.pop(0)))
                for name in head_outputs:
                    extra[name].append(torch.cat(out.pop(0)))
        self._tree_head_outputs = {name: rows.to_padded(kept, calls) for name, kept in extra.items()}
        logps = rows.to_padded(lps, calls)
        entropies = rows.to_padded(ents, calls) if compute_entropy else None
        values = rows.to_padded(vals, calls) if value_head is not None else None
        return logps, entropies, values

    def _offline_scores(self, model, rows: PaddedRows, rope_length: int, differentiable: bool,
                        head_outputs: tuple[str, ...] = (), aux_loss: bool = False):
        """An offline trainer's micro-batch (SFT's samples, DPO's pairs) through the tree:
        ``(logps, entropies, head outputs, forests, aux)`` on the rows' grid. ``logps`` carries the
        gradient where ``differentiable``: one autograd graph (packed, one call) or the bridge to the
        engine's own backward on the unwrapped model (dfs, or rows cut by ``tree_token_budget``).
        ``aux_loss``: also the MoE load-balancing loss over the rows' tokens (``trl_tree.engine.router``:
        each unique token's router logits weighted by the rows through it), differentiable the same
        way; else ``aux`` is None."""
        calls, forests = self._offline_layout(rows)
        two_pass = self._two_pass(differentiable, len(calls))
        call_kwargs = self._call_kwargs(rope_length)
        router = self._router() if aux_loss else None
        with self._strategy.scoring(model, graph=differentiable and not two_pass), self.accelerator.autocast():
            logps, entropies, _ = self._score_calls(model, rows, calls, forests, True, two_pass or not differentiable,
                                                    router, call_kwargs, head_outputs=head_outputs)
        extra = self._tree_head_outputs
        aux = router.loss() if router is not None else None
        if two_pass:
            target = self._unwrapped(model)

            def second_pass(grad_logps, grad_entropies, grad_aux, grad_values):
                self._tree_backward(target, rows, calls, forests, grad_logps, router=router, grad_aux=grad_aux,
                                    call_kwargs=call_kwargs)

            logps, _, aux, _ = bridge(logps, None, second_pass, aux)
        return logps, entropies.detach(), extra, forests, aux

    def _offline_layout(self, rows: PaddedRows) -> tuple[list[list[int]], list[PrefixForest]]:
        """``rows`` cut into tree calls and built into forests — kept for the next call on the same
        rows (DPO's reference call after its policy's)."""
        cached = getattr(self, "_tree_offline_forests", None)
        if cached is not None and cached[0] is rows:
            return cached[1], cached[2]
        calls = self._tree_calls(rows, None)
        forests = [PrefixForest.from_sequences(rows.subset(call)[0]) for call in calls]
        self._tree_offline_forests = (rows, calls, forests)
        return calls, forests

    def _tree_backward(self, model, rows: PaddedRows, calls, forests, grad: torch.Tensor,
                       grad_entropies: torch.Tensor | None = None, router=None, grad_aux: torch.Tensor | None = None,
                       call_kwargs: dict | None = None, value_head=None, grad_values: torch.Tensor | None = None,
                       sync: bool = True, final: bool | None = None) -> None:
        """Second pass: each call's backward with the per-token weights ``grad = dLoss/dlogp`` (and
        ``grad_entropies = dLoss/dentropy`` for an entropy bonus; ``grad_aux`` for the MoE
        load-balancing loss collected in ``router``; ``grad_values = dLoss/dvalue`` for the values
        of ``value_head`` read in the same forward)."""
        kwargs = {**self._mode_kwargs(), **(call_kwargs or {})}
        with_entropy = grad_entropies is not None
        if value_head is not None:
            kwargs["options"] = kwargs["options"].replace(cuda_graphs=False)
            if grad_values is None:
                grad_values = torch.zeros_like(grad)
        if router is not None:
            if grad_aux is None:
                router = None  # the loss does not depend on it
            else:
                router.set_backward(grad_aux)

        def make_loss(where, term_index):
            weights = grad[where].float()  # flat, in the call's (row, token) order
            ent_weights = grad_entropies[where].float() if with_entropy else None
            value_weights = grad_values[where].float() if value_head is not None else None

            def token_loss(lp, seq_idx, pos, ent=None, values=None):
                index = term_index(seq_idx, pos)
                terms = lp * weights[index]
                if ent is not None:
                    terms = terms + ent * ent_weights[index]
                return terms if values is None else terms + values * value_weights[index]

            return token_loss

        self._walk_calls(model, rows, calls, forests, make_loss, kwargs, with_entropy, router, value_head, sync, final)

    def _walk_calls(self, model, rows: PaddedRows, calls, forests, make_loss, kwargs: dict, with_entropy: bool = False,
                    router=None, value_head=None, sync: bool = True, final: bool | None = None,
                    closes_step: bool | None = None, coupled: bool = False) -> None:
        """Each call's ``tree_backward`` with the token loss ``make_loss(where, term_index)`` builds
        for it (``rows.call_terms``: where its terms sit, and the engine's ``(seq_idx, pos)`` to their
        index), under the trainer's autocast (and the model held whole: ``Strategy.hold``); then the gradients'
        synchronisation. ``final`` (default: ``sync``): the last call's last backward arms the
        overlapped average (``_arming``; ``closes_step`` as there). ``coupled``: the loss couples
        each sequence's terms (``tree_backward(coupled=...)``, one group per sequence)."""
        final = sync if final is None else final
        with self._strategy.hold(model), self.accelerator.autocast():
            for i, (call, forest) in enumerate(zip(calls, forests)):
                where, term_index = rows.call_terms(call)
                with self._arming(model, final and i == len(calls) - 1, closes_step=closes_step):
                    groups = {"coupled": np.arange(len(call))} if coupled else {}
                    tree_backward(model, forest, make_loss(where, term_index), score_from=rows.subset(call)[1],
                                  with_entropy=with_entropy, router=router, value_head=value_head, **groups, **kwargs)
        self._strategy.backward_done(model)  # FSDP2: reduced once, at the optimizer step's last micro-step
        if final:
            self._flush_average(model, closes_step=closes_step)
        if sync:
            self._sync_gradients(model)

    def _unwrapped(self, model):
        """``accelerator.unwrap_model(model)``, kept for the last model asked about: Accelerate looks
        installed packages up on every call (a DeepSpeed check through importlib, ~0.5 ms), and a
        window's micro-steps ask for the policy at each one, where the step's host time is the
        step's time."""
        cached = self.__dict__.get("_tree_unwrapped")
        if cached is not None and cached[0] is model:
            return cached[1]
        inner = self.accelerator.unwrap_model(model)
        self.__dict__["_tree_unwrapped"] = (model, inner)
        return inner

    def _averager(self, model, params=None) -> GradientAverager | None:
        """The by-hand average over the processes of ``model``'s trainable gradients (``params``: these
        instead, a PPO critic's), made once, in buckets of ``ddp_bucket_cap_mb`` (DDP's own setting,
        25 MiB by default); None on one process, for no ``params``, and under FSDP2 for a model (whose
        reduction is ``trl_tree.distributed.fsdp``'s; ``params`` there: what stays whole beside it)."""
        if self.accelerator.num_processes == 1 or (params is None and not self._strategy.averages_by_hand) or (
                params is not None and not params):
            return None
        averagers = self.__dict__.setdefault("_tree_averagers", {})
        key = id(model)
        if key not in averagers:
            chosen = trainable_parameters(model) if params is None else params
            cap_mb = getattr(self.args, "ddp_bucket_cap_mb", None) or 25  # DDP's knob and default
            group = self.__dict__.get("_tree_reduce_group")  # None: the default group
            averagers[key] = GradientAverager(chosen, self.accelerator.num_processes, bucket_bytes=int(cap_mb * 2**20),
                                              all_reduce=functools.partial(torch.distributed.all_reduce, group=group),
                                              launch_in_backward=self._tree_launch_in_backward)
        return averagers[key]

    def _arming(self, model, last: bool, params=None, closes_step: bool | None = None):
        """The context of a tree call: where it is the optimizer step's last for ``model``, its last
        backward arms the overlapped average (``grad_sync.GradientAverager``), so each bucket's
        all-reduce starts as soon as its gradients are final instead of after the whole backward.
        ``closes_step``: whether this micro-step's backward is the optimizer step's last (default:
        it is the step's last micro-step; a one-pass window takes every backward of the window at its
        first micro-step)."""
        averager = self._averager(model, params) if last and self._overlaps(closes_step) else None
        return before_last_backward(averager.arm if averager is not None else None)

    def _overlaps(self, closes_step: bool | None = None) -> bool:
        """Whether this backward's gradients are averaged overlapped with it (``_arming``)."""
        closes = self.accelerator.sync_gradients if closes_step is None else closes_step
        # not with CUDA graphs: a hook that ran while capturing would put a collective in the graph
        return closes and not self.args.tree_cuda_graphs and getattr(self.args, "tree_overlap_reduction", True)

    def _flush_average(self, model, params=None, closes_step: bool | None = None) -> None:
        """Right after the step's last backward for ``model``, on every rank (one that owned no tree
        too): launch the buckets the backward did not (``GradientAverager.flush``), so that every rank
        issues them at the same point of its sequence of collectives."""
        averager = self._averager(model, params) if self._overlaps(closes_step) else None
        if averager is not None:
            averager.flush()

    def _sync_gradients(self, model) -> None:
        """DDP's averaging, done by hand: the engine's backward never ran through DDP's forward
        (``grad_sync.GradientAverager``: the buckets the step's last backward did not already send,
        then the wait for all).
        Under FSDP2 and DeepSpeed the strategy reduces once, at the end of the optimizer step's last
        micro-step (``Strategy.micro_step``), outside autograd's backward."""
        if not self._strategy.averages_by_hand:  # FSDP2 / DeepSpeed: the strategy's one reduction per step
            return
        if self.accelerator.num_processes == 1 or not self.accelerator.sync_gradients:
            return
        self._averager(model).finish()

    def _add_step_time(self, started: float, loss: torch.Tensor, step_done: bool, excluded: float = 0.0) -> None:
        """``tree/fwd_bwd_time``: the seconds of an optimizer step's micro-steps since ``started``
        (less ``excluded``: generation and scoring in the RL trainers), the compute stream's queue
        drained, so that the time is the work's and not its launch — that stream's only: a device-wide
        wait would also wait for the gradient all-reduces a one-pass window's backward started, which
        can instead finish while the window's later micro-steps run on the host (the step's last
        micro-step waits for them before the optimizer step, so the step's time includes them);
        logged at the step's last micro-step (``step_done``). Every trainer and ``tree_mode`` logs
        it: a ``tree_mode='off'`` run is the baseline the docs compare against."""
        if loss.device.type == "cuda":
            with record_function("trl_tree.step_timer"):
                if self._tree_timer_waits_for_device:
                    torch.cuda.synchronize(loss.device)
                else:
                    torch.cuda.current_stream(loss.device).synchronize()
        self._tree_step_seconds = getattr(self, "_tree_step_seconds", 0.0) + time.perf_counter() - started - excluded
        if step_done:
            self._metrics["train"]["tree/fwd_bwd_time"].append(self._tree_step_seconds)
            self._tree_step_seconds = 0.0
            self._log_kernel_compiles()

    def _log_kernel_compiles(self) -> None:
        """``tree/kernel_compile_time``: what FlashAttention-4 spent in this step compiling (or loading
        from its disk cache) kernels for variants it had not run yet; ``tree/kernel_fallback_calls``:
        the calls that ran on PyTorch's FA2 meanwhile, their variants compiling off the step
        (``engine/attention/fa4_ahead.py``). Logged wherever FA4 was loaded; the step's handing over
        of variants, and a step that spent over a second compiling, say so in the log."""
        from ..engine.attention import fa4, fa4_ahead

        if fa4._interface.cache_info().currsize == 0 or fa4._interface() is None:  # FA4 not in use
            return
        kernels, seconds = fa4.take_compile_time()
        ahead = fa4_ahead.take_stats()
        self._metrics["train"]["tree/kernel_compile_time"].append(seconds)
        self._metrics["train"]["tree/kernel_fallback_calls"].append(float(ahead["fallback_calls"]))
        if ahead["submitted"]:
            logger.info("%s: FlashAttention-4 met %d kernel variant(s) not built yet: compiling them off the step "
                        "(%d in flight), their calls run on PyTorch's FA2 meanwhile (%s=0 compiles them in the step)",
                        type(self).__name__, ahead["submitted"], ahead["pending"], fa4_ahead.ENABLE_VARIABLE)
        if seconds > 1.0:
            logger.warning(
                "%s: FlashAttention-4 compiled %d kernel(s) in %.1f s of this step (variants not run before; later "
                "steps reuse them, and FA4's disk cache, which trl_tree turns on with %s=1, keeps them for later runs)",
                type(self).__name__, kernels, seconds, fa4.PERSISTENT_CACHE_VARIABLE)

    def _offline_training_step(self, model, inputs, num_items_in_batch):
        """An offline trainer's (SFT, DPO) micro-step: stock's, then the engine's pending gradient
        reduction (FSDP2), timed (``_add_step_time``); with ``tree_mode='off'`` T/U is logged as 1.0,
        so the ``tree/`` columns of a stock run line up with a tree run's."""
        started = time.perf_counter()
        with self._micro_step():
            loss = super().training_step(model, inputs, num_items_in_batch)
            self._after_backward(model)
        if self.args.tree_mode == "off":
            self._metrics["train"]["tree/dedup_ratio"].append(1.0)
        self._add_step_time(started, loss, self.accelerator.sync_gradients)
        return loss

    def _after_backward(self, model) -> None:
        """What an offline trainer's micro-step does after stock's backward, inside the timed step
        (DPO: the gradients of a call that ran past DDP averaged by hand); nothing here."""

    def _log_forests(self, forests: list[PrefixForest], router: bool = False) -> None:
        """The step's sharing (``tree/dedup_ratio`` = T/U), its calls, and how many of them ran as
        stock's padded batch (``tree/padded_calls``: the cost model's no-sharing rule under the layout
        switch, packed mode — ``packed.takes_padded_path``, as the engine decides; ``router``: the calls
        collected an MoE load-balancing loss, which keeps them packed); under a sharded engine, whether a
        model is gathered block by block (``tree/gather_block``)."""
        mode = "train" if self.model.training else "eval"
        padded = sum(takes_padded_path(f, router) for f in forests) if self.args.tree_mode == "packed" else 0
        self._metrics[mode]["tree/padded_calls"].append(float(padded))
        total = sum(f.num_tokens for f in forests)
        unique = sum(f.num_unique_tokens for f in forests)
        self._metrics[mode]["tree/total_tokens"].append(float(total))
        self._metrics[mode]["tree/unique_tokens"].append(float(unique))
        self._metrics[mode]["tree/dedup_ratio"].append(total / max(unique, 1))
        self._metrics[mode]["tree/calls"].append(float(len(forests)))
        gatherings = self._strategy.gatherings  # a sharded model's, once chosen (``distributed/gathering.py``)
        if gatherings:
            self._metrics[mode]["tree/gather_block"].append(float(any(g.block for g in gatherings.values())))
