"""TreeGRPOTrainer / TreeRLOOTrainer against stock TRL on the settings where they used to differ or
refuse (issue: same numbers as TRL or a refusal at construction), and a matrix of TRL options,
one update each, in both tree modes, so the next option TRL adds is caught.

CPU, tiny models saved to disk, SGD, float64 (``trainer_harness``); every comparison first checks
that both trainers trained on the same rollouts.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from conftest import assert_grads_close  # noqa: E402
from trainer_harness import run, save_tiny_checkpoint  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402

from trl_tree import TreeGRPOConfig, TreeGRPOTrainer, TreeRLOOConfig, TreeRLOOTrainer  # noqa: E402

ONE_UPDATE = dict(max_steps=1, gradient_accumulation_steps=1, num_iterations=1, beta=0.0)
KINDS = {
    "grpo": (GRPOTrainer, GRPOConfig, TreeGRPOTrainer, TreeGRPOConfig),
    "rloo": (RLOOTrainer, RLOOConfig, TreeRLOOTrainer, TreeRLOOConfig),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def compare(checkpoint, modes=("packed", "dfs"), kind="grpo", tree_fields=None, **overrides):
    """Stock once, then each tree mode: the same rollouts and the same update (float64)."""
    stock_trainer, stock_config, tree_trainer, tree_config = KINDS[kind]
    overrides.setdefault("dtype", torch.float64)
    ref, ref_completions, _ = run(stock_trainer, stock_config, checkpoint, **overrides)
    trainers = []
    for mode in modes:
        updates, completions, trainer = run(tree_trainer, tree_config, checkpoint, tree_mode=mode,
                                            **(tree_fields or {}), **overrides)
        assert completions == ref_completions, "the two trainers did not train on the same rollouts"
        if overrides["dtype"] == torch.float64:
            assert_grads_close(updates, ref)
        else:  # fp32: the whole update vector (per-parameter checks are made in float64, trainer_harness)
            diff = torch.sqrt(sum(((updates[n] - u) ** 2).sum() for n, u in ref.items()))
            norm = torch.sqrt(sum((u**2).sum() for u in ref.values()))
            assert (diff / norm).item() <= 1e-5, f"relative update error {(diff / norm).item():.3e}"
        trainers.append(trainer)
    return trainers


# ---------------------------------------------------------------- micro-batch order
@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_row_shuffle_reproduces_trls_micro_batches(checkpoint, loss_type):
    """tree_shuffle='rows': TRL's own row shuffle, so per-micro-batch normalisers and optimizer steps
    see TRL's rows — the update is TRL's with several micro-batches per generation batch."""
    compare(checkpoint, loss_type=loss_type, steps_per_generation=2, gradient_accumulation_steps=1,
            tree_fields={"tree_shuffle": "rows"})


@pytest.mark.parametrize("mode", ["packed", "dfs"])
@pytest.mark.parametrize("case", [
    dict(loss_type="bnpo", gradient_accumulation_steps=2, num_iterations=1),
    dict(loss_type="bnpo", num_iterations=2, steps_per_generation=2, gradient_accumulation_steps=2),
    dict(loss_type="dapo", steps_per_generation=2, gradient_accumulation_steps=1, num_iterations=1),
], ids=["bnpo-ga2", "bnpo-iter2-spg2-ga2", "dapo-spg2-ga1"])
def test_default_shuffle_gives_stocks_update(checkpoint, case, mode):
    """The configurations where the old default (regrouping) parted from stock: with the default
    tree_shuffle='auto' each is stock's update (per-micro-batch normalisers, optimizer steps inside
    a generation batch: auto keeps TRL's rows there)."""
    (trainer,) = compare(checkpoint, (mode,), max_steps=2, **case)
    assert trainer.args.tree_shuffle == "auto" and not trainer._regroups()


def test_auto_regroups_where_it_cannot_change_the_update(checkpoint):
    """One optimizer step per generation batch and a loss that sums over micro-batches (dapo): auto
    keeps prompt groups whole — more sharing — and the update is still stock's. TRL's shuffle draw is
    made all the same, so the second generation's rollouts are stock's too (compare checks them)."""
    fields = dict(loss_type="dapo", gradient_accumulation_steps=2, num_iterations=1, max_steps=2,
                  tree_fields={"tree_window": "micro_step"})
    (auto,) = compare(checkpoint, ("packed",), **fields)
    assert auto._regroups()
    _, _, rows = run(TreeGRPOTrainer, TreeGRPOConfig, checkpoint, dtype=torch.float64, tree_window="micro_step",
                     tree_shuffle="rows", **{k: v for k, v in fields.items() if k != "tree_fields"})

    def group_sizes(trainer):  # rows of each prompt in each micro-batch of the last generation batch
        sizes = []
        for micro in trainer._buffered_inputs:
            counts = {}
            for ids, mask in zip(micro["prompt_ids"], micro["prompt_mask"]):
                key = tuple(ids[mask.bool()].tolist())
                counts[key] = counts.get(key, 0) + 1
            sizes.extend(counts.values())
        return sorted(sizes)

    assert group_sizes(auto) == [4, 4, 4, 4]  # num_generations=4: every group whole in one micro-batch
    assert group_sizes(rows) != [4, 4, 4, 4]


def test_what_stock_trains_the_default_trains(checkpoint):
    """Two cases of TRL's own test files: steps_per_generation=4 with gradient_accumulation_steps=3
    (windows cannot hold it: the default takes trees per micro-step), and every completion masked
    as truncated (a zero-gradient step; the walk used to crash on a call with nothing to score)."""
    with pytest.warns(UserWarning, match="trees per micro-step here"):
        compare(checkpoint, ("packed", "dfs"), per_device_train_batch_size=4, steps_per_generation=4,
                gradient_accumulation_steps=3, num_iterations=1, max_steps=2)
    compare(checkpoint, ("packed", "dfs"), mask_truncated_completions=True, max_completion_length=1, max_steps=1)


def test_group_shuffle_is_an_opt_in_that_says_what_it_changes(checkpoint, caplog):
    """tree_shuffle='groups' keeps groups whole where that changes the update (bnpo over two
    optimizer steps): it says so at construction, logs the T/U it buys, and trains on other
    micro-batches than TRL (documented)."""
    overrides = dict(loss_type="bnpo", steps_per_generation=2, gradient_accumulation_steps=1, dtype=torch.float64)
    ref, _, _ = run(GRPOTrainer, GRPOConfig, checkpoint, **overrides)
    with pytest.warns(UserWarning, match=r"tree_shuffle='groups'.*changes stock TRL's update.*bnpo"), \
            caplog.at_level("WARNING", logger="trl_tree.trainers.online.mixin"):
        updates, _, trainer = run(TreeGRPOTrainer, TreeGRPOConfig, checkpoint, tree_shuffle="groups", **overrides)
    assert any("tree_shuffle='groups' gives micro-batches of T/U" in r.getMessage() for r in caplog.records)
    diff = torch.sqrt(sum(((updates[n] - u) ** 2).sum() for n, u in ref.items()))
    assert diff / torch.sqrt(sum((u**2).sum() for u in ref.values())) > 1e-3
    with pytest.raises(ValueError, match="tree_shuffle must be one of"):
        TreeGRPOConfig(output_dir="x", use_cpu=True, tree_shuffle="prompts")


# ---------------------------------------------------------------- entropy bonus, two-pass backward
@pytest.mark.parametrize("fields", [{"tree_token_budget": 40}, {}], ids=["budget", "plain"])
def test_entropy_bonus_through_the_two_pass_backward(checkpoint, fields):
    """An entropy bonus in dfs mode and under a token budget: the entropies' gradient is routed
    through the engine's backward (one micro-batch per step: the bonus is a per-micro-batch mean)."""
    modes = ("packed", "dfs") if fields else ("dfs",)
    compare(checkpoint, modes, tree_fields=fields, entropy_coef=0.05, gradient_accumulation_steps=1, max_steps=2,
            num_iterations=2)


# ---------------------------------------------------------------- MoE
@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe", router_aux_loss_coef=0.5)


def test_moe_load_balancing_loss_matches_trl(moe_checkpoint):
    """TRL turns the router's load-balancing loss on for MoE models; the tree computes it over the
    unique tokens weighted by multiplicity, in one call (packed), over the walk (dfs) and over
    several calls (a token budget)."""
    # float32: transformers' expert matmuls take no float64
    trainers = compare(moe_checkpoint, ("packed", "dfs"), dtype=torch.float32, **ONE_UPDATE)
    assert trainers[0].aux_loss_enabled
    compare(moe_checkpoint, ("packed",), tree_fields={"tree_token_budget": 40}, dtype=torch.float32, **ONE_UPDATE)


def test_moe_load_balancing_loss_keeps_trees_per_micro_batch(moe_checkpoint):
    """The loss is a function of each micro-batch's router statistics: an accumulation window cannot
    merge micro-steps exactly. Asked for, it is refused at construction; under 'auto' the trainer
    says so once and trains per micro-batch (stock's update, above); without the loss it windows."""
    accumulate = dict(gradient_accumulation_steps=2, per_device_train_batch_size=4, max_steps=0)
    with pytest.raises(ValueError, match=r"MoE load-balancing loss .* router_aux_loss_coef=0.0 to train with windows"):
        run(TreeGRPOTrainer, TreeGRPOConfig, moe_checkpoint, tree_window="accumulation", **accumulate)
    with pytest.warns(UserWarning, match=r"MoE load-balancing loss .*tree_window='auto' computes trees per micro-step"):
        _, _, trainer = run(TreeGRPOTrainer, TreeGRPOConfig, moe_checkpoint, **accumulate)
    assert not trainer._windows_on()
    _, _, trainer = run(TreeGRPOTrainer, TreeGRPOConfig, moe_checkpoint, tree_window="accumulation",
                        router_aux_loss_coef=0.0, **accumulate)
    assert trainer._windows_on() and not trainer.aux_loss_enabled


# ---------------------------------------------------------------- construction-time refusals and warnings
def test_dropout_refused_at_construction(tmp_path):
    """TRL 1.16 leaves dropout on by default (disable_dropout=False); attention dropout is out of
    its reach either way."""
    resid = save_tiny_checkpoint(tmp_path / "phi3", "phi3", resid_pdrop=0.1)
    with pytest.raises(ValueError, match=r"dropout is active in the model .*p=0.1.* disable_dropout=True"):
        run(TreeGRPOTrainer, TreeGRPOConfig, resid, max_steps=0)
    run(TreeGRPOTrainer, TreeGRPOConfig, resid, max_steps=0, disable_dropout=True)  # zeroes nn.Dropout modules
    attention = save_tiny_checkpoint(tmp_path / "attn", attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"dropout is active in the model .*attention_dropout \(0.1\)"):
        run(TreeGRPOTrainer, TreeGRPOConfig, attention, max_steps=0, disable_dropout=True)


def test_softcap_refused_on_a_kernel_without_it_at_construction(tmp_path):
    gemma = save_tiny_checkpoint(tmp_path / "gemma2", "gemma2", attn_logit_softcapping=20.0,
                                 attn_implementation="eager")
    eager = {"model_init_kwargs": {"dtype": torch.float32, "attn_implementation": "eager"}}
    with pytest.raises(ValueError, match=r"TreeGRPOTrainer: Gemma2ForCausalLM: attention logit soft-capping"):
        run(TreeGRPOTrainer, TreeGRPOConfig, gemma, max_steps=0, tree_attn_backend="torch_flash", **eager)
    compare(gemma, **eager, **ONE_UPDATE)  # the reference backends compute it: TRL's update


def test_budget_below_a_group_warns_once(checkpoint):
    with pytest.warns(UserWarning, match=r"tree_token_budget=8 is smaller than a prompt group's unique tokens .* "
                      r"A budget of at least \d+ keeps every group in one call"):
        compare(checkpoint, ("packed",), tree_fields={"tree_token_budget": 8}, **ONE_UPDATE)


class _PoisonedLoss(TreeGRPOTrainer):
    """A loss that turns non-finite (what a broken reward or loss setting produces)."""

    def compute_loss(self, *args, **kwargs):
        return super().compute_loss(*args, **kwargs) * float("nan")


def test_non_finite_loss_stops_before_the_update(checkpoint):
    with pytest.raises(FloatingPointError, match=r"non-finite loss .* at global step 0, micro-step 0 of the "
                       r"generation batch \(8 rows\)"):
        run(_PoisonedLoss, TreeGRPOConfig, checkpoint, **ONE_UPDATE)


def test_a_step_that_raises_gives_back_the_engine_state(checkpoint):
    """The check's error inside the micro-step: the engine object ends it as abandoned (no reduction,
    no step; under DeepSpeed the reduction block closed and ZeRO-3's parameters partitioned again)."""
    from trl_tree.distributed.strategy import Replicated

    calls = []

    class Recording(Replicated):
        def begin_micro_step(self, defer_step=True):
            calls.append("begin")

        def end_micro_step(self, closes_step):
            calls.append("end")

        def abandon_step(self):
            calls.append("abandon")

    class Poisoned(_PoisonedLoss):
        @property
        def _strategy(self):
            return self.__dict__.setdefault("_tree_strategy", Recording(self.accelerator))

    with pytest.raises(FloatingPointError):
        run(Poisoned, TreeGRPOConfig, checkpoint, **ONE_UPDATE)
    assert calls == ["begin", "abandon"]


def test_absolute_positions_warn_and_keep_true_positions(tmp_path):
    """GPT-2 with left-padded prompts: stock TRL shifts padded rows' positions; the tree keeps each
    token's depth (what generation used) and says so at construction; dfs runs too."""
    gpt2 = _save_gpt2(tmp_path / "gpt2")
    for mode in ("packed", "dfs"):
        with pytest.warns(UserWarning, match="absolute position embeddings"):
            updates, _, trainer = run(TreeGRPOTrainer, TreeGRPOConfig, gpt2, tree_mode=mode, disable_dropout=True,
                                      **ONE_UPDATE)
        assert all(torch.isfinite(u).all() for u in updates.values())


def _save_gpt2(path) -> str:
    from transformers import AutoModelForCausalLM, GPT2Config

    from trl_tree.data.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=len(tok), n_positions=128,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


# ---------------------------------------------------------------- the matrix
GRPO_MATRIX = {
    "scale_rewards=batch": dict(scale_rewards="batch"),
    "scale_rewards=none": dict(scale_rewards="none"),
    "sequence-level ratio": dict(importance_sampling_level="sequence", num_iterations=2, max_steps=2),
    "two-sided clip (delta), epsilon_high": dict(delta=1.5, epsilon_high=0.28, num_iterations=2, max_steps=2),
    "top entropy quantile": dict(top_entropy_quantile=0.5),
    "mask truncated completions": dict(mask_truncated_completions=True, max_completion_length=6),
    "temperature": dict(temperature=0.7),
    "kl with bias correction": dict(beta=0.1, use_bias_correction_kl=True),
    "off-policy mask": dict(off_policy_mask_threshold=0.5, num_iterations=2, max_steps=2),
    "two reward functions, weighted": dict(reward_weights=[1.0, 0.5]),
    "dr_grpo, accumulation": dict(loss_type="dr_grpo", gradient_accumulation_steps=2),
    "gradient checkpointing off": dict(gradient_checkpointing=False),
}


def reward_len(completions, **kwargs):
    return [len(c) / 8 for c in completions]


@pytest.mark.parametrize("option", sorted(GRPO_MATRIX))
def test_grpo_option_matrix(checkpoint, option):
    settings = {**ONE_UPDATE, **GRPO_MATRIX[option]}
    if "reward_weights" in settings:
        from trainer_harness import reward_a

        settings["trainer_kwargs"] = {"reward_funcs": [reward_a, reward_len]}
    compare(checkpoint, **settings)


RLOO_MATRIX = {
    "normalize_advantages": dict(normalize_advantages=True),
    "reward_clip_range": dict(reward_clip_range=(-0.1, 0.1)),
    "kl in reward": dict(beta=0.1),
}


@pytest.mark.parametrize("option", sorted(RLOO_MATRIX))
def test_rloo_option_matrix(checkpoint, option):
    compare(checkpoint, kind="rloo", **{**ONE_UPDATE, **RLOO_MATRIX[option]})
