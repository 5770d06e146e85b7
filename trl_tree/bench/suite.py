"""The GPU benchmark suite: W1–W7 × model sizes, baselines and tree modes in one process.

    python -m trl_tree.bench.suite [--sizes 0.5b,1.5b,7b] [--out docs/benchmarks/suite_h200.json]
    python -m trl_tree.bench.suite --report docs/benchmarks/suite_h200.json   # table + plot only

Per workload (``bench.workloads``) and randomly initialised Qwen2.5-shaped model (bf16, HF gradient
checkpointing as TRL uses it), on the same rollouts: TRL's padded computation (its fused LM head on
the completion tokens), padding-free packing through FlashAttention varlen (no sharing; the
strongest non-tree baseline), TRL 1.16's experimental trie packer where anything is shared
(``bench.trie_packer``, PyTorch's FA2 in place of its Hub kernel), the packed tree (and the same
split the other way at the root), and on W1/W4 the depth-first walk with the longest single
sequence's step as its memory reference. Each path: median of ``--iters`` CUDA-event timed
steps after a warm-up, peak memory above the weights. The FLOP limit (DESIGN, "Measuring speed")
is computed per workload and model. Writes JSON, a Markdown table next to it and, if matplotlib is
installed, a PNG of speed-up against T/U with the limit.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

from .. import PrefixForest, TreeOptions, tree_backward
from ..engine import packed as packed_pass
from ..engine.attention.backends import resolve_backend
from ..engine.attention.metadata import use_root_split
from ..engine.attention.root_split import RootSplitLayout
from ..engine.layout import layout_choices
from ..engine.model_parts import model_parts
from .common import (
    StepCost,
    add_kernels_arg,
    bench_model,
    drop_graphs,
    dump,
    environment,
    padded_step,
    step_flops,
    time_cuda,
)
from .profile import gpu_ms_by_kind, kernel_table, profile_step
from .trie_packer import trie_packer_available, trie_packer_step
from .workloads import suite_workloads

#: what ``--profile`` profiles by default: the baselines and the packed tree
PROFILED_PATHS = frozenset({"trl_padded", "per_sequence", "tree_packed"})


def _costs(forest: PrefixForest, seqs, score_from: int) -> tuple[StepCost, StepCost]:
    lengths = forest.seq_lengths.tolist()
    n_terms = sum(L - score_from for L in lengths)
    base = StepCost(forest.num_tokens, n_terms, sum(L * (L + 1) // 2 for L in lengths))
    tree = StepCost(forest.num_unique_tokens, forest.scoring_plan(score_from).num_predictions,
                    forest.sum_visible_keys())
    return base, tree


def run_workload(model, w, iters: int, dfs: bool, profile_tables: list[str] | None = None,
                 only: set[str] | None = None, backends: tuple[str, ...] = ("torch_flash",), warmup: int = 3,
                 profile_paths: frozenset[str] = PROFILED_PATHS) -> dict:
    """Time every path on workload ``w``; with ``profile_tables``, also profile one step of each of
    ``profile_paths`` (GPU time by kind of kernel in their rows, per-kernel tables appended to the
    list); ``only``: these paths (and the baseline). ``backends``: the
    tree's attention backend, then others whose main tree paths are timed too, as
    ``<path>@<backend>`` rows (e.g. ``tree_packed@flash``: FlashAttention-4)."""
    seqs, P = w.sequences, w.score_from
    forest = PrefixForest.from_sequences(seqs)
    flat = PrefixForest.from_sequences(seqs, share_prefixes=False)
    T, U = forest.num_tokens, forest.num_unique_tokens
    adv = torch.from_numpy(np.random.default_rng(0).standard_normal(len(seqs))).float().cuda()
    base_cost, tree_cost = _costs(forest, seqs, P)
    n_terms = base_cost.predictions
    # the packed tree keeps its attention outputs for the recompute (attention/kept.py); the walk
    # and the packed path timed without them recompute, like TRL's step
    base_flops = step_flops(base_cost, model.config, True)
    limit = base_flops / step_flops(tree_cost, model.config, True, attention_recompute=False)
    limit_recompute = base_flops / step_flops(tree_cost, model.config, True)

    def token_loss(lp, seq_idx, pos):
        return -lp * adv[seq_idx] / n_terms

    def tree(the_forest, mode="packed", varlen=False, root_split=None, keep_attention=True, backend=backends[0],
             merge_pops=True, **kw):
        def step():
            # padding-free = varlen packing, even when unshared
            with layout_choices(dense_unshared_batches=not varlen, root_split=root_split,
                                       keep_attention=keep_attention, merge_pops=merge_pops):
                tree_backward(model, the_forest, token_loss, mode, score_from=P,
                              options=TreeOptions(attn_backend=backend, **kw))
        return step

    layout = RootSplitLayout.from_forest(forest)
    parts = model_parts(model)
    eager_backend = resolve_backend(backends[0], parts.device, parts.compute_dtype, hidden_size=parts.hidden_size)
    dense = packed_pass.dense_blocks(parts, eager_backend)
    split = layout is not None and use_root_split(forest, layout, dense)  # what the engine decides
    base_path = "per_sequence" if w.per_sequence_baseline else "trl_padded"
    sampled = w.baseline_sample if w.per_sequence_baseline and w.baseline_sample else len(seqs)
    if w.per_sequence_baseline:  # one sequence per micro-batch, accumulated: the step a long-context user runs
        singles = [padded_step(model, [s], adv[i : i + 1], P, n_terms) for i, s in enumerate(seqs[:sampled])]
        paths = {"per_sequence": lambda: [step() for step in singles], "tree_packed": tree(forest)}
        if trie_packer_available():  # TRL's packer on the whole tree, where it fits
            paths["trl_trie_packer"] = trie_packer_step(model, seqs, adv, P, n_terms)
        dfs, iters = True, min(iters, 2)
    else:
        paths = {"trl_padded": padded_step(model, seqs, adv, P, n_terms), "padding_free": tree(flat, varlen=True),
                 "tree_packed": tree(forest)}
        if layout is not None:  # the packed path the other way round: does the split decision hold?
            paths["tree_packed_unsplit" if split else "tree_packed_split"] = tree(forest, root_split=not split)
        # what keeping the attention outputs for the recompute gains (and costs in memory)
        paths["tree_packed_recompute"] = tree(forest, keep_attention=False)
        # the same packed step replaying CUDA graphs (trl_tree.engine.graphs; captured in the warm-up)
        paths["tree_packed_graphs"] = tree(forest, cuda_graphs=True)
        if layout is not None and trie_packer_available():  # TRL's own tree packing, where anything is shared
            paths["trl_trie_packer"] = trie_packer_step(model, seqs, adv, P, n_terms)
    if dfs:
        longest = int(np.argmax(forest.seq_lengths))
        paths["tree_dfs"] = tree(forest, "dfs")
        # the walk's units replaying CUDA graphs (trl_tree/engine/dfs/graphs.py; captured in the warm-up)
        paths["tree_dfs_graphs"] = tree(forest, "dfs", cuda_graphs=True)
        if only is not None:  # asked for by name: what the walk's merged pops and kept attention gain
            paths["tree_dfs_graphs_unmerged"] = tree(forest, "dfs", cuda_graphs=True, merge_pops=False)
            paths["tree_dfs_graphs_recompute"] = tree(forest, "dfs", cuda_graphs=True, keep_attention=False)
        paths["longest_single"] = padded_step(model, [seqs[longest]], adv[longest : longest + 1], P, n_terms)
    for other in backends[1:]:  # the same tree paths through another attention backend
        for name, kw in (("tree_packed", {}), ("tree_packed_graphs", {"cuda_graphs": True}),
                         ("tree_dfs", {"mode": "dfs"}), ("tree_dfs_graphs", {"mode": "dfs", "cuda_graphs": True})):
            if name in paths:
                paths[f"{name}@{other}"] = tree(forest, backend=other, **kw)
    if only:
        paths = {k: v for k, v in paths.items() if k.split("@")[0] in only or k == base_path}
    rows = []
    for name, fn in paths.items():
        if "_graphs" in name:  # each graphed path's pool and kept stack counted in its own figures
            drop_graphs(model)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved()
        try:
            ms, peak, act = time_cuda(fn, warmup=warmup, iters=iters, reset=lambda: model.zero_grad(set_to_none=True))
            rows.append({"path": name, "ms": round(ms, 2), "peak_gib": round(peak, 3),
                         "activation_peak_gib": round(act, 3),
                         # what the path left reserved: a graph pool and a kept K/V stack are not in the peaks
                         "reserved_gib": round((torch.cuda.memory_reserved() - reserved) / 2**30, 3)})
            if name == base_path and sampled < len(seqs):  # every sequence costs the same: scale the sample
                rows[-1].update(ms=round(ms * len(seqs) / sampled, 2), timed_sequences=sampled)
        except torch.OutOfMemoryError:
            rows.append({"path": name, "error": "out of memory"})
        except Exception as e:  # one path failing (e.g. TRL's packer under compiled layers) must not lose the rest
            rows.append({"path": name, "error": f"{type(e).__name__}: {e}"[:500]})
        if profile_tables is not None and name in profile_paths and "ms" in rows[-1]:
            prof = profile_step(fn)
            rows[-1]["gpu_ms_by_kind"] = gpu_ms_by_kind(prof)
            profile_tables.append(f"===== {w.name} {name}\n{kernel_table(prof)}")
            model.zero_grad(set_to_none=True)
        print(w.name, rows[-1], flush=True)
    by = {r["path"]: r for r in rows}
    base = by[base_path].get("ms")
    for r in rows:
        if "ms" in r and base and r["path"] != "longest_single":
            r["speedup"] = round(base / r["ms"], 3)
            if r["path"].startswith("tree"):
                keeps = r["path"].startswith("tree_packed") and r["path"] != "tree_packed_recompute"
                r["fraction_of_flop_limit"] = round(r["speedup"] / (limit if keeps else limit_recompute), 3)
                r["speedup_over_T_U"] = round(r["speedup"] / (T / U), 3)
    if "tree_packed" in by:  # (left out by --paths)
        by["tree_packed"]["root_split"] = split
    pf, tp = by.get("padding_free", {}).get("ms"), by.get("tree_packed", {}).get("ms")
    single = by.get("longest_single", {})
    walks = [w_ + tag for tag in ("", *(f"@{b}" for b in backends[1:]))
             for w_ in ("tree_dfs", "tree_dfs_graphs", "tree_dfs_graphs_unmerged", "tree_dfs_graphs_recompute")]
    for walk in walks:
        dfs = by.get(walk, {})
        _, at, other = walk.partition("@")
        packed_ms = by.get("tree_packed" + at + other, {}).get("ms")  # the same backend's packed step
        if "ms" in dfs:
            from .dfs import walk_shape

            dfs.update(walk_shape(forest, P, model.config, "dfs", graphs="_graphs" in walk))
            if packed_ms:
                dfs["over_packed"] = round(dfs["ms"] / packed_ms, 3)
        for key in ("peak_gib", "activation_peak_gib"):
            if single.get(key) and key in dfs:
                dfs[key.replace("_gib", "") + "_over_longest_single"] = round(dfs[key] / single[key], 3)
    return {"workload": w.name, "description": w.description, "baseline": base_path, "num_sequences": len(seqs),
            "T": T, "U": U,
            "T_over_U": round(T / U, 3), "longest": int(forest.max_depth), "flop_limit": round(limit, 3),
            "flop_limit_recomputing_attention": round(limit_recompute, 3),
            "tree_over_padding_free": round(tp / pf, 3) if pf and tp else None, "rows": rows}


def markdown(payload: dict) -> str:
    env = payload["environment"]
    lines = [f"# Benchmark suite — {env.get('device', '?')}", "",
             f"torch {env.get('torch')}, transformers {env.get('transformers')}, CUDA {env.get('cuda')}; "
             f"layer kernels: {env.get('kernels', 'hf')} (baseline and tree alike); "
             f"attention: {env.get('attn_backends', 'torch_flash')} (FlashAttention-4 {env.get('flash_attn_4', 'not installed')}); bf16, "
             "HF gradient checkpointing, random-init Qwen2.5-shaped models; median of CUDA-event timed steps after "
             "warm-up, all paths in one process on the same rollouts. Speed-up is over TRL's padded path; "
             "limit = FLOP limit (DESIGN) of the packed tree as run (its checkpointed recompute skips the attention, "
             "whose outputs it kept: `attention/kept.py`); 'attention recomputed' = the packed tree without that; act. peak = peak memory above the weights and the gradients "
             "(activations and temporaries; `time_cuda`).", "",
             "| model | workload | T | U | T/U | limit | TRL padded | padding-free | tree packed | speed-up | "
             "÷ limit | packed, CUDA graphs (speed-up, ÷ limit) | attention recomputed (act. peak) | "
             "root split (packed the other way) | TRL trie packer | tree dfs (speed-up, ÷ packed) | "
             "dfs, CUDA graphs (speed-up, ÷ packed) | dfs act. peak ÷ longest single | act. peak TRL → packed |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for size, results in payload["results"].items():
        for r in results:
            by = {x["path"]: x for x in r["rows"]}

            def ms(path):
                x = by.get(path, {})
                return f"{x['ms']:.0f} ms" if "ms" in x else x.get("error", "–")
            tp, dfs = by.get("tree_packed", {}), by.get("tree_dfs", {})
            base_row = by.get(r.get("baseline", "trl_padded"), {})
            key = "activation_peak_gib" if "activation_peak_gib" in {**tp, **base_row} else "peak_gib"  # older payloads
            peak = f"{base_row.get(key, float('nan')):.2f} → " + (f"{tp[key]:.2f} GiB" if key in tp else ms("tree_packed"))
            timed = base_row.get("timed_sequences")
            base_note = (f" (per sequence{f', {timed} timed and scaled' if timed else ''})"
                         if r.get("baseline") == "per_sequence" else "")
            speed = f"{tp['speedup']:.2f}×" if "speedup" in tp else "–"
            limit_frac = f"{tp['fraction_of_flop_limit']:.2f}" if "fraction_of_flop_limit" in tp else "–"
            def walk_cell(path):
                x = by.get(path, {})
                if "speedup" not in x:
                    return ms(path)
                cell = f"{ms(path)} ({x['speedup']:.2f}×" + (f", {x['over_packed']:.2f}" if "over_packed" in x else "")
                calls = x.get("calls")
                return cell + ")" + (f", {calls} call{'s' if calls != 1 else ''}" if calls else "")
            dfs_cell, dfs_graphs_cell = walk_cell("tree_dfs"), walk_cell("tree_dfs_graphs")
            trie = by.get("trl_trie_packer", {})
            trie_cell = f"{ms('trl_trie_packer')} ({trie['speedup']:.2f}×)" if "speedup" in trie else ms("trl_trie_packer")
            graphed = by.get("tree_packed_graphs", {})
            graphs_cell = (f"{ms('tree_packed_graphs')} ({graphed['speedup']:.2f}×, {graphed['fraction_of_flop_limit']:.2f})"
                           if "fraction_of_flop_limit" in graphed else ms("tree_packed_graphs"))
            rec = by.get("tree_packed_recompute", {})
            rec_cell = f"{ms('tree_packed_recompute')} ({rec[key]:.2f} GiB)" if key in rec else ms("tree_packed_recompute")
            other = next((p for p in ("tree_packed_unsplit", "tree_packed_split") if p in by), None)
            split_cell = "–" if "root_split" not in tp else ("yes" if tp["root_split"] else "no")
            if other:
                split_cell += f" ({other.removeprefix('tree_packed_')} {ms(other)})"
            lines.append(
                f"| {size} | {r['workload']} | {r['T']} | {r['U']} | {r['T_over_U']:.2f} | {r['flop_limit']:.2f} | "
                f"{ms(r.get('baseline', 'trl_padded'))}{base_note} | "
                f"{ms('padding_free')} | {ms('tree_packed')} | {speed} | "
                f"{limit_frac} | {graphs_cell} | {rec_cell} | {split_cell} | {trie_cell} | "
                f"{dfs_cell} | {dfs_graphs_cell} | "
                f"{dfs.get('activation_peak_over_longest_single', dfs.get('peak_over_longest_single', '–'))} | "
                f"{peak} |")
    w5 = [f"{size} {r['tree_over_padding_free']:.3f}" for size, res in payload["results"].items()
          for r in res if r["workload"] == "W5" and r.get("tree_over_padding_free")]
    if w5:
        lines += ["", "W5 (no sharing): tree packed ÷ padding-free time = " + ", ".join(w5)]
    others = [(size, r, x) for size, res in payload["results"].items() for r in res for x in r["rows"]
              if "@" in x["path"]]
    if others:
        lines += ["", "Other attention backends on the same paths (time ÷ the same path with the first backend; "
                  "below 1: faster):", "", "| model | workload | path | backend | time | speed-up | ÷ first backend |",
                  "|---|---|---|---|---:|---:|---:|"]
        for size, r, x in others:
            path, backend = x["path"].split("@")
            first = next((y for y in r["rows"] if y["path"] == path), {})
            ratio = f"{x['ms'] / first['ms']:.2f}" if "ms" in x and "ms" in first else "–"
            time = f"{x['ms']:.0f} ms" if "ms" in x else x.get("error", "–")[:80]
            speed = f"{x['speedup']:.2f}×" if "speedup" in x else "–"
            lines.append(f"| {size} | {r['workload']} | {path} | {backend} | {time} | {speed} | {ratio} |")
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib; then --report)")
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    xs = np.linspace(0.8, 10.5, 50)
    ax.plot(xs, xs, "k:", label="T/U")
    for marker, (size, results) in zip("osD^", payload["results"].items()):
        pts = [(r["T_over_U"], x["speedup"], r["flop_limit"]) for r in results for x in r["rows"]
               if x["path"] == "tree_packed" and "speedup" in x]
        if not pts:
            continue
        t, s, lim = zip(*pts)
        line = ax.scatter(t, s, marker=marker, label=f"tree packed, {size}")
        color = line.get_facecolor()[0]
        ax.scatter(t, lim, marker="_", s=300, color=color, label=f"FLOP limit, {size}")
        graphed = [(r["T_over_U"], x["speedup"]) for r in results for x in r["rows"]
                   if x["path"] == "tree_packed_graphs" and "speedup" in x]
        if graphed:
            ax.scatter(*zip(*graphed), marker=marker, facecolors="none", edgecolors=color,
                       label=f"tree packed, CUDA graphs, {size}")
    ax.set_xlabel("T/U (total ÷ unique tokens)")
    ax.set_ylabel("speed-up over TRL's padded step")
    ax.set_title(f"trl_tree on {payload['environment'].get('device', 'GPU')}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def write_reports(payload: dict, json_path: str) -> None:
    stem = os.path.splitext(json_path)[0]
    with open(stem + ".md", "w") as f:
        f.write(markdown(payload))
    plot(payload, stem + ".png")
    print(markdown(payload))


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="0.5b,1.5b,7b")
    parser.add_argument("--workloads", default="W1,W2,W3,W4,W5,W6",
                        help="W6 (441k tokens) and W7 (2M tokens, 32k-token paths: an H200 at 7B) are timed against "
                        "one sequence per micro-batch, accumulated")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default="benchmark_suite.json")
    parser.add_argument("--report", default=None, help="only render the table and plot of this JSON")
    parser.add_argument("--profile", default=None,
                        help="also profile TRL's and the packed tree's step: GPU time by kernel kind in the JSON, "
                        "per-kernel tables written here")
    parser.add_argument("--profile-paths", default=",".join(sorted(PROFILED_PATHS)),
                        help="the paths --profile profiles, e.g. tree_packed_graphs,tree_dfs_graphs (graph replays "
                        "show their kernels too)")
    parser.add_argument("--no-dfs", action="store_true", help="leave out the depth-first walk's paths")
    parser.add_argument("--paths", default=None,
                        help="comma-separated paths to time (the baseline always runs), e.g. "
                        "tree_packed,tree_packed_graphs,tree_dfs,tree_dfs_graphs,longest_single; only by name: "
                        "tree_dfs_graphs_unmerged (every pop a call of its own), tree_dfs_graphs_recompute (the "
                        "walk's recompute runs the attention again)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps before the timed ones (the largest trees take minutes a step: 1)")
    parser.add_argument("--w7-scale", type=float, default=1.0,
                        help="W7 with its system prompt and turns this many times as long (3: 96k-token paths)")
    parser.add_argument("--attn-backends", default="auto",
                        help="the tree's attention backend ('auto': what the engine picks for each call), then others "
                        "timed on the same paths as <path>@<backend> rows, e.g. torch_flash,flash "
                        "(FlashAttention-4 where installed)")
    add_kernels_arg(parser)
    args = parser.parse_args(argv)
    only = set(args.paths.split(",")) if args.paths else None
    backends = tuple(args.attn_backends.split(","))
    if args.report:
        with open(args.report) as f:
            write_reports(json.load(f), args.report)
        return 0
    from tqdm.auto import tqdm

    env = {**environment(args.kernels), "attn_backends": args.attn_backends}

    results: dict[str, list] = {}
    tables: list[str] | None = [] if args.profile else None
    sizes, wanted = args.sizes.split(","), set(args.workloads.split(","))
    bar = tqdm(total=len(sizes) * len(wanted), desc="suite", unit="workload")
    for size in sizes:
        model = bench_model(size, args.kernels)
        results[size] = []
        for w in suite_workloads(model.config.vocab_size, wanted, args.w7_scale):
            if w.name in wanted:
                bar.set_postfix_str(f"{size} {w.name}")
                results[size].append(run_workload(model, w, args.iters, dfs=not args.no_dfs,
                                                  profile_tables=tables, only=only, backends=backends,
                                                  warmup=args.warmup,
                                                  profile_paths=frozenset(args.profile_paths.split(","))))
                if args.profile:
                    with open(args.profile, "w") as f:
                        f.write("\n\n".join(tables))
                dump(args.out, {"environment": env, "results": results})  # keep partial results
                bar.update()
        del model
        torch.cuda.empty_cache()
    bar.close()
    payload = {"environment": env, "results": results}
    dump(args.out, payload)
    write_reports(payload, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
