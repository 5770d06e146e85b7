"""``TreeAsyncGRPOTrainer``: TRL's asynchronous GRPO with this package's engine running its
micro-batches.

TRL 1.16's ``trl.experimental.async_grpo`` already folds each rank's samples into a trie row and
runs one packed pass through a hub FlashAttention-3 kernel (``tree_fa3``). Here that pass is the
tree engine's: the trainer keeps stock's rollout queue, staleness rule, batcher, collator and loss
code, and answers the fused LM head's call on the packed row from the engine (``trie_rows.py``: the
row read back as its leaves' sequences, the scores put back in stock's layout). So ``tree_mode``
picks the engine's packed pass (its own kernels, FA4 where ``auto`` picks it) or the depth-first
walk, ``tree_token_budget`` cuts a row into calls, and a model object is accepted where stock takes
only a name.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from dataclasses import dataclass, field
from unittest import mock

import numpy as np
import torch
from peft import PeftModel
from transformers import PreTrainedModel
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo import async_grpo_trainer as stock_module

from ..config import TreeArguments, as_tree_config
from .fused_forward import tree_fused_outputs
from ..offline.sft_rows import SFTRows
from ..tree_calls import TreeCallsMixin
from .trie_rows import TrieRow

#: the packed row's attention inputs stock passes to the fused forward
TRIE_KWARGS = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k", "tree_max_seqlen_q", "tree_max_seqlen_k")


#: how the policy loss's token sum is normalised
LOSS_NORMALIZATIONS = ("micro_batch", "window")
#: which batcher cuts the sample stream into micro-batches
BATCHERS = ("trl", "rollouts")


@dataclass
class TreeAsyncGRPOConfig(AsyncGRPOConfig, TreeArguments):
    """``trl.experimental.async_grpo.AsyncGRPOConfig`` plus the tree fields of :class:`TreeArguments`.
    Which samples form a micro-batch is TRL's batcher's choice (``token_budget``) unless
    ``tree_batcher='rollouts'`` picks this package's."""

    loss_normalization: str = field(
        default="micro_batch",
        metadata={"help": "'micro_batch' (default, stock's numbers): each micro-batch's token sum divided by its own "
                  "trained tokens (over all ranks), then by the accumulation steps — a token of a short micro-batch "
                  "weighs more than one of a long one. 'window' (opt-in, changes the numbers; the fix TRL issue #7206 "
                  "asks for): every token of the optimizer step weighs the same, the sum over the whole accumulation "
                  "window and all ranks divided by the window's trained tokens."},
    )
    tree_batcher: str = field(
        default="trl",
        metadata={"help": "'trl' (default): TRL's TokenBudgetBatcher, sample by sample into the least-loaded row; "
                  "samples over token_budget are dropped. 'rollouts' (opt-in, changes which samples share a "
                  "micro-batch, never a token's weight): each rollout (group_id) kept whole on one rank, rollouts "
                  "taken in arrival order and placed heaviest first by their trees' FLOPs; with tree_mode='dfs' a "
                  "sample over token_budget trains in a row of its own instead of being dropped."},
    )

    def __post_init__(self):
        self._check_tree_fields()
        if self.loss_normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(f"loss_normalization must be one of {LOSS_NORMALIZATIONS}, got "
                             f"{self.loss_normalization!r}")
        if self.tree_batcher not in BATCHERS:
            raise ValueError(f"tree_batcher must be one of {BATCHERS}, got {self.tree_batcher!r}")
        if self.tree_batcher == "rollouts" and self.token_budget is not None and self.token_budget <= 0:
            raise ValueError("tree_batcher='rollouts' cuts the stream by token_budget; token_budget=0 (a fixed sample "
                             "count per micro-batch) takes TRL's FixedCountBatcher: set a budget or tree_batcher='trl'")
        if self.tree_window == "accumulation":
            raise ValueError("tree_window='accumulation' places a synchronous generation batch's trees on ranks; the "
                             "async trainer's micro-batches come from TRL's batcher: leave it at 'auto'")
        self._default_to_cpu()
        super().__post_init__()


class TreeAsyncGRPOTrainer(TreeCallsMixin, AsyncGRPOTrainer):
    """Drop-in for ``trl.experimental.async_grpo.AsyncGRPOTrainer``: the same constructor; ``model``
    may also be a model object (stock takes a name, loaded with its hub kernel's attention)."""

    _tag_names = ["trl", "async-grpo", "trl_tree"]

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, processing_class=None,
                 callbacks=None, optimizers=(None, None), peft_config=None, tools=None, environment_factory=None,
                 rollout_worker=None, weight_transfer=None):
        args = as_tree_config(args, TreeAsyncGRPOConfig, model, "AsyncGRPO")
        if isinstance(rollout_worker, str):
            if rollout_worker != "local":
                raise ValueError(f"rollout_worker: a worker object, None (TRL's vLLM worker) or 'local', got "
                                 f"{rollout_worker!r}")
            model, processing_class, rollout_worker = _local_worker(model, args, train_dataset, processing_class,
                                                                    reward_funcs, tools, environment_factory)
            weight_transfer = rollout_worker.weight_transfer
        with _given_model(model, args) as name_or_model, _peak_flops_off_cuda():
            super().__init__(name_or_model, reward_funcs, args, train_dataset, processing_class, callbacks, optimizers,
                             peft_config, tools, environment_factory, rollout_worker, weight_transfer)
        self._tree_loss_terms: dict | None = None
        if args.tree_mode != "off":
            self._own_attention()
            self._install_trie_head()
        self._setup_tree()

    def _own_attention(self) -> None:
        """A model stock loaded with its hub kernel's attention name runs the engine's attention on
        ``sdpa``'s name instead: stock registers its own function under that name again at every
        construction, which would undo the engine's routing of it (``attention/dispatch.py``)."""
        model = self._unwrapped(self.model)
        if model.config._attn_implementation == stock_module.TREE_ATTENTION:
            model.set_attn_implementation("sdpa")

    def _install_trie_head(self) -> None:
        """Stock's fused forward on its packed row, answered by the tree (the trained model's causal
        LM: the PEFT base under LoRA, whose fused head stock installed)."""
        causal_lm = self._unwrapped(self.model)
        causal_lm = causal_lm.get_base_model() if isinstance(causal_lm, PeftModel) else causal_lm
        original = causal_lm.forward
        owner = weakref.ref(self)

        def forward(module, *args, fused_lm_head=False, shift_labels=None, **kwargs):
            trainer = owner()
            trie = {name: kwargs.pop(name) for name in TRIE_KWARGS if name in kwargs}
            plain = (trainer is not None and fused_lm_head and not args and shift_labels is not None
                     and len(trie) == len(TRIE_KWARGS) and set(kwargs) <= {"input_ids", "position_ids"})
            if not plain:
                return original(*args, fused_lm_head=fused_lm_head, shift_labels=shift_labels, **kwargs, **trie)
            return trainer._trie_outputs(module, kwargs["input_ids"], kwargs["position_ids"], shift_labels, trie)

        causal_lm.forward = types.MethodType(forward, causal_lm)

    def _trie_outputs(self, model, input_ids, position_ids, shift_labels, trie: dict):
        """TRL's ``FusedCausalLMOutput`` for one packed row, from the tree: the row's leaves scored as
        the offline trainers' fused calls are (``fused_forward.tree_fused_outputs``), their scores put
        back in the row's layout."""
        from trl.trainer.utils import FusedCausalLMOutput

        row = TrieRow.from_packed(input_ids[0], position_ids[0], shift_labels[0], trie["tree_kv_index"],
                                  trie["tree_cu_seqlens_q"], trie["tree_cu_seqlens_k"], type(self).__name__)
        batch = row.padded_batch(self.processing_class.pad_token_id, input_ids.device)
        rows = SFTRows.from_batch(batch, type(self).__name__)
        terms = self._tree_loss_terms
        if terms is not None and torch.is_grad_enabled() and self.args.tree_mode == "dfs" \
                and self._strategy.averages_by_hand:
            log_probs, entropy = self._walk_with_stock_loss(model, row, rows, terms)
            return FusedCausalLMOutput(log_probs=log_probs, entropy=entropy)
        out = tree_fused_outputs(self, model, rows, batch["input_ids"].shape, batch["labels"], None, (), policy=True)
        return FusedCausalLMOutput(log_probs=row.to_packed(out.log_probs), entropy=row.to_packed(out.entropy))

    def _walk_with_stock_loss(self, model, row: TrieRow, batch: SFTRows, inputs: dict):
        """dfs in one pass: stock's loss is a sum of per-term functions of one log-prob each (the
        clipped ratio times the advantage, over the micro-batch's normaliser), so the walk computes
        each term's gradient as it scores the token — no scoring pass first, which the two-pass
        bridge needs for a loss that is not separable. Returns the ``(1, positions)`` log-probs and
        entropies stock's loss then reads (for its value and metrics): already back-propagated, so
        they are a leaf whose gradient goes nowhere."""
        rows = batch.rows
        device = rows.rows.device
        width = rows.shape[1]
        # each labelled packed position's cell in the (samples, scored) grid: a sample is a leaf with a
        # labelled position (SFTRows keeps them in order, ``batch_rows``), its column 0 the prediction
        # at depth ``batch_cols``
        sample_of = np.searchsorted(batch.batch_rows, row.leaf)
        cell_of = np.full(row.num_positions, -1, dtype=np.int64)
        cell_of[row.labelled] = sample_of * width + row.depth - batch.batch_cols[sample_of]
        cell_of = torch.from_numpy(cell_of).to(device)
        selected = inputs["token_index"] >= 0
        cells = cell_of[inputs["token_index"][selected]]
        old = inputs["old_log_probs"][selected].float()
        advantages = inputs["advantages"][selected].float()
        order = torch.argsort(cells, stable=True)  # each cell's terms together (stock's loss sums over terms)
        counts = torch.bincount(cells, minlength=rows.shape[0] * width)
        starts = counts.cumsum(0) - counts
        scale = self._stock_loss_scale(inputs)
        low, high = 1 - self.epsilon_low, 1 + self.epsilon_high
        logps = torch.zeros(rows.shape, device=device)
        entropies = torch.zeros(rows.shape, device=device)

        def make_loss(where, term_index):
            call_cells = where[0] * width + where[1]

            def token_loss(lp, seq_idx, pos, ent=None):
                cell = call_cells[term_index(seq_idx, pos)]
                logps.view(-1)[cell] = lp.detach().float()
                entropies.view(-1)[cell] = ent.detach().float()
                n = counts[cell]
                pred = torch.repeat_interleave(torch.arange(cell.shape[0], device=device), n)
                offset = torch.arange(pred.shape[0], device=device) - (n.cumsum(0) - n)[pred]
                term = order[starts[cell][pred] + offset]
                ratio = torch.exp(lp.float()[pred] - old[term])
                per_term = -torch.minimum(ratio * advantages[term], ratio.clamp(low, high) * advantages[term])
                return torch.zeros_like(lp, dtype=torch.float32).index_add(0, pred, per_term * scale)

            return token_loss

        calls, forests = self._offline_layout(rows)
        self._log_forests(forests)
        longest = int(row.lengths.max())
        self._walk_calls(model, rows, calls, forests, make_loss, self._call_kwargs(longest), with_entropy=True)
        layout = (len(row.lengths), longest - 1)  # the leaves' next-token grid, as the two-pass path fills it
        return (row.to_packed(batch.to_batch(logps, layout)).requires_grad_(),
                row.to_packed(batch.to_batch(entropies, layout)))

    def _stock_loss_scale(self, inputs: dict) -> float:
        """What stock's loss divides a micro-batch's term sum by (its trained tokens per rank, then
        the accumulation steps) — or, with ``loss_normalization='window'``, the window's."""
        world = self.accelerator.num_processes
        if self.args.loss_normalization == "window":
            return world / max(self._tree_window_tokens, 1.0)
        per_rank = max(float(inputs["global_n_tokens"][0]) / world, 1.0)
        return 1.0 / (per_rank * self.current_gradient_accumulation_steps)

    def get_train_dataloader(self):
        """Stock's dataloader; with ``tree_batcher='rollouts'`` its batcher is this package's
        (``rollout_batcher.RolloutBatcher``)."""
        if self.args.tree_batcher != "rollouts":
            return super().get_train_dataloader()
        from .rollout_batcher import RolloutBatcher, flop_cost

        config = self._unwrapped(self.model).config
        cost = flop_cost(config, bool(self.args.gradient_checkpointing))
        keep = self.args.tree_mode == "dfs"

        def batcher(dataset, num_processes, token_budget, metrics):
            return RolloutBatcher(dataset, num_processes, token_budget, metrics, cost, keep_oversize=keep)

        with mock.patch.object(stock_module, "TokenBudgetBatcher", batcher):
            return super().get_train_dataloader()

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The optimizer step's micro-batches; with ``loss_normalization='window'`` also their trained
        tokens over all ranks (each batch carries its own global count)."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._tree_window_tokens = sum(float(b["global_n_tokens"][0]) for b in batches) if batches else None
        return batches, num_items

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._tree_loss_terms = inputs  # dfs: the walk computes stock's loss terms as it scores
        try:
            loss = super().compute_loss(self._past_ddp(model), inputs, return_outputs, num_items_in_batch)
        finally:
            self._tree_loss_terms = None
        if self.args.loss_normalization != "window":
            return loss
        # stock divided the micro-batch's sum by max(N_mb / W, 1) and by the accumulation steps; the
        # window's weighting divides it by N_window / W (DDP's average over the W ranks then gives
        # the window's sum over N_window)
        world = self.accelerator.num_processes
        per_rank = max(float(inputs["global_n_tokens"][0]) / world, 1.0)
        return loss * (per_rank * self.current_gradient_accumulation_steps * world
                       / max(self._tree_window_tokens, 1.0))

    def training_step(self, model, inputs, num_items_in_batch):
        with self._micro_step():
            return super().training_step(model, inputs, num_items_in_batch)

    def _check_trainer_support(self) -> None:
        args = self.args
        self._refuse({
            "the MoE auxiliary loss (router_aux_loss_coef; set it to 0.0 to train without it)":
                bool(getattr(self, "aux_loss_enabled", False)),
            "tree_cuda_graphs (not verified with the async trainer; a stream's micro-batch layouts rarely repeat, so "
            "they would seldom replay)": bool(args.tree_cuda_graphs),
            "FSDP1 or DeepSpeed (TRL's async trainer runs under FSDP2 only)":
                not self._strategy.runs_trl_async,
        })


@contextlib.contextmanager
def _given_model(model, args: TreeAsyncGRPOConfig):
    """Stock loads ``model`` by name with its hub kernel's attention; a model object is handed to its
    constructor in place of that loading (with ``tree_mode='off'`` it must then run stock's
    attention itself, so it is switched to the name stock registers)."""
    if not isinstance(model, PreTrainedModel):
        yield model
        return
    if args.tree_mode == "off":
        stock_module.register_tree_attention()
        model.set_attn_implementation(stock_module.TREE_ATTENTION)

    def given(name, **kwargs):
        return model

    with mock.patch.object(stock_module, "create_model_from_path", given):
        yield getattr(model.config, "_name_or_path", "") or "model"


@contextlib.contextmanager
def _peak_flops_off_cuda():
    """Stock looks its device's peak FLOPs up by CUDA device name, which fails on a machine without
    CUDA; there the MFU metrics are off (the None stock uses for an unknown device)."""
    if torch.cuda.is_available():
        yield
        return
    with mock.patch.object(stock_module, "get_peak_flops_per_device", lambda accelerator, dtype: None):
        yield


def _local_worker(model, args: TreeAsyncGRPOConfig, train_dataset, processing_class, reward_funcs, tools,
                  environment_factory):
    """``rollout_worker='local'``: the model and tokenizer loaded as stock would (a name) and a
    :class:`~trl_tree.trainers.asynchronous.local_rollout.LocalRolloutWorker` handed what stock hands its own
    worker. Returns ``(model, processing_class, worker)``."""
    from transformers import AutoTokenizer

    from .local_rollout import LocalRolloutWorker

    if args.token_budget is None:
        raise ValueError("rollout_worker='local' needs token_budget (the most unique tokens of one rank's micro-batch): "
                         "stock's default asks the vLLM server for its max_model_len")
    if not isinstance(model, PreTrainedModel):
        kwargs = dict(args.model_init_kwargs or {})
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        kwargs.setdefault("dtype", args.dtype)
        name = model
        model = stock_module.create_model_from_path(name, device_map=None, attn_implementation="sdpa", **kwargs)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
    if processing_class is None:
        raise ValueError("rollout_worker='local' with a model object needs processing_class")
    if processing_class.pad_token is None:
        processing_class.pad_token = processing_class.eos_token
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if processing_class.eos_token_id not in eos:
        eos = [processing_class.eos_token_id, *eos]
    funcs = [] if reward_funcs is None else reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    inflight = args.max_inflight_tasks if args.max_inflight_tasks > 0 else args.num_generations
    worker = LocalRolloutWorker(
        model, processing_class, train_dataset, funcs, eos_token_ids=eos, num_generations=args.num_generations,
        max_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, tools=tools,
        environment_factory=environment_factory, max_inflight_tasks=inflight, queue_maxsize=args.queue_maxsize,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        fork_threshold_tokens=args.fork_threshold_tokens, chat_template_kwargs=args.chat_template_kwargs,
        log_completions=args.log_completions)
    return model, processing_class, worker
