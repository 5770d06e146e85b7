"""Every command the docs show parses with the current flags: ``python -m trl_tree …``, ``trl-tree SUB …``,
``python -m trl_tree.bench.X …`` (also after ``accelerate launch``) and ``examples/X.py …``, in code blocks
and inline. Each is handed to its entry point with ``argparse`` stopped right after a successful parse, so
nothing runs; an unknown flag, a removed option or a bad choice fails here instead of in a reader's shell.
A command with shell variables (``$B``) or a placeholder this file cannot fill is left out, and the test
says how many it checked."""

from __future__ import annotations

import argparse
import os
import re
import runpy
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the placeholders the pages use, filled with values their options take
PLACEHOLDERS = {"N": "2", "GIB": "80", "SIZE": "1.5b", "FILE": "rollouts.jsonl", "ROLLOUTS": "rollouts.jsonl",
                "DIR": "out_dir", "OUT": "out.png", "KIND": "separate", "MB": "25", "K": "2"}
ENTRY = re.compile(r"(?:python3? -m (?P<module>trl_tree(?:\.[\w.]+)?)|(?<![\w-])-m (?P<bench>trl_tree\.bench\.\w+)"
                   r"|trl-tree (?P<sub>demo|inspect|bench|check)\b|(?P<example>examples/\w+\.py))")
STOP = {"#", "|", "&&", ";", ">", "&", "2>&1", "\\"}


class _Parsed(Exception):
    pass


def _pages() -> list[str]:
    pages = [os.path.join(ROOT, "README.md")]
    for folder, _, names in os.walk(os.path.join(ROOT, "docs")):
        pages += [os.path.join(folder, n) for n in names if n.endswith(".md")]
    return sorted(pages)


def _command_lines(text: str) -> list[str]:
    lines = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        lines += block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    lines += re.findall(r"`([^`\n]+)`", prose)
    return lines


def _argv(rest: str) -> list[str] | None:
    """The arguments after an entry point, placeholders filled; None where one cannot be."""
    try:
        tokens = shlex.split(rest, comments=True)
    except ValueError:
        return None
    argv: list[str] = []
    optional = False
    for token in tokens:
        if token in STOP or token.startswith((">", "2>", ")")):
            break
        if token.startswith("[") or optional:  # "[--lora]": an option shown as optional, left out
            optional = not token.endswith("]")
            continue
        if "|" in token:  # "grpo|rloo|ppo": the first of the alternatives
            token = token.split("|")[0]
        if token in ("...", "…"):  # "--model ..." : an option the reader fills
            if argv and argv[-1].startswith("--"):
                argv.pop()
            continue
        if "$" in token or "{" in token or "<" in token or "..." in token:
            return None
        if token.isupper() and len(token) > 0 and token.isalpha():
            if token not in PLACEHOLDERS:
                return None
            token = PLACEHOLDERS[token]
        argv.append(token)
    return argv


def doc_commands() -> list[tuple[str, str, str, list[str]]]:
    """(page, kind, target, argv) for every command found."""
    found = []
    for page in _pages():
        for line in _command_lines(open(page, encoding="utf-8").read()):
            for m in ENTRY.finditer(line):
                argv = _argv(line[m.end():])
                if argv is None:
                    continue
                kind, target = next((k, v) for k, v in m.groupdict().items() if v)
                found.append((os.path.relpath(page, ROOT), kind, target, argv))
    return found


def _run(kind: str, target: str, argv: list[str], monkeypatch) -> None:
    if kind == "module" and target == "trl_tree":
        from trl_tree.tools.demo import main

        main(argv, prog="python -m trl_tree")
    elif kind == "sub":
        from trl_tree.tools import cli

        cli.main([target, *argv])
    elif kind in ("module", "bench"):
        if target == "trl_tree.tools.cli":
            from trl_tree.tools.cli import main
        else:
            main = __import__(target, fromlist=["main"]).main
        main(argv)
    else:
        monkeypatch.setattr(sys, "argv", [target, *argv])
        runpy.run_path(os.path.join(ROOT, target), run_name="__main__")


def test_every_command_in_the_docs_parses(monkeypatch, capsys):
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.chdir(ROOT)
    commands = doc_commands()
    bad = []
    for page, kind, target, argv in commands:
        try:
            _run(kind, target, argv, monkeypatch)
        except _Parsed:
            continue
        except SystemExit as e:  # --help exits 0; a flag argparse refuses exits 2
            if e.code in (0, None):
                continue
            bad.append(f"{page}: {target} {' '.join(argv)}: {capsys.readouterr().err.strip().splitlines()[-1:]}")
            continue
        bad.append(f"{page}: {target} {' '.join(argv)}: ran without parsing its arguments")
    assert len(commands) >= 30, f"only {len(commands)} commands found in the docs"
    assert not bad, "commands in the docs that do not parse:\n" + "\n".join(bad)
