"""``trl-tree``: the subcommands' help, ``inspect`` on every input format against forests built
here, its errors, and ``demo --algo rloo``."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from trl_tree.tools.cli import main


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """Token-id rows (4 prompts x 8 completions) as JSONL, Parquet and a datasets directory."""
    folder = tmp_path_factory.mktemp("rollouts")
    rng = random.Random(0)
    rows = []
    for _ in range(4):
        prompt = [rng.randint(5, 90) for _ in range(rng.randint(50, 120))]
        rows += [{"prompt_ids": prompt, "completion_ids": [rng.randint(5, 90) for _ in range(rng.randint(5, 30))]}
                 for _ in range(8)]
    (folder / "ids.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    pq.write_table(pa.Table.from_pylist(rows), folder / "ids.parquet")
    Dataset.from_list(rows).save_to_disk(str(folder / "ds"))
    return folder, rows


def report(capsys, *argv) -> dict:
    assert main(["inspect", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_help_answers_without_importing_torch():
    code = "import sys; from trl_tree.tools.cli import main; main(['--help']); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip().endswith("False"), done.stdout + done.stderr
    for sub in ("demo", "inspect", "bench", "check"):
        assert sub in done.stdout
    assert main([]) == 2  # no subcommand: the help, and a usage error
    with pytest.raises(SystemExit) as e:
        main(["inspect", "--help"])
    assert e.value.code == 0


@pytest.mark.parametrize("argv,usage", [(["demo", "--help"], "usage: trl-tree demo"),
                                        (["check", "--help"], "usage: trl-tree check"),
                                        (["bench", "--help"], "usage: trl-tree bench")])
def test_subcommand_help_names_the_subcommand(argv, usage, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(usage) and "DESIGN" not in out


def test_python_m_help_names_the_module():
    done = subprocess.run([sys.executable, "-m", "trl_tree", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m trl_tree"), done.stdout + done.stderr


def test_inspect_counts_what_the_forest_holds(rollouts, capsys):
    from trl_tree import PrefixForest

    folder, rows = rollouts
    seqs = [r["prompt_ids"] + r["completion_ids"] for r in rows]
    forest = PrefixForest.from_sequences(seqs)
    whole = report(capsys, str(folder / "ids.jsonl"))
    assert (whole["total_tokens"], whole["unique_tokens"]) == (forest.num_tokens, forest.num_unique_tokens)
    assert whole["rows"] == 32 and whole["forests"] == 1 and whole["branching_histogram"] == {"8": 4}
    assert 1.0 < whole["flop_ratio"] < whole["dedup_ratio"] * 1.05  # the ceiling follows T/U
    assert whole["packed_bytes"] < whole["stock_bytes"]
    for source in ("ids.parquet", "ds"):  # the same rows from Parquet and a datasets directory
        assert report(capsys, str(folder / source)) == whole
    micro = report(capsys, str(folder / "ids.jsonl"), "--rows-per-forest", "4", "--model", "7b")
    assert micro["forests"] == 8 and micro["unique_tokens"] > whole["unique_tokens"]


def test_inspect_reads_text_and_chats_with_a_tokenizer(tmp_path, capsys):
    from trl_tree.data.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tok.save_pretrained(tmp_path / "tok")
    texts = [{"prompt": "count the a letters in banana banana", "completion": f" {'a' * k} done"} for k in range(1, 5)]
    (tmp_path / "text.jsonl").write_text("\n".join(json.dumps(r) for r in texts))
    out = report(capsys, str(tmp_path / "text.jsonl"), "--tokenizer", str(tmp_path / "tok"))
    assert out["rows"] == 4 and out["dedup_ratio"] > 1.5  # the prompt is shared
    chats = [{"messages": [{"role": "system", "content": "you count letters " * 5},
                           {"role": "user", "content": f"question {k}"}]} for k in range(3)]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in chats))
    out = report(capsys, str(tmp_path / "chat.jsonl"), "--tokenizer", str(tmp_path / "tok"))
    assert out["rows"] == 3 and out["dedup_ratio"] > 1.5  # the system prompt is shared


def test_inspect_draws_the_forest(rollouts, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    folder, _ = rollouts
    assert main(["inspect", str(folder / "ids.jsonl"), "--png", str(tmp_path / "f.png")]) == 0
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert "T/U" in capsys.readouterr().out


def test_inspect_errors_are_plain(rollouts, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub is never asked here
    folder, _ = rollouts
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "x"}))
    (tmp_path / "text.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}))
    (tmp_path / "broken.jsonl").write_text("{not json")
    cases = [
        ([str(tmp_path / "missing.jsonl")], "no such file"),
        ([str(tmp_path / "bad.jsonl")], "no known columns in ['question']"),
        ([str(tmp_path / "broken.jsonl")], "not valid JSON"),
        ([str(tmp_path / "text.jsonl")], "give --tokenizer"),
        ([str(tmp_path / "text.jsonl"), "--tokenizer", str(tmp_path / "nowhere")], "no directory at"),
        ([str(folder / "ids.jsonl"), "--model", "13b"], "is neither a size (0.5b, 1.5b, 7b), a config.json"),
        ([str(folder / "ids.jsonl"), "--model", "someone/no-such-model"], "nor a cached hub id"),
        ([str(folder / "ids.jsonl"), "--model", str(tmp_path)], "without a readable config.json"),
        ([str(folder / "ids.jsonl"), "--rows-per-forest", "0"], "at least 1"),
    ]
    for argv, message in cases:
        assert main(["inspect", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_demo_runs_rloo(capsys):
    assert main(["demo", "--algo", "rloo", "--steps", "1", "--stock-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "stock RLOO" in out and "tree RLOO" in out


def test_console_script_is_declared():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml")) as f:
        text = f.read()
    assert 'trl-tree = "trl_tree.tools.cli:main"' in text


def test_tree_configs_train_on_the_cpu_without_being_told():
    """No GPU here: TRL's bf16 default would make transformers refuse the config; the tree configs
    take use_cpu=True and fp32, and keep an explicit bf16=True."""
    import torch

    from trl_tree import TreeGRPOConfig, TreePPOConfig, TreeRLOOConfig

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    for cls in (TreeGRPOConfig, TreeRLOOConfig, TreePPOConfig):
        args = cls(output_dir="/tmp/unused", report_to="none")
        assert args.use_cpu and not args.bf16, cls.__name__
    assert TreeGRPOConfig(output_dir="/tmp/unused", report_to="none", bf16=True).bf16


def test_inspect_takes_a_model_directory(rollouts, tmp_path, capsys, monkeypatch):
    """``--model`` takes what ``from_pretrained`` takes: here a saved model's directory."""
    from trl_tree.data.tiny import shaped_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder, _ = rollouts
    shaped_config("0.5b").save_pretrained(tmp_path / "my-model")
    assert main(["inspect", str(folder / "ids.jsonl"), "--model", str(tmp_path / "my-model")]) == 0
    assert "my-model" in capsys.readouterr().out


def test_inspect_sft_compares_trl_order_with_the_sampler(tmp_path, capsys):
    """``inspect --sft --per-turn`` on conversations: per-turn samples, T/U in TRL's order and with
    the grouped sampler (which brings each conversation's turns together), per micro-batch."""
    from trl_tree.data.toy import chat_tokenizer, toy_conversations

    path = tmp_path / "conversations.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in toy_conversations(24)))
    chat_tokenizer().save_pretrained(tmp_path / "tok")
    argv = ["inspect", str(path), "--tokenizer", str(tmp_path / "tok"), "--sft", "--per-turn"]
    assert main(argv + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["groups"]["rows"] == report["trl_order"]["rows"] == 24 * 4
    assert report["groups"]["dedup_ratio"] > report["trl_order"]["dedup_ratio"] > 1.0
    assert len(report["groups_micro_batch_T_over_U"]) == 12
    assert main(argv) == 0
    assert "tree_shuffle='groups': T/U" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # --per-turn without --sft: a usage error
        main(["inspect", str(path), "--tokenizer", str(tmp_path / "tok"), "--per-turn"])


def test_inspect_reports_dpo_pairs(tmp_path, capsys):
    """DPO's files (prompt/chosen/rejected): each pair two sequences sharing the prompt, in
    micro-batches of pairs, TRL's order against TreeDPOTrainer's grouped sampler; ``--tokenizer
    tiny`` is the package's own, offline."""
    from trl_tree.data.toy import toy_preferences

    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in toy_preferences(32, pairs_per_prompt=4)))
    assert main(["inspect", str(path), "--tokenizer", "tiny", "--rows-per-forest", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trl_order"]["rows"] == 64 and report["groups"]["dedup_ratio"] > report["trl_order"]["dedup_ratio"]
    assert all(ratio > 1.0 for ratio in report["groups_micro_batch_T_over_U"])
    assert main(["inspect", str(path), "--tokenizer", "tiny"]) == 0
    assert "32 preference pairs" in capsys.readouterr().out


def _inspect_error(capsys, *argv) -> str:
    assert main(["inspect", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_inspect_bad_data_gets_one_line_naming_the_row(tmp_path, capsys):
    from trl_tree.data.toy import toy_conversations

    rows = [json.dumps(c) for c in toy_conversations(10)]
    bad = rows.copy()
    bad[5] = bad[5].replace('"role": "user"', '"role" "user"', 1)
    (tmp_path / "bad.jsonl").write_text("\n".join(bad))
    assert "bad.jsonl, line 6: not valid JSON" in _inspect_error(capsys, str(tmp_path / "bad.jsonl"), "--tokenizer",
                                                                 "tiny")
    no_role = [json.loads(r) for r in rows]
    del no_role[3]["messages"][1]["role"]
    (tmp_path / "role.jsonl").write_text("\n".join(json.dumps(r) for r in no_role))
    for extra in ([], ["--sft", "--per-turn"]):
        assert "row 3" in _inspect_error(capsys, str(tmp_path / "role.jsonl"), "--tokenizer", "tiny", *extra)
    no_assistant = [{"messages": [m for m in json.loads(r)["messages"] if m["role"] != "assistant"]} for r in rows]
    (tmp_path / "noasst.jsonl").write_text("\n".join(json.dumps(r) for r in no_assistant))
    err = _inspect_error(capsys, str(tmp_path / "noasst.jsonl"), "--tokenizer", "tiny", "--sft", "--per-turn")
    assert "none of the 10 rows" in err and "assistant turn" in err
    (tmp_path / "empty.jsonl").write_text("")
    assert "has no rows" in _inspect_error(capsys, str(tmp_path / "empty.jsonl"))
    assert "--tokenizer tiny" in _inspect_error(capsys, str(tmp_path / "noasst.jsonl"))


@pytest.mark.parametrize("algo", ["sft", "dpo"])
def test_demo_runs_sft_and_dpo(capsys, algo):
    assert main(["demo", "--algo", algo, "--steps", "2", "--stock-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert f"stock {algo.upper()}" in out and f"tree {algo.upper()}" in out and "loss" in out


def test_inspect_counts_the_same_things_in_every_mode():
    """Untreed, packed and dfs each count the LM head's call with its weight gradient (once left out
    of packed alone, which then read lighter than the memory-saving walk on every file): one
    sequence reads the same untreed and packed, and each figure holds at least the head's
    weight-gradient buffers."""
    from trl_tree.data.tiny import shaped_config
    from trl_tree.inspection import inspect

    config = shaped_config("1.5b")
    weight = config.vocab_size * config.hidden_size * (4 + 2)
    one, _ = inspect([list(range(2, 402))], [300], config)
    assert abs(one.packed_bytes - one.stock_bytes) <= 0.01 * one.stock_bytes
    shared = [list(range(2, 302)) + [1000 + 100 * i + j for j in range(100)] for i in range(8)]
    rep, _ = inspect(shared, [300] * 8, config)
    for figure in (rep.stock_bytes, rep.packed_bytes, rep.dfs_bytes):
        assert figure > weight
    assert rep.packed_bytes < rep.stock_bytes


def test_inspect_memory_agrees_with_the_peaks_measured_on_the_gpu():
    """``inspect``'s figures against the activation peaks the GPU suite measured on one H200 (the
    committed ``docs/benchmarks/suite_h200.json``: W1-W5 at 0.5B, 1.5B and 7B, bf16, gradient
    checkpointing, every row in one call): the untreed padded step and the packed call (which keeps
    its attention outputs by default, and runs a no-sharing batch padded) within 10%; the walk's
    figure is an upper bound (the whole longest path's stack and the head's weight gradient at once),
    at most 1.6x what it used."""
    from trl_tree.bench.workloads import suite_workloads
    from trl_tree.data.tiny import shaped_config
    from trl_tree.inspection import inspect

    measured = json.load(open(os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks", "suite_h200.json")))
    checked = 0
    for size, results in measured["results"].items():
        config = shaped_config(size)
        workloads = {w.name: w for w in suite_workloads(config.vocab_size, names={r["workload"] for r in results})}
        for result in results:
            w = workloads[result["workload"]]
            peaks = {r["path"]: r["activation_peak_gib"] * 2**30 for r in result["rows"]}
            rep, _ = inspect(w.sequences, [w.score_from] * len(w.sequences), config)
            where = f"{size} {w.name}"
            assert abs(rep.stock_bytes / peaks["trl_padded"] - 1) < 0.10, where
            assert abs(rep.packed_bytes / peaks["tree_packed"] - 1) < 0.10, where
            assert 0.9 <= rep.dfs_bytes / peaks["tree_dfs"] <= 1.6, where
            checked += 1
    assert checked >= 15


def test_inspect_says_how_auto_would_gather_under_fsdp2(rollouts, capsys):
    """``--gpus``: tree_gather='auto''s rule on the model's estimate. 14B on two 141 GiB GPUs was measured
    (docs/benchmarks/fsdp2_block_14b_2x_h200.json): the whole hold ran out of memory, block by block trained;
    the rule says block there, and whole for 0.5B on eight."""
    folder, _ = rollouts
    big = report(capsys, str(folder / "ids.jsonl"), "--model", "14b", "--gpus", "2", "--gpu-memory", "139.8")
    assert big["gathering"]["block"] and 14e9 < big["gathering"]["parameters"] < 16e9
    assert abs(big["gathering"]["whole_bf16_gib"] - 2 * big["gathering"]["parameters"] / 2**30) < 0.01
    # the shapes of the four-GPU rows: Qwen2.5-32B and Qwen3-30B-A3B (a mixture of experts), whose whole bf16
    # weights do not fit beside their sharded state on four H200s
    for size, billions in (("32b", 32.8), ("30b-a3b", 30.5)):
        row = report(capsys, str(folder / "ids.jsonl"), "--model", size, "--gpus", "4", "--gpu-memory", "139.8")
        assert row["gathering"]["block"] and abs(row["gathering"]["parameters"] / 1e9 - billions) < 0.1, size
    small = report(capsys, str(folder / "ids.jsonl"), "--model", "0.5b", "--gpus", "8")
    assert not small["gathering"]["block"] and "held whole" in small["gathering"]["reason"]
    assert main(["inspect", str(folder / "ids.jsonl"), "--model", "0.5b", "--gpus", "4"]) == 0
    out = capsys.readouterr().out
    assert "FSDP2 over 4 GPU(s) of 80 GiB" in out and "tree_gather='auto'" in out
    assert main(["inspect", str(folder / "ids.jsonl"), "--gpus", "0"]) == 2
    assert "--gpus must be at least 1" in capsys.readouterr().err
