"""Run under ``accelerate launch`` with 2 CPU processes (tests/test_distributed.py does).

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

from trl_tree import TreeGRPOConfig, TreeGRPOTrainer, TreePPOConfig, TreePPOTrainer, graphs  # noqa: E402


def main(checkpoint: str, out_dir: str) -> None:
    from transformers import PreTrainedTokenizerFast

    graphs.CPU_STAND_IN = graphs.EagerReplay  # CPU: the stand-in runs everything a graph replay would
    for run in ("packed", "dfs", "graphs"):
        mode = "packed" if run == "graphs" else run
        args = TreeGRPOConfig(
            output_dir=os.path.join(out_dir, run), tree_mode=mode, tree_cuda_graphs=run == "graphs",
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
        if run == "graphs":  # the graphed path ran: layouts captured on the unwrapped model
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


if __name__ == "__main__":  # one launch for both (each launch costs two interpreter start-ups and imports)
    main(sys.argv[1], sys.argv[2])
    main_ppo(sys.argv[1], sys.argv[2])
