"""Run under ``accelerate launch`` with ``examples/accelerate/fsdp2.yaml`` and 2 CPU processes
(tests/test_fsdp.py does): the tree trainers with their model prepared by Accelerate's own FSDP2
code (``fully_shard`` per decoder layer and at the root, its mixed-precision policy, its
parameter upcast), on the fixed rollouts of ``ddp_check.main_windows``.

One part of Accelerate's preparation cannot run on a CPU: its state turns an FSDP launch into
``MULTI_CPU`` when no accelerator is visible, so the FSDP plugin is dropped. ``emulate_fsdp2_on_cpu``
reproduces that one step by hand — the distributed type becomes FSDP with the plugin built from
the launcher's environment and the run's mixed precision, exactly as ``AcceleratorState`` does on
a GPU — and everything after it (``Accelerator.prepare`` → ``fsdp2_prepare_model``, autocast,
the trainer) is Accelerate's and the trainer's own code.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import ddp_check  # noqa: E402

#: (algorithm, tree_mode, tree_window, extra config, tag): the tree modes docs/multi_gpu.md lists for FSDP2
RUNS = (
    ("grpo", "off", "auto", {}, ""),
    ("grpo", "packed", "micro_step", {}, ""),
    ("grpo", "packed", "micro_step", {"tree_token_budget": 30}, "budget"),
    ("grpo", "dfs", "micro_step", {}, ""),
    ("grpo", "packed", "accumulation", {}, ""),
    ("grpo", "dfs", "accumulation", {}, ""),
    # gathered block by block inside the calls (tree_gather='block'), the ranks' calls lined up
    ("grpo", "packed", "micro_step", {"tree_token_budget": 30, "tree_gather": "block"}, "budget-block"),
    ("grpo", "dfs", "micro_step", {"tree_gather": "block"}, "block"),
    ("grpo", "packed", "accumulation", {"tree_gather": "block"}, "block"),
    ("grpo", "dfs", "accumulation", {"tree_gather": "block"}, "block"),
)
#: under Accelerate's ``mixed_precision: bf16``: stock (the bf16 rule's baseline) and the tree's paths
BF16_RUNS = (
    ("grpo", "off", "auto", {}, ""),
    ("grpo", "packed", "micro_step", {}, ""),
    ("grpo", "dfs", "accumulation", {}, ""),
    ("grpo", "packed", "accumulation", {"tree_token_budget": 64}, "budget"),
    ("grpo", "dfs", "micro_step", {"tree_gather": "block"}, "block"),
)

#: TreePPOTrainer under FSDP2, each critic kind: (critic, tree_mode, tree_window, extra config, tag); a
#: critic adapter needs a LoRA policy. The untreed PPO step (tree_mode='off') runs too: its separate
#: critic is sharded and reduced the same way
PPO_RUNS = (
    ("separate", "off", "auto", {}, ""),
    ("separate", "packed", "micro_step", {}, ""),
    ("separate", "dfs", "accumulation", {}, ""),
    # no KL penalty: no policy forward before the critic's first (on the policy's trunk, past its FSDP2 root)
    ("shared", "packed", "accumulation", {"kl_coef": 0.0}, ""),
    ("shared", "dfs", "micro_step", {"kl_coef": 0.0}, ""),
    ("adapter", "packed", "micro_step", {"lora": True}, ""),
    ("adapter", "dfs", "accumulation", {"lora": True}, ""),
    ("separate", "dfs", "accumulation", {"tree_gather": "block"}, "block"),
    ("shared", "packed", "micro_step", {"kl_coef": 0.0, "tree_gather": "block"}, "block"),
    ("adapter", "packed", "accumulation", {"lora": True, "tree_gather": "block"}, "block"),
)
#: under Accelerate's ``mixed_precision: bf16``, one optimizer step: the untreed step (the bf16 rule's
#: baseline) and the tree's, both against one process's fp32 step (fp32 weights: the value head draws the
#: same random init); the last also saves the trained critic (gathered whole from the shards)
PPO_BF16_RUNS = (
    ("separate", "off", "auto", {"max_steps": 1}, ""),
    ("separate", "packed", "accumulation", {"max_steps": 1, "save": True}, ""),
)


def emulate_fsdp2_on_cpu() -> None:
    """Make ``AcceleratorState`` take the FSDP branch it takes on a GPU (see the module docstring)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    original = AcceleratorState.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.distributed_type in (DistributedType.MULTI_CPU, DistributedType.NO) \
                and os.environ.get("ACCELERATE_USE_FSDP") == "true":
            plugin = kwargs.get("fsdp_plugin") or FullyShardedDataParallelPlugin()
            if self._mixed_precision != "no":
                plugin.set_mixed_precision(self._mixed_precision)
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    AcceleratorState.__init__ = init


def main(checkpoint: str, out_dir: str) -> None:
    emulate_fsdp2_on_cpu()
    for algo, mode, window, extra, tag in RUNS:
        ddp_check.train_window_run(checkpoint, out_dir, algo, None, mode, window, tag=f"fsdp{'-' + tag if tag else ''}",
                                   **extra)
    for algo, mode, window, extra, tag in BF16_RUNS:
        ddp_check.train_window_run(checkpoint, out_dir, algo, None, mode, window,
                                   tag=f"fsdp-bf16{'-' + tag if tag else ''}", dtype=torch.float32, bf16=True, **extra)


def main_ppo(checkpoint: str, out_dir: str) -> None:
    """TreePPOTrainer's runs (``PPO_RUNS``), float64, on the fixed rollouts of ``ddp_check``."""
    emulate_fsdp2_on_cpu()
    for critic, mode, window, extra, tag in PPO_RUNS:
        ddp_check.train_window_run(checkpoint, out_dir, "ppo", critic, mode, window,
                                   tag=f"fsdp{'-' + tag if tag else ''}", **extra)
    for critic, mode, window, extra, tag in PPO_BF16_RUNS:
        ddp_check.train_window_run(checkpoint, out_dir, "ppo", critic, mode, window,
                                   tag=f"fsdp-bf16{'-' + tag if tag else ''}", dtype=torch.float32, bf16=True, **extra)


#: four processes, one prompt group per optimizer step (4 rows): placed whole, a window would leave ranks
#: without a tree; under FSDP2 its tree is cut until every rank owns a piece; the last gathered block by
#: block (a policy and a separate critic, the four ranks' walks differing); (algo, critic, tree_mode, extra, tag)
IDLE_RANK_RUNS = (
    ("grpo", None, "dfs", {}, "fsdp-idle"),
    ("ppo", "shared", "packed", {"kl_coef": 0.0}, "fsdp-idle"),
    ("ppo", "separate", "dfs", {"kl_coef": 0.0}, "fsdp-idle"),
    ("ppo", "separate", "dfs", {"kl_coef": 0.0, "tree_gather": "block"}, "fsdp-idle-block"),
)


def main_idle(checkpoint: str, out_dir: str) -> None:
    emulate_fsdp2_on_cpu()
    for algo, critic, mode, extra, tag in IDLE_RANK_RUNS:
        ddp_check.train_window_run(checkpoint, out_dir, algo, critic, mode, "accumulation", tag=tag, rows=4,
                                   gradient_accumulation_steps=1, **extra)


#: a hybrid (Qwen3.5: gated DeltaNet beside attention; its model lists a vision block Accelerate's wrap policy
#: refused) under FSDP2, gathered block by block: (algo, tree_mode, tree_window, extra config, tag)
HYBRID_RUNS = (
    ("grpo", "packed", "accumulation", {"tree_gather": "block"}, "hybrid-block"),
    ("grpo", "dfs", "micro_step", {"tree_gather": "block"}, "hybrid-block"),
)


def main_hybrid(checkpoint: str, out_dir: str) -> None:
    """``HYBRID_RUNS`` with the delta rule in float64 (transformers' kernels compute in fp32 whatever the
    model's dtype, and their rounding moves with where chunks begin: ``mixers/deltanet.float64_kernels``)."""
    from trl_tree.data.tiny import tiny_model
    from trl_tree.engine.mixers.deltanet import float64_kernels

    emulate_fsdp2_on_cpu()
    with float64_kernels(tiny_model("qwen3_5")):
        for algo, mode, window, extra, tag in HYBRID_RUNS:
            ddp_check.train_window_run(checkpoint, out_dir, algo, None, mode, window, tag=f"fsdp-{tag}", **extra)


#: one process under FSDP2: a separate value model is sharded (over one rank) and its gradients still
#: reach it through the step's one reduction; (critic, tree_mode, tree_window)
PPO_ONE_PROCESS_RUNS = (("separate", "dfs", "micro_step"), ("separate", "packed", "accumulation"),
                        ("separate", "off", "auto"))


def main_ppo_one(checkpoint: str, out_dir: str) -> None:
    emulate_fsdp2_on_cpu()
    for critic, mode, window in PPO_ONE_PROCESS_RUNS:
        ddp_check.train_window_run(checkpoint, out_dir, "ppo", critic, mode, window, tag="fsdp1p")


def full_parameters(model) -> dict:
    """Every parameter whole (``full_tensor`` gathers a sharded one: a collective every rank makes)."""
    from trl_tree.distributed.fsdp import full_tensor

    return {n: full_tensor(p).detach().clone() for n, p in model.named_parameters()}


def main_offline(out_dir: str) -> None:
    """DPO and async GRPO under FSDP2 (float64): stock, packed, dfs on the runs of ddp_check's
    ``main_dpo`` / ``main_async``; each rank's full parameters are written."""
    import types

    from accelerate import PartialState
    from datasets import Dataset
    from sft_harness import save_sft_checkpoint, sft_tokenizer
    from test_async_grpo_trainer import VOCAB, ReadingTransfer, StubWorker, exact_varlen, forking_stream
    from test_dpo_trainer import pairs
    from trl import DPOConfig, DPOTrainer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_grpo_trainer, packing

    from trl_tree import TreeDPOConfig, TreeDPOTrainer
    from trl_tree.bench.common import bench_tokenizer
    from trl_tree.bench.trainer import launcher_precision
    from trl_tree.data.tiny import tiny_model
    from trl_tree.trainers.asynchronous.async_grpo import TreeAsyncGRPOConfig, TreeAsyncGRPOTrainer

    state = PartialState()
    dpo_checkpoint, async_checkpoint = os.path.join(out_dir, "dpo_tiny"), os.path.join(out_dir, "async_tiny")
    if state.is_main_process:
        save_sft_checkpoint(dpo_checkpoint)
        tiny_model("qwen2", vocab_size=VOCAB).save_pretrained(async_checkpoint)
    state.wait_for_everyone()
    common = dict(learning_rate=0.5, optim="sgd", max_steps=1, use_cpu=True, bf16=False, report_to="none",
                  save_strategy="no", seed=0, disable_tqdm=True, gradient_accumulation_steps=2)
    for mode in ("off", "packed", "dfs"):
        trainer_cls, config_cls = (DPOTrainer, DPOConfig) if mode == "off" else (TreeDPOTrainer, TreeDPOConfig)
        with launcher_precision("no"):  # fsdp2.yaml says bf16; the arguments take it: these runs are float64
            args = config_cls(output_dir=os.path.join(out_dir, f"dpo-{mode}"), per_device_train_batch_size=2, **common,
                              model_init_kwargs={"dtype": torch.float64},
                              **({} if mode == "off" else {"tree_mode": mode}),
                              **({"tree_memory_budget": 1 << 30} if mode == "dfs" else {}))  # one pass
            trainer = trainer_cls(model=dpo_checkpoint, args=args, train_dataset=pairs(8),
                                  processing_class=sft_tokenizer())
            trainer.train()
        torch.save({"params": full_parameters(trainer.model),
                    "distributed_type": trainer.accelerator.distributed_type.value},
                   os.path.join(out_dir, f"fsdp-dpo-{mode}_rank{state.process_index}.pt"))
    packing._flash_attn = lambda: types.SimpleNamespace(flash_attn_varlen_func=exact_varlen)
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None  # a CUDA lookup
    for mode in ("off", "packed", "dfs"):
        trainer_cls, config_cls = ((AsyncGRPOTrainer, AsyncGRPOConfig) if mode == "off"
                                   else (TreeAsyncGRPOTrainer, TreeAsyncGRPOConfig))
        with launcher_precision("no"):
            args = config_cls(output_dir=os.path.join(out_dir, f"async-{mode}"), per_device_train_batch_size=4,
                              token_budget=48, logging_steps=1, max_staleness=8,
                              model_init_kwargs={"dtype": torch.float64}, **common,
                              **({} if mode == "off" else {"tree_mode": mode}))
            trainer = trainer_cls(async_checkpoint, args=args, train_dataset=Dataset.from_dict({"prompt": ["p"] * 4}),
                                  processing_class=bench_tokenizer(VOCAB), rollout_worker=StubWorker(forking_stream(3)),
                                  weight_transfer=ReadingTransfer())
            trainer.train()
        torch.save({"params": full_parameters(trainer.model),
                    "distributed_type": trainer.accelerator.distributed_type.value},
                   os.path.join(out_dir, f"fsdp-async-{mode}_rank{state.process_index}.pt"))


if __name__ == "__main__":
    if sys.argv[3:] == ["ppo"]:
        main_ppo(sys.argv[1], sys.argv[2])
    elif sys.argv[3:] == ["ppo_one"]:
        main_ppo_one(sys.argv[1], sys.argv[2])
    elif sys.argv[3:] == ["hybrid"]:
        main_hybrid(sys.argv[1], sys.argv[2])
    elif sys.argv[3:] == ["idle"]:
        main_idle(sys.argv[1], sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])
        main_offline(sys.argv[2])
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort an orderly interpreter exit ("terminate called ..."); all is saved
