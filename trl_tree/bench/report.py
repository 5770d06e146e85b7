"""Render benchmark JSON files as Markdown tables (committed under docs/benchmarks/).

    python -m trl_tree.bench.report docs/benchmarks/packed_*.json
"""

from __future__ import annotations

import argparse
import json


def packed_table(payload: dict) -> str:
    w, env = payload["workload"], payload["environment"]
    lines = [
        f"**{w['model']}**, {w['dtype']}, gradient checkpointing, G={w['group']}, prompt {w['prompt']}, "
        f"completion {w['completion']} — T={w['T']}, U={w['U']}, T/U={w['T_over_U']:.2f}, "
        f"FLOP limit {w['flop_limit']:.2f} (checkpointing off: {w['flop_limit_no_ckpt']:.2f}); "
        f"{env['device']}, torch {env['torch']}, transformers {env['transformers']}, trl {env['trl']}",
        "",
        "| path | ms | speed-up | ÷ (T/U) | ÷ FLOP limit | peak GiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in payload["rows"]:
        if "ms" not in r:
            lines.append(f"| {r['path']} | {r.get('skipped') or r.get('error')} | | | | |")
            continue
        frac = f"{r['fraction_of_flop_limit']:.2f}" if "fraction_of_flop_limit" in r else "—"
        lines.append(
            f"| {r['path']} | {r['ms']:.1f} | {r['speedup']:.2f} | {r['speedup_over_T_U']:.2f} | {frac} | "
            f"{r['peak_gib']:.2f} |"
        )
    return "\n".join(lines)


def dfs_table(payload: dict) -> str:
    env = payload["environment"]
    out = [f"{payload['model']}; {env['device']}, torch {env['torch']}, transformers {env['transformers']}", ""]
    for w in payload["results"]:
        out += [
            f"**{w['workload']}**: {w['num_sequences']} sequences, T={w['T']}, U={w['U']}, T/U={w['T_over_U']:.2f}, "
            f"longest {w['max_depth']} tokens",
            "",
            "| path | calls | ms | speed-up vs TRL padded | peak GiB | activation peak GiB | act. peak ÷ longest single |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in w["rows"]:
            if "ms" not in r:
                out.append(f"| {r['path']} | | {r.get('error')} | | | | |")
                continue
            speed = f"{r['speedup']:.2f}" if r.get("speedup") else "—"
            act = f"{r['activation_peak_gib']:.2f}" if "activation_peak_gib" in r else "—"
            ratio = r.get("activation_peak_over_longest_single")
            ratio = f"{ratio:.2f}" if ratio else ("1.00" if r["path"] == "longest_single" else "—")
            out.append(f"| {r['path']} | {r.get('calls', '—')} | {r['ms']:.1f} | {speed} | {r['peak_gib']:.2f} | {act} | {ratio} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    for path in args.files:
        with open(path) as f:
            payload = json.load(f)
        if "workload" in payload and "rows" in payload:
            print(packed_table(payload) + "\n")
        elif "results" in payload and "model" in payload:
            print(dfs_table(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
