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
