"""TreeDPOTrainer against stock DPOTrainer: two updates (so the policy has moved from its reference
by the second) on the same micro-batches, float64 parameters, SGD; every loss type, the options that
change the loss, the reference kinds (a model, the PEFT base, precomputed), packed and dfs; the
metrics TRL logs; the refusals."""

import copy

import pytest
import torch
from datasets import Dataset
from sft_harness import assert_same_update, save_moe_checkpoint, save_sft_checkpoint, sft_tokenizer
from transformers import AutoModelForCausalLM
from trl import DPOConfig, DPOTrainer

from trl_tree import TreeDPOConfig, TreeDPOTrainer

SYSTEM = "you are a careful assistant; answer the question about the story. "
BASE = dict(per_device_train_batch_size=4, learning_rate=0.5, optim="sgd", max_steps=2, logging_steps=1,
            report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0, disable_tqdm=True,
            gradient_checkpointing=False, max_grad_norm=0.0)  # unclipped: a gradient off by a factor shows
LOGGED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
          "logps/rejected", "logits/chosen", "logits/rejected", "mean_token_accuracy", "num_tokens", "entropy")


def pairs(n: int = 8) -> Dataset:
    rows = [{"prompt": SYSTEM + f"story {i} " + "ab " * (i % 3) + "question?",
             "chosen": f" yes {i} good", "rejected": f" no {i % 4} bad answer"} for i in range(n)]
    return Dataset.from_list(rows)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_sft_checkpoint(tmp_path_factory.mktemp("dpo") / "tiny")


def run(trainer_cls, config_cls, checkpoint, data=None, *, reference=True, peft_config=None, eval_data=None,
        dtype=torch.float64, **config):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    ref = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype) if reference else None
    args = config_cls(output_dir=str(checkpoint) + "-dpo", **{**BASE, **config})
    trainer = trainer_cls(model=model, ref_model=ref, args=args, train_dataset=copy.deepcopy(data or pairs()),
                          eval_dataset=eval_data, processing_class=sft_tokenizer(), peft_config=peft_config)
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return params, trainer.state.log_history


def compare(checkpoint, tree=None, data=None, dtype=torch.float64, whole=False, **config):
    stock, stock_log = run(DPOTrainer, DPOConfig, checkpoint, data, dtype=dtype, **config)
    treed, tree_log = run(TreeDPOTrainer, TreeDPOConfig, checkpoint, data, dtype=dtype, **config, **(tree or {}))
    start = dict(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).named_parameters())
    assert_same_update(stock, treed, start, whole=whole)  # the updates, not the parameters they move
    for step in range(config.get("max_steps", 2)):
        for key in LOGGED + (("aux_loss",) if "aux_loss" in stock_log[step] else ()):
            if key in stock_log[step]:
                assert tree_log[step][key] == pytest.approx(stock_log[step][key], rel=1e-5, abs=1e-6), (step, key)
    assert tree_log[0]["tree/dedup_ratio"] > 1.5  # chosen and rejected share their prompt
    return tree_log


#: every loss type, five to a run (``loss_type`` lists combine; a wrong term would move the sum)
LOSS_GROUPS = {
    "sigmoid..nca_pair": ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair"],
    "robust..aot_unpaired": ["robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired"],  # label smoothing 0.2
    "apo_zero..sigmoid_norm": ["apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"],
}


@pytest.mark.parametrize("group", list(LOSS_GROUPS))
def test_every_loss_type_matches_stock(checkpoint, monkeypatch, group):
    """Packed: stock's loss on the tree's outputs, its metrics logged after the backward is queued
    (``_loss_before_metrics``, spied) — every number as stock logs it."""
    losses = LOSS_GROUPS[group]
    deferred = []
    before = TreeDPOTrainer._loss_before_metrics
    monkeypatch.setattr(TreeDPOTrainer, "_loss_before_metrics", lambda *a: deferred.append(1) or before(*a))
    compare(checkpoint, loss_type=losses, loss_weights=[1.0 / (k + 1) for k in range(len(losses))],
            label_smoothing=1e-3 if "exo_pair" in losses else 0.2 if "robust" in losses else 0.0)
    assert len(deferred) == 2


OPTIONS = {
    "ld_alpha_and_use_weighting": {"ld_alpha": 0.5, "use_weighting": True},
    "forward_kl": {"f_divergence_type": "forward_kl"},
    "js_divergence": {"f_divergence_type": "js_divergence"},
    "alpha_divergence": {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.5},
    "max_length_precomputed_reference": {"max_length": 100, "precompute_ref_log_probs": True},  # answers cut
    "accumulation_and_checkpointing": {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2,
                                       "gradient_checkpointing": True},
    "sync_ref_model": {"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5},
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_match_stock(checkpoint, option):
    compare(checkpoint, **OPTIONS[option])


@pytest.mark.parametrize("tree", [{"tree_mode": "dfs"}, {"tree_token_budget": 250}])
def test_engine_backward_paths_match_stock(checkpoint, tree):
    compare(checkpoint, tree=tree, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.3])


#: dfs whose units hold whole trees (on the CPU the default budget is one sequence's footprint, which
#: pushes every prompt and splits its pairs: the engine then scores first, as the case above checks)
ONE_PASS = {"tree_mode": "dfs", "tree_memory_budget": 1 << 30}
PER_PAIR_LOSSES = [t for group in LOSS_GROUPS.values() for t in group if t not in ("aot", "aot_unpaired")]
ONE_PASS_CASES = {
    "every_per_pair_loss": dict(loss_type=PER_PAIR_LOSSES, loss_weights=[1.0 / (k + 1) for k in range(13)],
                                label_smoothing=1e-3),
    "weighting_ld_alpha_divergence_accumulation_precomputed": dict(
        use_weighting=True, ld_alpha=0.5, f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5,
        gradient_accumulation_steps=2, per_device_train_batch_size=2, precompute_ref_log_probs=True),
}


@pytest.mark.parametrize("case", list(ONE_PASS_CASES))
def test_one_pass_walk_matches_stock(checkpoint, monkeypatch, case):
    """dfs in one pass (``dpo_walk``): each unit back-propagates its pairs' loss — stock's, on the
    unit's log-probs — as it scores them; no scoring pass first (spied: the walk never falls back)."""
    from trl_tree.engine import api as engine
    from trl_tree.trainers.offline import dpo

    fallbacks, one_pass = [], []
    linearised = engine._linearised_loss
    monkeypatch.setattr(engine, "_linearised_loss", lambda *a: fallbacks.append(1) or linearised(*a))
    walked = dpo.one_pass_loss
    monkeypatch.setattr(dpo, "one_pass_loss", lambda *a: one_pass.append(walked(*a)) or one_pass[-1])
    compare(checkpoint, tree=ONE_PASS, **ONE_PASS_CASES[case])
    assert one_pass and all(loss is not None for loss in one_pass) and not fallbacks


def test_one_pass_walk_checks_the_trainers_scale(checkpoint, monkeypatch):
    """The walk scales each unit's loss as the Trainer's backward will; a different scale is an error,
    never a silently wrong gradient."""
    from trl_tree.trainers.offline import dpo_walk

    monkeypatch.setattr(dpo_walk, "_gradient_scale", lambda trainer, n: 0.25)
    with pytest.raises(RuntimeError, match="scaled the loss by 0.25"):
        run(TreeDPOTrainer, TreeDPOConfig, checkpoint, **ONE_PASS)


@pytest.mark.parametrize("tree", [{}, ONE_PASS], ids=["packed", "dfs_one_pass"])
def test_lora_with_the_base_as_reference_matches_stock(checkpoint, tree):
    from peft import LoraConfig

    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    torch.manual_seed(0)
    stock, stock_log = run(DPOTrainer, DPOConfig, checkpoint, reference=False, peft_config=peft)
    torch.manual_seed(0)
    tree, tree_log = run(TreeDPOTrainer, TreeDPOConfig, checkpoint, reference=False, peft_config=peft, **tree)
    assert stock and all("lora" in n for n in stock)
    assert_same_update(stock, tree)
    assert tree_log[1]["rewards/margins"] == pytest.approx(stock_log[1]["rewards/margins"], rel=1e-5, abs=1e-7)


def test_evaluation_runs_through_the_tree(checkpoint):
    config = {"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 4}
    _, stock_log = run(DPOTrainer, DPOConfig, checkpoint, eval_data=pairs(4), **config)
    _, tree_log = run(TreeDPOTrainer, TreeDPOConfig, checkpoint, eval_data=pairs(4), **config)
    stock_eval = [e for e in stock_log if "eval_loss" in e]
    tree_eval = [e for e in tree_log if "eval_loss" in e]
    for a, b in zip(stock_eval, tree_eval):
        for key in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen", "eval_logits/rejected"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


REFUSED = {"activation_offloading": {"activation_offloading": True}}


def test_cuda_graphs_replay_the_policy_call(checkpoint, monkeypatch):
    """``tree_cuda_graphs=True``: the same pairs every step, so from the second the policy's packed call
    replays its captured graphs (the CPU stand-in), the head's argmax and mean logit included (DPO's
    metrics); the update and every logged number are stock's."""
    from trl_tree.engine import graphs

    monkeypatch.setattr(graphs, "CPU_STAND_IN", graphs.EagerReplay)
    captures = []
    capture = graphs.GraphRunner.capture
    monkeypatch.setattr(graphs.GraphRunner, "capture",
                        lambda self, *a, **k: captures.append(1) or capture(self, *a, **k))
    compare(checkpoint, tree={"tree_cuda_graphs": True}, data=pairs(4), max_steps=3)
    assert captures


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def moe_checkpoint(request, tmp_path_factory):
    return save_moe_checkpoint(tmp_path_factory.mktemp(request.param) / "tiny", request.param)


MOE_CASES = {
    "packed": {},
    "dfs": {"tree_mode": "dfs", "tree_chunk_size": 9},  # two passes: the loss needs every unit's expert counts
    "budget": {"tree_token_budget": 150},
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_load_balancing_loss_matches_stock(moe_checkpoint, case):
    """An MoE policy with its router_aux_loss_coef: the load-balancing loss over every real token of
    the concatenated chosen and rejected rows (a shared prompt counted once per row through it), in
    one packed call, over the walk and under a token budget: stock's two updates and aux_loss metric."""
    # fp32 (the experts' grouped matrix products take no float64): the update of all parameters together
    log = compare(moe_checkpoint, tree=MOE_CASES[case], dtype=torch.float32, whole=True)
    assert log[0]["aux_loss"] > 0
    if case == "budget":
        assert log[0]["tree/calls"] > 1


@pytest.mark.parametrize("option", list(REFUSED))
def test_unsupported_options_are_refused(checkpoint, option):
    with pytest.raises(ValueError, match=option):
        run(TreeDPOTrainer, TreeDPOConfig, checkpoint, **REFUSED[option])


def test_groups_bring_the_pairs_of_a_prompt_together(checkpoint, caplog):
    """``tree_shuffle='groups'``: the four pairs of each prompt meet in one micro-batch (their prompt
    computed once), every pair once per epoch; the construction line says what it buys."""
    import logging
    import random

    rows = [{"prompt": SYSTEM + f"story {p} " + "ab " * p + "question?", "chosen": f" yes {p}{k} good",
             "rejected": f" no {k} bad"} for p in range(4) for k in range(4)]
    random.Random(0).shuffle(rows)
    data = Dataset.from_list(rows)
    logs = {}
    for shuffle in ("rows", "groups"):
        with caplog.at_level(logging.WARNING, logger="trl_tree.trainers.offline.sft_sampler"):
            _, log = run(TreeDPOTrainer, TreeDPOConfig, checkpoint, data, tree_shuffle=shuffle, max_steps=-1,
                         num_train_epochs=1)
        logs[shuffle] = [e for e in log if "loss" in e]
    assert len(logs["groups"]) == len(logs["rows"]) == 4
    ratio = {k: sum(e["tree/total_tokens"] for e in v) / sum(e["tree/unique_tokens"] for e in v)
             for k, v in logs.items()}
    assert ratio["groups"] > 1.3 * ratio["rows"]
    assert sum(e["num_tokens"] for e in logs["groups"][-1:]) == sum(e["num_tokens"] for e in logs["rows"][-1:])
    assert any("with tree_shuffle='groups'" in r.message for r in caplog.records)


@pytest.mark.slow
def test_dpo_example_learns(monkeypatch, capsys, tmp_path):
    """``examples/dpo_tree.py``, shortened: rewards/accuracies rise by at least 0.1 and the pairs
    share their prompts."""
    import re

    from test_examples_learn import run_example

    run_example("dpo_tree.py", ["--steps", "16"], monkeypatch, tmp_path)
    out = capsys.readouterr().out
    match = re.search(r"rewards/accuracies ([0-9.]+) -> ([0-9.]+) \(first -> last quarter.*T/U ([0-9.]+)", out)
    assert match, out[-2000:]
    first, last, ratio = map(float, match.groups())
    assert last - first >= 0.1 and ratio > 2.0, match.group(0)
