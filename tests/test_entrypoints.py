"""The README's main job, the example and the GPU scripts' CPU-checkable parts."""

from __future__ import annotations

import importlib
import importlib.util
import json
import runpy
import subprocess
import sys

import pytest

from trl_tree.bench.common import StepCost, step_flops
from trl_tree.data.tiny import shaped_config


def test_demo_trains_with_the_tree_and_times_stock_grpo(capsys):
    from trl_tree.tools.demo import main

    assert main(["--steps", "2", "--stock-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "stock GRPO" in out and "tree GRPO" in out and "T/U" in out


def test_grpo_example_runs_the_walk_under_a_budget(monkeypatch, capsys, tmp_path):
    """The options the learning tests (test_examples_learn.py) leave at their defaults."""
    import tempfile

    monkeypatch.setattr(sys, "argv", ["grpo_tree.py", "--steps", "1", "--mode", "dfs", "--token-budget", "300",
                                      "--story-length", "64"])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    runpy.run_path("examples/grpo_tree.py", run_name="__main__")
    assert "reward" in capsys.readouterr().out
    assert not list(tmp_path.iterdir()), "the example left its temporary folder behind"


def test_agentic_tools_example_round_trips_its_tool_calls():
    """TRL's environment_factory with a key-value store the model queries: the call format round-trips
    through the in-memory tokenizer's chat template and TRL's response parser, and the store rewards
    the key that holds the code (the run itself, and that its forest branches at the tool calls:
    ``test_examples_learn.py``)."""
    spec = importlib.util.spec_from_file_location("agentic_tools_tree", "examples/agentic_tools_tree.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tokenizer = example.tool_tokenizer()
    env = example.KeyValueStore()
    env.reset(seed=3)
    prompt = tokenizer.apply_chat_template(example.question(), tools=[env.lookup], add_generation_prompt=True,
                                           tokenize=False)
    text = tokenizer.apply_chat_template(example.conversation("beta", env), tools=[env.lookup], tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text and tokenizer.unk_token_id not in ids[len(tokenizer(prompt)["input_ids"]):]
    for key, reward in (("beta", 0.0), (example.CODE_KEY, 1.0)):
        parsed = tokenizer.parse_response(f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{key}"}}}}\n'
                                          "</tool_call><|im_end|>", prefix=prompt)
        call = parsed["tool_calls"][0]["function"]
        assert call == {"name": "lookup", "arguments": {"key": key}}
        assert env.lookup(**call["arguments"]) == env.store[key] and env.get_reward() == reward
    with pytest.raises(KeyError, match="no key"):
        env.lookup("epsilon")


@pytest.mark.parametrize("script", ["grpo_tree.py", "grpo_tree_lora.py", "ppo_tree.py", "ppo_tree_lora.py",
                                    "agentic_tools_tree.py"])
def test_example_help_imports_nothing_heavy(script):
    code = (f"import runpy, sys; sys.argv = ['{script}', '--help']\n"
            f"try:\n    runpy.run_path('examples/{script}', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('heavy' if 'torch' in sys.modules else 'light')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip().endswith("light") and "usage:" in done.stdout, done.stdout + done.stderr


def test_example_saves_to_its_output_dir(monkeypatch, capsys, tmp_path):
    """``--output-dir`` holds the trained model and its tokenizer, loadable as any checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "trained"
    monkeypatch.setattr(sys, "argv", ["sft_tree.py", "--steps", "2", "--conversations", "4", "--output-dir", str(out)])
    runpy.run_path("examples/sft_tree.py", run_name="__main__")
    assert "loss" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer) and tokenizer.chat_template


@pytest.mark.parametrize("argv", [[], ["--mode", "dfs", "--chunk-size", "7"]])
def test_example_runs(argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["tree_logprobs_basic.py", *argv])
    runpy.run_path("examples/tree_logprobs_basic.py", run_name="__main__")
    out = capsys.readouterr().out
    assert "max |Δ log-prob| vs untreed" in out


@pytest.mark.parametrize("module", ["check_gpu", "packed", "dfs", "report", "suite", "trainer", "overhead", "trie_packer",
                                    "compiled", "graphs", "ranks"])
def test_bench_modules_import(module):
    importlib.import_module(f"trl_tree.bench.{module}")


def test_rank_balance_simulation_runs_on_the_cpu(tmp_path):
    import json

    from trl_tree.bench.ranks import main

    assert main(["--size", "0.5b", "--ranks", "2", "--groups-per-rank", "2", "--out", str(tmp_path / "r.json")]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["results"]
    assert {r["shape"] for r in rows} == {"W1", "W2", "W3", "W4"}
    for r in rows:
        assert 1.0 <= r["imbalance_best"] <= min(r["imbalance_lpt"], r["imbalance_kk"], r["imbalance_contiguous"])
        assert r["T_over_U_whole_trees"] >= r["T_over_U_sliced_mean"]


def test_trainer_bench_rollouts_depend_on_the_row_alone():
    """``bench.trainer``'s rollouts: the same global batch gets the same rows on one process or two (the
    update check compares them), a group cut over processes shares its prompt, no two rows of a group
    share a completion, and W4's trees of different prompts share the system prompt and nothing else."""
    from types import SimpleNamespace

    from trl_tree import PrefixForest
    from trl_tree.bench.trainer import BenchRollouts

    def trainer(rank):
        return SimpleNamespace(accelerator=SimpleNamespace(process_index=rank))

    batch = [p for p in ("p3", "p7", "p1") for _ in range(4)]  # 3 groups of 4: the middle one straddles 2 ranks
    rollouts = BenchRollouts(vocab=50, prompt=6, completion=8, group=4, free_lengths=True)
    one = rollouts(batch, trainer(0))
    halves = [rollouts(batch[:6], trainer(0)), rollouts(batch[6:], trainer(1))]
    for key in one:
        assert one[key] == halves[0][key] + halves[1][key]
    rows = list(zip(one["prompt_ids"], one["completion_ids"]))
    assert all(min(p + c) >= 2 and 4 <= len(c) <= 8 for p, c in rows)
    for g in range(3):
        group = rows[4 * g : 4 * g + 4]
        assert len({tuple(p) for p, _ in group}) == 1 and len({tuple(c) for _, c in group}) == 4
    assert rows[0][0] != rows[4][0]

    agentic = BenchRollouts(vocab=50_000, prompt=0, completion=0, group=0, free_lengths=False, agentic=True)
    assert (agentic.group, agentic.prompt, agentic.completion) == (12, 4800, 530)
    out = agentic([p for p in ("a", "b") for _ in range(12)], trainer(0))
    paths = [p + c for p, c in zip(out["prompt_ids"], out["completion_ids"])]
    one_tree = PrefixForest.from_sequences(paths[:12])
    both = PrefixForest.from_sequences(paths)
    assert one_tree.num_tokens / one_tree.num_unique_tokens == pytest.approx(9.41, abs=0.01)
    assert both.num_unique_tokens == 2 * one_tree.num_unique_tokens - 4800  # the system prompt once


def test_trainer_bench_fingerprint_sees_gradients_the_weights_did_not_take():
    """``bench.trainer``'s check that ranks agree: two ranks whose bf16 weights a tiny learning rate
    left unchanged, but whose gradients differed, must not read as agreeing (Adam's moments hold
    the gradients)."""
    import torch

    from trl_tree.bench.trainer import parameter_fingerprint

    prints = []
    for scale in (1.0, 2.0):  # two ranks' gradients, not averaged
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8).to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-8)
        before = [p.detach().clone() for p in model.parameters()]
        (scale * model(torch.ones(2, 8, dtype=torch.bfloat16)).float().pow(2).sum()).backward()
        optimizer.step()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the weights did not move
        prints.append((parameter_fingerprint(model), parameter_fingerprint(model, optimizer)))
    assert prints[0][0] == prints[1][0] and prints[0][1] != prints[1][1]


def test_trainer_bench_update_check(tmp_path, monkeypatch):
    """``bench.trainer --update-check`` on a tiny Qwen2 shape on the CPU: the fp32 tree's update equals
    the fp32 untreed reference, the bf16 ones keep DESIGN.md's rule against stock's bf16 error, and a
    later launch reads the reference and stock's error from the directory."""
    import json

    import trl_tree.data.tiny
    from trl_tree.bench.trainer import main

    monkeypatch.setitem(trl_tree.data.tiny.QWEN2_SHAPES, "0.5b", (64, 128, 2, 4, 2, 1000, 4096))
    shape = ["--size", "0.5b", "--group", "4", "--prompt", "16", "--completion", "8", "--per-device", "2",
             "--accumulation", "4", "--free-lengths", "--update-check", str(tmp_path / "ref")]
    with pytest.raises(FileNotFoundError, match="no reference"):
        main([*shape, "--modes", "packed"])
    assert main([*shape, "--modes", "off+fp32,off,packed+fp32,packed+window", "--out", str(tmp_path / "a.json")]) == 0
    assert main([*shape, "--modes", "dfs+window,dfs+fp32+window+mem=0.001", "--out", str(tmp_path / "b.json")]) == 0
    results = json.loads((tmp_path / "a.json").read_text())["results"]
    results |= json.loads((tmp_path / "b.json").read_text())["results"]
    assert results["off+fp32"]["reference"] and results["off"]["err_over_stock_bf16"] == 1.0
    assert results["packed+fp32"]["update_rel_err"] < 1e-5
    assert results["dfs+fp32+window+mem=0.001"]["update_rel_err"] < 1e-5  # +mem: a walk of the smallest units
    assert 1e-4 < results["off"]["update_rel_err"] < 0.1
    for mode in ("packed+window", "dfs+window"):
        assert results[mode]["within_bf16_rule"] and results[mode]["update_rel_err"] > 1e-4, results[mode]


def test_local_metric_collectives_take_one_ranks_values_during_the_loss_only():
    """``bench.trainer``'s ``+localmetrics`` (timing only): while the loss runs, the accelerator's
    gather and reduce return this rank's values; afterwards, and after a failing loss, its own again."""
    from types import SimpleNamespace

    from trl_tree.bench.trainer import local_metric_collectives

    class Accelerator:
        def gather(self, tensor):
            return ("gathered", tensor)

        def reduce(self, tensor, reduction="mean", scale=1.0):
            return ("reduced", tensor)

    accelerator, seen = Accelerator(), []

    def compute_loss(model, inputs):
        seen.append((accelerator.gather(1), accelerator.reduce(2, reduction="sum")))
        if inputs == "fail":
            raise RuntimeError("loss failed")
        return 3

    loss = local_metric_collectives(SimpleNamespace(_compute_loss=compute_loss, accelerator=accelerator))
    assert loss(None, None) == 3 and seen == [(1, 2)]
    assert accelerator.gather(1) == ("gathered", 1) and accelerator.reduce(2) == ("reduced", 2)
    with pytest.raises(RuntimeError, match="loss failed"):
        loss(None, "fail")
    assert seen[-1] == (1, 2) and accelerator.gather(1) == ("gathered", 1) and accelerator.reduce(2) == ("reduced", 2)


def test_committed_dfs_results_render_with_their_calls():
    """The committed walk results re-render (``bench.report``), each dfs row with its model calls as
    the current planner counts them for that forest and model shape."""
    import json

    from trl_tree import PrefixForest
    from trl_tree.bench.dfs import agentic_tree, walk_shape
    from trl_tree.bench.report import dfs_table
    from trl_tree.data.tiny import grpo_group

    with open("docs/benchmarks/dfs_0.5b_h200.json") as f:
        payload = json.load(f)
    table = dfs_table(payload)
    assert "| dfs | 3 |" in table and "| dfs nodes | 5 |" in table
    config = shaped_config("0.5b")
    seqs = {"grpo_g16_p2048_c512": (grpo_group(2048, 512, 16, config.vocab_size, seed=0), 2048),
            "agentic_16x8650": (agentic_tree(config.vocab_size), 4800)}
    for w in payload["results"]:
        forest = PrefixForest.from_sequences(seqs[w["workload"]][0])
        for row in w["rows"]:
            if row["path"].startswith("dfs"):
                assert walk_shape(forest, seqs[w["workload"]][1], config, row["path"])["calls"] == row["calls"]


def test_flop_limit_of_a_grpo_group_is_below_t_over_u():
    """Completions are scored either way, so a GRPO group's FLOP limit sits below T/U (0.76 T/U here
    for 0.5B, G=16, P=2048, C=512, counting the fused head's backward recompute; DESIGN quotes ~0.86
    with its own accounting) but well above the attention-free ratio of the LM head alone."""
    config = shaped_config("0.5b")
    G, P, C = 16, 2048, 512
    L = P + C
    base = StepCost(G * L, G * C, G * L * (L + 1) // 2)
    tree = StepCost(P + G * C, G * C, P * (P + 1) // 2 + G * sum(range(P + 1, L + 1)))
    limit = step_flops(base, config, False) / step_flops(tree, config, False)
    t_over_u = G * L / (P + G * C)
    assert 0.7 * t_over_u < limit < 0.9 * t_over_u


def test_flops_without_the_attention_recompute_drop_one_attention_pass():
    """With the attention outputs kept (``attention/kept.py``) the checkpointed recompute runs no
    attention: exactly one forward's attention FLOPs (4·heads·head_dim·layers per pair) fewer."""
    config = shaped_config("0.5b")
    cost = StepCost(1000, 300, 250_000)
    head_dim = config.hidden_size // config.num_attention_heads
    one_pass = 4 * config.num_attention_heads * head_dim * config.num_hidden_layers * cost.attention_pairs
    assert step_flops(cost, config, True) - step_flops(cost, config, True, attention_recompute=False) == one_pass
    assert step_flops(cost, config, False, attention_recompute=False) == step_flops(cost, config, False)


def test_kernels_option_patches_or_refuses_clearly(monkeypatch):
    from trl_tree.bench.common import KERNELS, apply_kernels
    from trl_tree.data.tiny import tiny_model

    model = tiny_model("qwen2")
    before = type(model.model.layers[0].mlp).forward
    apply_kernels(model, "hf")  # the modeling file's own layers: nothing changes
    assert type(model.model.layers[0].mlp).forward is before
    with pytest.raises(ValueError, match="unknown kernels"):
        apply_kernels(model, "triton")
    assert KERNELS == ("hf", "liger", "compiled")
    from trl_tree.engine import compile as tree_compile

    monkeypatch.setattr(tree_compile, "BACKEND", "aot_eager")
    apply_kernels(model, "compiled")  # every layer child compiled, the model's classes untouched
    assert all(c._compiled_call_impl is not None for layer in model.model.layers for c in layer.children())
    assert type(model.model.layers[0].mlp).forward is before
    tree_compile.uncompile_layers(model)
    if importlib.util.find_spec("liger_kernel") is None:
        with pytest.raises(SystemExit, match="pip install liger-kernel"):
            apply_kernels(model, "liger")


def test_committed_suite_split_decisions_match_the_rule():
    """Each committed packed row says whether it ran split at the root; the current rule
    (``use_root_split``, cuDNN at head_dim 128) must decide the same for that workload and model."""
    import json

    from trl_tree import PrefixForest
    from trl_tree.engine.attention.metadata import use_root_split
    from trl_tree.engine.attention.partial import CUDNN_MAX_HEAD_DIM, CUDNN_MIN_HEAD_DIM
    from trl_tree.engine.attention.root_split import RootSplitLayout
    from trl_tree.bench.workloads import suite_workloads
    from trl_tree.engine.model_parts import head_dim_of

    with open("docs/benchmarks/suite_h200.json") as f:
        payload = json.load(f)
    for size, results in payload["results"].items():
        config = shaped_config(size)
        dense = CUDNN_MIN_HEAD_DIM <= head_dim_of(config) <= CUDNN_MAX_HEAD_DIM
        workloads = {w.name: w for w in suite_workloads(config.vocab_size)}
        for r in results:
            forest = PrefixForest.from_sequences(workloads[r["workload"]].sequences)
            layout = RootSplitLayout.from_forest(forest)
            expected = layout is not None and use_root_split(forest, layout, dense)
            packed = next(x for x in r["rows"] if x["path"] == "tree_packed")
            assert packed["root_split"] == expected, (size, r["workload"])


def test_profile_sorts_kernels_by_kind():
    """``bench.profile`` files the kernel names the H200 profiles show under the right kind."""
    from trl_tree.bench.profile import kind_of

    assert kind_of("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT") == "gemm"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "gemm"
    assert kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention"
    assert kind_of("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>") == "attention"
    assert kind_of("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl>") == "elementwise"
    assert kind_of("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16>") == "elementwise"
    assert kind_of("Memcpy HtoD (Pinned -> Device)") == "elementwise"
    assert kind_of("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"
    assert kind_of("some_custom_op") == "other"


def test_last_step_profile_writes_the_operator_tables(tmp_path):
    """``bench.trainer --profile``: the callback profiles the run's last optimizer step only."""
    from types import SimpleNamespace

    import torch

    from trl_tree.bench.trainer import LastStepProfile

    profile = LastStepProfile(str(tmp_path / "mode_rank0.txt"))
    profile.on_step_begin(None, SimpleNamespace(global_step=0, max_steps=2), None)
    assert profile.prof is None  # not the last step
    profile.on_step_begin(None, SimpleNamespace(global_step=1, max_steps=2), None)
    x = torch.randn(32, 32)
    (x @ x).sum()
    profile.on_step_end(None, SimpleNamespace(global_step=2, max_steps=2), None)
    text = (tmp_path / "mode_rank0.txt").read_text()
    assert "# by self_cpu_time_total" in text and "aten::mm" in text and profile.prof is None
    record = json.loads((tmp_path / "mode_rank0.json").read_text())
    # the CPU: no kernels, nothing waited for
    assert record == {"timeline": {}, "host_syncs": {"count": 0, "ms": 0.0, "by_op": {}}, "sync_stacks": []}


def test_timeline_charges_gpu_idle_time_to_the_open_package_range():
    """``bench.profile.timeline``: busy time is the union of the kernels over streams, and each idle
    gap goes to the innermost ``trl_tree.*`` range open at its middle."""
    from trl_tree.bench.profile import timeline

    kernels = [(0, 100), (50, 150), (400, 500)]  # two streams overlap; then 250 µs idle; then 100 busy
    host = [(0, 600, "trl_tree.training_step"), (160, 390, "trl_tree.window.exchange"), (10, 20, "aten::mm")]
    t = timeline(kernels, host, min_gap_ms=0.0)
    assert t["wall_ms"] == 0.6 and t["gpu_busy_ms"] == 0.25 and t["gpu_idle_ms"] == 0.35
    assert t["idle_by_range_ms"] == {"trl_tree.window.exchange": 0.25, "trl_tree.training_step": 0.1}
    assert t["longest_gaps"][0] == {"at_ms": 0.15, "ms": 0.25, "in": "trl_tree.window.exchange"}
    assert t["range_cpu_ms"]["trl_tree.window.exchange"] == {"calls": 1, "ms": 0.23}
    assert timeline([], host) == {}


def test_sync_stacks_counts_synchronisations_by_their_python_stack():
    """``bench.profile.sync_stacks``: each warning of torch's sync debug mode is counted under the
    package frames that led to it (paths from the package on); other warnings pass through."""
    import warnings

    from trl_tree.bench.profile import sync_stacks, top_stacks

    source = "import warnings\ndef synchronising():\n    warnings.warn('called a synchronizing CUDA operation')\n"
    code = compile(source, "/somewhere/site-packages/trl_tree/fake.py", "exec")  # as if the package's own code
    namespace: dict = {}
    exec(code, namespace)
    with sync_stacks() as counts:
        namespace["synchronising"]()
        namespace["synchronising"]()
        with pytest.warns(UserWarning, match="another"):
            warnings.warn("another")
    assert top_stacks(counts) == [{"count": 2, "stack": ["trl_tree/fake.py:3 synchronising"]}]


def test_profiled_ranges_open_one_per_call():
    """``trl_tree.engine._profiling.profiled``: a call inside another call of the same function opens a
    range of its own (``record_function`` as a decorator shares one object between the calls)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trl_tree.engine._profiling import profiled

    @profiled("trl_tree.test.nested")
    def countdown(n: int) -> int:
        torch.ones(1)  # a range with no operator in it is not recorded
        return countdown(n - 1) + 1 if n else 0

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert countdown(2) == 2
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.name == "trl_tree.test.nested")
    assert len(spans) == 3  # nested, each closed by its own call
    assert spans[0][0] <= spans[1][0] <= spans[2][0] <= spans[2][1] <= spans[1][1] <= spans[0][1]


def test_the_demo_says_when_its_ratio_is_not_to_be_trusted(monkeypatch, capsys):
    """The demo times stock and tree one after the other: steps that vary more than 1.5x within a run,
    or a load average above the cores, make it say the ratio may be skewed; a quiet run says nothing."""
    from trl_tree.tools import demo

    monkeypatch.setattr(demo.os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    monkeypatch.setattr(demo.os, "cpu_count", lambda: 2)
    demo._say_if_unreliable((100.0, 120.0), (400.0, 430.0))
    assert capsys.readouterr().out == ""
    demo._say_if_unreliable((100.0, 190.0), (400.0, 430.0))
    assert "varied up to 1.9x" in capsys.readouterr().out
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (4.2, 4.0, 4.0))
    demo._say_if_unreliable((100.0, 120.0), (400.0, 430.0))
    assert "load average is 4.2 on 2 core(s)" in capsys.readouterr().out


def test_the_bench_records_other_jobs_on_the_gpus(monkeypatch, capsys):
    """``environment()`` lists the processes of other jobs on the host's GPUs (its own launch's left
    out) and warns on stderr; where nvidia-smi is missing it says it cannot tell."""
    import os
    import types

    from trl_tree.bench import common

    table = f"{os.getpid()}, python, 900\n{os.getppid()}, accelerate, 10\n4242424, python3, 30000\n"
    monkeypatch.setattr(common.subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=0, stdout=table))
    assert common.gpu_neighbours() == [{"pid": 4242424, "name": "python3", "used_mib": "30000"}]
    assert "other processes use this host's GPUs" in capsys.readouterr().err
    monkeypatch.setattr(common.subprocess, "run",
                        lambda *a, **k: types.SimpleNamespace(returncode=0, stdout=f"{os.getpid()}, python, 900\n"))
    assert common.gpu_neighbours() == [] and capsys.readouterr().err == ""
    # a process this run started (FA4's compile workers hold a CUDA context) is not another job's
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        listing = f"{os.getpid()}, python, 900\n{child.pid}, python3, 664\n"
        monkeypatch.setattr(common.subprocess, "run",
                            lambda *a, **k: types.SimpleNamespace(returncode=0, stdout=listing))
        assert common.gpu_neighbours() == [] and capsys.readouterr().err == ""
    finally:
        child.kill()

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(common.subprocess, "run", missing)
    assert common.gpu_neighbours().startswith("unknown")
