"""Shared fixtures: tiny models built in code and the exactness helpers of DESIGN ("Exactness")."""

from __future__ import annotations

import pytest
import torch

from trl_tree.tiny import tiny_model

LOGP_ATOL = 1e-5  # max abs difference of log-probs, fp32
GRAD_RTOL = 1e-5  # ||g_tree - g_ref|| / ||g_ref|| per parameter, fp32


def pytest_configure(config):
    torch.set_num_threads(2)
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
    assert tree.keys() == ref.keys(), sorted(set(tree) ^ set(ref))
    for name, g in ref.items():
        err = ((tree[name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert err <= rtol, f"{name}: relative gradient error {err:.3e} > {rtol}"


def weighted_loss(lp: torch.Tensor, seq_idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """A per-token loss that depends on sequence and position (signs differ), like GRPO's."""
    weight = ((seq_idx * 7 + pos * 13) % 5 - 2).to(lp.dtype) / 2
    return -lp * weight + 0.01 * lp.exp() * (pos % 2)
