"""Every example, run in the venv the README's first command makes (`pip install -e .`, no extras).

Why: the test extra brings packages (mkdocs-material pulls in `requests`) that a user's first
install does not, so an example can pass the suite and still fail after `pip install -e .` (TRL's
asynchronous GRPO needed `requests`). `.ci/run` calls this between the README's two commands.
Each example runs shortened (the asynchronous one with its defaults, and its reward must rise),
saves to `--output-dir` where it takes one, and the saved folder must hold a model.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

SHORT = ["--steps", "2"]
#: (script, arguments, whether it saves to --output-dir)
RUNS = [
    ("tree_logprobs_basic.py", [], False),
    ("grpo_tree.py", [*SHORT, "--story-length", "32"], True),
    ("grpo_tree_lora.py", [*SHORT, "--story-length", "32"], True),
    ("ppo_tree.py", [*SHORT, "--story-length", "32"], True),
    ("ppo_tree_lora.py", [*SHORT, "--story-length", "32"], True),
    ("agentic_tools_tree.py", [*SHORT, "--warm-start-steps", "2", "--num-generations", "2"], True),
    ("sft_tree.py", [*SHORT, "--conversations", "8"], True),
    ("dpo_tree.py", [*SHORT], True),
    ("async_grpo_tree.py", [], True),  # its defaults: it must learn here too
]


def main() -> int:
    failed = []
    for script, argv, saves in RUNS:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, os.path.join("examples", script), *argv, *(["--output-dir", out] if saves else [])]
            start = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            took = time.perf_counter() - start
            why = None
            if done.returncode != 0:
                why = "exit status " + str(done.returncode) + ":\n" + done.stderr[-3000:]
            elif saves and not os.path.isfile(os.path.join(out, "config.json")) \
                    and not os.path.isfile(os.path.join(out, "adapter_config.json")):
                why = f"--output-dir {out} holds no saved model: {sorted(os.listdir(out))}"
            elif script == "async_grpo_tree.py":
                rise = re.search(r"reward (-?[0-9.]+) -> (-?[0-9.]+)", done.stdout)
                if not rise or float(rise.group(2)) - float(rise.group(1)) < 0.1:
                    why = "the reward did not rise by 0.1:\n" + done.stdout[-2000:]
            elif script == "ppo_tree.py" and "critic's warm-up" not in done.stdout:  # 2 steps: warm-up only
                why = "two steps of the critic's warm-up, and the example did not say so:\n" + done.stdout[-2000:]
        print(f"{'ok  ' if why is None else 'FAIL'} {script} ({took:.0f} s)", flush=True)
        if why is not None:
            failed.append(script)
            print(why, flush=True)
    if failed:
        print(f"after `pip install -e .` alone, these examples fail: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
