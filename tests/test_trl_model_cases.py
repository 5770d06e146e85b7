"""TRL's own ``test_train`` cases for the model families issue 48 names, with the import swapped.

TRL's SFT, DPO and GRPO test files train tiny Hub checkpoints of Qwen3-MoE, GPT-OSS, Nemotron-H
and LFM2 (and we add Qwen3-Next, Falcon-H1 and Jamba) with the trainer's defaults and assert that a loss is logged,
that MoE models log their load-balancing loss, and that every parameter moved. Here the same
families are built offline (``trl_tree.data.tiny``), trained by the tree trainers with TRL's defaults
(gradient checkpointing on, ``tree_mode`` auto), and held to the same assertions. That the tree's
update equals stock's is the business of the per-trainer parity suites; this file checks that a
user who swaps the import meets no refusal and no dead parameter on these models.
"""

from __future__ import annotations

import os

import pytest
import torch
from datasets import Dataset
from sft_harness import QWEN3_NEXT_MOE, save_sft_checkpoint, sft_tokenizer
from trainer_harness import reward_a

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl_tree import (  # noqa: E402
    TreeDPOConfig,
    TreeDPOTrainer,
    TreeGRPOConfig,
    TreeGRPOTrainer,
    TreeSFTConfig,
    TreeSFTTrainer,
)

#: the families, as TRL's tiny checkpoints are: MoE ones with their load-balancing loss on
FAMILIES = {
    "qwen3_moe": dict(router_aux_loss_coef=0.01),
    "gpt_oss": dict(router_aux_loss_coef=0.01, attn_implementation="eager"),
    "nemotron_h": dict(),  # Mamba-2, attention, MoE and Mamba-2 blocks (TRL's "nano")
    "lfm2": dict(),
    "qwen3_next": dict(QWEN3_NEXT_MOE, router_aux_loss_coef=0.01),
    "qwen3_5_moe": dict(router_aux_loss_coef=0.01),  # the hybrid flagship: TRL's newest tiny checkpoints
    # beyond TRL's list: the other hybrids the tree runs
    "falcon_h1": dict(),
    "jamba": dict(router_aux_loss_coef=0.01),
}
#: TRL's defaults but for the CPU, a short run and a rate at which two steps move every parameter
ARGS = dict(report_to="none", use_cpu=True, bf16=False, max_steps=2, logging_steps=1, save_strategy="no",
            learning_rate=1e-2, per_device_train_batch_size=4, disable_tqdm=True, seed=0)
TEXTS = [f"the {w} saw {n} birds and {w} counted them again" for w in ("cat", "dog", "fox", "owl") for n in range(4)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    fields = FAMILIES[request.param]
    attn = fields.get("attn_implementation")
    path = save_sft_checkpoint(tmp_path_factory.mktemp(request.param) / "tiny", family=request.param, **fields)
    return path, ({"model_init_kwargs": {"attn_implementation": attn}} if attn else {})


def _trained(trainer) -> None:
    """TRL's assertions after ``trainer.train()``, and that the tree shared tokens."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    if trainer.aux_loss_enabled:  # MoE models log the load-balancing auxiliary loss (on by default)
        assert any(log.get("aux_loss") is not None for log in trainer.state.log_history)
    for name, param in before.items():
        assert not torch.equal(param, trainer.model.get_parameter(name)), f"parameter {name} has not changed"
    shared = [log["tree/dedup_ratio"] for log in trainer.state.log_history if "tree/dedup_ratio" in log]
    assert shared and max(shared) > 1.0, shared


def test_sft(checkpoint):
    path, extra = checkpoint
    args = TreeSFTConfig(output_dir=path + "-sft", **ARGS, **extra)
    _trained(TreeSFTTrainer(model=path, args=args, train_dataset=Dataset.from_dict({"text": TEXTS}),
                            processing_class=sft_tokenizer()))


def test_dpo(checkpoint):
    path, extra = checkpoint
    data = Dataset.from_dict({"prompt": [t[:14] for t in TEXTS], "chosen": [t[14:] for t in TEXTS],
                              "rejected": [t[14:][::-1] for t in TEXTS]})
    args = TreeDPOConfig(output_dir=path + "-dpo", **ARGS, **extra)
    _trained(TreeDPOTrainer(model=path, args=args, train_dataset=data, processing_class=sft_tokenizer()))


def test_grpo(checkpoint):
    path, extra = checkpoint
    args = TreeGRPOConfig(output_dir=path + "-grpo", **{**ARGS, "per_device_train_batch_size": 8}, **extra,
                          num_generations=4, max_completion_length=8)
    _trained(TreeGRPOTrainer(model=path, args=args, reward_funcs=reward_a, processing_class=sft_tokenizer(),
                             train_dataset=Dataset.from_dict({"prompt": [t[:14] for t in TEXTS]})))


def test_a_load_balancing_loss_without_experts_is_refused(tmp_path):
    """A dense Qwen3-Next keeps its config's default ``router_aux_loss_coef``: TRL then asks the model
    for router logits it does not have (and fails inside ``load_balancing_loss_func``); the tree says
    what to set, at construction."""
    path = save_sft_checkpoint(tmp_path / "tiny", family="qwen3_next")
    args = TreeSFTConfig(output_dir=str(tmp_path / "sft"), **ARGS)
    with pytest.raises(ValueError, match=r"has no experts \(num_experts=0\).*set router_aux_loss_coef=0.0"):
        TreeSFTTrainer(model=path, args=args, train_dataset=Dataset.from_dict({"text": TEXTS}),
                       processing_class=sft_tokenizer())
    trainer = TreeSFTTrainer(model=path, args=TreeSFTConfig(output_dir=str(tmp_path / "sft2"), **ARGS,
                                                            router_aux_loss_coef=0.0),
                             train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=sft_tokenizer())
    _trained(trainer)
