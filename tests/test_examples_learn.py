"""Every trainer example, shortened, visibly learns: the mean toy reward over the last quarter of
its logged steps is at least 0.1 above the first quarter's (fixed seed, CPU; shorter prompts and
fewer steps than the defaults, whose full runs docs/quickstart.md reports). The examples print the
same two means; this is what a user who runs one sees. The PPO examples are in
``test_examples_learn_ppo.py``: a file of their own, so that pytest-xdist's two workers share the runs."""

from __future__ import annotations

import re
import runpy
import sys

import pytest

SHORT = ["--story-length", "64"]
CASES = [
    ("grpo_tree.py", ["--steps", "6", *SHORT]),
    ("grpo_tree_lora.py", ["--steps", "6", *SHORT]),
    ("agentic_tools_tree.py", ["--steps", "6", "--num-generations", "4"]),
    ("async_grpo_tree.py", ["--steps", "12"]),  # the local rollout worker, no server
]


def rise(out: str) -> float:
    match = re.search(r"reward (-?[0-9.]+) -> (-?[0-9.]+) \(first -> last quarter", out)
    assert match, f"no learning line in the output:\n{out[-2000:]}"
    return float(match.group(2)) - float(match.group(1))


@pytest.mark.slow
@pytest.mark.parametrize("script,argv", CASES, ids=[f"{s}{'-shared' if 'shared' in a else ''}" for s, a in CASES])
def test_example_learns(script, argv, monkeypatch, capsys, tmp_path):
    run_example(script, argv, monkeypatch, tmp_path)
    out = capsys.readouterr().out
    gained = rise(out)
    assert gained >= 0.1, f"{script} {' '.join(argv)}: the reward rose by {gained:.3f}"
    assert not list(tmp_path.iterdir()), "the example left its temporary folder behind"
    if script == "agentic_tools_tree.py":  # the forest shares more than the prompt: it branches at the tool calls
        steps = re.findall(r"T/U ([\d.]+) \(sharing only the prompt: ([\d.]+)\)", out)
        assert steps and all(float(tree) > float(prompt) > 1.0 for tree, prompt in steps), out


def run_example(script: str, argv: list[str], monkeypatch, tmp_path) -> None:
    """Run ``examples/<script>`` as ``python examples/<script> <argv>`` would, its temporary files in ``tmp_path``."""
    import tempfile

    monkeypatch.setattr(sys, "argv", [script, *argv])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    runpy.run_path(f"examples/{script}", run_name="__main__")


@pytest.mark.slow
def test_demo_ppo_learns(capsys):
    """``python -m trl_tree --algo ppo``, shortened: the tree run's reward rises, and the untreed
    step is timed against it."""
    from trl_tree.tools.demo import main

    assert main(["--algo", "ppo", "--steps", "7", "--stock-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "untreed PPO" in out and "tree PPO" in out and "policy+critic" in out and "(critic warm-up)" in out
    assert rise(out) >= 0.1
