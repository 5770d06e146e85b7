"""Every file the user-facing pages name exists: a result file cited in a sentence, an example, a config,
a test or a module (``docs/benchmarks/x.json``, ``examples/accelerate/fsdp2.yaml``, ``tests/test_fsdp.py``,
``trl_tree/engine/forest.py``, or a bare name such as ``zero_fsdp_4x_h200.json``), with ``{a,b}`` and ``*``
read as the shell reads them. mkdocs' strict build checks the pages' links; this checks what they cite
in text. Not checked: code blocks (their ``--out`` names are files a command writes), and a name whose
sentence says it is kept in the repository's history (superseded results named, not shipped).
The benchmarks index and its notes record superseded runs by name; their links are mkdocs'."""

from __future__ import annotations

import fnmatch
import itertools
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: pages whose prose names superseded result files on purpose (in git history): links only
HISTORY_PAGES = ("docs/benchmarks/README.md", "docs/benchmarks/notes.md")
CITED = re.compile(r"(?<![\w/.*{}-])((?:[\w.*{},-]+/)*[\w.*{},-]+\.(?:json|md|py|yaml|yml|png|toml))(?![\w/-])")
#: the folders a bare or partial name is looked up in
PLACES = ("", "docs", "docs/benchmarks", "examples", "examples/accelerate", "tests", "trl_tree")


def _files() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    return listed.stdout.split()


def _expand(name: str) -> list[str]:
    """``a_{x,y}_b.json`` as the shell expands it."""
    parts = re.split(r"(\{[^{}]*\})", name)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def _prose(text: str) -> str:
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks: commands and their outputs
    return re.sub(r"https?://\S+", "", text)


def _exists(name: str, page: str, files: list[str], suffixes: set[str]) -> bool:
    for one in _expand(name):
        here = os.path.normpath(os.path.join(os.path.dirname(page), one))
        wanted = [here] + [os.path.normpath(os.path.join(place, one)) for place in PLACES]
        if any(fnmatch.filter(files, w) for w in wanted) or any(fnmatch.fnmatch(s, "*/" + one) for s in suffixes):
            continue
        return False
    return True


def dead_references() -> dict[str, list[str]]:
    files = _files()
    suffixes = set(files)
    pages = [f for f in files if f.endswith(".md") and (f.startswith("docs/") or f == "README.md")
             and f not in HISTORY_PAGES]
    dead: dict[str, list[str]] = {}
    for page in pages:
        text = _prose(open(os.path.join(ROOT, page), encoding="utf-8").read())
        for match in CITED.finditer(text):
            name = match.group(1)
            sentence = text[max(0, match.start() - 300): match.end() + 300]
            if "history" in sentence or "." + name.rsplit(".", 1)[-1] == name:
                continue
            if not _exists(name, page, files, suffixes):
                dead.setdefault(page, []).append(name)
    return dead


def test_every_file_a_page_cites_exists():
    dead = dead_references()
    assert not dead, "files named on the pages but not in the repository: " + "; ".join(
        f"{page}: {', '.join(sorted(set(names)))}" for page, names in sorted(dead.items()))


def test_the_readme_results_table_is_the_json_it_cites():
    """README's results table, row by row, against docs/benchmarks/suite_h200.json: stock TRL's padded step
    and the packed tree with CUDA graphs (ms, rounded; speed-up, one decimal) on W1 and the agentic W4, and
    W4's activation peaks of stock and the eager packed call (GiB, one decimal)."""
    import json

    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert "docs/benchmarks/suite_h200.json" in text
    suite = json.load(open(os.path.join(ROOT, "docs/benchmarks/suite_h200.json")))["results"]
    row = re.compile(r"^\| (\S+)B \| ([\d,]+) → ([\d,]+) ms, \*\*([\d.]+)×\*\* \| ([\d,]+) → ([\d,]+) ms, "
                     r"\*\*([\d.]+)×\*\* \| ([\d.]+) → ([\d.]+) GiB \|$", re.M)
    rows = row.findall(text)
    assert len(rows) == 3, "README's results table changed shape: update this test with it"

    def paths(size: str, workload: str) -> dict:
        run = next(w for w in suite[size] if w["workload"] == workload)
        return {r["path"]: r for r in run["rows"]}

    def num(s: str) -> float:
        return float(s.replace(",", ""))

    for size, w1_stock, w1_tree, w1_x, w4_stock, w4_tree, w4_x, mem_stock, mem_tree in rows:
        for workload, stock, tree, x in (("W1", w1_stock, w1_tree, w1_x), ("W4", w4_stock, w4_tree, w4_x)):
            got = paths(f"{size.lower()}b", workload)
            base, graphs = got["trl_padded"]["ms"], got["tree_packed_graphs"]["ms"]
            assert (num(stock), num(tree)) == (round(base), round(graphs)), f"{size}B {workload}: ms"
            assert num(x) == round(base / graphs, 1), f"{size}B {workload}: speed-up"
        w4 = paths(f"{size.lower()}b", "W4")
        assert (num(mem_stock), num(mem_tree)) == (round(w4["trl_padded"]["activation_peak_gib"], 1),
                                                   round(w4["tree_packed"]["activation_peak_gib"], 1)), f"{size}B"


def _refused_settings_in_code() -> list[str]:
    """The settings the trainers refuse by name: the keys of every dict handed to ``_refuse`` (or built for
    it by a ``_refused_settings``), the part before their parenthesised reason."""
    import ast

    names = []
    for folder, _, files in os.walk(os.path.join(ROOT, "trl_tree")):
        for f in files:
            if not f.endswith(".py"):
                continue
            tree = ast.parse(open(os.path.join(folder, f), encoding="utf-8").read())
            for node in ast.walk(tree):
                dicts = []
                if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "_refuse" and node.args:
                    dicts += [a for a in node.args if isinstance(a, ast.Dict)]
                if isinstance(node, ast.FunctionDef) and node.name in ("_refused_settings", "_check_trainer_support"):
                    dicts += [n for n in ast.walk(node) if isinstance(n, ast.Dict)]
                for d in dicts:
                    for key in d.keys:
                        if isinstance(key, ast.Constant) and isinstance(key.value, str):
                            names.append(key.value.split(" (")[0])
                        elif isinstance(key, ast.JoinedStr) and isinstance(key.values[0], ast.Constant):
                            names.append(str(key.values[0].value).split(" (")[0])
    return names


def test_every_setting_the_trainers_refuse_is_in_the_limitations():
    """docs/limitations.md is the one list of refusals: every setting a trainer refuses by name at construction
    is on it (its code names — ``tree_cuda_graphs``, ``label_smoothing_factor`` — or, where the key has none, one
    of its words), and the trainer pages link to it."""
    limitations = open(os.path.join(ROOT, "docs/limitations.md"), encoding="utf-8").read().lower()
    refused = _refused_settings_in_code()
    assert len(refused) >= 8, refused
    missing = []
    for name in refused:
        identifiers = re.findall(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+", name)
        words = [w for w in re.findall(r"[A-Za-z0-9-]{4,}", name) if w.lower() not in ("with", "under", "their", "that")]
        if identifiers:
            if not all(i in limitations for i in identifiers):
                missing.append(name)
        elif not any(w.lower() in limitations for w in words):
            missing.append(name)
    assert not missing, f"refused in the code, absent from docs/limitations.md: {missing}"
    for page in ("trainers.md", "sft.md", "dpo.md", "ppo.md", "async_grpo.md"):
        assert "limitations.md" in open(os.path.join(ROOT, "docs", page), encoding="utf-8").read(), page
