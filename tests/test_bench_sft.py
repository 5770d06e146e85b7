"""The SFT trainer benchmark's modes run end to end (CPU, a tiny config): stock padded, stock packed
(bfd), the tree packed and dfs, on a small per-turn shape; the tree sees the shape's sharing."""

import numpy as np

from trl_tree.bench.sft import run_mode
from trl_tree.bench.workloads import SFTShape, _per_turn, sft_shapes
from trl_tree.data.tiny import tiny_config


def test_every_mode_runs_on_a_small_shape():
    config = tiny_config("qwen2", vocab_size=64, max_position_embeddings=512)
    ids, labels = _per_turn(np.random.default_rng(0), 64, 2, 3, 40, 6, 10)
    shape = SFTShape("small", "2 x 3 turns", ids, labels)
    losses = {}
    for mode in ("stock", "stock_packed", "tree", "tree_dfs"):
        result = run_mode(mode, shape, config, steps=2)
        losses[mode] = result["loss"]
        if mode.startswith("tree"):
            assert result["T_over_U"] > 2.0
    assert max(losses.values()) - min(losses.values()) < 1e-3  # one model, one batch: one loss


def test_shapes_have_the_sharing_they_describe():
    shapes = {s.name: s for s in sft_shapes(1000)}
    assert set(shapes) == {"turns_2x8", "turns_1x16", "branches", "reasoning", "system", "none"}
    turns = shapes["turns_1x16"]
    assert all(turns.input_ids[k][: len(turns.input_ids[k - 1]) - 384] == turns.input_ids[k - 1][:-384]
               for k in range(1, 16))
    assert shapes["none"].score_from == [256] * 16


def test_dpo_bench_modes_run_on_a_small_shape():
    """The DPO trainer benchmark's modes on a tiny config: one loss, the pairs' prompts shared."""
    from trl_tree.bench.dpo import flop_limit
    from trl_tree.bench.dpo import run_mode as run_dpo

    config = tiny_config("qwen2", vocab_size=64, max_position_embeddings=512)
    rng = np.random.default_rng(0)
    head = rng.integers(1, 64, 40).tolist()
    rows = [{"prompt_ids": head, "chosen_ids": rng.integers(1, 64, 8).tolist(),
             "rejected_ids": rng.integers(1, 64, 8).tolist()} for _ in range(2)]
    results = {mode: run_dpo(mode, rows, config, steps=2) for mode in ("stock", "tree", "tree_dfs")}
    # bf16 weights (the bench's dtype): stock's padded rows and the tree round differently
    assert max(r["loss"] for r in results.values()) - min(r["loss"] for r in results.values()) < 2e-3
    assert results["tree"]["T_over_U"] > 2.5
    limit, total, unique = flop_limit(rows, config)
    assert total == 4 * 48 and unique == 40 + 4 * 8 and limit > 1.5


def test_dpo_bench_groups_mode_gathers_a_prompts_pairs():
    """The DPO bench's dataset shape: with tree_shuffle='groups' a micro-batch holds one prompt's
    pairs (more shared), in TRL's order they are scattered."""
    from trl_tree.bench.dpo import run_mode as run_dpo

    config = tiny_config("qwen2", vocab_size=64, max_position_embeddings=512)
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(4):
        head = rng.integers(1, 64, 30).tolist()
        rows += [{"prompt_ids": head, "chosen_ids": rng.integers(1, 64, 6).tolist(),
                  "rejected_ids": rng.integers(1, 64, 6).tolist()} for _ in range(4)]
    scattered = run_dpo("tree", rows, config, steps=4, micro_batch=4)
    grouped = run_dpo("tree+groups", rows, config, steps=4, micro_batch=4)
    assert grouped["T_over_U"] > scattered["T_over_U"] + 1.0


def test_async_bench_modes_run_on_a_small_stream(monkeypatch):
    """The async trainer benchmark's modes on a tiny config (an exact SDPA stand-in for stock's hub
    kernel, as in test_async_grpo_trainer.py): on TRL's batcher every mode trains the same first
    micro-batch (one loss); past the budget stock drops the long turns, the rollouts batcher with dfs
    trains them."""
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import types

    from test_async_grpo_trainer import exact_varlen
    from trl.experimental.async_grpo import packing

    from trl_tree.bench.async_grpo import run_mode as run_async
    from trl_tree.bench.workloads import AsyncStream, _agent_rollouts

    monkeypatch.setattr(packing, "_flash_attn", lambda: types.SimpleNamespace(flash_attn_varlen_func=exact_varlen))
    config = tiny_config("qwen2", vocab_size=64, max_position_embeddings=512)
    samples = _agent_rollouts(np.random.default_rng(0), 64, 6, 8, 6, 2, 2, forks=2, fork_after=2)
    stream = AsyncStream("small", "2 x 6 turns", samples, token_budget=28, fit_budget=40)
    results = {mode: run_async(mode, stream, config, steps=3)
               for mode in ("stock", "tree", "tree_dfs", "stock+fit", "tree_dfs+rollouts")}
    same = [results[m]["first_loss"] for m in ("stock", "tree", "tree_dfs")]
    assert max(same) - min(same) < 1e-5 * abs(same[0])
    assert results["stock"]["dropped"] > 0 and results["stock+fit"]["dropped"] == 0
    assert results["tree_dfs+rollouts"]["dropped"] == 0
    assert results["tree"]["T_over_U"] > 1.2
