"""GPU exactness check of every tree attention backend (bf16: at most 1.5x the untreed bf16 error vs fp32).

    python -m trl_tree.bench.check_gpu [--out check.json]

For each backend that runs on this GPU, the tree's bf16 log-probs and gradients are compared with
an fp32 untreed reference (TF32 off); the untreed bf16 path is compared with the same reference.
The tree passes when its error is at most 1.5x the untreed bf16 path's own error. In fp32 the
backends that support it must also match the reference to 1e-5 like on the CPU. Two models: head
dimension 128 (every path) and 64 (the graphed paths, whose split runs on cuDNN only when replayed).
Each partial-kernel pair (FA2's, FA4's) is first checked alone against the math pair. Two
attention variants on every eager path whose backend computes them (others are refused by
name, recorded as skipped): sliding windows of 64 tokens (Mistral-shaped: every layer windowed)
and Gemma-2's soft-capped attention with alternating windows; and a Qwen3.5 hybrid (gated
DeltaNet through the kernels transformers routes to on this machine; its fp32 rows with those
kernels computing in float64, as they otherwise compute in fp32 whatever the model's dtype).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os

import torch
from transformers import AutoModelForCausalLM

from .. import TreeOptions, tree_backward, tree_logprobs
from ..engine.attention import partial
from ..engine.attention.backends import BACKENDS, DFS_BACKENDS, backend_available
from ..engine.attention.partial import PARTIAL_KERNELS
from ..engine.attention.support import attention_refusal
from ..engine.layout import layout_choices
from ..engine.mixers import tree_mixers
from ..engine.mixers.deltanet import float64_kernels
from ..engine.reference import untreed_backward, untreed_logprobs
from ..data.tiny import grpo_group, random_tree, tiny_config
from .common import add_kernels_arg, apply_kernels, dump, environment

RULE = 1.5


def _token_loss(lp: torch.Tensor, seq_idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    # advantage-like weights of both signs, varying per sequence and position
    weight = ((seq_idx * 7 + pos * 13) % 5 - 2).to(lp.dtype) / 2
    return -lp * weight


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _errors(logps, grads, ref_logps, ref_grads) -> dict[str, float]:
    diffs = torch.cat([(a.float() - b).abs() for a, b in zip(logps, ref_logps)])
    num = sum(float((grads[n] - g).pow(2).sum()) for n, g in ref_grads.items())
    den = sum(float(g.pow(2).sum()) for g in ref_grads.values())
    return {"logp_max_abs": float(diffs.max()), "logp_mean_abs": float(diffs.mean()), "grad_rel": (num / den) ** 0.5}


def _run(model, seqs, backend, mode="packed", root_split=None, checkpointed: str | bool = False,
         graphs: bool | str = False):
    model.zero_grad(set_to_none=True)
    if checkpointed:  # HF gradient checkpointing, as TRL trains: the kept attention outputs are used
        reentrant = checkpointed == "reentrant"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        try:
            return _run(model, seqs, backend, mode, root_split, graphs=graphs)
        finally:
            model.gradient_checkpointing_disable()
            model.eval()
    if backend is None:
        logps = untreed_logprobs(model, seqs)
        untreed_backward(model, seqs, _token_loss)
        return [lp.detach() for lp in logps], _grads(model)
    kw, train_kw = {}, {}
    if mode == "dfs":  # cut nodes and group subtrees at 64 tokens
        kw = {"chunk_size": 64}
    elif mode == "dfs-budget":  # groups sized by the memory model: merged pops, units keeping their attention
        mode, kw, train_kw = "dfs", {"memory_budget": _walk_budget(model, seqs)}, {"keep_graph": False}
    with layout_choices(root_split=root_split):
        if graphs:  # eager at the first call, captured at the second, checked on a replay
            from ..engine import graphs as graph_module

            # "buckets": the layout padded to buckets (attention/buckets.py), as free-length rollouts replay
            saved, graph_module.EXACT_LAYOUTS = graph_module.EXACT_LAYOUTS, graphs != "buckets"
            try:
                kind = "buckets" if graphs == "buckets" else True
                for _ in range(3):
                    model.zero_grad(set_to_none=True)
                    tree_backward(model, seqs, _token_loss, mode,
                                  options=TreeOptions(attn_backend=backend, cuda_graphs=kind, **kw, **train_kw))
                grads = _grads(model)
                # packed: the same graphs, replayed; dfs: the forward-only walk's own unit graphs (eager,
                # captured, replayed)
                for _ in range(3 if mode == "dfs" else 1):
                    logps = tree_logprobs(model, seqs, mode,
                                          options=TreeOptions(attn_backend=backend, cuda_graphs=kind, **kw))
            finally:
                graph_module.EXACT_LAYOUTS = saved
            return [lp.detach() for lp in logps], grads
        with torch.no_grad():
            logps = tree_logprobs(model, seqs, mode, options=TreeOptions(attn_backend=backend, **kw))
        tree_backward(model, seqs, _token_loss, mode, options=TreeOptions(attn_backend=backend, **kw, **train_kw))
    return [lp.detach() for lp in logps], _grads(model)


def _walk_budget(model, seqs) -> int:
    """Twice one checkpointed forward+backward of the longest sequence: on the check's workloads the
    walk then pushes its prompts, merges pops with a group, and some units keep their attention
    outputs for the recompute while larger ones do not (``GroupBudget.keeps_attention``)."""
    from ..engine.cost_model import ActivationModel

    longest = max(len(s) for s in seqs)
    return 2 * ActivationModel.of(model.config, True, model.dtype.itemsize).single_sequence(longest)


def _paths() -> list[tuple[str, str, bool | None, str | bool, bool, str]]:
    """(backend, mode, root split, checkpointed, graphs, label): every backend packed and dfs; the
    packed FlashAttention path whole and split at the roots (``attention/root_split.py``), split under
    gradient checkpointing, where the recompute takes the kept attention outputs (``attention/kept.py``),
    and those three again replaying CUDA graphs (``trl_tree.engine.graphs``; with both checkpoint kinds),
    replaying the graphs of the layout padded to buckets (``attention/buckets.py``), and the walk
    replaying its units' graphs (``dfs/graphs.py``), exact and padded to buckets (``dfs/buckets.py``),
    and the walk sized by the memory model (merged pops, kept attention outputs)."""
    paths = []
    for b in BACKENDS:
        if b in PARTIAL_KERNELS:
            for graphs in (False, True):
                tag = "+graphs" if graphs else ""
                paths += [(b, "packed", False, False, graphs, f"packed/{b}{tag}"),
                          (b, "packed", True, False, graphs, f"packed/{b}+split{tag}"),
                          (b, "packed", True, True, graphs, f"packed/{b}+split+ckpt{tag}")]
            paths.append((b, "packed", True, "reentrant", True, f"packed/{b}+split+ckpt-reentrant+graphs"))
            paths.append((b, "packed", None, True, "buckets", f"packed/{b}+ckpt+graphs+buckets"))
        else:
            paths.append((b, "packed", None, False, False, f"packed/{b}"))
    paths += [(b, "dfs", None, False, False, f"dfs/{b}") for b in DFS_BACKENDS]
    # the walk's units replayed (trl_tree/engine/dfs/graphs.py), plain and under checkpointing, and padded to
    # buckets (trl_tree/engine/dfs/buckets.py), as free-length rollouts replay them
    paths += [(b, "dfs", None, ckpt, True, f"dfs/{b}{'+ckpt' if ckpt else ''}+graphs")
              for b in DFS_BACKENDS for ckpt in (False, True)]
    paths += [(b, "dfs", None, True, "buckets", f"dfs/{b}+ckpt+graphs+buckets") for b in DFS_BACKENDS]
    # the walk sized by the memory model under checkpointing: merged pops, units keeping their attention
    # outputs for the recompute (dfs/plan.py, GroupBudget.keeps_attention), eager, replayed and padded
    return paths + [(b, "dfs-budget", None, True, graphs, f"dfs/{b}+ckpt+budget{tag}") for b in DFS_BACKENDS
                    for graphs, tag in ((False, ""), (True, "+graphs"), ("buckets", "+graphs+buckets"))]


def _check_kernel_pairs(device: torch.device) -> tuple[bool, list[dict]]:
    """Each registered partial-kernel pair (``attention/partial.py``; FA4's, ``attention/fa4.py``)
    against the per-segment math pair on the same bf16 inputs: varlen segments with fewer queries
    than keys (causal, bottom-right), the same followed by empty segments, and a dense non-causal
    rectangle, GQA, head_dim 128 and 64;
    the backward handed the forward's output and log-sum-exp. A pair passes when its errors are at
    most ``RULE`` x those of PyTorch's FA2 pair (the kernels every other path is checked with)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    cu_q = torch.tensor([0, 100, 164, 420], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 300, 364, 876], dtype=torch.int32, device=device)
    # empty segments at the end: a unit padded to buckets (dfs/buckets.py) rounds its segment count up with them
    empty = torch.tensor([420, 420], dtype=torch.int32, device=device)
    cu_q_empty, cu_k_empty = torch.cat([cu_q, empty]), torch.cat([cu_k, empty + 456])
    cases = {"varlen_causal": (cu_q, cu_k, 256, 512, True), "dense_rectangle": (None, None, 300, 700, False),
             "varlen_empty_segments": (cu_q_empty, cu_k_empty, 256, 512, True)}
    rows, ok_all = [], True
    for head_dim in (128, 64):
        for case, (cq, ck, mq, mk, causal) in cases.items():
            nq = int(cq[-1]) if cq is not None else mq
            nk = int(ck[-1]) if ck is not None else mk
            if cq is None:
                cq = torch.tensor([0, nq], dtype=torch.int32, device=device)
                ck = torch.tensor([0, nk], dtype=torch.int32, device=device)

            def rand(*shape):
                return torch.randn(*shape, generator=gen).to(device, torch.bfloat16)

            q, k, v, g = rand(nq, 4, head_dim), rand(nk, 1, head_dim), rand(nk, 1, head_dim), rand(nq, 4, head_dim)
            scale = head_dim ** -0.5
            ref_out, ref_lse, _ = partial.math_partial_forward(q, k, v, cq, ck, mq, mk, causal, scale)
            ref_grads = partial.math_partial_backward(g, q, k, v, ref_out, ref_lse, None, cq, ck, mq, mk, causal, scale)
            errors = {}
            for name, (fwd, bwd) in sorted(PARTIAL_KERNELS.items()):
                try:
                    out, lse, state = fwd(q, k, v, cq, ck, mq, mk, causal, scale)
                    grads = bwd(g, q, k, v, out, lse, state, cq, ck, mq, mk, causal, scale)
                except Exception as e:  # noqa: BLE001 - recorded as a failure, the rest still run
                    ok_all = False
                    rows.append({"head_dim": head_dim, "case": case, "pair": name, "error": f"{type(e).__name__}: {e}"[:400]})
                    continue
                errors[name] = {"out": float((out.float() - ref_out.float()).abs().max()),
                                "lse": float((lse.float() - ref_lse.float()).abs().max()),
                                **{f"d{x}": float((a.float() - b.float()).abs().max()) for x, a, b in
                                   zip("qkv", grads, ref_grads)}}
            base = errors.get("torch_flash")
            for name, errs in errors.items():
                passed = base is None or all(errs[key] <= RULE * base[key] + 1e-6 for key in errs)
                ok_all &= passed
                rows.append({"head_dim": head_dim, "case": case, "pair": name, **errs, "passed": passed})
                print("kernel pair", rows[-1], flush=True)
    return ok_all, rows


def _check_model(config, paths, device: torch.device, kernels: str, attn_implementation: str = "sdpa"
                 ) -> tuple[bool, list[dict]]:
    """Every path of ``paths`` on a model of ``config``, bf16 and fp32, against the fp32 untreed model."""
    torch.manual_seed(0)
    with device:
        model32 = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    for model in (model32, model16):  # reference and tree alike: the check is of the tree, on these layers
        apply_kernels(model, kernels)  # after the copy: a deep copy drops torch.compile's wrappers
    workloads = {
        "grpo_p300_c100_g8": grpo_group(300, 100, 8, config.vocab_size, seed=1),
        "random_tree_24": random_tree(24, config.vocab_size, max_len=256, seed=2),
    }
    # a hybrid's kernels compute in fp32 whatever the model's dtype (transformers' delta rule), their rounding
    # moving with where chunks begin: the fp32 reference and the fp32 tree run them in float64, so the fp32
    # rows check the tree's computation itself (mixers/deltanet.float64_kernels)
    hybrid = bool(tree_mixers(model32))

    def exact():
        return float64_kernels(model32) if hybrid else contextlib.nullcontext()

    results, ok_all = [], True
    for name, seqs in workloads.items():
        with exact():
            ref_logps, ref_grads = _run(model32, seqs, None)
        base = _errors(*_run(model16, seqs, None), ref_logps, ref_grads)
        results.append({"workload": name, "path": "untreed", "dtype": "bf16", **base})
        for backend, mode, split, checkpointed, graphs, label in paths:
            for dtype, model in (("bf16", model16), ("fp32", model32)):
                dt = torch.bfloat16 if dtype == "bf16" else torch.float32
                ok, why = backend_available(backend, device, dt)
                refusal = attention_refusal(model, backend, device, dt, mode.split("-")[0]) if ok else None
                if refusal is not None:  # a variant this kernel does not compute: refused by name, by design
                    ok, why = False, refusal[:160]
                if not ok:
                    results.append({"workload": name, "path": label, "dtype": dtype, "skipped": why})
                    continue
                if graphs and device.type != "cuda":
                    results.append({"workload": name, "path": label, "dtype": dtype, "skipped": "no CUDA graphs"})
                    continue
                try:
                    with exact() if dtype == "fp32" else contextlib.nullcontext():
                        errs = _errors(*_run(model, seqs, backend, mode, split, checkpointed, graphs), ref_logps,
                                       ref_grads)
                except Exception as e:  # noqa: BLE001 - a path that cannot run fails the check, the rest still run
                    ok_all = False
                    results.append({"workload": name, "path": label, "dtype": dtype, "error": f"{type(e).__name__}: {e}"[:400]})
                    continue
                if dtype == "bf16":
                    passed = all(errs[k] <= RULE * base[k] for k in ("logp_mean_abs", "logp_max_abs", "grad_rel"))
                else:
                    passed = errs["logp_max_abs"] <= 1e-5 and errs["grad_rel"] <= 1e-5
                ok_all &= passed
                results.append({"workload": name, "path": label, "dtype": dtype, **errs, "passed": passed})
                print(f"{name} {label} {dtype} {'PASS' if passed else 'FAIL'} max|dlogp| {errs['logp_max_abs']:.3e} "
                      f"grad rel {errs['grad_rel']:.3e}", flush=True)  # progress
    return ok_all, results


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only smoke-tests the script")
    parser.add_argument("--paths", default=None,
                        help="check only the paths whose label contains one of these comma-separated strings "
                        "(e.g. dfs,graphs); the untreed reference always runs")
    parser.add_argument("--models", default=None,
                        help="check only these comma-separated models: qwen2 (head dims 128 and 64), window64, "
                        "gemma2_softcap, qwen3_5_hybrid (default: all)")
    add_kernels_arg(parser)
    args = parser.parse_args(argv)
    models = set(args.models.split(",")) if args.models else None
    device = torch.device(args.device)
    wanted = args.paths.split(",") if args.paths else None
    # the check is of FA4's own kernels: none of its calls may stand in on FA2 while a variant compiles
    from ..engine.attention.fa4_ahead import ENABLE_VARIABLE

    os.environ[ENABLE_VARIABLE] = "0"

    def chosen(paths):
        return [p for p in paths if wanted is None or any(w in p[5] for w in wanted)]

    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("check_gpu needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    partial.DENSE_AT_SIGHTING = 1  # every cuDNN block from its first call: this checks numbers, not plan costs

    for backend in BACKENDS:  # asking registers what a backend brings (FA4: its kernel pair)
        backend_available(backend, device, torch.bfloat16)
    results, ok_all = [], True
    pairs_ok, pair_rows = (_check_kernel_pairs(device) if device.type == "cuda" and models is None
                           else (True, []))
    ok_all &= pairs_ok
    for heads, paths in ((2, chosen(_paths())), (4, chosen([p for p in _paths() if p[4]]))):
        if models is not None and "qwen2" not in models:
            continue
        # head_dim 128 (as Qwen2.5-1.5B/7B): the size at which the split and the dfs prefix run on cuDNN;
        # head_dim 64 (as Qwen2.5-0.5B): where only replayed graphs run the split's blocks on cuDNN
        config = tiny_config(
            "qwen2", vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=4096, initializer_range=0.05,
        )
        ok, rows = _check_model(config, paths, device, args.kernels)
        ok_all &= ok
        results += [{"head_dim": 256 // heads, **r} for r in rows]
    shape = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=128, max_position_embeddings=4096, initializer_range=0.05)
    variants = (("window64", tiny_config("mistral", **{**shape, "sliding_window": 64}), "sdpa"),
                ("gemma2_softcap", tiny_config("gemma2", **{**shape, "sliding_window": 64, "query_pre_attn_scalar": 128,
                                                           "attn_logit_softcapping": 50.0}), "eager"))
    # a hybrid: Qwen3.5's gated DeltaNet in 3 of 4 layers, its kernels those transformers routes to here (the
    # environment's sequence_kernels: flash-linear-attention's where installed); the walk's replayed graphs
    # do not run mixers (refused by name), so the eager paths only
    hybrid = tiny_config("qwen3_5", **{**shape, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                       "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                                       "layer_types": ["linear_attention"] * 3 + ["full_attention"]})
    variants += (("qwen3_5_hybrid", hybrid, "sdpa"),)
    for name, config, implementation in variants:  # the eager paths (graphs replay the same kernels)
        if models is not None and name not in models:
            continue
        ok, rows = _check_model(config, chosen([p for p in _paths() if not p[4]]), device, args.kernels, implementation)
        ok_all &= ok
        results += [{"head_dim": f"128/{name}", **r} for r in rows]
    print(f"{'hd':>3} {'workload':22} {'path':40} {'dtype':5} {'max|dlogp|':>11} {'mean|dlogp|':>12} {'grad rel':>10}  verdict")
    for r in results:
        if "skipped" in r or "error" in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"FAIL: {r['error']}"
            print(f"{r['head_dim']:>3} {r['workload']:22} {r['path']:40} {r['dtype']:5} {why}")
            continue
        verdict = "reference" if r["path"].startswith("untreed") else ("PASS" if r["passed"] else "FAIL")
        print(f"{r['head_dim']:>3} {r['workload']:22} {r['path']:40} {r['dtype']:5} {r['logp_max_abs']:11.3e} {r['logp_mean_abs']:12.3e} {r['grad_rel']:10.3e}  {verdict}")
    dump(args.out, {"environment": environment(args.kernels), "rule": f"bf16 tree error <= {RULE} x untreed bf16 error vs fp32 untreed; fp32 tree <= 1e-5 (hybrids: their fp32 rows with the kernels in float64)", "kernel_pairs": pair_rows, "results": results, "passed": ok_all})
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
