"""DPO's depth-first step in one pass: each unit of the walk back-propagates its pairs' loss as soon
as it has scored them.

DPO's loss is a nonlinear function of each sequence's summed log-prob, so a token's gradient is
known only once its whole pair is scored. The two-pass bridge (``bridge.py``) scores the micro-batch
first and walks afterwards — a whole extra forward of the policy. But a pair's chosen and rejected
answers share their prompt, so they sit in one tree, and wherever the walk's units hold whole trees
(groups of trees under the memory model's budget) every pair is complete inside the unit that scores
it: the engine's ``tree_backward(coupled=...)`` hands each unit's terms to a loss that may couple
them, and falls back to the two passes itself where a unit would split a pair.

The loss a unit back-propagates is stock's own (``dpo_stock_loss``, muted: no GPU sync or collective
per unit) on the unit's log-probs, the other pairs zero — which adds nothing to the unit's gradient,
every loss here being a mean of per-pair terms (``"sft"``'s token mean included); the reference runs
first, as its log-probs enter every pair's loss. The gradient of that loss with respect to the
unit's log-probs weights its tokens. After the walk, stock's loss runs once more on every log-prob
for its value and its metrics, as stock logs them. ``aot`` and ``aot_unpaired`` sort the batch's
margins (they couple all pairs) and keep the two passes, as does an MoE policy's load-balancing
loss (its gradient needs every unit's expert counts first, ``trl_tree.engine.router``).
"""

from __future__ import annotations

import torch

from .dpo_stock_loss import stock_loss, takes_the_batch, with_reference
from ..asynchronous.fused_forward import place_on_batch, rows_of

#: loss types that couple every pair of the micro-batch (they sort its margins)
BATCH_COUPLED_LOSSES = ("aot", "aot_unpaired")


def walks_in_one_pass(trainer, inputs: dict, return_outputs: bool) -> bool:
    """Whether this micro-batch's dfs step can run in one pass (``one_pass_loss``): a training step
    of a loss made of per-pair terms, on a batch the tree takes as it is, without a loss scaler."""
    return (trainer.args.tree_mode == "dfs" and takes_the_batch(trainer, inputs, return_outputs)
            and not any(t in BATCH_COUPLED_LOSSES for t in trainer.loss_types) and trainer.accelerator.scaler is None
            and not getattr(trainer, "aux_loss_enabled", False))


def one_pass_loss(trainer, model, inputs: dict, num_items_in_batch=None) -> torch.Tensor | None:
    """The micro-batch's DPO loss, its gradient already accumulated by the walk; None where the
    batch needs the two passes after all (nothing labelled, or rows cut into several tree calls)."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    labels = ids.masked_fill(inputs["completion_mask"] == 0, -100)
    batch = rows_of(trainer, ids, mask, labels)
    if batch.empty:
        return None
    rows = batch.rows
    calls, forests = trainer._offline_layout(rows)
    if len(calls) != 1:
        return None
    inputs = with_reference(trainer, inputs)  # first: every pair's loss reads it (the tree answers, same rows)
    layout = (ids.shape[0], ids.shape[1] - 1)
    # the metrics' entropy as a constant: a differentiable one would add its gradient's work to the head
    head_outputs = ("entropy", "mean_logits", "is_top1") + (("log_sum_sq_probs",) if trainer.use_weighting else ())
    kept = _Kept(rows.shape)
    scale = _gradient_scale(trainer, num_items_in_batch)

    def make_loss(where, term_index):
        def token_loss(lp, seq_idx, pos, **extra):
            idx = term_index(seq_idx, pos)
            cells = (where[0][idx], where[1][idx])
            kept.record(cells, {"log_probs": lp, **extra})

            def on_batch(values: torch.Tensor) -> torch.Tensor:  # the unit's terms, the other pairs zero
                return place_on_batch(batch, values.new_zeros(rows.shape).index_put(cells, values), layout)

            leaf = lp.detach().requires_grad_()
            outputs = {"log_probs": on_batch(leaf)}
            if "log_sum_sq_probs" in extra:  # WPO's weights (constants)
                outputs["log_sum_sq_probs"] = on_batch(extra["log_sum_sq_probs"])
            (grad,) = torch.autograd.grad(stock_loss(trainer, inputs, outputs, muted=True), leaf)
            return lp * (grad * scale)

        return token_loss

    trainer._log_forests(forests)
    call_kwargs = {**trainer._call_kwargs(ids.shape[1]), "coupled": (batch.batch_rows % (ids.shape[0] // 2))[calls[0]],
                   "head_outputs": head_outputs}
    trainer._walk_calls(trainer._unwrapped(model), rows, calls, forests, make_loss,
                        {**trainer._mode_kwargs(), **call_kwargs})
    outputs = {name: place_on_batch(batch, grid, layout) for name, grid in kept.grids.items()}
    outputs["log_probs"] = outputs["log_probs"].detach().requires_grad_()  # back-propagated already: a leaf
    return _ScaleCheck.apply(stock_loss(trainer, inputs, outputs, muted=False), scale)


class _Kept:
    """The walk's scores of every labelled cell of the rows' grid, for stock's final loss and metrics
    (each grid made at the first unit, in the dtype the head gives it)."""

    def __init__(self, shape) -> None:
        self.shape = shape
        self.grids: dict[str, torch.Tensor] = {}

    def record(self, cells, given: dict[str, torch.Tensor]) -> None:
        for name, values in given.items():
            grid = self.grids.get(name)
            if grid is None:
                grid = self.grids[name] = values.new_zeros(self.shape)
            grid.index_put_(cells, values.detach())


def _gradient_scale(trainer, num_items_in_batch) -> float:
    """What the Trainer's ``training_step`` multiplies the returned loss by before its backward (its
    gradient-accumulation division, then Accelerate's own): the walk scales each unit's loss the
    same, and ``_ScaleCheck`` verifies it at that backward."""
    scaled = trainer.loss_is_scaled_for_ga
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
            trainer.compute_loss_func is not None)
    scale = 1.0 if scaled else 1.0 / trainer.current_gradient_accumulation_steps
    if trainer.accelerator.distributed_type.value == "DEEPSPEED":  # Accelerate leaves it to DeepSpeed, which
        return scale  # the Trainer tells not to scale (scale_wrt_gas=False)
    return scale / trainer.accelerator.gradient_accumulation_steps


class _ScaleCheck(torch.autograd.Function):
    """Identity on the loss; its backward checks that the Trainer scaled the loss as the walk
    assumed (``_gradient_scale``) — a different scale would have left wrong gradients."""

    @staticmethod
    def forward(ctx, loss, scale):
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        got = float(grad)
        if abs(got - ctx.scale) > 1e-6 * abs(ctx.scale):
            raise RuntimeError(f"TreeDPOTrainer's one-pass walk scaled the loss by {ctx.scale}, but the trainer's "
                               f"backward scaled it by {got}; set tree_mode='packed' for this setup")
        return None, None


