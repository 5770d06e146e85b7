"""Every trainer example, shortened, visibly learns: the mean toy reward over the last quarter of
its logged steps is at least 0.1 above the first quarter's (fixed seed, CPU; shorter prompts and
fewer steps than the defaults, whose full runs docs/quickstart.md reports). The examples print the
same two means; this is what a user who runs one sees."""

from __future__ import annotations

import re
import runpy
import sys

import pytest

SHORT = ["--story-length", "64"]
CASES = [
    ("grpo_tree.py", ["--steps", "6", *SHORT]),
    ("grpo_tree_lora.py", ["--steps", "6", *SHORT]),
    ("ppo_tree.py", ["--steps", "8", *SHORT]),
    ("ppo_tree.py", ["--steps", "10", "--critic", "shared", *SHORT]),
    ("ppo_tree_lora.py", ["--steps", "8", *SHORT]),
    ("agentic_tools_tree.py", ["--steps", "8"]),
]


def rise(out: str) -> float:
    match = re.search(r"reward (-?[0-9.]+) -> (-?[0-9.]+) \(first -> last quarter", out)
    assert match, f"no learning line in the output:\n{out[-2000:]}"
    return float(match.group(2)) - float(match.group(1))


@pytest.mark.slow
@pytest.mark.parametrize("script,argv", CASES, ids=[f"{s}{'-shared' if 'shared' in a else ''}" for s, a in CASES])
def test_example_learns(script, argv, monkeypatch, capsys, tmp_path):
    import tempfile

    monkeypatch.setattr(sys, "argv", [script, *argv])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    runpy.run_path(f"examples/{script}", run_name="__main__")
    gained = rise(capsys.readouterr().out)
    assert gained >= 0.1, f"{script} {' '.join(argv)}: the reward rose by {gained:.3f}"
    assert not list(tmp_path.iterdir()), "the example left its temporary folder behind"


@pytest.mark.slow
def test_demo_ppo_learns(capsys):
    """``python -m trl_tree --algo ppo``, shortened: the tree run's reward rises, and the untreed
    step is timed against it."""
    from trl_tree.demo import main

    assert main(["--algo", "ppo", "--steps", "7", "--stock-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "untreed PPO" in out and "tree PPO" in out and "policy+critic" in out and "(critic warm-up)" in out
    assert rise(out) >= 0.1
