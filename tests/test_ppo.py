"""TreePPOTrainer: the tree's update equals the untreed one, the untreed one equals the textbook.

(a) one update with ``tree_mode="packed"``/``"dfs"`` against ``tree_mode="off"`` (policy and
critic updates, float64, 1e-5 relative) for each critic kind, with ``kl_coef > 0``,
``num_ppo_epochs=2``, ``num_mini_batches=2``, gradient accumulation and checkpointing (the
harness's defaults), LoRA for the adapter critic; (b) GAE, whitening, the token rewards, the
clipped value loss and the policy loss against plain loops written here from the textbook
formulas, on fixed tensors and on one real update; (c) a short run of the toy task in which the
reward rises and the critic's explained variance goes up; bad input refused at construction.
"""

from __future__ import annotations

import copy
import math
import os
import sys

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

sys.path.insert(0, os.path.dirname(__file__))
from trainer_harness import PROMPTS, multi_turn_rollout, reward_a, run, save_tiny_checkpoint  # noqa: E402

from trl_tree import TreePPOConfig, TreePPOTrainer  # noqa: E402
from trl_tree.trainers.online import advantages as adv  # noqa: E402

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
# with the harness's gradient accumulation (2) and num_iterations (2 PPO epochs): 2 optimizer steps per epoch
PPO = dict(kl_coef=0.1, num_mini_batches=2, tree_shuffle="rows", beta=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ppo"))


def _train(checkpoint, mode, kind, lora=False, rollout_func=None, **overrides):
    from peft import LoraConfig

    kwargs = {"peft_config": LoraConfig(**LORA)} if lora else {}
    if rollout_func is not None:
        kwargs["rollout_func"] = rollout_func
    settings = {**PPO, **overrides}
    updates, completions, trainer = run(TreePPOTrainer, TreePPOConfig, checkpoint, tree_mode=mode, critic=kind,
                                        dtype=torch.float64, trainer_kwargs=kwargs, **settings)
    critic = {f"critic.{i}": p.detach().clone() for i, p in enumerate(trainer.critic.parameters())}
    return updates, critic, completions, trainer


_OFF: dict = {}


def _compare(checkpoint, mode, kind, lora=False, rollout_func=None, **overrides):
    key = (kind, lora, rollout_func, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
    if key not in _OFF:
        _OFF[key] = _train(checkpoint, "off", kind, lora, rollout_func, **overrides)
    ref_updates, ref_critic, ref_completions, ref_trainer = _OFF[key]
    updates, critic, completions, trainer = _train(checkpoint, mode, kind, lora, rollout_func, **overrides)
    assert completions == ref_completions, "the rollouts differ: the comparison would be meaningless"
    for name, ref in ref_updates.items():
        if ".critic." in name:
            continue
        err = ((updates[name] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert err <= 1e-5, f"policy {name}: relative update error {err:.2e}"
    start = ref_trainer._ppo_test_start
    for name, ref in ref_critic.items():
        ref_update, update = ref - start[name], critic[name] - start[name]
        assert ref_update.norm() > 0, f"{name} did not train"
        err = ((update - ref_update).norm() / ref_update.norm()).item()
        assert err <= 1e-5, f"critic {name}: relative update error {err:.2e}"
    return trainer


@pytest.fixture(autouse=True)
def _record_critic_start(monkeypatch):
    """Record each trainer's critic before training (for the critic-update comparison)."""
    original = TreePPOTrainer._setup_critic

    def setup(self, value_model):
        original(self, value_model)
        self._ppo_test_start = {f"critic.{i}": p.detach().clone() for i, p in enumerate(self.critic.parameters())}

    monkeypatch.setattr(TreePPOTrainer, "_setup_critic", setup)


@pytest.mark.parametrize("mode", ["packed", "dfs"])
@pytest.mark.parametrize("kind", ["separate", "shared"])
def test_update_matches_untreed(checkpoint, kind, mode):
    trainer = _compare(checkpoint, mode, kind)
    assert trainer.args.gradient_checkpointing and trainer.args.num_iterations == 2
    assert trainer.args.steps_per_generation == 4 and trainer.args.gradient_accumulation_steps == 2
    logs = trainer.state.log_history[0]
    for key in ("objective/kl", "objective/rlhf_reward", "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg",
                "policy/approxkl_avg", "val/explained_variance", "tree/dedup_ratio"):
        assert key in logs, key
    assert logs["tree/dedup_ratio"] > 1.5


@pytest.mark.parametrize("mode", ["packed", "dfs"])
def test_adapter_critic_matches_untreed(checkpoint, mode):
    """One frozen base: the policy adapter, the critic adapter (+ head) and the base as reference."""
    trainer = _compare(checkpoint, mode, "adapter", lora=True, learning_rate=0.5)
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert set(model.peft_config) == {"default", "critic"} and trainer.ref_model is None


def test_one_micro_batch_per_step_k3_and_token_budget(checkpoint):
    """No accumulation, k3, and a token budget cutting the calls (the critic's too)."""
    _compare(checkpoint, "packed", "separate", gradient_accumulation_steps=1, kl_estimator="k3",
             tree_token_budget=40)


def test_shared_critic_on_a_lora_policy(checkpoint):
    """A value head on the trunk of a PEFT policy: the value loss trains the policy adapter too."""
    _compare(checkpoint, "packed", "shared", lora=True, learning_rate=0.5)


def test_multi_turn_tool_tokens_are_no_steps(checkpoint):
    """rollout_func with a tool mask: tool output gets no advantage and no return (GAE skips it), and
    trajectories sharing turns still train exactly (dfs: the walk, the critic's too)."""
    trainer = _compare(checkpoint, "dfs", "separate", rollout_func=multi_turn_rollout, max_completion_length=64)
    assert trainer.state.log_history[0]["tree/dedup_ratio"] > 2
    for batch in trainer._buffered_inputs:
        tool = (batch["tool_mask"] == 0) & (batch["completion_mask"] == 1)
        assert tool.any()
        assert (batch["advantages"][tool] == 0).all() and (batch["returns"][tool] == 0).all()
        assert (batch["advantages"][~tool & (batch["completion_mask"] == 1)] != 0).any()


def test_shared_critic_without_checkpointing_with_warmup_and_kl_in_the_loss(checkpoint):
    """GRPO's beta (KL to the reference in the loss) beside PPO's kl_coef (in the reward)."""
    trainer = _compare(checkpoint, "packed", "shared", gradient_checkpointing=False, critic_warmup_steps=1, beta=0.04)
    assert "loss/policy_avg" not in trainer.state.log_history[0]  # step 1: the critic alone
    assert "loss/policy_avg" in trainer.state.log_history[1] and "kl" in trainer.state.log_history[1]


# ---------------------------------------------------------------------- (b) the textbook
def textbook_gae(rewards, values, mask, gamma, lam):
    """A_t = sum_k (gamma lam)^k delta_{t+k} over the row's counted steps, delta from the next counted step."""
    B, T = rewards.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        steps = [t for t in range(T) if mask[b, t]]
        for i, t in enumerate(steps):
            total = 0.0
            for k, s in enumerate(steps[i:]):
                nxt = steps[i + k + 1] if i + k + 1 < len(steps) else None
                v_next = float(values[b, nxt]) if nxt is not None else 0.0
                delta = float(rewards[b, s]) + gamma * v_next - float(values[b, s])
                total += (gamma * lam) ** k * delta
            out[b, t] = total
    return out


def textbook_whiten(x, mask, shift_mean=True):
    xs = [float(x[b, t]) for b in range(x.shape[0]) for t in range(x.shape[1]) if mask[b, t]]
    mean = sum(xs) / len(xs)
    var = sum((v - mean) ** 2 for v in xs) / (len(xs) - 1)
    out = (x.double() - mean) / math.sqrt(var + 1e-8)
    return out + mean if not shift_mean else out


def _fixed(seed=0, B=5, T=9):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.25).long()
    mask[0] = 0  # a row without counted tokens
    mask[1, 4:] = 0  # right padding
    return rewards, values, mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0), (0.0, 0.3)])
def test_gae_is_the_textbook_sum(gamma, lam):
    rewards, values, mask = _fixed()
    got = adv.gae(rewards, values, mask, gamma, lam)
    assert torch.allclose(got, textbook_gae(rewards, values, mask, gamma, lam), atol=1e-12)


def test_whitening_and_token_rewards_are_the_textbook_ones():
    rewards, values, mask = _fixed(1)
    for shift in (True, False):
        got = adv.masked_whiten(values, mask, shift_mean=shift) * mask
        assert torch.allclose(got, textbook_whiten(values, mask, shift) * mask, atol=1e-10)
    scores = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.25], dtype=torch.float64)
    logps, ref = rewards.clamp(max=0) - 1, values.clamp(max=0) - 1
    got = adv.token_rewards(scores, mask, adv.kl_penalty(logps, ref, "k3"), 0.2)
    for b in range(mask.shape[0]):
        counted = [t for t in range(mask.shape[1]) if mask[b, t]]
        for t in range(mask.shape[1]):
            r = float(ref[b, t] - logps[b, t])
            want = -0.2 * (math.exp(r) - 1 - r) if mask[b, t] else 0.0
            if counted and t == counted[-1]:
                want += float(scores[b])
            assert float(got[b, t]) == pytest.approx(want, abs=1e-12), (b, t)


def test_clipped_value_loss_is_the_textbook_one():
    _, values, _ = _fixed(2)
    old = values + 0.3 * torch.sin(values * 7)
    returns = values.flip(1)
    got, clipped = adv.clipped_value_loss(values, old, returns, 0.1)
    for b in range(values.shape[0]):
        for t in range(values.shape[1]):
            v, o, r = float(values[b, t]), float(old[b, t]), float(returns[b, t])
            vc = min(max(v, o - 0.1), o + 0.1)
            assert float(got[b, t]) == pytest.approx(0.5 * max((v - r) ** 2, (vc - r) ** 2), abs=1e-12)
            assert bool(clipped[b, t]) == ((vc - r) ** 2 > (v - r) ** 2)


def test_one_real_update_is_the_textbook_loss(checkpoint):
    """tree_mode='off': the loss of a real micro-batch recomputed sequence by sequence with loops."""
    captured = {}
    original = TreePPOTrainer._compute_loss

    def spy(self, model, inputs):
        if "models" not in captured:  # the weights this loss is computed with (the step changes them after)
            captured["models"] = [copy.deepcopy(m) for m in (self.model, self.critic.model, self.ref_model)]
        loss = original(self, model, inputs)
        captured.setdefault("inputs", inputs)
        captured.setdefault("loss", float(loss.detach()))
        captured.setdefault("trainer", self)
        return loss

    TreePPOTrainer._compute_loss = spy
    try:
        _train(checkpoint, "off", "separate", max_steps=1, gradient_accumulation_steps=1, num_iterations=1,
               num_mini_batches=1)
    finally:
        TreePPOTrainer._compute_loss = original
    trainer, inputs = captured["trainer"], captured["inputs"]
    args = trainer.args
    policy, critic, ref_model = captured["models"]
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    B, T = completion_ids.shape
    # the rollout: scores -> token rewards -> GAE -> whitening, row by row
    completions = trainer.processing_class.batch_decode(
        [[t for t, m in zip(ids, mk) if m] for ids, mk in zip(completion_ids.tolist(), completion_mask.tolist())],
        skip_special_tokens=True)
    scores = reward_a(completions)
    old = inputs["old_per_token_logps"]
    pg, vf, counted = 0.0, 0.0, 0
    rewards = torch.zeros(B, T, dtype=torch.float64)
    values = torch.zeros(B, T, dtype=torch.float64)
    new_logps = torch.zeros(B, T, dtype=torch.float64)
    with torch.no_grad():
        for b in range(B):
            ids = torch.cat([prompt_ids[b][prompt_mask[b].bool()], completion_ids[b][completion_mask[b].bool()]])
            n = int(completion_mask[b].sum())
            p0 = ids.shape[0] - n
            # TRL's fused head patches the models' forward with their own head (a copy's would be the live
            # one): the logits are taken here from each copy's backbone and head weight
            logits = _logits(policy, ids)
            ref_logits = _logits(ref_model, ids)
            hidden = critic.base_model(input_ids=ids[None]).last_hidden_state[0]
            for t in range(n):
                lp = torch.log_softmax(logits[p0 + t - 1], -1)[ids[p0 + t]]
                rlp = torch.log_softmax(ref_logits[p0 + t - 1], -1)[ids[p0 + t]]
                new_logps[b, t] = lp
                rewards[b, t] = -args.kl_coef * (float(old[b, t]) - float(rlp))
                values[b, t] = critic.score(hidden[p0 + t - 1]).double().squeeze()
            if n:
                rewards[b, n - 1] += scores[b]
    mask = completion_mask
    advantages = textbook_whiten(textbook_gae(rewards, inputs["old_values"], mask, args.gamma, args.lam), mask) * mask
    assert torch.allclose(inputs["advantages"].double(), advantages, atol=1e-6)
    returns = (textbook_gae(rewards, inputs["old_values"], mask, args.gamma, args.lam) + inputs["old_values"]) * mask
    assert torch.allclose(inputs["returns"].double(), returns, atol=1e-6)
    assert torch.allclose(inputs["old_values"].double(), values * mask, atol=1e-6)
    # the micro-batch's loss: PPO's clipped surrogate (token mean) + vf_coef * clipped value loss (token mean)
    eps = args.epsilon
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            ratio = math.exp(float(new_logps[b, t]) - float(old[b, t]))
            a = float(advantages[b, t])
            pg += -min(ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a)
            v, o, r = float(values[b, t]), float(inputs["old_values"][b, t]), float(returns[b, t])
            vc = min(max(v, o - args.cliprange_value), o + args.cliprange_value)
            vf += 0.5 * max((v - r) ** 2, (vc - r) ** 2)
            counted += 1
    want = pg / counted + args.vf_coef * vf / counted
    assert captured["loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)  # TRL's head rounds through fp32


def _logits(model, ids):
    hidden = model.base_model(input_ids=ids[None]).last_hidden_state[0]
    return torch.nn.functional.linear(hidden, model.get_output_embeddings().weight).double()


# ---------------------------------------------------------------------- (c) it learns
def test_toy_run_raises_reward_and_explained_variance(tmp_path):
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast

    from trl_tree.data.toy import build_tiny_policy, reward_letter_a, toy_prompts

    path = build_tiny_policy(tmp_path / "policy", hidden_size=32, num_layers=2)
    args = TreePPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=16, num_generations=4, max_completion_length=8,
        learning_rate=5e-3, critic_learning_rate=1e-2, max_steps=24, beta=0.0, kl_coef=0.01, vf_coef=0.5,
        critic="shared", num_ppo_epochs=2,
        logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0, disable_tqdm=True,
        gradient_checkpointing=False, temperature=1.0, gamma=1.0, lam=0.95)
    trainer = TreePPOTrainer(model=path, reward_funcs=reward_letter_a, args=args,
                             train_dataset=Dataset.from_dict({"prompt": toy_prompts(128, story_len=40)}),
                             processing_class=PreTrainedTokenizerFast.from_pretrained(path))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    first, last = logs[: len(logs) // 3], logs[-len(logs) // 3 :]

    def avg(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    assert avg(last, "objective/scores") > avg(first, "objective/scores") + 0.02
    assert avg(last, "val/explained_variance") > avg(first, "val/explained_variance") + 0.1


# ---------------------------------------------------------------------- bad input
def _config(tmp_path, **fields):
    base = dict(output_dir=str(tmp_path / "o"), use_cpu=True, bf16=False, report_to="none",
                per_device_train_batch_size=4, num_generations=2)
    return TreePPOConfig(**{**base, **fields})


@pytest.mark.parametrize("field,value,match", [
    ("gamma", 1.5, "gamma must be in"), ("lam", -0.1, "lam must be in"), ("critic_lam", 2.0, "critic_lam must be in"),
    ("critic", "twin", "critic must be one of"), ("kl_estimator", "k2", "kl_estimator must be one of"),
    ("num_generations", 3, "divisible by num_generations"), ("cliprange_value", 0.0, "cliprange_value must be"),
])
def test_bad_fields_refused(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        _config(tmp_path, **{field: value})


def test_trl_1_12_names_map_and_conflicts_refused(tmp_path):
    args = _config(tmp_path, cliprange=0.3, num_ppo_epochs=3, num_mini_batches=2, gradient_accumulation_steps=2,
                   response_length=17, num_generations=1)
    assert (args.epsilon, args.num_iterations, args.steps_per_generation, args.max_completion_length,
            args.num_generations) == (0.3, 3, 4, 17, 1)
    with pytest.raises(ValueError, match="disagree"):
        _config(tmp_path, cliprange=0.3, epsilon=0.1)


def _trainer(checkpoint, tmp_path, **kwargs):
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast

    fields = kwargs.pop("fields", {})
    return TreePPOTrainer(model=checkpoint, reward_funcs=kwargs.pop("reward_funcs", reward_a),
                          args=_config(tmp_path, **fields), train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          processing_class=PreTrainedTokenizerFast.from_pretrained(checkpoint), **kwargs)


def test_bad_critics_refused_at_construction(checkpoint, tmp_path):
    from transformers import AutoModelForTokenClassification

    from trl_tree.data.tiny import tiny_config

    with pytest.raises(ValueError, match="peft_config"):
        _trainer(checkpoint, tmp_path, fields={"critic": "adapter"})
    small_vocab = AutoModelForTokenClassification.from_config(tiny_config("qwen2", vocab_size=20, num_labels=1))
    with pytest.raises(ValueError, match="tokenizer"):
        _trainer(checkpoint, tmp_path, value_model=small_vocab)
    two_labels = AutoModelForTokenClassification.from_config(tiny_config("qwen2", vocab_size=96, num_labels=2))
    with pytest.raises(ValueError, match="one-value head"):
        _trainer(checkpoint, tmp_path, value_model=two_labels)
    with pytest.raises(ValueError, match="reads values from the policy"):
        _trainer(checkpoint, tmp_path, fields={"critic": "shared"}, value_model=two_labels)
    with pytest.raises(ValueError, match="reward"):
        _trainer(checkpoint, tmp_path, fields={"reward_weights": [1.0, 2.0]})


def test_critic_saved_and_restored(checkpoint, tmp_path):
    """A checkpoint holds the critic; resuming restores it (and its optimizer state) before training on."""
    fields = dict(max_steps=2, save_strategy="steps", save_steps=1, learning_rate=0.05, kl_coef=0.1)
    trainer = _trainer(checkpoint, tmp_path, fields=fields)
    trainer.train()
    saved = os.path.join(trainer.args.output_dir, "checkpoint-1")
    assert os.path.exists(os.path.join(saved, "critic.safetensors"))
    assert os.path.isdir(os.path.join(saved, "value_model"))
    after_two = [p.detach().clone() for p in trainer.critic.parameters()]
    resumed = _trainer(checkpoint, tmp_path, fields=fields)
    loaded = resumed.critic.load(saved)
    assert loaded and any((a - b).abs().max() > 0 for a, b in zip(after_two, resumed.critic.parameters()))
    resumed.train(resume_from_checkpoint=saved)
    assert resumed.state.global_step == 2



@pytest.mark.parametrize("kind", ["separate", "shared"])
def test_each_optimizer_step_starts_the_critic_gradients_at_zero(checkpoint, kind):
    """The Trainer zeroes the model it prepared after each optimizer step, which holds neither a
    separate value model nor a value head: the critic's gradients must not add up across steps. With
    a learning rate of 0 the two steps of a PPO epoch pair see the same weights and the same rollouts,
    so the gradient each optimizer step applies is the same — not twice the first at the second."""
    from transformers import TrainerCallback

    seen, built = [], []

    class Record(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            seen.append([p.grad.detach().clone() for p in built[0].critic.parameters()])

    original = TreePPOTrainer._setup_critic

    def setup(self, value_model):
        original(self, value_model)
        built.append(self)
        self.add_callback(Record())

    TreePPOTrainer._setup_critic = setup
    try:
        _train(checkpoint, "packed", kind, max_steps=2, gradient_accumulation_steps=1, steps_per_generation=1,
               num_iterations=2, num_mini_batches=1, learning_rate=0.0)
    finally:
        TreePPOTrainer._setup_critic = original
    assert len(seen) == 2 and max(g.abs().max().item() for g in seen[0]) > 0
    for first, second in zip(*seen):
        assert torch.allclose(first, second, rtol=1e-9, atol=1e-12), "the critic's gradients of step 1 carried over"


def test_a_value_model_of_another_tokenizer_is_warned_about(checkpoint, tmp_path):
    """Accepted (its vocabulary is large enough), never silently: another family's value model reads
    the policy's token ids as other tokens."""
    import warnings

    from transformers import AutoModelForTokenClassification

    from trl_tree.data.tiny import tiny_config

    other = AutoModelForTokenClassification.from_config(tiny_config("llama", vocab_size=200, num_labels=1))
    with pytest.warns(UserWarning, match="looks made for another tokenizer: .*model_type 'llama'"):
        _trainer(checkpoint, tmp_path, value_model=other)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(checkpoint, tmp_path)  # the policy's own checkpoint with a new head
    assert not [w for w in caught if "another tokenizer" in str(w.message)]
