"""Attention outputs kept from a checkpointed forward for the recompute in backward.

Why: under gradient checkpointing (TRL's default) every decoder layer runs its forward twice —
once in the forward, once again in the backward to rebuild what it dropped — and tree attention
is a larger share of a tree step than of an untreed one (every shared token is attended by every
branch below it; docs/benchmarks/notes.md gives the shares). The
FlashAttention backward needs only q, k, v (rebuilt by the recompute anyway) plus the output and
its log-sum-exp; keeping those two from the first forward lets the recompute skip the attention
kernels altogether. The result is bit for bit the same — the recompute would rebuild identical
values — for one more hidden-sized tensor per token and layer (as much again as the layer inputs
checkpointing keeps), released layer by layer as the backward reaches it. Megatron-LM's
"selective recomputation" makes the same trade the other way round, for attention whose
``S²`` probabilities are the memory hog; FlashAttention has none, so keeping is cheap.

Entries are keyed by the attention module and taken last-in first-out, so a module that is called
twice in one forward gets its own outputs back in the order the backward recomputes them. The
recompute is told from the forward by the number of attention calls served: a forward makes
exactly one per layer (the engine checks it), every later call of the same metadata is a recompute.
"""

from __future__ import annotations

from typing import Any


class KeptAttention:
    """Per-module stacks of a forward's attention results, handed to the recompute once each."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._kept: dict[int, list[Any]] = {}

    def recomputing(self, calls: int) -> bool:
        """Whether the ``calls``-th attention call of this metadata (1-based) is a recompute."""
        return calls > self.layers

    def keep(self, module: object, entry: Any) -> None:
        self._kept.setdefault(id(module), []).append(entry)

    def recomputed(self, calls: int, module: object) -> Any | None:
        """What the ``calls``-th attention call of this metadata gets back: the module's kept entry
        (taken) when the call is the recompute, else None (compute it)."""
        return self.take(module) if self.recomputing(calls) else None

    def keep_from_forward(self, calls: int, module: object, entry: Any) -> None:
        """Keep ``entry`` if the ``calls``-th call is the forward (its output detached by the caller:
        the alias, not the tensor autograd is handed now); a recompute that found nothing keeps nothing."""
        if not self.recomputing(calls):
            self.keep(module, entry)

    def take(self, module: object) -> Any | None:
        """The module's latest kept entry, removed (None: nothing kept, compute it again)."""
        stack = self._kept.get(id(module))
        if not stack:
            return None
        entry = stack.pop()
        if not stack:
            del self._kept[id(module)]
        return entry

    def __len__(self) -> int:
        return sum(len(stack) for stack in self._kept.values())
