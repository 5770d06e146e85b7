"""The engine's layout choices: switches the packed pass and the walk read on every call.

Why one object in a module of its own: the packed pass, the depth-first walk and the entry points
all read these switches, and the benchmarks and the GPU check flip them to time or check a layout
the defaults would not pick. Kept below all three, they are one place to read and one place to
change (``layout_choices``), whichever module runs the call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields


@dataclass
class LayoutChoices:
    """The defaults are what a call does unless a benchmark says otherwise."""

    #: Run a forest with little to share as stock's right-padded batch through the model's own
    #: attention (``cost_model.runs_padded``, ``packed.padded_batch``). The benchmarks set it False to
    #: time the tree itself on such batches.
    dense_unshared_batches: bool = True
    #: Split the packed FlashAttention at the roots (``attention/root_split.py``): None = where it pays
    #: (``metadata.use_root_split``); the benchmarks force True/False to time both.
    root_split: bool | None = None
    #: Under gradient checkpointing, keep each layer's attention output and log-sum-exp from the forward
    #: so the recompute skips the attention kernels (``attention/kept.py``; packed FlashAttention path).
    #: Costs one hidden-sized tensor per token and layer until the backward reaches the layer. The
    #: default of the entry points' ``keep_attention=None``; set False (or pass ``keep_attention=False``)
    #: where that memory is needed more than the step time it saves.
    keep_attention: bool = True
    #: A training walk that recomputes its pushed nodes recomputes each one together with its first
    #: group of children where both fit (``dfs/plan.py``, merged pops); the benchmarks set it False to
    #: time the walk with every pop a call of its own.
    merge_pops: bool = True


#: The choices every call reads.
LAYOUT = LayoutChoices()


@contextmanager
def layout_choices(dense_unshared_batches: bool = True, root_split: bool | None = None, keep_attention: bool = True,
                   merge_pops: bool = True) -> Iterator[LayoutChoices]:
    """Run steps with these layout choices and restore the previous ones afterwards — how the
    benchmarks and the GPU check time or check a layout the defaults would not pick."""
    saved = {f.name: getattr(LAYOUT, f.name) for f in fields(LAYOUT)}
    chosen = {"dense_unshared_batches": dense_unshared_batches, "root_split": root_split,
              "keep_attention": keep_attention, "merge_pops": merge_pops}
    for name, value in chosen.items():
        setattr(LAYOUT, name, value)
    try:
        yield LAYOUT
    finally:
        for name, value in saved.items():
            setattr(LAYOUT, name, value)
