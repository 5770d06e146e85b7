"""Run under ``accelerate launch`` with 2 CPU processes (tests/test_distributed.py does).

SFT and DPO (``main_sft``, ``main_dpo``): stock SFTTrainer, TreeSFTTrainer packed and dfs (its engine backward averages
the gradients by hand) and with ``tree_shuffle='groups'`` (the sampler under Accelerate's batch
sharding), per-turn samples, gradient accumulation; stock DPOTrainer and TreeDPOTrainer packed;
each rank's final parameters are written. The async GRPO trainer likewise (``main_async``): stock,
packed and dfs on one recorded stream.

Last, accumulation windows placing whole trees on ranks (``main_windows``): GRPO and PPO, packed
and dfs, on fixed rollouts whose prompt groups straddle the two processes; the test runs the same
global batch on one process and checks that the updates agree. ``ddp_check.py CHECKPOINT OUT
windows ROWS`` runs the windows alone, ``ROWS`` rows per micro-step over any number of processes
(the eight-process test: one row each).

Then TreePPOTrainer: a separate critic (off, packed, dfs) and a critic adapter under LoRA (off,
packed); the test checks that the ranks agree on policy and critic and that the tree equals the
untreed run (the critic's gradients are averaged by hand).

Trains the tiny policy a few steps with gradient accumulation in packed mode, in dfs mode (whose
backward runs inside the engine and synchronises gradients by hand) and in packed mode with
``tree_cuda_graphs`` (the call runs outside DDP, replays the CPU stand-in of a graph from each
micro-batch's second pass, and the trainer averages the gradients by hand), from the same seed on
the same rollouts, and writes each rank's final parameters; the test checks that the ranks agree
(gradients were averaged) and that dfs and graphs equal packed (the averaging is the same).
"""

import os
import sys

import torch
from datasets import Dataset

sys.path.insert(0, os.path.dirname(__file__))
from trainer_harness import PROMPTS, reward_a  # noqa: E402

from trl_tree import TreeGRPOConfig, TreeGRPOTrainer, TreePPOConfig, TreePPOTrainer
from trl_tree.engine import graphs  # noqa: E402
from trl_tree.bench.trainer import launcher_precision  # noqa: E402


def main(checkpoint: str, out_dir: str) -> None:
    from transformers import PreTrainedTokenizerFast

    graphs.CPU_STAND_IN = graphs.EagerReplay  # CPU: the stand-in runs everything a graph replay would
    for run in ("packed", "dfs", "graphs", "dfs-graphs"):
        mode = "packed" if run == "graphs" else run.split("-")[0]
        args = TreeGRPOConfig(
            output_dir=os.path.join(out_dir, run), tree_mode=mode, tree_cuda_graphs=run.endswith("graphs"),
            num_iterations=2, per_device_train_batch_size=4,
            num_generations=4, max_completion_length=8, learning_rate=0.05, optim="sgd", max_steps=2,
            gradient_accumulation_steps=2, beta=0.04, use_cpu=True, bf16=False, report_to="none",
            save_strategy="no", seed=0, disable_tqdm=True, model_init_kwargs={"dtype": torch.float64},
        )
        torch.manual_seed(0)
        trainer = TreeGRPOTrainer(model=checkpoint, reward_funcs=reward_a, args=args,
                                  train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                  processing_class=PreTrainedTokenizerFast.from_pretrained(checkpoint))
        trainer.train()
        rank = trainer.accelerator.process_index
        assert trainer.accelerator.num_processes == 2, "expected two processes"
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        if run.endswith("graphs"):  # the graphed path ran: layouts (or walk units) captured on the unwrapped model
            runner = graphs._RUNNERS[trainer.accelerator.unwrap_model(trainer.model)]
            params["captures"] = torch.tensor(runner.captures)
        torch.save(params, os.path.join(out_dir, f"{run}_rank{rank}.pt"))


def main_ppo(checkpoint: str, out_dir: str) -> None:
    from peft import LoraConfig
    from transformers import PreTrainedTokenizerFast

    for run in ("separate-off", "separate-packed", "separate-dfs", "adapter-off", "adapter-packed"):
        kind, mode = run.split("-")
        args = TreePPOConfig(
            output_dir=os.path.join(out_dir, run), tree_mode=mode, critic=kind, kl_coef=0.1, num_iterations=2,
            per_device_train_batch_size=4, num_generations=4, max_completion_length=8, learning_rate=0.05,
            optim="sgd", max_steps=2, gradient_accumulation_steps=2, tree_shuffle="rows", use_cpu=True, bf16=False,
            tree_window="micro_step",  # the per-micro-step paths; main_windows covers the windows
            report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
            model_init_kwargs={"dtype": torch.float64},
        )
        lora = {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])} if kind == "adapter" \
            else {}
        torch.manual_seed(0)
        trainer = TreePPOTrainer(model=checkpoint, reward_funcs=reward_a, args=args,
                                 train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                 processing_class=PreTrainedTokenizerFast.from_pretrained(checkpoint), **lora)
        trainer.train()
        assert trainer.accelerator.num_processes == 2, "expected two processes"
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        params.update({f"critic.{i}": p.detach().clone() for i, p in enumerate(trainer.critic.parameters())})
        torch.save(params, os.path.join(out_dir, f"{run}_rank{trainer.accelerator.process_index}.pt"))


def fixed_rollout(prompts, trainer):
    """Completions that depend only on the prompt and the row's place in the whole generation batch
    (process-major, as TRL gathers it), so 1 and 2 processes train on the same rows. Each is
    ``COMPLETION`` tokens long with no EOS: every micro-batch holds the same number of tokens, so
    per-micro-batch normalisers (PPO's) give the same update however rows are split."""
    tok = trainer.processing_class
    offset = trainer.accelerator.process_index * len(prompts)
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for i, prompt in enumerate(prompts):
        ids = tok(prompt)["input_ids"]
        place = offset + i
        head = [5 + (sum(ids) + k) % 20 for k in range(2)]  # shared by the group: the tree branches after it
        tail = [5 + (sum(ids) * 3 + place * 7 + k * 5) % 40 for k in range(COMPLETION - 2)]
        out["prompt_ids"].append(ids)
        out["completion_ids"].append(head + tail)
        out["logprobs"].append([0.0] * COMPLETION)
    return out


COMPLETION = 6

#: ``TRL_TREE_CHECK_GPU=1``: the runs train on the launch's GPUs (NCCL) in fp32 instead of on CPU
#: processes (gloo) in fp64 (tests/test_deepspeed_gpu.py)
ON_GPU = os.environ.get("TRL_TREE_CHECK_GPU") == "1"


def reward_chars(completions, **kwargs):
    """A reward that differs within every group of ``fixed_rollout``'s completions."""
    return [(sum(map(ord, c)) % 11) / 10 for c in completions]

#: accumulation windows over ranks: (algorithm, critic, tree_mode, tree_window)
WINDOW_RUNS = (
    ("grpo", None, "off", "auto"), ("grpo", None, "packed", "micro_step"), ("grpo", None, "packed", "accumulation"),
    ("grpo", None, "dfs", "accumulation"), ("grpo", None, "packed", "auto"),
    ("ppo", "separate", "off", "auto"), ("ppo", "separate", "packed", "accumulation"),
    ("ppo", "separate", "dfs", "accumulation"), ("ppo", "shared", "off", "auto"),
    ("ppo", "shared", "packed", "accumulation"),
)


def main_windows(checkpoint: str, out_dir: str, runs=WINDOW_RUNS, rows: int = 6) -> None:
    """Trees placed over ranks (``tree_window``): ``rows`` rows per micro-step in all (6: 3 per
    process on two), two micro-steps per optimizer step, groups of 4, so with 2 processes a group
    straddles them; the same global batch (12 rows) on 1 process. ``rows=8`` on eight processes
    (one row each): four groups for eight ranks, so half the ranks own no tree. Writes each run's
    trained parameters and its tree metrics."""
    for algo, critic, mode, window in runs:
        train_window_run(checkpoint, out_dir, algo, critic, mode, window, rows=rows)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # the two-pass bridge where the loss is separable too
        train_window_run(checkpoint, out_dir, "grpo", None, "dfs", "accumulation", tag="twopass", rows=rows,
                         tree_one_pass=False)


def train_window_run(checkpoint: str, out_dir: str, algo: str, critic: str | None, mode: str, window: str,
                     tag: str = "", dtype: torch.dtype | None = None, rows: int = 6, lora: bool = False,
                     save: bool = False, **extra) -> str:
    """One run of :func:`main_windows` (``extra``: more config fields, ``tag``: added to its name;
    ``rows``: per micro-step, all processes together; ``lora``: a LoRA adapter on the policy, which
    a critic adapter needs; ``save``: ``save_model`` to ``<output_dir>/final`` after training);
    returns the run's name. Saved: the full parameters (gathered under
    FSDP2), the critic's too, the tree metrics, the distributed type and whether the parameters
    were sharded."""
    from transformers import PreTrainedTokenizerFast

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    dtype = dtype or (torch.float32 if ON_GPU else torch.float64)
    assert rows % processes == 0, f"{rows} rows per micro-step do not split over {processes} processes"
    run = "-".join(x for x in (algo, critic, mode, window, tag) if x)
    common = dict(output_dir=os.path.join(out_dir, run), tree_mode=mode, tree_window=window,
                  per_device_train_batch_size=rows // processes, num_generations=4, max_completion_length=COMPLETION,
                  learning_rate=0.05, optim="sgd", max_steps=2, gradient_accumulation_steps=2, num_iterations=2,
                  use_cpu=not ON_GPU, bf16=False, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
                  logging_steps=1, model_init_kwargs={"dtype": dtype})
    common.update(extra)
    # TrainingArguments take the launcher's mixed precision unless bf16=True: set for this run only
    with launcher_precision("bf16" if common["bf16"] else "no"):
        if algo == "grpo":
            args = TreeGRPOConfig(loss_type="dapo", beta=0.04, **common)
            cls = TreeGRPOTrainer
        else:
            args = TreePPOConfig(**{"critic": critic, "kl_coef": 0.1, **common})
            cls = TreePPOTrainer
        torch.manual_seed(0)
        adapter = {}
        if lora:
            from peft import LoraConfig

            adapter = {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])}
        trainer = cls(model=checkpoint, reward_funcs=reward_chars, args=args, rollout_func=fixed_rollout,
                      train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                      processing_class=PreTrainedTokenizerFast.from_pretrained(checkpoint), **adapter)
        start = _trained_state(trainer, algo)
        trainer.train()
        if save:
            trainer.save_model(os.path.join(common["output_dir"], "final"))
    assert trainer.accelerator.num_processes == processes
    params = _trained_state(trainer, algo)
    metrics = {}
    for entry in trainer.state.log_history:  # this process's own logs
        for k, v in entry.items():
            if k.startswith("tree/"):
                metrics.setdefault(k, []).append(float(v))
    # the by-hand averages' all-reduces: on a communicator of their own, not the default group, where
    # TRL's metric gathers would queue behind them (distributed/exchange.reduction_group)
    groups = [a._all_reduce.keywords.get("group") for a in trainer.__dict__.get("_tree_averagers", {}).values()]
    own_group = [g is not None and g is not torch.distributed.group.WORLD for g in groups]
    torch.save({"params": params, "start": start, "metrics": metrics, "averagers_on_own_group": own_group,
                "distributed_type": trainer.accelerator.distributed_type.value,
                "sharded": any(type(p).__name__ == "DTensor" for p in trainer.model.parameters())},
               os.path.join(out_dir, f"win-{run}-p{processes}_rank{trainer.accelerator.process_index}.pt"))
    return run


def _trained_state(trainer, algo: str) -> dict:
    """Every trained parameter whole (gathered where FSDP2 shards it: every rank calls this), the
    critic's as ``critic.{i}``."""
    from trl_tree.distributed.fsdp import full_tensor

    with zero3_whole(trainer.model, *([trainer.critic] if algo == "ppo" else [])):
        params = {n: full_tensor(p).detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        if algo == "ppo":
            params.update({f"critic.{i}": full_tensor(p).detach().clone()
                           for i, p in enumerate(trainer.critic.parameters())})
    return params


def zero3_whole(*modules):
    """DeepSpeed ZeRO-3's partitioned parameters of ``modules`` gathered whole (a no-op elsewhere)."""
    from trl_tree.distributed.deepspeed import whole

    return whole([p for m in modules for p in m.parameters()])


def main_sft(out_dir: str) -> None:
    from accelerate import PartialState
    from sft_harness import dataset, save_sft_checkpoint, sft_tokenizer
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from trl_tree import TreeSFTConfig, TreeSFTTrainer

    state = PartialState(cpu=True)
    checkpoint = os.path.join(out_dir, "sft_tiny")
    if state.is_main_process:
        save_sft_checkpoint(checkpoint)
    state.wait_for_everyone()
    common = dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, learning_rate=0.5, optim="sgd",
                  max_steps=2, use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0,
                  disable_tqdm=True, gradient_checkpointing=False)
    runs = {"sft_stock": (SFTTrainer, SFTConfig, {}), "sft_packed": (TreeSFTTrainer, TreeSFTConfig, {}),
            "sft_dfs": (TreeSFTTrainer, TreeSFTConfig, {"tree_mode": "dfs"}),
            "sft_groups": (TreeSFTTrainer, TreeSFTConfig, {"tree_shuffle": "groups"})}
    for run, (trainer_cls, config_cls, tree) in runs.items():
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
        args = config_cls(output_dir=os.path.join(out_dir, run), **common, **tree)
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset("turns", n=6),
                              processing_class=sft_tokenizer())
        trainer.train()
        rank = trainer.accelerator.process_index
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        params["tokens"] = torch.tensor(trainer._total_train_tokens)
        torch.save(params, os.path.join(out_dir, f"{run}_rank{rank}.pt"))
    main_dpo(out_dir, checkpoint, common)


def main_dpo(out_dir: str, checkpoint: str, common: dict) -> None:
    """Stock DPOTrainer and TreeDPOTrainer (packed: the tree inside DDP's forward; dfs and CUDA graphs:
    past DDP's forward, the gradients averaged by hand) on two ranks."""
    from sft_harness import sft_tokenizer
    from test_dpo_trainer import pairs
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from trl_tree import TreeDPOConfig, TreeDPOTrainer

    runs = {"dpo_stock": (DPOTrainer, DPOConfig, {}), "dpo_packed": (TreeDPOTrainer, TreeDPOConfig, {}),
            # dfs in one pass (units of whole trees: dpo_walk), past DDP's forward
            "dpo_dfs": (TreeDPOTrainer, TreeDPOConfig, {"tree_mode": "dfs", "tree_memory_budget": 1 << 30}),
            # graphs: the policy's call past DDP (a replayed backward runs none of its hooks), averaged by hand
            "dpo_graphs": (TreeDPOTrainer, TreeDPOConfig, {"tree_cuda_graphs": True})}
    graphs.CPU_STAND_IN = graphs.EagerReplay
    for run, (trainer_cls, config_cls, tree) in runs.items():
        model, ref = (AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64) for _ in range(2))
        args = config_cls(output_dir=os.path.join(out_dir, run), **{**common, "per_device_train_batch_size": 2},
                          **tree)
        trainer = trainer_cls(model=model, ref_model=ref, args=args, train_dataset=pairs(8),
                              processing_class=sft_tokenizer())
        trainer.train()
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        torch.save(params, os.path.join(out_dir, f"{run}_rank{trainer.accelerator.process_index}.pt"))


def main_async(out_dir: str) -> None:
    """Stock AsyncGRPOTrainer and TreeAsyncGRPOTrainer (packed: inside DDP's forward; dfs: past it,
    the gradients averaged by hand) on two ranks: the same recorded stream, TRL's batcher placing
    one row per rank, two accumulated micro-batches; stock's hub kernel replaced by the exact SDPA
    stand-in of test_async_grpo_trainer.py."""
    import types

    from accelerate import PartialState
    from datasets import Dataset
    from test_async_grpo_trainer import VOCAB, ReadingTransfer, StubWorker, exact_varlen, forking_stream
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_grpo_trainer, packing

    from trl_tree.bench.common import bench_tokenizer
    from trl_tree.data.tiny import tiny_model
    from trl_tree.trainers.asynchronous.async_grpo import TreeAsyncGRPOConfig, TreeAsyncGRPOTrainer

    packing._flash_attn = lambda: types.SimpleNamespace(flash_attn_varlen_func=exact_varlen)
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None  # a CUDA lookup
    state = PartialState(cpu=True)
    checkpoint = os.path.join(out_dir, "async_tiny")
    if state.is_main_process:
        tiny_model("qwen2", vocab_size=VOCAB).save_pretrained(checkpoint)
    state.wait_for_everyone()
    common = dict(max_steps=1, learning_rate=0.5, optim="sgd", per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, token_budget=48, report_to="none", save_strategy="no",
                  logging_steps=1, use_cpu=True, bf16=False, max_staleness=8, disable_tqdm=True)
    runs = {"async_stock": (AsyncGRPOTrainer, AsyncGRPOConfig, {}),
            "async_packed": (TreeAsyncGRPOTrainer, TreeAsyncGRPOConfig, {"tree_mode": "packed"}),
            "async_dfs": (TreeAsyncGRPOTrainer, TreeAsyncGRPOConfig, {"tree_mode": "dfs"})}
    for run, (trainer_cls, config_cls, tree) in runs.items():
        args = config_cls(output_dir=os.path.join(out_dir, run), **common, **tree)
        trainer = trainer_cls(checkpoint, args=args, train_dataset=Dataset.from_dict({"prompt": ["p"] * 4}),
                              processing_class=bench_tokenizer(VOCAB), rollout_worker=StubWorker(forking_stream(3)),
                              weight_transfer=ReadingTransfer())
        trainer.train()
        params = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
        torch.save(params, os.path.join(out_dir, f"{run}_rank{trainer.accelerator.process_index}.pt"))


if __name__ == "__main__":
    if sys.argv[3:4] == ["windows"]:  # CHECKPOINT OUT windows ROWS: the windows alone
        main_windows(sys.argv[1], sys.argv[2], rows=int(sys.argv[4]))
    else:  # one launch for all (each launch costs two interpreter start-ups and imports)
        main_sft(sys.argv[2])
        main_async(sys.argv[2])
        main(sys.argv[1], sys.argv[2])
        main_ppo(sys.argv[1], sys.argv[2])
        main_windows(sys.argv[1], sys.argv[2])
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort an orderly interpreter exit ("terminate called ..."); all is saved
