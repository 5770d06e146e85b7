"""``TreeOptions``: how the engine runs a call — kernels, memory and CUDA graphs — grouped in one object.

Why an object: these knobs change how fast a call runs and how much memory it takes, never its
numbers, and a caller sets them once (a trainer maps its config to them, a benchmark sweeps them)
rather than at every call. The entry points keep their own arguments for what changes the result
(``temperature``, ``score_from``, ``value_head``, …) and for ``mode``, the one choice most callers make.
The knobs were keyword arguments of every entry point before; they still are accepted there, with
a ``DeprecationWarning`` (:func:`merge_deprecated`).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TreeOptions:
    """Tuning knobs of ``tree_logprobs``, ``tree_backward``, ``tree_values`` and ``tree_value_backward``.

    Every field's default is what a call does without options; none of them changes a number."""

    attn_backend: str = field(default="auto", metadata={
        "help": "Tree attention kernel: 'auto' (FlashAttention where it runs, else SDPA), 'flash' "
                "(FlashAttention-4), 'torch_flash', 'flex', 'sdpa' or 'eager'."})
    chunk_size: int | None = field(default=None, metadata={
        "help": "mode='dfs': the most tokens of one call of the walk (long nodes cut, small sibling subtrees "
                "grouped up to it); None: sized by the memory model."})
    memory_budget: int | None = field(default=None, metadata={
        "help": "Bytes a call may take: mode='auto' picks packed when its activations fit, and the walk sizes "
                "its groups to it. None: 80% of the free GPU memory (unlimited on CPU); the walk's groups then "
                "stay within one forward+backward of the longest sequence, or 5% of the GPU's memory where that "
                "is larger (cost_model.walk_unit_floor)."})
    keep_graph: bool | None = field(default=None, metadata={
        "help": "mode='dfs' backward: keep each pushed node's graph until its backward instead of recomputing "
                "it. None: keep it where the model uses gradient checkpointing (the kept graph is then only "
                "each layer's input)."})
    keep_attention: bool | None = field(default=None, metadata={
        "help": "Under gradient checkpointing, keep the attention's outputs from the forward for the "
                "recompute (faster, one hidden-sized tensor per token and layer more). None: the layout "
                "default (trl_tree.engine.layout.LAYOUT.keep_attention, on)."})
    cuda_graphs: bool | str = field(default=False, metadata={
        "help": "Replay CUDA graphs of a call's forward and backward once its layout was seen before; "
                "'buckets' also replays layouts that do not repeat, padded to buckets."})

    def __post_init__(self) -> None:
        if not isinstance(self.attn_backend, str):
            raise TypeError(f"attn_backend must be a backend's name, got {self.attn_backend!r}")
        if self.chunk_size is not None and (not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool)
                                            or self.chunk_size < 1):
            raise ValueError(f"chunk_size must be a positive int or None, got {self.chunk_size!r}")
        if self.memory_budget is not None and (not isinstance(self.memory_budget, int)
                                               or isinstance(self.memory_budget, bool) or self.memory_budget < 0):
            raise ValueError(f"memory_budget must be a number of bytes (an int >= 0) or None, got "
                             f"{self.memory_budget!r}")
        if not any(self.keep_graph is v for v in (None, True, False)):
            raise TypeError(f"keep_graph must be True, False or None, got {self.keep_graph!r}")
        if not any(self.keep_attention is v for v in (None, True, False)):
            raise TypeError(f"keep_attention must be True, False or None, got {self.keep_attention!r}")
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "buckets"):
            raise TypeError(f"cuda_graphs must be True, False or 'buckets', got {self.cuda_graphs!r}")

    def replace(self, **changes: object) -> TreeOptions:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)


#: The knobs' names, each once a keyword argument of the entry points.
OPTION_NAMES = tuple(f.name for f in dataclasses.fields(TreeOptions))


def merge_deprecated(options: TreeOptions | None, knobs: dict[str, object], entry_point: str,
                     accepted: tuple[str, ...] = OPTION_NAMES) -> TreeOptions:
    """``options`` with the knobs passed the old way (as keyword arguments) folded in, each with a
    ``DeprecationWarning``; an unknown keyword, a knob this entry point never took, or a knob given
    both ways is a ``TypeError``."""
    unknown = [name for name in knobs if name not in accepted]
    if unknown:
        raise TypeError(f"{entry_point}() got an unexpected keyword argument {unknown[0]!r}")
    if options is not None and not isinstance(options, TreeOptions):
        raise TypeError(f"options must be a trl_tree.TreeOptions, got {type(options).__name__}")
    if not knobs:
        return options if options is not None else TreeOptions()
    twice = [name for name in knobs if options is not None and getattr(options, name) != getattr(TreeOptions, name)]
    if twice:
        raise TypeError(f"{entry_point}(): {twice[0]!r} given both as a keyword argument and in options; "
                        "set it in options only")
    names = ", ".join(f"{name}={value!r}" for name, value in knobs.items())
    warnings.warn(f"{entry_point}({', '.join(knobs)}=...) is deprecated: pass options=TreeOptions({names})",
                  DeprecationWarning, stacklevel=3)
    return (options if options is not None else TreeOptions()).replace(**knobs)
