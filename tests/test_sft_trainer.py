"""TreeSFTTrainer against stock SFTTrainer: one update on the same samples (TRL's order), float64
parameters so that only a real difference shows; the logged metrics; each refusal."""

import pytest
import torch
from sft_harness import assert_same_update, dataset, run, save_moe_checkpoint, save_sft_checkpoint, sft_tokenizer
from transformers import AutoModelForCausalLM
from trl import SFTConfig, SFTTrainer

from trl_tree import TreeSFTConfig, TreeSFTTrainer

METRICS = ("loss", "entropy", "mean_token_accuracy", "num_tokens")
MOE_METRICS = METRICS + ("aux_loss",)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_sft_checkpoint(tmp_path_factory.mktemp("sft") / "tiny")


def _start(checkpoint, dtype=torch.float64):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _compare(checkpoint, data, tree_only=None, stock_log_index=0, dtype=torch.float64, whole=False, **config):
    stock, stock_log = run(SFTTrainer, SFTConfig, checkpoint, data, dtype=dtype, **config)
    tree, tree_log = run(TreeSFTTrainer, TreeSFTConfig, checkpoint, data, dtype=dtype,
                         **config, **(tree_only or {}))
    start = _start(checkpoint, dtype)
    assert_same_update(stock, tree, {n: start[n] for n in stock if n in start} if set(stock) <= set(start) else None,
                       whole=whole)
    for key in MOE_METRICS if "aux_loss" in stock_log[stock_log_index] else METRICS:
        assert tree_log[stock_log_index][key] == pytest.approx(stock_log[stock_log_index][key], rel=1e-5, abs=1e-7)
    return tree_log


CASES = {
    "text": ("text", {}),
    "prompt_completion": ("prompt_completion", {}),
    "prompt_completion_full_loss": ("prompt_completion", {"completion_only_loss": False}),
    "messages_assistant_only": ("messages", {"assistant_only_loss": True}),
    "turns_with_tools": ("tools", {}),
    "max_length": ("turns", {"max_length": 150}),  # some completions cut, some samples dropped
    "grad_accumulation": ("turns", {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 3}),
    "dft_with_checkpointing": ("turns", {"loss_type": "dft", "gradient_checkpointing": True}),
    "padding_free": ("turns", {"padding_free": True, "max_length": None}),
    "packing_bfd": ("turns", {"packing": True, "max_length": 128, "per_device_train_batch_size": 2}),
    "packing_wrapped": ("text", {"packing": True, "packing_strategy": "wrapped", "max_length": 64,
                                 "per_device_train_batch_size": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_update_matches_stock(checkpoint, case):
    kind, config = CASES[case]
    log = _compare(checkpoint, dataset(kind), **config)
    assert log[0]["tree/dedup_ratio"] >= 1.0


@pytest.mark.parametrize("tree", [{"tree_token_budget": 250}, {"tree_mode": "dfs", "tree_chunk_size": 7}])
def test_engine_backward_paths_match_stock(checkpoint, tree):
    """The two-pass paths (the engine's own backward through the bridge)."""
    log = _compare(checkpoint, dataset("turns"), tree_only=tree, gradient_accumulation_steps=2)
    if "tree_token_budget" in tree:
        assert log[0]["tree/calls"] > 1


def test_shared_histories_are_computed_once(checkpoint):
    """Per-turn samples of one conversation in one micro-batch: the histories count once."""
    _, log = run(TreeSFTTrainer, TreeSFTConfig, checkpoint, dataset("turns", n=1, turns=4))
    assert log[0]["tree/dedup_ratio"] > 2.0
    assert log[0]["num_tokens"] == log[0]["tree/total_tokens"]  # stock's count: every sample's tokens


def test_lora_update_matches_stock(checkpoint):
    from peft import LoraConfig

    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    torch.manual_seed(0)
    stock, _ = run(SFTTrainer, SFTConfig, checkpoint, dataset("turns"), peft_config=peft, dtype=torch.float64)
    torch.manual_seed(0)
    tree, _ = run(TreeSFTTrainer, TreeSFTConfig, checkpoint, dataset("turns"), peft_config=peft,
                  dtype=torch.float64)
    assert stock and all("lora" in n for n in stock)
    assert_same_update(stock, tree)


def test_evaluation_runs_through_the_tree(checkpoint):
    data = dataset("turns")
    config = {"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 4}
    stock, stock_log = run(SFTTrainer, SFTConfig, checkpoint, data, eval_data=dataset("tools"), dtype=torch.float64,
                           **config)
    tree, tree_log = run(TreeSFTTrainer, TreeSFTConfig, checkpoint, data, eval_data=dataset("tools"),
                         dtype=torch.float64, **config)
    stock_eval = next(e for e in stock_log if "eval_loss" in e)
    tree_eval = next(e for e in tree_log if "eval_loss" in e)
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        assert tree_eval[key] == pytest.approx(stock_eval[key], rel=1e-6)
    assert tree_eval["eval_tree/dedup_ratio"] > 1.0


def test_labels_that_are_not_the_inputs_are_refused(checkpoint):
    """A dataset prepared by hand whose labels are not its next tokens: a clear error, not a number."""
    from datasets import Dataset

    data = Dataset.from_list([{"input_ids": [3, 4, 5, 6], "labels": [-100, 4, 9, 6]}] * 4)
    with pytest.raises(ValueError, match="label 9 at position 2 where its input token is 5"):
        run(TreeSFTTrainer, TreeSFTConfig, checkpoint, data, dataset_kwargs={"skip_prepare_dataset": True})


REFUSALS = {
    "label_smoothing_factor": {"label_smoothing_factor": 0.1},
    "activation_offloading": {"activation_offloading": True},
    "tree_cuda_graphs": {"tree_cuda_graphs": True},
}


@pytest.mark.parametrize("option", list(REFUSALS))
def test_unsupported_options_are_refused_at_construction(checkpoint, option):
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    try:
        args = TreeSFTConfig(output_dir="/tmp/refused", report_to="none", **REFUSALS[option])
    except ValueError as err:  # refused by TRL's or transformers' own checks first
        pytest.skip(f"refused before the tree: {err}")
    with pytest.raises(ValueError, match=option.split("_")[0]):
        TreeSFTTrainer(model=model, args=args, train_dataset=dataset("turns"), processing_class=sft_tokenizer())


def test_compute_loss_func_is_refused(checkpoint, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    args = TreeSFTConfig(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="compute_loss_func"):
        TreeSFTTrainer(model=model, args=args, train_dataset=dataset("turns"), processing_class=sft_tokenizer(),
                       compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum())


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def moe_checkpoint(request, tmp_path_factory):
    return save_moe_checkpoint(tmp_path_factory.mktemp(request.param) / "tiny", request.param)


MOE_CASES = {
    # tokens after a sample's last label and samples with no label left at all: stock's aux counts them
    "max_length": ("turns", {"max_length": 150}, {}),
    "assistant_only_dfs": ("messages", {"assistant_only_loss": True}, {"tree_mode": "dfs", "tree_chunk_size": 7}),
    "budget": ("turns", {"gradient_accumulation_steps": 2}, {"tree_token_budget": 250}),
    # no attention mask: stock's aux counts every token of the flat row
    "padding_free": ("turns", {"padding_free": True, "max_length": None}, {}),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_load_balancing_loss_matches_stock(moe_checkpoint, case):
    """An MoE model with its router_aux_loss_coef: the tree's load-balancing loss over every real token
    of the batch (labelled or not), in one packed call, over the walk and under a token budget, gives
    stock's update and its aux_loss metric."""
    kind, config, tree_only = MOE_CASES[case]
    if case == "padding_free" and "gpt_oss" in moe_checkpoint:
        pytest.skip("GPT-OSS runs eager attention, which attends across a padding-free row's samples in stock")
    # fp32 (the experts' grouped matrix products take no float64): the update of all parameters together
    log = _compare(moe_checkpoint, dataset(kind), tree_only=tree_only, dtype=torch.float32, whole=True, **config)
    assert log[0]["aux_loss"] > 0



def test_construction_says_what_grouping_buys(checkpoint, caplog):
    """One line: T/U in TRL's order and with groups; for samples that share nothing, that the tree
    gives nothing here."""
    import logging

    from datasets import Dataset

    with caplog.at_level(logging.WARNING, logger="trl_tree.trainers.offline.sft_sampler"):
        run(TreeSFTTrainer, TreeSFTConfig, checkpoint, dataset("turns", n=4, turns=4), max_steps=1)
    assert any("in TRL's order" in r.message and "with tree_shuffle='groups'" in r.message for r in caplog.records)
    caplog.clear()
    distinct = Dataset.from_list([{"text": c * 30} for c in "abcdefgh"])
    with caplog.at_level(logging.WARNING, logger="trl_tree.trainers.offline.sft_sampler"):
        run(TreeSFTTrainer, TreeSFTConfig, checkpoint, distinct, max_steps=1)
    assert any("the tree gives nothing here" in r.message for r in caplog.records)


def test_malformed_conversations_get_stocks_error(checkpoint):
    from datasets import Dataset

    bad = Dataset.from_list([{"messages": [{"content": "no role"}, {"role": "assistant", "content": "x"}]}] * 4)
    errors = []
    for trainer_cls, config_cls in ((SFTTrainer, SFTConfig), (TreeSFTTrainer, TreeSFTConfig)):
        with pytest.raises(Exception) as err:
            run(trainer_cls, config_cls, checkpoint, bad)
        errors.append((type(err.value), str(err.value)))
    assert errors[0] == errors[1]


def test_padded_calls_follow_the_engine(checkpoint, monkeypatch):
    """``tree/padded_calls`` counts the calls the engine ran as stock's padded batch: samples that
    share nothing do, unless the layout switch turns the padded path off."""
    from datasets import Dataset

    from trl_tree.engine.layout import LAYOUT

    distinct = Dataset.from_list([{"text": c * 30} for c in "abcd"])
    _, log = run(TreeSFTTrainer, TreeSFTConfig, checkpoint, distinct)
    assert log[0]["tree/padded_calls"] == 1
    monkeypatch.setattr(LAYOUT, "dense_unshared_batches", False)
    _, log = run(TreeSFTTrainer, TreeSFTConfig, checkpoint, distinct)
    assert log[0]["tree/padded_calls"] == 0
