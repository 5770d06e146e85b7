"""Packed tree forward+backward against TRL's own padded path, on a GRPO group (GPU, bf16).

    python -m trl_tree.bench.packed [--size 1.5b] [--group 16] [--prompt 2048] [--completion 512]
                                    [--backends torch_flash,flex] [--out packed.json]

A randomly initialised Qwen2.5-shaped model (nothing downloaded), gradient checkpointing on as TRL
uses it. Rows, all on the same rollouts in one process:

- ``trl_padded``: TRL 1.16's GRPO computation — the padded batch through the model's own attention
  with TRL's fused LM head (``add_fused_lm_head``) scoring the completion tokens;
- ``padding_free``: the T tokens packed without sharing, FlashAttention varlen (PyTorch's);
- ``causal_U``: one causal sequence as long as the forest's U unique tokens (a scale reference);
- ``tree[<backend>]``: ``tree_backward`` in packed mode, per attention backend;
- ``tree[<backend>] no-ckpt``: the same with checkpointing off (the tree's activations fit).

Reported per row: median time, speed-up over ``trl_padded``, speed-up ÷ (T/U), speed-up ÷ the FLOP
limit (DESIGN, "Measuring speed") and peak memory above the model's own.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from .. import PrefixForest, TreeOptions, tree_backward
from ..engine.attention.backends import backend_available
from ..engine.layout import layout_choices
from ..data.tiny import grpo_group
from .common import (
    StepCost,
    add_grpo_shape_args,
    add_kernels_arg,
    bench_model,
    dump,
    environment,
    step_flops,
    time_cuda,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_grpo_shape_args(parser)
    parser.add_argument("--backends", default="torch_flash,flex,flash")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", default=None, help="write per-kernel CUDA time tables (torch profiler) here")
    add_kernels_arg(parser)
    args = parser.parse_args(argv)
    model = bench_model(args.size, args.kernels, args.family)
    config = model.config

    G, P, C = args.group, args.prompt, args.completion
    seqs = grpo_group(P, C, G, config.vocab_size, seed=0)
    forest = PrefixForest.from_sequences(seqs)
    flat = PrefixForest.from_sequences(seqs, share_prefixes=False)
    T, U = forest.num_tokens, forest.num_unique_tokens
    advantages = torch.from_numpy(np.random.default_rng(0).standard_normal(G)).float().cuda()
    n_terms = G * C

    def token_loss(lp, seq_idx, pos):
        return -lp * advantages[seq_idx] / n_terms

    input_ids = torch.tensor(seqs, device="cuda")
    attention_mask = torch.ones_like(input_ids)
    labels = input_ids.clone()
    labels[:, :-C] = -100

    def trl_padded():
        model.zero_grad(set_to_none=False)  # in place: the gradients' memory stays (time_cuda's activation peak)
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        lp = out.log_probs[:, -C:]
        loss = -(lp * advantages[:, None]).sum() / n_terms
        loss.backward()
        return float(loss.detach())

    causal_ids = torch.from_numpy(forest.tokens).cuda().unsqueeze(0)
    causal_labels = causal_ids.clone()
    causal_labels[:, : U - n_terms] = -100

    def causal_u():
        model.zero_grad(set_to_none=False)
        out = model(input_ids=causal_ids, labels=causal_labels, fused_lm_head=True)
        out.log_probs.sum().backward()

    def tree(backend, the_forest=None):
        def step():
            model.zero_grad(set_to_none=False)
            with layout_choices(dense_unshared_batches=the_forest is None):  # padding-free stays varlen
                return tree_backward(model, the_forest if the_forest is not None else seqs, token_loss,
                                     score_from=P, options=TreeOptions(attn_backend=backend))
        return step

    baseline_cost = StepCost(T, n_terms, sum(L * (L + 1) // 2 for L in forest.seq_lengths.tolist()))
    tree_plan = forest.scoring_plan(P)
    tree_cost = StepCost(U, tree_plan.num_predictions, forest.sum_visible_keys())
    limit = step_flops(baseline_cost, config, True) / step_flops(tree_cost, config, True)
    limit_no_ckpt = step_flops(baseline_cost, config, True) / step_flops(tree_cost, config, False)

    rows = []

    def record(name, fn, flop_limit, cost):
        torch.cuda.empty_cache()
        try:
            ms, peak, act_peak = time_cuda(fn, iters=args.iters, reset=lambda: model.zero_grad(set_to_none=True))
        except torch.OutOfMemoryError:
            rows.append({"path": name, "error": "out of memory"})
            print(f"{name}: out of memory", flush=True)
            return
        row = {"path": name, "ms": round(ms, 2), "peak_gib": round(peak, 2),
               "activation_peak_gib": round(act_peak, 3), "tokens": cost.tokens,
               "flop_limit": round(flop_limit, 3) if flop_limit else None}
        rows.append(row)
        print(row, flush=True)

    loss_ref = trl_padded()
    record("trl_padded", trl_padded, None, baseline_cost)
    if backend_available("torch_flash", torch.device("cuda"), torch.bfloat16)[0]:
        record("padding_free", tree("torch_flash", flat), 1.0, baseline_cost)
    record("causal_U", causal_u, None, StepCost(U, n_terms, U * (U + 1) // 2))
    losses = {}
    for backend in [b for b in args.backends.split(",") if b]:
        ok, why = backend_available(backend, torch.device("cuda"), torch.bfloat16)
        if not ok:
            rows.append({"path": f"tree[{backend}]", "skipped": why})
            print(f"tree[{backend}] skipped: {why}", flush=True)
            continue
        losses[backend] = tree(backend)()
        record(f"tree[{backend}]", tree(backend), limit, tree_cost)
        model.gradient_checkpointing_disable()
        record(f"tree[{backend}] no-ckpt", tree(backend), limit_no_ckpt, tree_cost)
        model.gradient_checkpointing_enable()

    if args.profile:
        profile_steps(args.profile, {"causal_U": causal_u, **{f"tree[{b}]": tree(b) for b in losses}})

    base_ms = next(r["ms"] for r in rows if r["path"] == "trl_padded")
    for r in rows:
        if "ms" in r:
            r["speedup"] = round(base_ms / r["ms"], 3)
            r["speedup_over_T_U"] = round(r["speedup"] / (T / U), 3)
            if r.get("flop_limit"):
                r["fraction_of_flop_limit"] = round(r["speedup"] / r["flop_limit"], 3)
    header = f"{'path':26} {'ms':>9} {'speed-up':>9} {'/(T/U)':>7} {'/limit':>7} {'peak GiB':>9}"
    print(f"\n{args.size} G={G} P={P} C={C}: T={T} U={U} T/U={T / U:.2f} FLOP limit={limit:.2f} (no-ckpt {limit_no_ckpt:.2f})")
    print(header)
    for r in rows:
        if "ms" in r:
            print(f"{r['path']:26} {r['ms']:9.1f} {r['speedup']:9.2f} {r['speedup_over_T_U']:7.2f} "
                  f"{r.get('fraction_of_flop_limit', float('nan')):7.2f} {r['peak_gib']:9.2f}")
        else:
            print(f"{r['path']:26} {r.get('skipped') or r.get('error')}")
    dump(args.out, {
        "environment": environment(args.kernels),
        "workload": {"model": f"Qwen2.5-{args.size}-shaped (random init)", "dtype": "bf16",
                     "gradient_checkpointing": True, "group": G, "prompt": P, "completion": C,
                     "T": T, "U": U, "T_over_U": round(T / U, 3), "flop_limit": round(limit, 3),
                     "flop_limit_no_ckpt": round(limit_no_ckpt, 3)},
        "loss": {"trl_padded": loss_ref, **{f"tree[{k}]": v for k, v in losses.items()}},
        "rows": rows,
    })
    return 0


def profile_steps(path: str, steps: dict) -> None:
    """Per-kernel CUDA time of one step of each path, largest first (what to optimise next)."""
    from torch.profiler import ProfilerActivity, profile

    with open(path, "w") as f:
        for name, step in steps.items():
            step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            f.write(f"===== {name}\n")
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
            f.write("\n")


if __name__ == "__main__":
    raise SystemExit(main())
