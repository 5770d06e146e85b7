"""``TreePPOTrainer``: PPO with a learned critic on TRL's ``GRPOTrainer``, policy and critic both over the tree.

TRL removed its PPOTrainer (last in 1.12); this trainer keeps everything ``GRPOTrainer`` gives —
generation (transformers or vLLM), reward functions and models, tools / environments /
``rollout_func``, PEFT, logging, checkpoints, ``accelerate launch`` — and replaces the advantage:

* at each generation batch (``_generate_and_score_completions``): the rollout policy's and the
  reference's log-probs, the critic's old values, token rewards (the score on the last counted
  token, a per-token KL penalty ``kl_coef``), GAE advantages and returns (``advantages.py``),
  whitened over the generation batch of every process;
* at each micro-batch (``_compute_loss``): GRPO's clipped policy loss on the per-token advantages
  (TRL's loss code, unchanged) plus ``vf_coef`` times the clipped value loss.

Every pass goes through the prefix forest of the micro-batch's rollouts: old and reference
log-probs and the policy loss through the mixin, the critic's values through
``trl_tree.tree_values`` / ``tree_value_backward`` (a value model's backbone, or the policy's trunk
under a critic adapter), or — a head on the policy's trunk — in the policy's own forward.
``tree_mode="off"`` computes the same on the padded batch (the untreed reference).

Under FSDP2 every critic kind trains sharded: a separate value model is sharded as Accelerate
shards the policy (``distributed/fsdp.shard_as_accelerate``), a critic adapter with the policy; the
critic's calls run under the engine's gather-once path (``distributed/fsdp.gathered``) and its
gradients are reduced once per optimizer step (``reduce_gradients``), as the policy's. Its value
calls there always take the two-pass backward: the engine calls a critic's backbone directly, past
the FSDP2 root whose hooks would otherwise re-gather what a one-pass backward needs.

Under DeepSpeed (ZeRO-1/2/3) the critic trains inside the policy's engine: its modules are joined to
the policy while DeepSpeed builds the engine and taken out afterwards
(``distributed/deepspeed.join_modules``), so one ZeRO optimizer partitions, reduces, clips (one norm,
as under DDP) and steps both, and the trainer runs every mode's step — ``tree_mode="off"`` included —
through the tree's one reduction per optimizer step; under ZeRO-3 the critic is held whole with the
policy through the step's calls. TRL 1.12's PPOTrainer reached one engine the same way, by wrapping
policy and value model in one module; here the module DeepSpeed holds stays the policy.
"""

from __future__ import annotations

import contextlib
import os

import torch
from trl import GRPOTrainer
from trl.trainer.utils import disable_dropout_in_model, use_adapter

from ...distributed import deepspeed as zero
from ...distributed.exchange import reduction_group
from ...engine.api import tree_value_backward, tree_values
from ...engine.model_parts import capture_last_hidden_state, value_model_parts
from .advantages import (
    clipped_value_loss,
    explained_variance,
    gae,
    kl_penalty,
    masked_mean,
    masked_whiten,
    token_rewards,
)
from .bridge import bridge
from ..config import TreePPOConfig, as_tree_config
from .critic import Critic, _DetachedInput
from .mixin import TreeTrainerMixin


class TreePPOTrainer(TreeTrainerMixin, GRPOTrainer):
    """PPO with a critic (``TreePPOConfig.critic``: "separate", "shared" or "adapter"). Constructor
    arguments are ``GRPOTrainer``'s plus ``value_model`` (critic="separate": a path or a
    ``*ForTokenClassification`` model with one label; None: ``value_model_path``, else the
    policy's checkpoint). The critic is ``trainer.critic``; it is saved with every checkpoint
    (``critic.safetensors``) and restored on resume."""

    _tag_names = ["trl", "ppo", "trl_tree"]

    def __init__(self, model, reward_funcs=None, args=None, *rest, value_model=None, **kwargs):
        args = as_tree_config(args, TreePPOConfig, model, "PPO")
        if any(o is not None for o in kwargs.get("optimizers", (None, None))):
            raise ValueError("TreePPOTrainer builds its optimizer with the critic's parameter group; passing "
                             "optimizers is not supported (set learning_rate / critic_learning_rate / optim)")
        beta = args.beta
        # GRPO builds a reference model only for its loss's KL (beta != 0); PPO's reward KL needs one too
        args.beta = 1.0 if (args.kl_coef != 0 and beta == 0) else beta
        try:
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
        finally:
            args.beta = beta
        self.beta = beta
        self._setup_tree()
        self._setup_critic(value_model)

    # ------------------------------------------------------------------ construction
    def _setup_critic(self, value_model) -> None:
        args = self.args
        _check_trainer_hooks()
        strategy = self._strategy
        # the tree modes were checked with the model (``_check_tree_support``); PPO's step is its own with
        # tree_mode='off' too, so the engine's refusal holds there as well
        why = strategy.refusal(args) if args.tree_mode == "off" else None
        if why is not None:
            raise ValueError(f"TreePPOTrainer: {why}")
        policy = self._unwrapped(self.model)
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        vocab = policy.get_input_embeddings().num_embeddings  # the ids the policy reads (and generates)
        if hasattr(tokenizer, "__len__"):
            vocab = min(vocab, len(tokenizer))
        self.critic = Critic.build(args.critic, policy, value_model if value_model is not None else
                                   args.value_model_path, args.model_init_kwargs or {}, vocab, tokenizer)
        critic_model = self.critic.model
        if critic_model is not None:
            if args.disable_dropout:
                disable_dropout_in_model(critic_model)
            if args.gradient_checkpointing:
                critic_model.gradient_checkpointing_enable(args.gradient_checkpointing_kwargs)
            if args.tree_mode != "off":
                self._refuse_dropout(critic_model.base_model, "the value model")  # its own head's is never run
            if args.tree_compile_layers:
                from ...engine.compile import compile_layers

                compile_layers(critic_model)
        # one critic on every rank (heads drew from per-rank seeds); under FSDP2's low-memory loading the
        # other ranks hold a value model on the meta device, and sharding it hands them rank 0's weights
        low_memory = critic_model is not None and strategy.loads_on_meta()
        if self.accelerator.num_processes > 1 and not low_memory:
            # through the accelerator's device: under DeepSpeed the critic is still on the CPU here (the engine
            # moves it), where NCCL has no backend
            device = self.accelerator.device
            with torch.no_grad():
                for p in self.critic.parameters():
                    if not hasattr(p, "ds_id"):  # ZeRO-3 initialised a partitioned value model alike on every rank
                        sent = p.data.to(device)
                        torch.distributed.broadcast(sent, src=0)
                        if sent is not p.data:
                            p.data.copy_(sent)
        if (self.accelerator.num_processes > 1 and self._tree_reduce_group is None
                and strategy.averages_critic_by_hand(self.critic)):
            self._tree_reduce_group = reduction_group(self.accelerator.device)
        strategy.place_critic(self.critic, self.model, "TreePPOTrainer")  # where the critic trains: one place

    def create_optimizer(self, model=None):
        """TRL's optimizer for the policy, plus one parameter group for the critic (its own learning
        rate with ``critic_learning_rate``; the scheduler scales both). Under FSDP2 the critic's group
        joins once the policy is sharded (``create_scheduler``): Accelerate swaps the optimizer's
        parameters for the policy's sharded ones and knows no other model's. Under DeepSpeed the
        critic's modules are joined to the policy here, before DeepSpeed builds its engine around
        both (``distributed/deepspeed.join_modules``)."""
        critic_params = self.critic.parameters()
        saved = [p.requires_grad for p in critic_params]
        for p in critic_params:  # a critic adapter lives in the policy model: keep it out of the policy's groups
            p.requires_grad_(False)
        try:
            optimizer = super().create_optimizer(model)
        finally:
            for p, flag in zip(critic_params, saved):
                p.requires_grad_(flag)
        if self._strategy.critic_group_with_optimizer(self.critic, self._unwrapped(self.model)):
            self._add_critic_group(optimizer)
        return optimizer

    def _add_critic_group(self, optimizer) -> None:
        """Once per optimizer (Transformers asks for the optimizer twice under DeepSpeed)."""
        params = self.critic.parameters()
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if any(id(p) in held for p in params):
            return
        group = {"params": params, "weight_decay": self.args.weight_decay}
        if self.args.critic_learning_rate is not None:
            group["lr"] = self.args.critic_learning_rate
        optimizer.add_param_group(group)
        self._critic_group_added = True

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """Under FSDP2, here — after ``accelerator.prepare`` sharded the policy, before the scheduler
        reads the optimizer's groups — the critic adapter's parameters are read again from the sharded
        policy and the critic's group is added. Under DeepSpeed, once its engine is built, the critic's
        modules are taken out of the policy again."""
        if self._strategy.critic_prepared(self.critic, self._unwrapped(self.model)) \
                and not getattr(self, "_critic_group_added", False):
            self._add_critic_group(self.optimizer if optimizer is None else optimizer)
        return super().create_scheduler(num_training_steps, optimizer)

    def _defers_deepspeed_step(self) -> bool:
        """Every mode: ``tree_mode="off"`` is no stock step here, and under ZeRO-3 the critic is held
        whole (as the tree holds the policy) until the step's reduction."""
        return True

    # ------------------------------------------------------------------ rollouts
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._ppo_rewards_per_func = rewards_per_func  # every process's rows; PPO's scores come from them
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        return self._ppo_rollout(output)

    def _ppo_rollout(self, output: dict) -> dict:
        """Replace GRPO's per-sequence advantages by PPO's per-token ones (see the module's docstring)."""
        args = self.args
        mode = "train" if self.model.training else "eval"
        device = self.accelerator.device
        prompt_ids, completion_ids = output["prompt_ids"], output["completion_ids"]
        completion_mask = output["completion_mask"]
        B, T = completion_ids.shape
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in output else completion_mask * output["tool_mask"]

        rewards_per_func = self._ppo_rewards_per_func
        weights = self.reward_weights.to(rewards_per_func.device)
        scores_all = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        unscorable_all = torch.isnan(rewards_per_func).all(dim=1)
        local = slice(self.accelerator.process_index * B, (self.accelerator.process_index + 1) * B)
        scores, unscorable = scores_all[local].to(device).float(), unscorable_all[local].to(device)
        eos = torch.tensor(self.eos_token_ids, device=device)
        has_eos = (torch.isin(completion_ids, eos) & completion_mask.bool()).any(dim=1)
        if args.missing_eos_penalty is not None:
            scores = torch.where(has_eos, scores, scores - args.missing_eos_penalty)
        if unscorable.any():  # no reward at all: no learning signal for either model
            mask = mask * (~unscorable).unsqueeze(1).to(mask.dtype)
            output["tool_mask"] = output.get("tool_mask", torch.ones_like(completion_mask)) * (
                ~unscorable).unsqueeze(1).to(completion_mask.dtype)
            scores = torch.where(unscorable, torch.zeros_like(scores), scores)

        batch_size = args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size
        with torch.no_grad():
            old_logps = output.get("old_per_token_logps")
            ref_logps = output.get("ref_per_token_logps")
            if args.kl_coef != 0:
                if old_logps is None:
                    old_logps, _, _ = self._get_per_token_logps_and_entropies(
                        self.model, input_ids, attention_mask, T, batch_size=batch_size)
                    output["old_per_token_logps"] = old_logps
                if ref_logps is None:
                    ref_logps = self._reference_logps(input_ids, attention_mask, T, batch_size)
            old_values = self._critic_values(input_ids, attention_mask, T, batch_size, differentiable=False)

        kl = kl_penalty(old_logps, ref_logps, args.kl_estimator) if args.kl_coef != 0 else None
        rewards = token_rewards(scores, mask, kl, args.kl_coef)

        def reduce(t):
            return self.accelerator.reduce(t, reduction="sum")

        if args.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False, reduce=reduce) * mask
        advantages = gae(rewards, old_values, mask, args.gamma, args.lam)
        critic_lam = args.lam if args.critic_lam is None else args.critic_lam
        critic_adv = advantages if critic_lam == args.lam else gae(rewards, old_values, mask, args.gamma, critic_lam)
        returns = (critic_adv + old_values) * mask
        if args.whiten_advantages:
            advantages = masked_whiten(advantages, mask, reduce=reduce) * mask
        output["advantages"] = advantages
        output["returns"] = returns
        output["old_values"] = old_values

        m = mask.float()
        gather = self.accelerator.gather
        non_score = -args.kl_coef * kl * m if kl is not None else torch.zeros_like(m)
        metrics = self._metrics[mode]
        metrics["objective/scores"].append(gather(scores).mean().item())
        metrics["objective/kl"].append(gather((kl * m).sum(1) if kl is not None else scores * 0).mean().item())
        metrics["objective/non_score_reward"].append(gather(non_score.sum(1)).mean().item())
        metrics["objective/rlhf_reward"].append(gather(scores + non_score.sum(1)).mean().item())
        metrics["val/num_eos_tokens"].append(gather(has_eos.float().sum()).sum().item())
        metrics["val/explained_variance"].append(explained_variance(old_values, returns, mask, reduce))
        metrics["val/values"].append(masked_mean(old_values, mask, reduce).item())
        metrics["val/returns"].append(masked_mean(returns, mask, reduce).item())
        return output

    def _reference_logps(self, input_ids, attention_mask, logits_to_keep: int, batch_size: int) -> torch.Tensor:
        """The reference's log-probs as GRPO computes them for its ``beta`` (a reference model, or
        the PEFT base with adapters disabled)."""
        if self.ref_model is not None:
            return self._get_per_token_logps_and_entropies(self.ref_model, input_ids, attention_mask, logits_to_keep,
                                                           batch_size=batch_size)[0]
        model = self._unwrapped(self.model)
        with use_adapter(model, adapter_name="ref" if "ref" in getattr(model, "peft_config", {}) else None):
            return self._get_per_token_logps_and_entropies(self.model, input_ids, attention_mask, logits_to_keep,
                                                           batch_size=batch_size)[0]

    # ------------------------------------------------------------------ the critic's values
    def _in_critic_warmup(self) -> bool:
        return self.model.training and self.state.global_step < self.args.critic_warmup_steps

    def _critic_head(self) -> torch.nn.Module:
        head = self.critic.head
        if self.critic.kind == "shared" and self._in_critic_warmup():
            return _DetachedInput(head)  # warm-up trains the head only; the shared trunk is the policy's
        return head

    def _critic_values(self, input_ids, attention_mask, logits_to_keep: int, batch_size: int | None,
                       differentiable: bool) -> torch.Tensor:
        """``(B, logits_to_keep)`` values of the critic at the states before each completion token
        (0 in padding). ``differentiable``: the value loss's backward reaches the critic — through
        the graph, or (dfs, several calls under a token budget, a critic adapter under gradient
        checkpointing) through a second pass (``bridge``) that runs ``tree_value_backward``."""
        policy = self._unwrapped(self.model)
        model = self.critic.backbone_model(policy)
        head = self._critic_head()
        # a critic adapter under checkpointing (its recompute must run the adapter) and every critic under
        # FSDP2 (its calls gathered once, their backward inside them): the values' backward in a second pass
        needs_active = ((self.critic.kind == "adapter" and self.args.gradient_checkpointing)
                        or self._strategy.critic_second_pass)
        if self.args.tree_mode == "off":
            if differentiable and not needs_active:
                return self._padded_values(model, head, input_ids, attention_mask, logits_to_keep, None)
            with torch.no_grad():
                values = self._padded_values(model, head, input_ids, attention_mask, logits_to_keep, batch_size)
            if not differentiable:
                return values

            def padded_backward(grad, *_):
                # the recompute runs the critic adapter (and, under FSDP2, on the gathered critic)
                with torch.enable_grad(), self.critic.active(policy), self._critic_gathered(model):
                    again = self._padded_values(model, head, input_ids, attention_mask, logits_to_keep, None)
                    torch.autograd.backward(again, grad.to(again.dtype))
                self._critic_reduction_pending()

            return bridge(values, None, padded_backward)[0]

        if differentiable and self.model.training:
            window, micro = self._window_for(input_ids, attention_mask, logits_to_keep)
            if window is not None:
                return self._window_values(window, micro, policy, model, head)
        # the layout the policy's pass over the same rollouts built (``_tree_layout``)
        rows, calls, forests = self._tree_layout(input_ids, attention_mask, logits_to_keep,
                                                 None if differentiable else batch_size)
        two_pass = self._two_pass(differentiable, len(calls)) or (differentiable and needs_active)
        kwargs = self._value_kwargs(input_ids.shape[1])
        with contextlib.nullcontext() if differentiable and not two_pass else torch.no_grad():
            values = self._tree_values(policy, model, head, rows, calls, forests, kwargs)
        if not two_pass:
            return values

        def second_pass(grad, *_):
            self._tree_values_backward(policy, model, head, rows, calls, forests, grad, kwargs)

        return bridge(values, None, second_pass)[0]

    def _tree_values(self, policy, model, head, rows, calls, forests, kwargs) -> torch.Tensor:
        """``(B, logits_to_keep)`` values of ``rows`` from the tree calls."""
        parts = []
        with self.critic.active(policy), self.accelerator.autocast(), self._critic_gathered(model):
            for call, forest in zip(calls, forests):
                parts.append(torch.cat(tree_values(model, forest, head, score_from=rows.subset(call)[1], **kwargs)))
        return rows.to_padded(parts, calls)

    def _tree_values_backward(self, policy, model, head, rows, calls, forests, grad, kwargs,
                              final: bool = True) -> None:
        """The critic's tree backward with the per-token weights ``grad = dLoss/dvalue``; ``final``:
        these calls end the step's critic backward (the last one's arms the critic's overlapped average)."""
        with self.critic.active(policy), self.accelerator.autocast(), self._critic_gathered(model):
            for i, (call, forest) in enumerate(zip(calls, forests)):
                where, term_index = rows.call_terms(call)
                weights = grad[where].float()

                def value_loss(v, seq_idx, pos, weights=weights, term_index=term_index):
                    return v * weights[term_index(seq_idx, pos)]

                with self._arming(self.critic, final and i == len(calls) - 1, self._critic_params()):
                    tree_value_backward(model, forest, value_loss, head, score_from=rows.subset(call)[1], **kwargs)
        self._critic_reduction_pending()
        if final:
            self._flush_average(self.critic, self._critic_params())

    def _window_values(self, window, micro: int, policy, model, head) -> torch.Tensor:
        """The critic's values of micro-step ``micro`` from the accumulation window's trees (the
        window's ``critic`` pass: its backward runs once, with the policy's, at the window's end)."""
        if "critic" not in window.passes:
            def score(rows, calls, forests, rope_length):
                with torch.no_grad():
                    return [self._tree_values(policy, model, head, rows, calls, forests,
                                              self._value_kwargs(rope_length))]

            def backward(rows, calls, forests, rope_length, grads, last):
                if grads[0] is not None or not calls:  # a rank without trees still flushes its average
                    self._tree_values_backward(policy, model, head, rows, calls, forests, grads[0],
                                               self._value_kwargs(rope_length), final=last)

            with self._critic_gathered(model):  # every rank, around the whole pass (``Strategy.hold``)
                window.forward("critic", score, backward, self.accelerator.device)
        (values,) = window.outputs("critic", micro)

        def keep(grad, *_):
            window.add_grads("critic", micro, [grad])

        return bridge(values, None, keep)[0]

    def _value_kwargs(self, width: int) -> dict:
        """The critic's calls: the policy's mode and options, run eagerly (CUDA graphs replay the
        policy's scoring only), at the padded batch's width."""
        return {"mode": self.args.tree_mode, "options": self.args.tree_options().replace(cuda_graphs=False),
                "rope_length": width}

    def _padded_values(self, model, head, input_ids, attention_mask, logits_to_keep: int,
                       batch_size: int | None) -> torch.Tensor:
        """The untreed values: the backbone on the padded batch, the head on the positions before
        each completion token (chunks of ``batch_size`` rows, as TRL's log-prob passes)."""
        backbone = value_model_parts(model, head).backbone
        step = batch_size or input_ids.shape[0]
        out = []
        with self.critic.active(self._unwrapped(self.model)), self.accelerator.autocast(), \
                self._critic_gathered(model):
            for start in range(0, input_ids.shape[0], step):
                hidden = backbone(input_ids=input_ids[start : start + step],
                                  attention_mask=attention_mask[start : start + step], use_cache=False)
                hidden = hidden.last_hidden_state[:, -logits_to_keep - 1 : -1]
                out.append(head(hidden.reshape(-1, hidden.shape[-1])).view(hidden.shape[:2]).float())
        return torch.cat(out) * attention_mask[:, -logits_to_keep:]

    # ------------------------------------------------------------------ the loss
    def _joint_value_head(self):
        return self.critic.head if getattr(self, "_ppo_want_joint", False) else None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        in_loss = getattr(self, "_ppo_in_loss", False) and torch.is_grad_enabled()
        joint = in_loss and self._joint_value_head() is not None
        if not joint or self.args.tree_mode != "off":
            out = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        else:  # the untreed shared critic: the head on the same forward's last hidden state
            backbone = value_model_parts(self._unwrapped(model), self.critic.head).backbone
            with capture_last_hidden_state(backbone) as captured:
                out = super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                    compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
            hidden = torch.cat(captured)[:, -logits_to_keep - 1 : -1]
            values = self.critic.head(hidden.reshape(-1, hidden.shape[-1])).view(hidden.shape[:2]).float()
            self._tree_joint_values = values * attention_mask[:, -logits_to_keep:]
        if in_loss:
            self._ppo_logps = out[0].detach()
        return out

    def _compute_loss(self, model, inputs):
        args = self.args
        mode = "train" if self.model.training else "eval"
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        T = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        warmup = self._in_critic_warmup()
        self._tree_joint_values = None
        self._ppo_logps = None
        if warmup:
            policy_loss = None
        else:
            self._ppo_want_joint = self.critic.kind == "shared"
            self._ppo_in_loss = True
            try:
                policy_loss = super()._compute_loss(model, inputs)
            finally:
                self._ppo_want_joint = self._ppo_in_loss = False
        values = self._tree_joint_values
        if values is None:
            values = self._critic_values(input_ids, attention_mask, T, None, differentiable=torch.is_grad_enabled())
        self._tree_joint_values = None
        per_token, clipped = clipped_value_loss(values, inputs["old_values"], inputs["returns"], args.cliprange_value)
        m = mask.to(per_token.dtype)
        value_loss = (per_token * m).sum() / m.sum().clamp(min=1.0)
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = args.vf_coef * value_loss / normalizer
        if policy_loss is not None:
            loss = policy_loss + loss
        self._log_ppo_losses(mode, mask, value_loss, clipped, values, inputs, policy_loss, normalizer)
        return loss

    def _per_micro_batch_terms(self) -> list[str]:
        return [*super()._per_micro_batch_terms(), "the value loss is a token mean over the micro-batch"]

    def _log_ppo_losses(self, mode, mask, value_loss, clipped, values, inputs, policy_loss, normalizer) -> None:
        """TRL 1.12 PPO's loss metrics (``loss/value_avg``, ``val/clipfrac_avg``, ``loss/policy_avg``,
        ``policy/approxkl_avg``, ``policy/clipfrac_avg``, ``val/ratio``), averaged over processes."""
        metrics = self._metrics[mode]

        def mean(x):
            return masked_mean(x.detach().float(), mask, lambda t: self.accelerator.reduce(t, reduction="sum")).item()

        metrics["loss/value_avg"].append(self.accelerator.gather(value_loss.detach()).mean().item())
        metrics["val/clipfrac_avg"].append(mean(clipped.float()))
        metrics["val/vpred"].append(mean(values))
        logps = self._ppo_logps
        if policy_loss is None or logps is None:
            return
        old = inputs.get("old_per_token_logps")
        old = logps if old is None else old
        log_ratio = logps - old
        ratio = log_ratio.exp()
        metrics["loss/policy_avg"].append(self.accelerator.gather(policy_loss.detach() * normalizer).mean().item())
        metrics["policy/approxkl_avg"].append(mean(0.5 * log_ratio ** 2))
        metrics["policy/clipfrac_avg"].append(mean(((ratio - 1).abs() > self.epsilon_low).float()))
        metrics["val/ratio"].append(mean(ratio))

    # ------------------------------------------------------------------ the step
    def training_step(self, model, inputs, num_items_in_batch):
        self._strategy.critic_prepared(self.critic, self._unwrapped(self.model))  # idempotent; DeepSpeed: separated
        if self._tree_micro_in_update == 0:
            self._zero_critic_gradients()
        if self.critic.model is not None:
            self.critic.model.train(self.model.training)
        return super().training_step(model, inputs, num_items_in_batch)

    def _zero_critic_gradients(self) -> None:
        """At an optimizer step's first micro-step: the critic's gradients of the last step dropped.
        The Trainer zeroes the model it prepared (``model.zero_grad()`` after each optimizer step),
        which does not hold a separate value model or a value head, so without this they would add
        up across steps. Under DeepSpeed the engine zeroes them: they are in its optimizer."""
        if self.critic.in_engine:
            return
        for p in self.critic.parameters():
            p.grad = None

    def _sync_other_gradients(self) -> None:
        if self.accelerator.num_processes > 1 and self.accelerator.sync_gradients:
            # the critic is never under DDP: its gradients, accumulated over the window, averaged once
            # (the buckets its last backward did not already send: _tree_values_backward's arming)
            params = self._critic_params()
            if params:
                self._averager(self.critic, params).finish()

    def _critic_params(self) -> list[torch.nn.Parameter]:
        """The critic's trainable parameters that are averaged by hand: all of them under DDP (value
        model or adapter, and head); under FSDP2 only the head outside the sharded models; none under
        DeepSpeed (its engine reduces them)."""
        return self.critic.replicated_parameters()

    def _critic_gathered(self, model):
        """The critic's backbone model whole for a sequence of calls (``Strategy.critic_hold``: under
        FSDP2 gathered once, under ZeRO-3 the policy's engine, which holds the critic's parameters)."""
        return self._strategy.critic_hold(model, self._unwrapped(self.model))

    def _critic_reduction_pending(self) -> None:
        """After a critic backward: its gradients await the step's one reduction where the strategy
        reduces (FSDP2: the value model's own, or the policy's for an adapter or a head on the trunk)."""
        self._strategy.critic_backward_done(self.critic, self._unwrapped(self.model))

    def _window_models(self) -> list[torch.nn.Module]:
        models = super()._window_models()
        if self.critic.model is not None:
            models.append(self.critic.model)
        return models

    def _clip_grad_norm(self, model):
        """Clip the policy's and the critic's gradients together (one norm), as TRL 1.12's PPO did."""
        params = {id(p): p for p in list(model.parameters()) + self.critic.parameters()}
        return self._strategy.clip_grad_norm(list(params.values()), self.args.max_grad_norm)

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        self._save_critic(os.path.join(self._get_output_dir(trial=trial), folder))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if not _internal_call:
            self._save_critic(output_dir or self.args.output_dir)

    def _save_critic(self, directory: str) -> None:
        """The critic beside the policy; where it is sharded (FSDP2) or partitioned (ZeRO-3) every rank
        takes part in gathering it whole and the saving ranks write."""
        collective = self._strategy.collective_save
        if self.args.should_save or collective:
            with zero.whole(self.critic.parameters()):
                self.critic.save(directory, write=self.args.should_save)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        with zero.whole(self.critic.parameters(), modifier_rank=0):
            if not self.critic.load(checkpoint):
                raise ValueError(f"{checkpoint} holds no critic ({self.critic.kind}); it was not written by "
                                 "TreePPOTrainer")


#: the Trainer's private methods TreePPOTrainer overrides to train the critic with the policy: one norm
#: over both (``_clip_grad_norm``), the critic saved and restored with the policy's checkpoint
TRAINER_HOOKS = ("_clip_grad_norm", "_save_checkpoint", "_load_optimizer_and_scheduler")


def _check_trainer_hooks() -> None:
    """Refuse, at construction, a transformers whose Trainer no longer calls what the critic's
    training hooks into (an override of a method that is gone would be skipped silently: the
    critic unclipped, or missing from checkpoints)."""
    import transformers

    missing = [name for name in TRAINER_HOOKS if not callable(getattr(transformers.Trainer, name, None))]
    if missing:
        raise ValueError(f"TreePPOTrainer: transformers {transformers.__version__}'s Trainer has no {', '.join(missing)}, "
                         "which the critic's clipping and checkpoints hook into; install transformers>=5.23,<6 (the "
                         "tested range, docs/limitations.md)")
