"""The PPO examples, shortened, visibly learn (``test_examples_learn.py`` says how; a file of its
own so that pytest-xdist's workers, which take whole files, share the example runs)."""

from __future__ import annotations

import pytest
from test_examples_learn import SHORT, rise, run_example

#: the separate critic's run is the demo's (``test_examples_learn.test_demo_ppo_learns``, the same
#: trainer and critic): not run twice
CASES = [
    ("ppo_tree.py", ["--steps", "10", "--critic", "shared", *SHORT]),
    ("ppo_tree_lora.py", ["--steps", "8", *SHORT]),
]


@pytest.mark.slow
@pytest.mark.parametrize("script,argv", CASES, ids=[f"{s}{'-shared' if 'shared' in a else ''}" for s, a in CASES])
def test_ppo_example_learns(script, argv, monkeypatch, capsys, tmp_path):
    run_example(script, argv, monkeypatch, tmp_path)
    gained = rise(capsys.readouterr().out)
    assert gained >= 0.1, f"{script} {' '.join(argv)}: the reward rose by {gained:.3f}"
    assert not list(tmp_path.iterdir()), "the example left its temporary folder behind"
