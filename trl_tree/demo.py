"""The main job on an embedded default: tree vs untreed on a tiny model, CPU, nothing downloaded.

    python -m trl_tree            # or: trl-tree-demo

Builds a small Qwen2-shaped model in code and two kinds of rollouts (GRPO groups and an agentic
multi-turn tree), then prints T, U, T/U, the largest |Δ log-prob| and relative gradient error of
the packed tree against the untreed per-sequence computation, and the forward+backward time of
both. The untreed side is the padded batch (how TRL runs it), timed on the same rollouts.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from . import PrefixForest, tree_backward, tree_logprobs
from .reference import right_pad, untreed_logprobs
from .tiny import grpo_group, tiny_model


def agentic_tree(vocab: int, system: int = 96, turns: int = 4, branches: int = 2, turn_len: int = 24,
                 seed: int = 0) -> list[list[int]]:
    """Trajectories sharing a system prompt and earlier turns, branching at every tool call."""
    rng = np.random.default_rng(seed)
    paths = [rng.integers(0, vocab, system).tolist()]
    for _ in range(turns):
        paths = [p + rng.integers(0, vocab, turn_len).tolist() for p in paths for _ in range(branches)]
    return paths


def _padded_step(model, seqs, loss_weight) -> float:
    """Untreed forward+backward as TRL runs it: right-padded batch, the model's own attention."""
    ids, mask = right_pad(seqs)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(lp * mask[:, 1:] * loss_weight).sum()
    loss.backward()
    return float(loss.detach())


def _time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run(repeats: int = 3) -> list[dict]:
    torch.manual_seed(0)
    model = tiny_model("qwen2", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                       initializer_range=0.05)
    workloads = {
        "GRPO group (G=8, prompt 256, completion 64)": grpo_group(256, 64, 8, 512, seed=0),
        "agentic tree (system 96, 4 turns, 2 branches)": agentic_tree(512),
    }
    rows = []
    for name, seqs in workloads.items():
        forest = PrefixForest.from_sequences(seqs)
        with torch.no_grad():
            tree = tree_logprobs(model, seqs)
            ref = untreed_logprobs(model, seqs)
        dlogp = max(float((a - b).abs().max()) for a, b in zip(tree, ref))

        def tree_step():
            model.zero_grad(set_to_none=True)
            tree_backward(model, seqs, lambda lp, s, p: -lp)

        def untreed_step():
            model.zero_grad(set_to_none=True)
            _padded_step(model, seqs, 1.0)

        untreed_step()
        g_ref = [p.grad.clone() for p in model.parameters()]
        tree_step()
        grad_err = max(float((p.grad - g).norm() / g.norm()) for p, g in zip(model.parameters(), g_ref))
        t_tree, t_untreed = _time(tree_step, repeats), _time(untreed_step, repeats)
        rows.append({"workload": name, "T": forest.num_tokens, "U": forest.num_unique_tokens,
                     "T/U": forest.dedup_ratio, "max|dlogp|": dlogp, "grad_rel": grad_err,
                     "tree_s": t_tree, "untreed_s": t_untreed})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="trl_tree demo: packed tree vs untreed on a tiny CPU model")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print("trl_tree demo: tiny Qwen2-shaped model (4 layers, fp32, CPU, built in code)\n")
    for r in run(args.repeats):
        print(r["workload"])
        print(f"  T = {r['T']}   U = {r['U']}   T/U = {r['T/U']:.2f}")
        print(f"  largest |Δ log-prob| vs untreed = {r['max|dlogp|']:.2e}   "
              f"worst relative gradient error = {r['grad_rel']:.2e}")
        print(f"  forward+backward: untreed (padded batch) {r['untreed_s'] * 1e3:.1f} ms, "
              f"tree {r['tree_s'] * 1e3:.1f} ms  ->  {r['untreed_s'] / r['tree_s']:.2f}x\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
