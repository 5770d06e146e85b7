"""Every trainer under every engine and tree mode, launched on several CPU processes, each launch under a
watchdog: a hang is a failure with every rank's stack, in bounded time.

One command runs the whole matrix and writes its result::

    python tests/sharded_matrix.py --processes 2 4 --out docs/benchmarks/sharded_matrix_cpu.json

(``--engines ddp fsdp2 fsdp2_block zero2 zero3``; ``fsdp2_block``: FSDP2 with ``tree_gather='block'``, ``--subset ci``: the part CI runs, ``tests/test_sharded_matrix.py``).
A launch runs many combinations in one pair of interpreters (start-up and imports dominate on a CPU);
a combination that fails or hangs ends its launch, is recorded with its ranks' output, and the launch
goes on from the next one.

The rollouts give ranks different work on purpose (``uneven_rollout``): different completion lengths
per rank and place, groups whose completions branch at different depths, so that ranks own different
numbers of trees, calls and walk units — the case where collectives that depend on a rank's own work
stop lining up. Each combination records, per rank, whether it trained (``ok``: finite, moved, and
every rank holding the same parameters afterwards), was refused at construction with a reason
(``refused``), raised (``failed``) or hung (``hang``: the watchdog's stack dump, every rank).

Worker mode (under ``accelerate launch``, which the runner does): ``sharded_matrix.py --worker OUT
ENGINE COMBO...``.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ENGINES = ("ddp", "fsdp2", "fsdp2_block", "zero2", "zero3")
#: the engines whose sharded model is gathered block by block inside the calls (``tree_gather='block'``)
BLOCK_ENGINES = ("fsdp2_block",)
#: online trainers (with their accumulation windows) and offline ones (no windows)
ONLINE = ("grpo", "grpo_iter_kl", "rloo", "ppo_separate", "ppo_shared", "ppo_adapter")
OFFLINE = ("sft", "dpo")
MODES = ("packed", "dfs")
WINDOWS = ("micro_step", "accumulation", "budget")
#: the worker's ``tree_gather`` (set from its engine)
GATHER = "auto"
#: seconds one combination may take before the watchdog dumps every rank's stack and ends the launch
WATCHDOG_S = int(os.environ.get("TRL_TREE_MATRIX_WATCHDOG", "240"))


def all_combos() -> list[str]:
    combos = [f"{t}:{m}:{w}" for t in ONLINE for m in MODES for w in WINDOWS]
    combos += [f"{t}:{m}:{w}" for t in OFFLINE for m in MODES for w in ("micro_step", "budget")]
    combos += [f"async:{m}:budget" for m in MODES]
    return combos


def ci_combos(engine: str) -> list[str]:
    """CI's share: each trainer family in each mode under each engine, the window kinds spread over
    them so that every engine meets every kind (micro-step, accumulation window, token budget)."""
    windows = WINDOWS[ENGINES.index(engine) % 3:] + WINDOWS[:ENGINES.index(engine) % 3]
    return [f"grpo_iter_kl:packed:{windows[0]}", f"grpo:dfs:{windows[1]}", f"ppo_separate:dfs:{windows[0]}",
            f"ppo_shared:packed:{windows[2]}", f"rloo:dfs:{windows[2]}", f"sft:dfs:budget", "dpo:packed:micro_step"]


# ---------------------------------------------------------------------- the launches (runner)
def accelerate_config(engine: str, directory: str, processes: int) -> str:
    """An Accelerate config for ``engine`` on ``processes`` CPU processes: the shipped ones where they run
    on a CPU (DDP's two-process one, FSDP2's), a ZeRO config that partitions every parameter."""
    if engine == "ddp":
        return os.path.join(ROOT, "examples/accelerate/cpu_2proc.yaml")
    if engine.startswith("fsdp2"):
        return os.path.join(ROOT, "examples/accelerate/fsdp2.yaml")
    stage = int(engine[-1])
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    ds = {"zero_optimization": zero, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"}}
    path = os.path.join(directory, f"zero{stage}.json")
    with open(path, "w") as f:
        json.dump(ds, f)
    config = os.path.join(directory, f"zero{stage}.yaml")
    with open(config, "w") as f:
        f.write("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
                f"  deepspeed_config_file: {path}\n  zero3_init_flag: {stage == 3}\n"
                f"num_machines: 1\nnum_processes: {processes}\nmachine_rank: 0\n")
    return config


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_engine(engine: str, processes: int, combos: list[str], directory: str, log=print) -> dict:
    """Every combination of ``combos`` under ``engine`` on ``processes`` processes: {combo: result}."""
    os.makedirs(directory, exist_ok=True)
    config = accelerate_config(engine, directory, processes)
    results: dict[str, dict] = {}
    todo = list(combos)
    while todo:
        out = os.path.join(directory, f"launch{len(results)}")
        os.makedirs(out, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONFAULTHANDLER": "1"}
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()),
               "--config_file", config, "--num_processes", str(processes), "--mixed_precision", "no",
               os.path.abspath(__file__), "--worker", out, engine, *todo]
        started = time.time()
        # the backstop: every combination's own watchdog, plus start-up
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=WATCHDOG_S * (len(todo) + 1) + 120)
            output = done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            output = "".join(x.decode() if isinstance(x, bytes) else x for x in (e.stdout or "", e.stderr or ""))
        per_rank = _read_results(out, processes)
        finished = [c for c in todo if all(c in r for r in per_rank)]
        for combo in finished:
            results[combo] = _merge(combo, [r[combo] for r in per_rank])
            log(f"{engine} x{processes} {combo}: {results[combo]['status']}")
        todo = [c for c in todo if c not in finished]
        if not todo:
            break
        if any(results[c]["status"] == "failed" for c in finished):  # it raised on every rank: recorded
            continue
        # the launch ended early: the first unfinished combination failed or hung
        culprit = todo.pop(0)
        hung = "Timeout (0:" in output
        with open(os.path.join(out, "launch.log"), "w") as f:  # every rank's stack, whole
            f.write(output)
        results[culprit] = {"status": "hang" if hung else "failed", "seconds": round(time.time() - started, 1),
                            "ranks_started": [_started(out, r) for r in range(processes)], "output": output[-12000:],
                            "log": os.path.join(out, "launch.log")}
        log(f"{engine} x{processes} {culprit}: {results[culprit]['status']}")
    return results


def _read_results(out: str, processes: int) -> list[dict]:
    ranks = []
    for r in range(processes):
        path = os.path.join(out, f"rank{r}.jsonl")
        found = {}
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    entry = json.loads(line)
                    found[entry["combo"]] = entry
        ranks.append(found)
    return ranks


def _started(out: str, rank: int) -> str | None:
    path = os.path.join(out, f"rank{rank}.current")
    return open(path).read() if os.path.exists(path) else None


def _merge(combo: str, entries: list[dict]) -> dict:
    """One combination's ranks together: ``ok`` only where every rank trained finite, moved parameters
    and all hold the same parameters; a refusal must be every rank's."""
    statuses = {e["status"] for e in entries}
    result = {"status": statuses.pop() if len(statuses) == 1 else "failed",
              "seconds": max(e["seconds"] for e in entries)}
    if result["status"] == "ok":
        digests = {e["digest"] for e in entries}
        if len(digests) != 1:
            result.update(status="failed", message="the ranks hold different parameters after training")
        elif not all(e["moved"] and e["finite"] for e in entries):
            result.update(status="failed", message="parameters did not move, or are not finite")
    messages = [e.get("message") for e in entries if e.get("message")]
    if messages:
        result.setdefault("message", messages[0][-3000:])
    return result


# ---------------------------------------------------------------------- one launch (worker)
def uneven_rollout(prompts, trainer):
    """Completions whose length and branching depend on the row's rank and place: a rank's rows
    share a head of 1-4 tokens (so trees branch at different depths) and run 2-9 tokens, no EOS —
    ranks own different numbers of trees, calls and walk units."""
    tok = trainer.processing_class
    rank = trainer.accelerator.process_index
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for i, prompt in enumerate(prompts):
        ids = tok(prompt)["input_ids"]
        shared = 1 + (rank + sum(ids)) % 4
        length = shared + 1 + (i * 3 + rank * 5) % (6 + rank % 2)
        head = [5 + (sum(ids) + k) % 20 for k in range(shared)]
        tail = [5 + (sum(ids) * 3 + i * 7 + rank * 11 + k * 5) % 40 for k in range(length - shared)]
        out["prompt_ids"].append(ids)
        out["completion_ids"].append(head + tail)
        out["logprobs"].append([0.0] * length)
    return out


def _online(trainer_kind: str, mode: str, window: str, checkpoint: str, out: str, processes: int):
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast

    from ddp_check import PROMPTS, reward_chars
    from trl_tree import TreeGRPOConfig, TreeGRPOTrainer, TreePPOConfig, TreePPOTrainer, TreeRLOOConfig, \
        TreeRLOOTrainer

    common = dict(output_dir=out, tree_mode=mode, tree_window="micro_step" if window == "budget" else window,
                  per_device_train_batch_size=2, num_generations=4, max_completion_length=12, learning_rate=0.05,
                  optim="sgd", max_steps=2, gradient_accumulation_steps=2 if processes >= 4 else 4,
                  use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
                  logging_steps=1, tree_gather=GATHER)
    if window == "budget":
        common["tree_token_budget"] = 24
    adapter = {}
    if trainer_kind.startswith("grpo"):
        cls, args = TreeGRPOTrainer, TreeGRPOConfig(
            loss_type="dapo", **({"num_iterations": 2, "beta": 0.04} if trainer_kind == "grpo_iter_kl" else {}),
            **common)
    elif trainer_kind == "rloo":
        cls, args = TreeRLOOTrainer, TreeRLOOConfig(**common)
    else:
        critic = trainer_kind.split("_")[1]
        cls, args = TreePPOTrainer, TreePPOConfig(critic=critic, kl_coef=0.1, **common)
        if critic == "adapter":
            from peft import LoraConfig

            adapter = {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])}
    # RLOO (TRL's RLOOTrainer takes no rollout function) generates with the tiny model: random lengths
    rollout = {} if trainer_kind == "rloo" else {"rollout_func": uneven_rollout}
    return cls(model=checkpoint, reward_funcs=reward_chars, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
               processing_class=PreTrainedTokenizerFast.from_pretrained(checkpoint), **rollout, **adapter)


def _offline(trainer_kind: str, mode: str, window: str, sft_checkpoint: str, out: str):
    from sft_harness import dataset, sft_tokenizer
    from test_dpo_trainer import pairs
    from transformers import AutoModelForCausalLM

    from trl_tree import TreeDPOConfig, TreeDPOTrainer, TreeSFTConfig, TreeSFTTrainer

    common = dict(output_dir=out, tree_mode=mode, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  learning_rate=0.5, optim="sgd", max_steps=2, use_cpu=True, bf16=False, report_to="none",
                  save_strategy="no", seed=0, disable_tqdm=True, gradient_checkpointing=False, tree_gather=GATHER)
    if window == "budget":
        common["tree_token_budget"] = 24
    model = AutoModelForCausalLM.from_pretrained(sft_checkpoint)
    if trainer_kind == "sft":
        return TreeSFTTrainer(model=model, args=TreeSFTConfig(**common), train_dataset=dataset("turns", n=12),
                              processing_class=sft_tokenizer())
    ref = AutoModelForCausalLM.from_pretrained(sft_checkpoint)
    return TreeDPOTrainer(model=model, ref_model=ref, args=TreeDPOConfig(**common), train_dataset=pairs(12),
                          processing_class=sft_tokenizer())


def _async(mode: str, out: str, policy: str):
    from datasets import Dataset

    from trl_tree import TreeAsyncGRPOConfig, TreeAsyncGRPOTrainer
    from trl_tree.data.toy import toy_prompts

    args = TreeAsyncGRPOConfig(output_dir=out, tree_mode=mode, max_steps=2, num_generations=4,
                               max_completion_length=16, learning_rate=0.01, token_budget=512, max_staleness=2,
                               use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1,
                               tree_gather=GATHER)

    def letter_a(completions, **kwargs):
        return [(c[-1]["content"] if c else "").count("a") / 8 for c in completions]

    prompts = [[{"role": "user", "content": p}] for p in toy_prompts(story_len=120)]
    return TreeAsyncGRPOTrainer(model=policy, reward_funcs=letter_a, args=args,
                                train_dataset=Dataset.from_dict({"prompt": prompts}), rollout_worker="local")


def _state(trainer):
    """(digest of every trained parameter, whole; their values) — collective under FSDP2 / ZeRO-3."""
    import torch

    from trl_tree.distributed.deepspeed import whole
    from trl_tree.distributed.fsdp import full_tensor

    model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
    extra = list(trainer.critic.parameters()) if hasattr(trainer, "critic") else []
    with whole(list(model.parameters()) + extra):
        tensors = [full_tensor(p.detach()).double().cpu() for n, p in sorted(model.named_parameters())
                   if p.requires_grad] + [full_tensor(p.detach()).double().cpu() for p in extra]
    digest = hashlib.sha256(b"".join(t.numpy().round(9).tobytes() for t in tensors)).hexdigest()[:16]
    return digest, tensors


def worker(out: str, engine: str, combos: list[str]) -> None:
    import torch
    from accelerate import PartialState

    from sft_harness import save_sft_checkpoint
    from trainer_harness import save_tiny_checkpoint

    global GATHER
    GATHER = "block" if engine in BLOCK_ENGINES else "auto"
    if engine.startswith("fsdp2"):
        from fsdp_trainer_check import emulate_fsdp2_on_cpu

        emulate_fsdp2_on_cpu()
    state = PartialState(cpu=True)
    rank, processes = state.process_index, state.num_processes
    checkpoint, sft_checkpoint = os.path.join(out, "tiny"), os.path.join(out, "sft_tiny")
    chat_policy = os.path.join(out, "chat_tiny")
    if state.is_main_process:  # written once, read by every rank
        from trl_tree.data.toy import build_tiny_policy

        save_tiny_checkpoint(checkpoint)
        save_sft_checkpoint(sft_checkpoint)
        build_tiny_policy(chat_policy, chat=True, every_character=False)
    state.wait_for_everyone()
    for combo in combos:
        with open(os.path.join(out, f"rank{rank}.current"), "w") as f:
            f.write(combo)
        trainer_kind, mode, window = combo.split(":")
        faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)  # a hang: every rank's stack, then the end
        started = time.time()
        entry = {"combo": combo, "rank": rank}
        run_dir = os.path.join(out, combo.replace(":", "-"))
        try:
            torch.manual_seed(0)
            try:
                if trainer_kind in OFFLINE:
                    trainer = _offline(trainer_kind, mode, window, sft_checkpoint, run_dir)
                elif trainer_kind == "async":
                    trainer = _async(mode, run_dir, chat_policy)
                else:
                    trainer = _online(trainer_kind, mode, window, checkpoint, run_dir, processes)
            except (ValueError, NotImplementedError) as e:  # a refusal at construction, with its reason
                entry.update(status="refused", message=str(e))
            else:
                _, before = _state(trainer)
                trainer.train()
                digest, after = _state(trainer)
                entry.update(status="ok", digest=digest,
                             moved=any(not torch.equal(a, b) for a, b in zip(before, after)),
                             finite=all(bool(t.isfinite().all()) for t in after))
                del trainer
        except Exception:
            entry.update(status="failed", message=traceback.format_exc())
            _write(out, rank, {**entry, "seconds": round(time.time() - started, 1)})
            raise  # the other ranks may be waiting in a collective: end the launch, the runner goes on
        finally:
            faulthandler.cancel_dump_traceback_later()
        _write(out, rank, {**entry, "seconds": round(time.time() - started, 1)})
        state.wait_for_everyone()


def _write(out: str, rank: int, entry: dict) -> None:
    with open(os.path.join(out, f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(entry) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--subset", choices=("all", "ci"), default="all")
    parser.add_argument("--combos", nargs="+", default=None, help="TRAINER:MODE:WINDOW, instead of the subset")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    parser.add_argument("--work", default=None, help="the launches' folder (default: a temporary one)")
    args = parser.parse_args(argv)
    import tempfile

    import torch

    work = args.work or tempfile.mkdtemp(prefix="trl_tree_matrix_")
    results = {"torch": torch.__version__, "watchdog_s": WATCHDOG_S, "runs": {}}
    for processes in args.processes:
        for engine in args.engines:
            combos = args.combos or (ci_combos(engine) if args.subset == "ci" else all_combos())
            key = f"{engine}x{processes}"
            results["runs"][key] = run_engine(engine, processes, combos, os.path.join(work, key))
    counts: dict[str, int] = {}
    for runs in results["runs"].values():
        for r in runs.values():
            counts[r["status"]] = counts.get(r["status"], 0) + 1
    results["counts"] = counts
    print(json.dumps(counts))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if set(counts) <= {"ok", "refused"} else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        sys.exit(main())
