"""What moves between ranks when trees are placed on ranks other than their rows' own: token ids
once per window, then per-token tensors (log-probs out, loss gradients back) — never activations.

A thin layer over ``torch.distributed`` (the process group Accelerate set up: gloo on CPU, NCCL on
GPU) that is the identity for one process, so the window code has one path for 1 and N ranks.
Each collective is a sync point of the calls lined up block by block (``engine/call_gate.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..engine.call_gate import sync_point


class RankExchange:
    """``rank`` and ``world`` of the default process group (0 and 1 when there is none); the
    collectives run on ``group`` (default: the default group).

    Why a group of its own (:func:`exchange_group`): a window's trees are walked while the
    gradients' all-reduces they make final are in flight (``grad_sync.GradientAverager``, on
    :func:`reduction_group`), and a rank that owns no tree launches its all-reduces only
    later. Collectives of one group must be issued in the same order on every rank, so the
    window's exchanges, which every rank issues at the same points, go on another."""

    def __init__(self, rank: int | None = None, world: int | None = None, group=None) -> None:
        initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = rank if rank is not None else (torch.distributed.get_rank() if initialized else 0)
        self.world = world if world is not None else (torch.distributed.get_world_size() if initialized else 1)
        self.group = group
        if self.world > 1 and not initialized:
            raise RuntimeError(f"{self.world} ranks asked for but torch.distributed is not initialised")

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (pickled: for small agreements, such as which kinds of
        gradient a pass received; the window's token ids go through :meth:`all_gather_ints`)."""
        if self.world == 1:
            return [obj]
        sync_point()
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj, group=self.group)
        return out

    def all_gather_ints(self, values: np.ndarray) -> list[np.ndarray]:
        """Every rank's 1-D int64 array, in rank order, through two tensor collectives — the lengths,
        then the arrays padded to the longest — and one copy back to the host: no pickling, which
        ``all_gather_object`` does to every rank's token arrays at every window (host time a short
        step pays in full)."""
        values = np.ascontiguousarray(values, dtype=np.int64)
        if self.world == 1:
            return [values]
        sync_point()
        device = self._device()
        size = torch.tensor([values.size], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(size) for _ in range(self.world)]
        torch.distributed.all_gather(sizes, size, group=self.group)
        counts = torch.cat(sizes).tolist()  # one read-back
        mine = torch.zeros(max(counts), dtype=torch.int64, device=device)
        mine[: values.size] = torch.from_numpy(values).to(device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        torch.distributed.all_gather(out, mine, group=self.group)
        flat = torch.stack(out).cpu().numpy()
        return [flat[r, : counts[r]] for r in range(self.world)]

    def _device(self) -> torch.device:
        """Where this group's collectives take their tensors: the current GPU under NCCL, else the CPU."""
        if torch.distributed.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_to_all(self, send: list[torch.Tensor], recv_sizes: list[int]) -> list[torch.Tensor]:
        """``send[d]`` (1-D, one dtype and device for all) goes to rank ``d``; returns what each rank
        sent here, ``recv_sizes[s]`` elements from rank ``s``. Every rank knows the sizes (the plan
        is computed identically everywhere), so no size exchange is needed."""
        if len(send) != self.world or len(recv_sizes) != self.world:
            raise ValueError(f"all_to_all needs one tensor and one size per rank ({self.world})")
        if self.world == 1:
            if send[0].numel() != recv_sizes[0]:
                raise ValueError(f"sending {send[0].numel()} elements to self, expected {recv_sizes[0]}")
            return [send[0]]
        sync_point()
        flat = torch.cat([t.reshape(-1) for t in send])
        out = flat.new_empty(sum(recv_sizes))
        torch.distributed.all_to_all_single(out, flat, output_split_sizes=list(recv_sizes),
                                            input_split_sizes=[t.numel() for t in send], group=self.group)
        return list(out.split(list(recv_sizes)))


_EXCHANGE_GROUPS: dict[tuple, object] = {}
_REDUCTION_GROUPS: dict[tuple, object] = {}


def _own_group(groups: dict[tuple, object], max_ctas: int | None = None,
               high_priority: bool = False) -> tuple[object | None, bool]:
    """A communicator over every rank of the default group, made once per default group (a later
    init gets its own) and NCCL settings, kept in ``groups``, and whether this call made it; None on
    one process. Making it is a collective call. ``max_ctas``, ``high_priority``: NCCL's
    ``maxCTAs`` and a high-priority stream (ignored by other backends)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None, False
    if torch.distributed.get_world_size() == 1:
        return None, False
    key = (id(torch.distributed.group.WORLD), max_ctas, high_priority)
    made = key not in groups
    if made:
        options = None
        if (max_ctas is not None or high_priority) and torch.distributed.get_backend() == "nccl":
            options = torch.distributed.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
            if max_ctas is not None:
                config = options.config
                config.max_ctas = max_ctas
                options.config = config
        groups[key] = torch.distributed.new_group(pg_options=options)
    return groups[key], made


def exchange_group():
    """The process group of the windows' exchanges (every rank of the default group, a communicator
    of their own), made on first use — a collective call, which every rank makes when its first
    window opens; None on one process."""
    return _own_group(_EXCHANGE_GROUPS)[0]


def reduction_group(device: torch.device | None = None, max_ctas: int | None = None, high_priority: bool = False):
    """The process group of the gradient average the trainers do by hand (``grad_sync``), made by
    every rank when its trainer is built; None on one process.

    Why not the default group: collectives of one group run one after another, and TRL's loss
    gathers its metrics on the default group at every micro-step. A one-pass window's backward runs
    at the window's first micro-step; its all-reduces can then finish while the later micro-steps
    run TRL's loss on the host — unless each of those gathers must first wait for every gradient
    bucket queued before it. ``device``: where one small all-reduce makes the communicator right
    away (NCCL makes it at first use, which would otherwise be inside a rank's backward, waiting
    there for ranks that reach theirs later). ``max_ctas``, ``high_priority``: NCCL settings of the
    communicator (``bench.trainer``'s ``+ctas=N``, ``+hipri``: how many SMs the overlapped all-reduces
    may take from the backward they run beside, and whether they go first when SMs free up)."""
    group, made = _own_group(_REDUCTION_GROUPS, max_ctas, high_priority)
    if made:
        torch.distributed.all_reduce(torch.zeros(1, device=device), group=group)
    return group
