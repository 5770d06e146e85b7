"""Two gloo processes: ``GradientAverager`` against ``average_gradients`` (test_grad_sync.py runs it).

Each rank trains the same small model on its own data with three backward passes per step (as a
walk's units or a window's calls). The averager is armed before the last pass (bit for bit the
same sums; also with every all-reduce held until after that pass), before the first (what the later passes add is reduced apart and added: equal up to
rounding), or never; in one case a parameter only rank 0 trains; in another only rank 0 runs a
backward at all (a window's rank that owns no tree), its last bucket final first (as a tied
weight's is), and both ranks exchange on a group of their own (``RankExchange``'s) between rank
0's backward and ``finish`` — each group's collectives must line up: the buckets go in order.
Exits non-zero on any difference.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from trl_tree.distributed.grad_sync import GradientAverager, average_gradients  # noqa: E402

CASES = ("last", "after", "first", "never", "unused_here", "idle_rank")


def _passes(params, rank: int, case: str, arm=None) -> None:
    """Three backward passes through the last three layers (params 2..7); the spare first layer
    (params 0, 1: the last bucket, in the backward's reverse order) only where ``unused_here``."""
    if case == "idle_rank" and rank == 1:
        return  # a rank that owns no tree: no backward at all
    g = torch.Generator().manual_seed(100 + rank)
    layers = [(params[k], params[k + 1]) for k in range(2, 8, 2)]
    for step in range(3):
        if arm is not None and step == {"last": 2, "after": 2, "first": 0, "idle_rank": 2}.get(case, -1):
            arm()
        x = torch.randn(5, 8, generator=g)
        for k, (w, b) in enumerate(layers):
            x = torch.nn.functional.linear(x, w, b)
            x = torch.tanh(x) if k < 2 else x
        loss = x.pow(2).sum()
        if case in ("unused_here", "idle_rank") and rank == 0:  # the last bucket: final first in the backward
            loss = loss + torch.nn.functional.linear(x, params[0], params[1]).sum()
        loss.backward()


def _two_averagers(rank: int, world: int, exchange) -> list:
    """A policy's and a critic's averagers (PPO's), rank 1 owning no tree: rank 0 runs both
    backwards, each followed by its ``flush``; rank 1 only flushes. Then the window's exchange and
    both ``finish``es. Every rank issues the policy's buckets, the critic's, then their flags: the
    order ``flush`` fixes (without it rank 1 would send the policy's flags before the critic's
    buckets). Returns (got, want) pairs."""
    torch.manual_seed(1)
    policy, critic = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)
    params = list(policy.parameters()) + list(critic.parameters())
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    averagers = GradientAverager(params[:2], world, bucket_bytes=200), GradientAverager(params[2:], world, 64)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(7))
    for averager, loss in zip(averagers, (lambda w: torch.tanh(torch.nn.functional.linear(x, w[0], w[1])).sum(),
                                          lambda w: torch.nn.functional.linear(x @ torch.ones(8, 16), w[2], w[3]).sum())):
        if rank == 0:
            averager.arm()
            loss(params).backward()
        averager.flush()
    assert exchange.all_gather_object(rank) == list(range(world))
    for averager in averagers:
        averager.finish()
        averager.remove()
    if rank == 0:
        torch.tanh(torch.nn.functional.linear(x, reference[0], reference[1])).sum().backward()
        torch.nn.functional.linear(x @ torch.ones(8, 16), reference[2], reference[3]).sum().backward()
    for p in reference:
        p.grad = p.grad if p.grad is not None else torch.zeros_like(p)
    average_gradients(reference, world)
    return [(p.grad, r.grad) for p, r in zip(params, reference)]


def worker(rank: int, world: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from datetime import timedelta

    from trl_tree.distributed.exchange import RankExchange

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))  # a mismatch fails
    exchange = RankExchange(group=dist.new_group())
    results = {}
    for case in CASES:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(4, 4), torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)]
        params = [p for layer in layers for p in layer.parameters()]
        reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
        averager = GradientAverager(params, world, bucket_bytes=600,  # several buckets
                                    launch_in_backward=case != "after")  # after: every bucket at finish
        _passes(params, rank, case, averager.arm)
        if case == "idle_rank":  # the window's exchange while rank 0's buckets are in flight
            assert exchange.all_gather_object(rank) == list(range(world))
        averager.finish()
        buckets = averager.last_step["buckets"]
        # the bucket of the spare layer (the first, in reverse order) gets no gradient: it leaves at finish
        expected = {"last": (buckets - 1, 0), "after": (0, 0), "first": (buckets - 1, buckets - 1), "never": (0, 0),
                    "idle_rank": (buckets if rank == 0 else 0, 0)}.get(case)
        if expected is not None:  # last: the others left during the backward; first: each again at the end
            got = (averager.last_step["overlapped"], averager.last_step["again"])
            assert got == expected, (case, averager.last_step)
        _passes(reference, rank, case)
        if case == "idle_rank":  # rank 0's gradients averaged with rank 1's zeros
            for p in reference:
                p.grad = p.grad if p.grad is not None else torch.zeros_like(p)
            average_gradients(reference[:2], world)
        average_gradients(reference[2:], world)
        if case == "unused_here":  # rank 0's gradient averaged with the other's zeros
            for p in reference[:2]:
                grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(grad)
                p.grad = grad / world
        results[case] = [(p.grad, r.grad) for p, r in zip(params, reference)]
        averager.remove()
    results["two_averagers"] = _two_averagers(rank, world, exchange)
    torch.save(results, f"{path}.{rank}")
    dist.destroy_process_group()


def main() -> int:
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.path.join(tempfile.mkdtemp(), "grads")
    mp.spawn(worker, args=(2, port, path), nprocs=2, join=True)
    ranks = [torch.load(f"{path}.{r}") for r in range(2)]
    for rank, cases in enumerate(ranks):
        for case, pairs in cases.items():
            if case == "two_averagers":
                continue
            for k, (got, want) in enumerate(pairs):
                if case not in ("unused_here", "idle_rank") and k < 2:  # no rank trained it: it stays None
                    assert got is None and want is None, (rank, case, k, got)
                    continue
                assert got is not None, (rank, case, k)
                if case == "first":  # what came after a bucket left is summed apart, then added: rounding only
                    assert torch.allclose(got, want, rtol=1e-6, atol=1e-8), (rank, case, k, got, want)
                else:  # armed where the gradients are final, or not at all: the very same sums
                    assert torch.equal(got, want), (rank, case, k, got, want)
    for rank, cases in enumerate(ranks):
        for k, (got, want) in enumerate(cases["two_averagers"]):
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-8), (rank, "two_averagers", k, got, want)
    for case in (*CASES, "two_averagers"):
        for (a, _), (b, _) in zip(ranks[0][case], ranks[1][case]):
            assert (a is None and b is None) or torch.equal(a, b), ("ranks disagree", case)
    print("ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
