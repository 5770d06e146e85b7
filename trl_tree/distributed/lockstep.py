"""The ranks' model calls lined up, for models gathered block by block inside each call.

Why: gathered block by block (FSDP2's per-block units), a call of the model
is a sequence of collectives — every block's all-gather in the forward, again in the backward —
and collectives must be issued in the same order on every rank. But a rank's calls depend on its
own trees: a walk's units (a push is a forward, a pop or group a forward and its backward), calls
under a token budget, a window's share of trees (none at all, on some rank). Left alone, one
rank's forward would meet another's backward: equal-shaped blocks gathered in different orders
exchange the wrong shards (a wrong number, not a hang), or the ranks wait for each other.

So every call is a slot the ranks agree on, through one small all-reduce before it: a slot is a
model and a kind — a forward, or a forward whose backward follows before the next call. The slot
is the lowest any rank asks for; a rank that asked for another makes a stand-in call of the slot's
kind (one token, zero loss: the same blocks gathered in the same order, zero added to gradients)
and asks again; at the end of the held block (:meth:`CallLockstep.drain`) a rank that is done
makes stand-in calls until every rank is — as it does before any other collective the ranks make
inside the block (a window's exchanges: ``call_gate.sync_point``). Every slot moves every rank that
asked for it, so the agreement ends; a rank makes at most as many stand-in calls as the other ranks
make real ones.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from ..engine.call_gate import gated

#: the code of a rank with no call left in the held block
_DONE = 1 << 30


class CallLockstep:
    """One agreement per call between the ranks, over the models held block by block now."""

    def __init__(self, device: torch.device, group=None) -> None:
        self.device = device
        self.group = group
        self._models: list[tuple[torch.nn.Module, frozenset[int]]] = []
        #: per held model's index, the module its last real call entered (a critic's calls enter its backbone,
        #: past the root): a stand-in enters there too, to meet the same hooks
        self._entries: dict[int, torch.nn.Module] = {}
        #: slots agreed and stand-in calls made (read by the tests)
        self.slots = 0
        self.standins = 0

    @contextmanager
    def holding(self, model: torch.nn.Module) -> Iterator[None]:
        """Calls of ``model`` (any of its modules) line up until the block ends; on leaving, the
        ranks wait for each other (stand-in calls) — collective, as is entering. After an error the
        other ranks cannot be waited for: nothing more is agreed."""
        self._models.append((model, frozenset(id(m) for m in model.modules())))
        failed = False
        try:
            with gated(self):
                yield
        except BaseException:
            failed = True
            raise
        finally:
            try:
                if not failed:
                    self.drain()
            finally:
                self._models.pop()
                self._entries.pop(len(self._models), None)

    # ------------------------------------------------------------------ the agreement
    def before_call(self, module: torch.nn.Module, grad: bool) -> None:
        index = self._index_of(module)
        if index is None:
            return
        self._entries[index] = module
        code = 2 * index + int(grad)
        while True:
            slot = self._agree(code)
            if slot == code:
                return
            self._stand_in(slot)

    def sync_point(self) -> None:
        self.drain()

    def drain(self) -> None:
        """Stand-in calls until every rank has made its last call of the block (or up to a collective
        every rank makes at the same point: ``call_gate.sync_point``)."""
        while True:
            slot = self._agree(_DONE)
            if slot == _DONE:
                return
            self._stand_in(slot)

    def _index_of(self, module: torch.nn.Module) -> int | None:
        for i in range(len(self._models) - 1, -1, -1):
            if id(module) in self._models[i][1]:
                return i
        return None

    def _agree(self, code: int) -> int:
        value = torch.tensor([code], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=self.group)
        self.slots += 1
        return int(value.item())

    def _stand_in(self, slot: int) -> None:
        """A one-token call of the slot's model: its forward gathers each block in the order a real
        call does; with a graph, a zero loss's backward gathers them again (and adds zeros)."""
        model = self._entries.get(slot // 2, self._models[slot // 2][0])
        self.standins += 1
        ids = torch.ones(1, 1, dtype=torch.long, device=self.device)
        with torch.enable_grad() if slot % 2 else torch.no_grad():
            out = model(input_ids=ids, use_cache=False)
            if slot % 2:
                first = out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))
                (first.float().sum() * 0.0).backward()


def needs_lockstep() -> bool:
    """Whether there are several ranks to line up."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1
