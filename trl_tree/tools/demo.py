"""The main job on an embedded default: a short tree GRPO run on CPU, against stock GRPO.

    python -m trl_tree            # or: trl-tree-demo
    python -m trl_tree --algo ppo # the same with TreePPOTrainer (a critic of its own), against its untreed step
    trl-tree demo --algo rloo     # TreeRLOOTrainer against trl.RLOOTrainer
    python -m trl_tree --algo sft # TreeSFTTrainer on per-turn agent conversations against trl.SFTTrainer
    python -m trl_tree --algo dpo # TreeDPOTrainer on pairs sharing their prompts against trl.DPOTrainer

Builds a tiny Qwen2-shaped policy in code (saved to a temporary directory; nothing downloaded),
trains it with ``TreeGRPOTrainer`` on a toy task whose reward (the share of the letter 'a' in the
answer) rises within a few steps, printing per step the reward, the tree's T/U and the time of the
policy's forward+backward (generation excluded). Then it runs the same steps with
``tree_mode="off"`` — exactly TRL's ``GRPOTrainer`` — and prints both times per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def train(mode: str, steps: int, checkpoint: str, out_dir: str, num_generations: int = 8, seed: int = 0,
          algo: str = "grpo"):
    """One GRPO (or PPO) run on the toy task; returns the Trainer's per-step logs."""
    import torch
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from transformers.trainer_callback import PrinterCallback
    from transformers.utils import logging as hf_logging

    from ..data.toy import TOY_PPO, reward_letter_a, toy_prompts
    from ..trainers import (
        TreeGRPOConfig,
        TreeGRPOTrainer,
        TreePPOConfig,
        TreePPOTrainer,
        TreeRLOOConfig,
        TreeRLOOTrainer,
    )

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    config_cls, trainer_cls = {"ppo": (TreePPOConfig, TreePPOTrainer), "rloo": (TreeRLOOConfig, TreeRLOOTrainer)}.get(
        algo, (TreeGRPOConfig, TreeGRPOTrainer))
    ppo = dict(critic="separate", **TOY_PPO) if algo == "ppo" else {}
    args = config_cls(
        output_dir=out_dir, tree_mode=mode, max_steps=steps, per_device_train_batch_size=2 * num_generations,
        num_generations=num_generations, max_completion_length=24, learning_rate=3e-3, beta=0.0,
        bf16=False, use_cpu=not torch.cuda.is_available(), logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=seed, **ppo,
    )
    trainer = trainer_cls(
        model=checkpoint, reward_funcs=reward_letter_a, args=args,
        train_dataset=Dataset.from_dict({"prompt": toy_prompts()}),
        processing_class=PreTrainedTokenizerFast.from_pretrained(checkpoint),
    )
    trainer.remove_callback(PrinterCallback)  # the per-step dicts; the demo prints its own table
    trainer.train()
    return [h for h in trainer.state.log_history if "reward" in h]


def train_offline(algo: str, mode: str, steps: int, checkpoint: str, out_dir: str, seed: int = 0) -> list[dict]:
    """One SFT or DPO run on the toy agent data (per-turn samples of conversations; preference pairs,
    two per prompt) with ``tree_shuffle='groups'``; ``mode='off'`` is stock's trainer in TRL's order.
    Returns the Trainer's per-step logs."""
    import torch
    from datasets import Dataset, disable_progress_bars
    from transformers.trainer_callback import PrinterCallback
    from transformers.utils import logging as hf_logging

    from ..data.sft_data import expand_turns
    from ..data.toy import toy_conversations, toy_preferences
    from ..trainers import TreeDPOConfig, TreeDPOTrainer, TreeSFTConfig, TreeSFTTrainer

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    disable_progress_bars()  # the datasets' tokenisation bars: the demo prints its own table
    common = dict(output_dir=out_dir, tree_mode=mode, tree_shuffle="rows" if mode == "off" else "groups",
                  max_steps=steps, per_device_train_batch_size=8, lr_scheduler_type="constant", bf16=False,
                  use_cpu=not torch.cuda.is_available(), logging_steps=1, report_to="none", save_strategy="no",
                  disable_tqdm=True, seed=seed)
    if algo == "sft":
        data = [sample for c in toy_conversations(64) for sample in expand_turns(c)]
        trainer = TreeSFTTrainer(model=checkpoint, args=TreeSFTConfig(learning_rate=2e-3, max_length=None, **common),
                                 train_dataset=Dataset.from_list(data))
    else:
        trainer = TreeDPOTrainer(model=checkpoint, args=TreeDPOConfig(learning_rate=5e-4, beta=0.1, **common),
                                 train_dataset=Dataset.from_list(toy_preferences(8 * steps, pairs_per_prompt=2)))
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h and "tree/fwd_bwd_time" in h]


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Train a tiny built-in model on the CPU with a tree trainer (GRPO by default; RLOO, PPO, SFT or DPO with "
        "--algo), then time the same steps without the tree (stock TRL, or the trainer's tree_mode='off' for PPO), "
        "and print both step times. Nothing is downloaded"))
    parser.add_argument("--algo", default="grpo", choices=("grpo", "rloo", "ppo", "sft", "dpo"),
                        help="grpo: TreeGRPOTrainer against trl.GRPOTrainer; rloo: TreeRLOOTrainer against "
                        "trl.RLOOTrainer; ppo: TreePPOTrainer (policy and a separate critic over the tree) against its "
                        "tree_mode='off' step; sft / dpo: TreeSFTTrainer / TreeDPOTrainer with tree_shuffle='groups' "
                        "against trl.SFTTrainer / trl.DPOTrainer in TRL's order")
    parser.add_argument("--steps", type=int, default=None, help="tree steps (default: 12; 30 for sft and dpo)")
    parser.add_argument("--stock-steps", type=int, default=4, help="stock GRPO steps, for the timing")
    parser.add_argument("--mode", default="packed", choices=("packed", "dfs"))
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: the machine's cores, at most 8). Fixed, so that the "
                        "two runs are timed alike; the times printed are medians with their range over the steps")
    args = parser.parse_args(argv)

    import warnings

    import torch

    from ..data.toy import TOY_PPO, build_tiny_policy, learning_line

    warnings.filterwarnings("ignore", category=FutureWarning)
    threads = args.threads or min(os.cpu_count() or 1, 8)
    torch.set_num_threads(threads)
    offline = args.algo in ("sft", "dpo")
    args.steps = args.steps or (30 if offline else 12)
    if offline:
        return _offline_demo(args, threads)

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_tiny_policy(os.path.join(tmp, "policy"))
        name = args.algo.upper()
        what = "policy+critic" if args.algo == "ppo" else "policy"
        stock = {"grpo": "stock GRPO (tree_mode='off', i.e. trl.GRPOTrainer)",
                 "rloo": "stock RLOO (tree_mode='off', i.e. trl.RLOOTrainer)"}.get(
            args.algo, "untreed PPO (tree_mode='off': the same trainer on the padded batch)")
        print(f"trl_tree demo: {name} on a toy task, tiny Qwen2-shaped policy (4 layers, fp32), tree_mode={args.mode}, "
              f"{threads} CPU thread(s)\n")
        print(f" step  reward   T/U   {what} fwd+bwd")
        # PPO's first steps train the critic alone (TOY_PPO's critic warm-up): not timed, marked in the table
        warmup = TOY_PPO["critic_warmup_steps"] if args.algo == "ppo" else 0
        tree_logs = train(args.mode, args.steps, checkpoint, os.path.join(tmp, "tree"), algo=args.algo)
        for i, h in enumerate(tree_logs, 1):
            ratio = f"{h['tree/dedup_ratio']:5.2f}" if i > warmup else "    -"
            print(f"{i:5d}  {h['reward']:6.3f}  {ratio}  {h['tree/fwd_bwd_time'] * 1e3:8.0f} ms"
                  f"{'  (critic warm-up)' if i <= warmup else ''}")
        print(f"\n{stock}, {args.stock_steps} steps for the timing:")
        stock_logs = train("off", args.stock_steps + warmup, checkpoint, os.path.join(tmp, "stock"), algo=args.algo)
        for i, h in enumerate(stock_logs, 1):
            print(f"{i:5d}  {h['reward']:6.3f}     -   {h['tree/fwd_bwd_time'] * 1e3:8.0f} ms"
                  f"{'  (critic warm-up)' if i <= warmup else ''}")

    timed = tree_logs[warmup:] or tree_logs
    (t_tree, lo_tree, hi_tree, n_tree), (t_stock, lo_stock, hi_stock, n_stock) = (per_step(timed),
                                                                                  per_step(stock_logs[warmup:]))
    print(
        f"\n{learning_line([h['reward'] for h in tree_logs])}; "
        f"T/U {statistics.mean(h.get('tree/dedup_ratio', 1.0) for h in timed):.2f}; {what} forward+backward per step "
        f"(median, range over steps): {'untreed' if args.algo == 'ppo' else 'stock'} {name} {t_stock:.0f} ms "
        f"({lo_stock:.0f}-{hi_stock:.0f}, {n_stock} steps), tree {name} {t_tree:.0f} ms ({lo_tree:.0f}-{hi_tree:.0f}, "
        f"{n_tree} steps) -> {t_stock / t_tree:.2f}x"
    )
    _say_if_unreliable((lo_tree, hi_tree), (lo_stock, hi_stock))
    return 0


def _say_if_unreliable(tree: tuple[float, float], stock: tuple[float, float]) -> None:
    """Say when the printed ratio is not to be trusted: the two runs are timed one after the other,
    so other work on the machine can slow either (measured: 12.47x printed for SFT while other jobs
    ran, 3.12x on a quiet machine). Signs of it: a run whose steps vary more than 1.5x, or a load
    average above the machine's cores (the demo's own threads fill them at most)."""
    spread = max([hi / lo for lo, hi in (tree, stock) if lo > 0] or [1.0])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    busy = load > (os.cpu_count() or 1) + 0.5 or spread > 1.5
    if busy:
        print(f"note: the step times varied up to {spread:.1f}x within a run and the load average is {load:.1f} on "
              f"{os.cpu_count()} core(s): other work on this machine is likely to skew the ratio; rerun on a quiet "
              "machine for a figure to quote")


def per_step(logs: list[dict]) -> tuple[float, float, float, int]:
    """Median, least and most of the steps' times (ms), and their number; the first step warms up
    allocators and kernels and is left out."""
    times = [h["tree/fwd_bwd_time"] * 1e3 for h in logs]
    times = times[1:] if len(times) > 1 else times
    return statistics.median(times), min(times), max(times), len(times)


def _offline_demo(args, threads: int) -> int:
    """``--algo sft|dpo``: the tree run (grouped samples) printed step by step, then stock's trainer
    in TRL's order timed on the same data."""
    from ..data.toy import build_tiny_policy, learning_line

    name = args.algo.upper()
    stock = f"stock {name} (tree_mode='off', i.e. trl.{name}Trainer, TRL's order)"
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_tiny_policy(os.path.join(tmp, "policy"), chat=True)
        what = "per-turn samples of agent conversations" if args.algo == "sft" else "preference pairs, two per prompt"
        print(f"trl_tree demo: {name} on {what}, tiny Qwen2-shaped policy (4 layers, fp32), tree_mode={args.mode}, "
              f"tree_shuffle='groups' (opt-in: it changes which samples share a step), {threads} CPU thread(s)\n")
        print(" step    loss   T/U   fwd+bwd")
        tree_logs = train_offline(args.algo, args.mode, args.steps, checkpoint, os.path.join(tmp, "tree"))
        for i, h in enumerate(tree_logs, 1):
            print(f"{i:5d}  {h['loss']:6.3f}  {h['tree/dedup_ratio']:5.2f}  {h['tree/fwd_bwd_time'] * 1e3:6.0f} ms")
        print(f"\n{stock}, {args.stock_steps} steps for the timing:")
        stock_logs = train_offline(args.algo, "off", args.stock_steps, checkpoint, os.path.join(tmp, "stock"))
        for i, h in enumerate(stock_logs, 1):
            print(f"{i:5d}  {h['loss']:6.3f}  {h['tree/dedup_ratio']:5.2f}  {h['tree/fwd_bwd_time'] * 1e3:6.0f} ms")
    (t_tree, lo_tree, hi_tree, n_tree) = per_step(tree_logs)
    (t_stock, lo_stock, hi_stock, n_stock) = per_step(stock_logs)
    print(f"\n{learning_line([h['loss'] for h in tree_logs], 'loss')}; "
          f"T/U {statistics.mean(h['tree/dedup_ratio'] for h in tree_logs):.2f}; forward+backward per step (median, "
          f"range over steps): stock {name} {t_stock:.0f} ms ({lo_stock:.0f}-{hi_stock:.0f}, {n_stock} steps), tree "
          f"{name} {t_tree:.0f} ms ({lo_tree:.0f}-{hi_tree:.0f}, {n_tree} steps) -> {t_stock / t_tree:.2f}x")
    _say_if_unreliable((lo_tree, hi_tree), (lo_stock, hi_stock))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
