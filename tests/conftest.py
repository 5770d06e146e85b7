"""Shared fixtures: tiny models built in code and the exactness helpers of DESIGN ("Exactness")."""

from __future__ import annotations

import os

import pytest
import torch

from trl_tree.data.tiny import tiny_model

LOGP_ATOL = 1e-5  # max abs difference of log-probs, fp32
GRAD_RTOL = 1e-5  # ||g_tree - g_ref|| / ||g_ref|| per parameter, fp32


def free_port() -> int:
    """A TCP port free on this machine now, for a launch's rendezvous: tests that start several
    processes may run at the same time (pytest-xdist), and a fixed port would collide."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def no_leaked_launcher_settings():
    """A test must not leave Accelerate's launcher variables changed: TrainingArguments read
    ``ACCELERATE_MIXED_PRECISION`` and friends, so a leak silently turns a later test's fp64 run into
    bf16 (it did, depending on which pytest-xdist worker ran what)."""
    before = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
    if after != before:
        os.environ.update(before)
        for k in set(after) - set(before):
            del os.environ[k]
        pytest.fail(f"the test left Accelerate's launcher settings changed: {before} -> {after}")


def pytest_configure(config):
    # two cores: two threads in one process, one in each of pytest-xdist's two workers
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
    torch.use_deterministic_algorithms(False)


@pytest.fixture(scope="session")
def qwen2():
    return tiny_model("qwen2")


def assert_logps_close(tree, ref, atol: float = LOGP_ATOL) -> None:
    assert len(tree) == len(ref)
    for i, (a, b) in enumerate(zip(tree, ref)):
        assert a.shape == b.shape, f"sequence {i}: {tuple(a.shape)} vs {tuple(b.shape)}"
        if a.numel():
            err = (a.detach() - b.detach()).abs().max().item()
            assert err <= atol, f"sequence {i}: max |Δ log-prob| = {err:.3e} > {atol}"


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(tree: dict, ref: dict, rtol: float = GRAD_RTOL) -> None:
    """||g_tree - g_ref|| / ||g_ref|| <= rtol for every parameter.

    A gradient that is mathematically zero (e.g. q_proj on a constant sequence, where attention
    cannot depend on the scores) is pure fp32 rounding noise, and dividing by its norm measures
    nothing; the denominator is therefore floored at 10% of the largest parameter gradient's norm
    (such a parameter must still match to 1e-6 of the model's gradient scale).
    """
    assert tree.keys() == ref.keys(), sorted(set(tree) ^ set(ref))
    floor = 0.1 * max(g.norm() for g in ref.values()).clamp_min(1e-30)
    for name, g in ref.items():
        err = ((tree[name] - g).norm() / torch.maximum(g.norm(), floor)).item()
        assert err <= rtol, f"{name}: relative gradient error {err:.3e} > {rtol}"


def weighted_loss(lp: torch.Tensor, seq_idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """A per-token loss whose weight depends on sequence and position, like GRPO's advantages.

    Weights are kept positive: with mixed signs a constant sequence's terms cancel to a gradient
    that is only rounding residue, and comparing residues says nothing about exactness.
    """
    weight = 1 + ((seq_idx * 7 + pos * 13) % 5).to(lp.dtype) / 4
    return -lp * weight + 0.01 * lp.exp() * (pos % 2)
