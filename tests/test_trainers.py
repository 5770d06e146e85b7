"""TreeGRPOTrainer / TreeRLOOTrainer against TRL's trainers: same rollouts, same parameter update.

CPU, tiny Qwen2 saved to disk, SGD, TRL's defaults otherwise (gradient checkpointing on). Each
comparison asserts the rollouts are identical first, then the update to 1e-5 relative: in fp32 the
whole update vector (``assert_update_close``); in float64 every parameter's update
(``assert_grads_close``; see ``trainer_harness`` for why per-parameter checks use float64).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from conftest import assert_grads_close  # noqa: E402
from trainer_harness import PROMPTS, multi_turn_rollout, reward_a, run, save_tiny_checkpoint  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402

from trl_tree import TreeGRPOConfig, TreeGRPOTrainer, TreeRLOOConfig, TreeRLOOTrainer  # noqa: E402
from trl_tree.distributed.grouping import plan_micro_batches, prompt_groups, split_into_calls  # noqa: E402
from trl_tree.engine.rows import PaddedRows  # noqa: E402

KINDS = {
    "grpo": (GRPOTrainer, GRPOConfig, TreeGRPOTrainer, TreeGRPOConfig),
    "rloo": (RLOOTrainer, RLOOConfig, TreeRLOOTrainer, TreeRLOOConfig),
}
_REFERENCE: dict = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def assert_update_close(tree: dict, ref: dict, rtol: float = 1e-5) -> None:
    diff = torch.sqrt(sum(((tree[n] - u) ** 2).sum() for n, u in ref.items()))
    norm = torch.sqrt(sum((u**2).sum() for u in ref.values()))
    assert (diff / norm).item() <= rtol, f"relative update error {(diff / norm).item():.3e} > {rtol}"


def reference(kind, checkpoint, **overrides):
    """TRL's own run for these settings, computed once per module."""
    key = (kind, checkpoint, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
    if key not in _REFERENCE:
        trl_trainer, trl_config = KINDS[kind][:2]
        _REFERENCE[key] = run(trl_trainer, trl_config, checkpoint, **overrides)[:2]
    return _REFERENCE[key]


def compare(kind, checkpoint, mode, tree_fields=None, dtype=torch.float64, **overrides):
    overrides["dtype"] = dtype
    ref_updates, ref_completions = reference(kind, checkpoint, **overrides)
    tree_trainer, tree_config = KINDS[kind][2:]
    updates, completions, trainer = run(
        tree_trainer, tree_config, checkpoint, tree_mode=mode, **(tree_fields or {}), **overrides
    )
    assert completions == ref_completions, "the two trainers did not train on the same rollouts"
    (assert_grads_close if dtype == torch.float64 else assert_update_close)(updates, ref_updates)
    return trainer


LOSS_SETTINGS = {
    "grpo": {},
    "bnpo": {"gradient_accumulation_steps": 1},  # normalised per micro-batch: only one micro-batch is comparable
    "dr_grpo": {},
    "dapo": {},
    "luspo": {"importance_sampling_level": "sequence"},
    "cispo": {},
    "sapo": {},
    "vespo": {},
}


@pytest.mark.parametrize("mode", ["packed", "dfs"])
@pytest.mark.parametrize("loss_type", list(LOSS_SETTINGS))
def test_grpo_loss_types_match_trl(checkpoint, loss_type, mode):
    """beta > 0 (reference model), num_iterations = 2, gradient accumulation, checkpointing on."""
    trainer = compare("grpo", checkpoint, mode, loss_type=loss_type, **LOSS_SETTINGS[loss_type])
    assert trainer.args.gradient_checkpointing


@pytest.mark.parametrize("mode", ["packed", "dfs"])
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_fp32_update_matches_trl(checkpoint, kind, mode):
    compare(kind, checkpoint, mode, dtype=torch.float32)


@pytest.mark.parametrize("mode", ["packed", "dfs"])
def test_rloo_matches_trl(checkpoint, mode):
    compare("rloo", checkpoint, mode)


@pytest.mark.parametrize("kind,mode,overrides", [
    ("grpo", "packed", {"gradient_accumulation_steps": 4}),
    ("grpo", "dfs", {"gradient_accumulation_steps": 2, "steps_per_generation": 4, "loss_type": "dapo"}),
    ("rloo", "packed", {"gradient_accumulation_steps": 4}),
])
def test_accumulation_windows_match_trl(checkpoint, kind, mode, overrides):
    """Micro-batches of 2 rows cut every group of 4; tree_window='accumulation' computes each
    optimizer step's micro-steps as one set of trees and gives TRL's update on TRL's own micro-batches
    (tree_shuffle='rows'), also with two optimizer steps per generation batch."""
    trainer = compare(kind, checkpoint, mode, tree_fields={"tree_window": "accumulation", "tree_shuffle": "rows"},
                      per_device_train_batch_size=2, **overrides)
    logs = [h for h in trainer.state.log_history if "tree/rank_imbalance" in h]
    assert logs and all(h["tree/dedup_ratio"] > 1.5 for h in logs), "the windows did not fuse the micro-steps"
    # the loss written out (separable_loss): forward and backward at once; RLOO's per-sequence loss
    # in one pass where its sequences stay in one call (packed)
    assert all(h["tree/passes"] == 1.0 for h in logs), [h["tree/passes"] for h in logs]


@pytest.mark.parametrize("kind,mode", [("grpo", "dfs"), ("rloo", "packed"), ("rloo", "dfs")])
def test_two_pass_bridge_still_matches_trl(checkpoint, kind, mode):
    """tree_one_pass=False: the two-pass bridge where the one-pass loss would serve (windows and the
    micro-step path); the same update."""
    trainer = compare(kind, checkpoint, mode, tree_fields={"tree_one_pass": False, "tree_window": "accumulation",
                                                            "tree_shuffle": "rows"}, per_device_train_batch_size=2,
                      gradient_accumulation_steps=4)
    assert {h["tree/passes"] for h in trainer.state.log_history if "tree/passes" in h} == {2.0}


@pytest.mark.parametrize("mode", ["packed", "dfs"])
def test_grpo_lora_matches_trl(checkpoint, mode):
    """LoRA through ``peft_config``; the reference is the base model with the adapter disabled."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    compare("grpo", checkpoint, mode, trainer_kwargs={"peft_config": lora}, learning_rate=0.5)


def test_grpo_token_budget_and_dfs_chunks(checkpoint):
    """A budget smaller than a micro-batch: several calls, two-pass backward; dfs with 3-token chunks."""
    trainer = compare("grpo", checkpoint, "packed", tree_fields={"tree_token_budget": 40})
    assert max(trainer.state.log_history[0]["tree/calls"], 0) > 1
    compare("grpo", checkpoint, "dfs", tree_fields={"tree_token_budget": 64, "tree_chunk_size": 3})
    compare("grpo", checkpoint, "dfs", tree_fields={"tree_memory_budget": 0})  # smallest groups


def test_grpo_without_checkpointing_and_with_entropy_bonus(checkpoint):
    """Packed mode differentiates the entropies too (TRL's entropy bonus; normalised per micro-batch,
    so compared on one micro-batch per step)."""
    compare("grpo", checkpoint, "packed", gradient_checkpointing=False, entropy_coef=0.05, gradient_accumulation_steps=1)


def test_tree_mode_off_is_trl_bit_for_bit(checkpoint):
    ref_updates, ref_completions = reference("grpo", checkpoint)
    updates, completions, _ = run(TreeGRPOTrainer, TreeGRPOConfig, checkpoint, tree_mode="off")
    assert completions == ref_completions
    for name, u in ref_updates.items():
        assert torch.equal(updates[name], u), name


def test_metrics_logged(checkpoint):
    _, _, trainer = run(TreeGRPOTrainer, TreeGRPOConfig, checkpoint, max_steps=1, gradient_accumulation_steps=1)
    logs = trainer.state.log_history[0]
    for key in ("tree/dedup_ratio", "tree/unique_tokens", "tree/total_tokens", "tree/fwd_bwd_time", "tree/padded_calls"):
        assert key in logs, key
    assert logs["tree/total_tokens"] > logs["tree/unique_tokens"] > 0
    assert logs["tree/dedup_ratio"] == pytest.approx(logs["tree/total_tokens"] / logs["tree/unique_tokens"])
    assert logs["tree/padded_calls"] == 0  # GRPO groups share their prompts: the tree pays


@pytest.mark.parametrize("mode", ["packed", "dfs"])
def test_multi_turn_rollouts_share_turns(checkpoint, mode):
    """``rollout_func`` with a tool mask: trajectories sharing turns share nodes, and train exactly."""
    settings = dict(trainer_kwargs={"rollout_func": multi_turn_rollout}, max_completion_length=64)
    trainer = compare("grpo", checkpoint, mode, **settings)
    logs = trainer.state.log_history[0]
    # groups of 4 sharing a prompt only would give T/U < 4 / (1 + 3 * completion/prompt share)
    prompt_only = _prompt_only_ratio(trainer)
    assert logs["tree/dedup_ratio"] > prompt_only * 1.1


def _prompt_only_ratio(trainer) -> float:
    """T/U if a group shared its prompt and nothing else (for the multi-turn test)."""
    rollout = multi_turn_rollout(["count the a letters in banana 0"] * 4, trainer)
    p = len(rollout["prompt_ids"][0])
    comps = [len(c) for c in rollout["completion_ids"]]
    total = sum(p + c for c in comps)
    return total / (p + sum(comps))


# ---------------------------------------------------------------- refusals and unit pieces
def test_refusals(checkpoint):
    with pytest.raises(ValueError, match="tree_mode must be one of"):
        TreeGRPOConfig(output_dir="/tmp/unused", tree_mode="tree")
    with pytest.raises(ValueError, match="trainer cannot, because its backward path is fixed per mode"):
        TreeGRPOConfig(output_dir="/tmp/unused", tree_mode="auto")
    with pytest.raises(ValueError, match="tree_token_budget must be a positive int"):
        TreeGRPOConfig(output_dir="/tmp/unused", tree_token_budget=0)
    with pytest.raises(ValueError, match="tree_memory_budget must be a non-negative int"):
        TreeGRPOConfig(output_dir="/tmp/unused", tree_memory_budget=-1)
    with pytest.raises(ValueError, match="tree_shuffle must be one of"):
        TreeGRPOConfig(output_dir="/tmp/unused", tree_shuffle="tokens")
    # an entropy bonus in dfs mode is no longer refused: tests/test_stock_parity.py compares it with TRL


def test_plain_trl_config_is_accepted(checkpoint):
    _, _, trainer = run(TreeGRPOTrainer, GRPOConfig, checkpoint, max_steps=1)
    assert isinstance(trainer.args, TreeGRPOConfig) and trainer.args.tree_mode == "packed"


def test_padded_rows_round_trip():
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 0], [3, 4, 5, 6, 9, 10, 11]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    rows = PaddedRows.from_padded(ids, mask, 3)
    assert [s.tolist() for s in rows.sequences] == [[5, 6, 7, 8], [3, 4, 5, 6, 9, 10, 11]]
    assert rows.score_from == [2, 4]
    flat = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])]
    out = rows.to_padded([torch.cat(flat[::-1])], [[1, 0]])
    assert out.tolist() == [[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]]
    assert [h.tolist() for h in rows.host_sequences()] == [[5, 6, 7, 8], [3, 4, 5, 6, 9, 10, 11]]  # read back once
    again = PaddedRows.from_host(rows.host_sequences(), rows.score_from, ids.device)  # one upload for all rows
    assert [s.tolist() for s in again.sequences] == [s.tolist() for s in rows.sequences] and again.host is not None
    assert again.rows.tolist() == [0, 0, 1, 1, 1] and again.cols.tolist() == [0, 1, 0, 1, 2]
    with pytest.raises(ValueError, match="not one contiguous run"):
        PaddedRows.from_padded(ids, torch.tensor([[1, 0, 1, 1, 1, 1, 0], [1] * 7]), 3)
    with pytest.raises(ValueError, match="no prompt token"):
        PaddedRows.from_padded(ids, torch.tensor([[0, 0, 0, 0, 1, 1, 0], [1] * 7]), 3)


def test_group_preserving_plan():
    groups = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    for costs in (None, [100, 10, 90, 20]):
        plan = plan_micro_batches(groups, 2, costs, generator=torch.Generator().manual_seed(1))
        assert sorted(i for b in plan for i in b) == list(range(16)) and all(len(b) == 8 for b in plan)
        for b in plan:  # every group whole in one micro-batch
            assert all(set(g) <= set(b) or not set(g) & set(b) for g in groups)
    plan = plan_micro_batches(groups, 2, [100, 10, 90, 20], generator=torch.Generator().manual_seed(1))
    loads = sorted(sum([100, 10, 90, 20][k] for k, g in enumerate(groups) if g[0] in b) for b in plan)
    assert loads == [110, 110]
    with pytest.raises(ValueError, match="equal micro-batches"):
        plan_micro_batches(groups, 3)
    prompt_ids = torch.tensor([[0, 1, 2], [3, 1, 2], [0, 1, 2], [5, 6, 7]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    assert prompt_groups(prompt_ids, prompt_mask) == [[0, 2], [1], [3]]


def test_calls_respect_the_budget():
    from trl_tree import PrefixForest

    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 7, 7, 7, 7], [8, 8, 8], [1, 2, 3, 4, 6]]
    for budget in (3, 6, 9, 12, 100, None):
        calls = split_into_calls(seqs, budget)
        assert split_into_calls([np.array(x) for x in seqs], budget) == calls  # int arrays: the same calls
        assert [i for c in calls for i in c] == sorted(range(5), key=seqs.__getitem__)  # trie order
        if budget is None:
            assert len(calls) == 1
            continue
        for c in calls:
            unique = PrefixForest.from_sequences([seqs[i] for i in c]).num_unique_tokens
            assert unique <= budget or len(c) == 1


def test_grpo_with_compiled_layers_matches_trl(checkpoint, monkeypatch):
    """``tree_compile_layers=True``: the policy's and the reference model's layers are compiled
    (``aot_eager`` on CPU) and the update is still TRL's (float64)."""
    import torch._dynamo

    from trl_tree.engine import compile as tree_compile

    monkeypatch.setattr(tree_compile, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    try:
        trainer = compare("grpo", checkpoint, "packed", tree_fields={"tree_compile_layers": True})
        for model in (trainer.model, trainer.ref_model):
            children = [c for layer in tree_compile.decoder_layers(model) for c in layer.children()]
            assert children and all(c._compiled_call_impl is not None for c in children)
        # tree_mode="off" compiles too (at construction): TRL's own step on the same layers, for like-for-like
        # timings (its update is the reference's above; training it again would only compile again)
        from datasets import Dataset
        from transformers import PreTrainedTokenizerFast

        off = TreeGRPOTrainer(model=checkpoint, reward_funcs=reward_a,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                              args=TreeGRPOConfig(output_dir=f"{checkpoint}/off", tree_mode="off",
                                                  tree_compile_layers=True, use_cpu=True, bf16=False, report_to="none",
                                                  per_device_train_batch_size=8, num_generations=4),
                              processing_class=PreTrainedTokenizerFast.from_pretrained(checkpoint))
        assert all(c._compiled_call_impl is not None for layer in tree_compile.decoder_layers(off.model)
                   for c in layer.children())
    finally:
        torch._dynamo.reset()
    with pytest.raises(ValueError, match="tree_compile_layers must be True or False"):
        TreeGRPOConfig(output_dir="x", use_cpu=True, tree_compile_layers="yes")


@pytest.mark.parametrize("mode,buckets", [("packed", False), ("packed", True), ("dfs", False), ("dfs", True)],
                         ids=["exact", "buckets", "dfs", "dfs-buckets"])
def test_grpo_with_cuda_graphs_matches_trl(checkpoint, monkeypatch, mode, buckets):
    """``tree_cuda_graphs=True``: with num_iterations = 2 every micro-batch's layout comes back, so its
    second pass replays the captured graphs (the CPU stand-in of ``trl_tree.engine.graphs``; in dfs mode the
    walk's units, ``trl_tree.engine.dfs.graphs``); the update is still TRL's (float64), gradient
    accumulation included."""
    from trl_tree.engine import graphs

    monkeypatch.setattr(graphs, "CPU_STAND_IN", graphs.EagerReplay)
    if buckets:  # only the padded graphs are captured: the update runs through them, as with free lengths
        monkeypatch.setattr(graphs, "EXACT_LAYOUTS", False)
    trainer = compare("grpo", checkpoint, mode,
                      tree_fields={"tree_cuda_graphs": True, "tree_cuda_graph_buckets": buckets})
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert graphs._RUNNERS[model].captures > 0
    if mode == "dfs" and buckets:
        from trl_tree.engine.dfs.graphs import unit_graph_stats

        stats = unit_graph_stats(model)
        assert stats["padded"] > 0 and stats["replayed"] > 0
    with pytest.raises(ValueError, match="tree_keep_graph=True .* replayed units"):
        TreeGRPOConfig(output_dir="x", use_cpu=True, tree_cuda_graphs=True, tree_mode="dfs", tree_keep_graph=True)
    with pytest.raises(ValueError, match="tree_cuda_graphs must be True or False"):
        TreeGRPOConfig(output_dir="x", use_cpu=True, tree_cuda_graphs="yes")
    with pytest.raises(ValueError, match="tree_cuda_graph_buckets must be True or False"):
        TreeGRPOConfig(output_dir="x", use_cpu=True, tree_cuda_graph_buckets=1)


@pytest.mark.parametrize("wrapper", ["FSDP", "DEEPSPEED"])
def test_sharded_wrappers_are_refused_where_the_tree_averages_gradients_itself(wrapper, monkeypatch):
    """tree_cuda_graphs, tree_mode='dfs', tree_token_budget and accumulation windows synchronise
    gradients themselves, which is done for DDP, FSDP2 and DeepSpeed (ZeRO 1-3; not graphs under a
    sharding wrapper); under FSDP1 they are refused at construction, with the field to change, and so
    is a DeepSpeed too old for the tree's one reduction per step."""
    from types import SimpleNamespace

    from trl_tree.data.tiny import tiny_model
    from trl_tree.distributed import deepspeed as zero
    from trl_tree.trainers.online.mixin import TreeTrainerMixin

    def check(fsdp2=False, zero_stage=2, **fields):
        args = SimpleNamespace(**{"tree_mode": "packed", "tree_token_budget": None, "tree_cuda_graphs": False,
                                  "tree_cuda_graph_buckets": False, "tree_attn_backend": "auto", "tree_window": "auto",
                                  "tree_shuffle": "groups", "per_device_train_batch_size": 4,
                                  "gradient_accumulation_steps": 1, "steps_per_generation": 1, "bf16": False,
                                  "fp16": False, **fields})
        fake = TreeTrainerMixin()  # the mixin's own checks, on a stand-in trainer's fields
        fake.args, fake.model, fake.num_generations = args, tiny_model(), 4
        plugin = SimpleNamespace(zero_stage=zero_stage) if wrapper == "DEEPSPEED" else None
        fake.accelerator = SimpleNamespace(distributed_type=SimpleNamespace(value=wrapper), num_processes=2,
                                           is_fsdp2=fsdp2, state=SimpleNamespace(deepspeed_plugin=plugin))
        fake._check_tree_support()
        return fake

    monkeypatch.setattr(zero, "missing_support", lambda *accelerator: None)  # DeepSpeed need not be installed here
    check()  # packed, no budget, no graphs: the wrapper's own backward runs
    with pytest.raises(ValueError, match=f"tree_cuda_graphs .* not {'DeepSpeed ZeRO-2' if wrapper == 'DEEPSPEED' else 'FSDP1'}"):
        check(tree_cuda_graphs=True)
    if wrapper == "FSDP":  # FSDP1
        for fields in ({"tree_mode": "dfs"}, {"tree_token_budget": 4096}):
            with pytest.raises(ValueError, match="tree_mode='dfs' and tree_token_budget .* not FSDP1"):
                check(**fields)
        with pytest.raises(ValueError, match="tree_window='accumulation' .* not FSDP1"):
            check(tree_window="accumulation")
        assert not check()._windows_on()  # 'auto' runs micro-step trees there
        # FSDP2: the engine's backward runs inside trl_tree.distributed.fsdp.gathered
        for fields in ({"tree_mode": "dfs"}, {"tree_token_budget": 4096}, {"tree_window": "accumulation"}):
            assert check(fsdp2=True, **fields)._windows_on() == (fields.get("tree_window") != "micro_step")
        with pytest.raises(ValueError, match="tree_cuda_graphs .* not FSDP"):
            check(fsdp2=True, tree_cuda_graphs=True)
    else:  # DeepSpeed, every ZeRO stage: gradients kept local and reduced once per step (distributed/deepspeed.py)
        for stage in (1, 2, 3):
            for fields in ({"tree_mode": "dfs"}, {"tree_token_budget": 4096}, {"tree_window": "accumulation"}, {}):
                assert check(zero_stage=stage, **fields)._windows_on()
        monkeypatch.setattr(zero, "missing_support", lambda *accelerator: "DeepSpeed 0.16 has no engine.coalesce_grad_reduction")
        with pytest.raises(ValueError, match="coalesce_grad_reduction.*tree_mode='off'"):
            check(zero_stage=3)
        assert check(tree_mode="off") is not None  # stock's path needs nothing of it
