"""Configs of the tree trainers: TRL's own configs plus the tree fields of DESIGN.md.

The fields live in one mixin dataclass so ``TreeGRPOConfig`` and ``TreeRLOOConfig`` cannot drift
apart; each config is ``(TRL config, TreeArguments)`` and accepts every argument TRL's does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trl import GRPOConfig, RLOOConfig

TREE_MODES = ("packed", "dfs", "off")
TREE_SHUFFLES = ("groups", "rows")
ATTN_BACKENDS = ("auto", "flash", "torch_flash", "flex", "sdpa", "eager")


@dataclass
class TreeArguments:
    """Where and how the policy's log-probs go through the prefix tree."""

    tree_mode: str = field(
        default="packed",
        metadata={
            "help": "'packed': one forward+backward over each micro-batch's unique tokens (fastest; activations ~ "
            "unique tokens). 'dfs': a depth-first walk with a K/V stack, memory bounded by the longest "
            "sequence (the engine runs the backward; see docs/trainers.md). 'off': exactly TRL's trainer."
        },
    )
    tree_shuffle: str = field(
        default="groups",
        metadata={
            "help": "How a generation batch is cut into micro-batches. 'groups': the prompt groups are shuffled "
            "and kept whole, so a micro-batch's sequences share their prompts (the tree's gain); each micro-batch "
            "has TRL's row count. 'rows': TRL's own row shuffle, so every micro-batch (and so every per-micro-batch "
            "normaliser and optimizer step) holds exactly the rows stock TRL gives it, at the cost of sharing. "
            "With one micro-batch per generation batch both give TRL's update (see docs/trainers.md)."
        },
    )
    tree_attn_backend: str = field(
        default="auto",
        metadata={"help": f"Tree attention kernel, one of {ATTN_BACKENDS}. 'auto': flash-attn, else PyTorch's "
                  "FlashAttention varlen, else flex on GPU; sdpa on CPU."},
    )
    tree_token_budget: int | None = field(
        default=None,
        metadata={
            "help": "Largest number of unique tokens one tree call may hold. Set, it (1) spreads prompt groups over "
            "the micro-batches by unique-token cost and (2) cuts a heavier micro-batch into several calls whose "
            "backward runs one after another, so peak memory follows the budget. None: one call per micro-batch."
        },
    )
    tree_chunk_size: int | None = field(
        default=None,
        metadata={"help": "dfs mode: most tokens one step of the walk runs (long nodes are cut into chunks, small "
                  "sibling subtrees grouped up to it). None: whole nodes, and sibling subtrees grouped as far as a call "
                  "stays within one forward+backward of the longest sequence (trl_tree.cost_model.GroupBudget)."},
    )
    tree_memory_budget: int | None = field(
        default=None,
        metadata={"help": "dfs mode without tree_chunk_size: activation bytes one call of the walk may use when "
                  "sibling subtrees are grouped. None: one forward+backward of the longest sequence (the DFS "
                  "memory bound). Larger: fewer, faster calls (the walk is launch-bound on small models)."},
    )
    tree_keep_graph: bool | None = field(
        default=None,
        metadata={"help": "dfs mode: keep each node's graph on the way down instead of recomputing it on the way "
                  "up (one forward less per inner node; memory of the whole path). None: keep it when the model "
                  "uses gradient checkpointing (the kept graph is then only each layer's input)."},
    )

    tree_keep_attention: bool = field(
        default=True,
        metadata={"help": "packed mode under gradient checkpointing: keep each layer's attention output and "
                  "log-sum-exp from the forward so the recompute skips the attention kernels (the same gradients; "
                  "1-4% faster at 1.5B/7B, more on deep trees) for one hidden-sized tensor per unique token and "
                  "layer. False: recompute the attention, as TRL does."},
    )
    tree_compile_layers: bool = field(
        default=False,
        metadata={"help": "torch.compile every decoder layer's attention module, MLP and norms "
                  "(trl_tree.compile_layers; the tree attention stays eager between the graphs; with tree_mode='off', "
                  "TRL's own step on compiled layers). Pays where the GPU is the bottleneck: 7B packed steps 8-9% "
                  "faster on an H200, the 1.5B Trainer step 13%; little or nothing on small models whose tree "
                  "steps wait on the host. The first steps compile (10-15 s)."},
    )
    tree_cuda_graphs: bool = field(
        default=False,
        metadata={"help": "Replay CUDA graphs of the packed training forward and backward (trl_tree.graphs) for "
                  "micro-batch layouts seen before (captured at the second sighting; the loss stays eager). Pays "
                  "where the host is the bottleneck — small models: a 0.5B agentic-tree step 207 -> 100 ms on an "
                  "H200 — and only when layouts repeat (num_iterations > 1, fixed-length rollouts). Under DDP the call "
                  "runs outside the wrapper and the gradients are averaged by hand (not FSDP/DeepSpeed). Costs one "
                  "gradient-sized buffer and the graphs' activation pool."},
    )
    tree_cuda_graph_buckets: bool = field(
        default=False,
        metadata={"help": "With tree_cuda_graphs: micro-batch layouts that do not repeat (free-length completions) "
                  "replay the graphs of their layout padded to buckets (up to 12.5% more tokens, keys and "
                  "predictions; trl_tree/attention/buckets.py). Pays where the host is the bound: free-length "
                  "GRPO on an H200, 0.5B 193-251 -> 153-162 ms per step; at 1.5B the padding costs more (290 -> 323 ms)."},
    )

    def _check_tree_fields(self) -> None:
        if self.tree_mode not in TREE_MODES:
            raise ValueError(f"tree_mode must be one of {TREE_MODES}, got {self.tree_mode!r}")
        if self.tree_shuffle not in TREE_SHUFFLES:
            raise ValueError(f"tree_shuffle must be one of {TREE_SHUFFLES}, got {self.tree_shuffle!r}")
        if self.tree_attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"tree_attn_backend must be one of {ATTN_BACKENDS}, got {self.tree_attn_backend!r}")
        for name in ("tree_token_budget", "tree_chunk_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        budget = self.tree_memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"tree_memory_budget must be a non-negative int (bytes) or None, got {budget!r}")
        if self.tree_keep_graph not in (None, True, False):
            raise ValueError(f"tree_keep_graph must be True, False or None, got {self.tree_keep_graph!r}")
        for name in ("tree_keep_attention", "tree_compile_layers", "tree_cuda_graphs", "tree_cuda_graph_buckets"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


@dataclass
class TreeGRPOConfig(GRPOConfig, TreeArguments):
    """``trl.GRPOConfig`` plus the tree fields of :class:`TreeArguments` (``tree_mode``, ``tree_shuffle``,
    ``tree_attn_backend``, ``tree_token_budget``, ``tree_chunk_size``, ``tree_memory_budget``,
    ``tree_keep_graph``, ``tree_keep_attention``, ``tree_compile_layers``, ``tree_cuda_graphs``,
    ``tree_cuda_graph_buckets``)."""

    def __post_init__(self):
        self._check_tree_fields()
        super().__post_init__()


@dataclass
class TreeRLOOConfig(RLOOConfig, TreeArguments):
    """``trl.RLOOConfig`` plus the tree fields of :class:`TreeArguments` (``tree_mode``, ``tree_shuffle``,
    ``tree_attn_backend``, ``tree_token_budget``, ``tree_chunk_size``, ``tree_memory_budget``,
    ``tree_keep_graph``, ``tree_keep_attention``, ``tree_compile_layers``, ``tree_cuda_graphs``,
    ``tree_cuda_graph_buckets``)."""

    def __post_init__(self):
        self._check_tree_fields()
        super().__post_init__()


def as_tree_config(args, config_cls, model, suffix: str):
    """A tree config from ``args`` (None, TRL's config or already a tree config)."""
    if isinstance(args, config_cls):
        return args
    if args is None:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
        return config_cls(output_dir=f"{name.split('/')[-1]}-Tree{suffix}")
    # TRL's config is already validated and derived (__post_init__ ran); copy it as it stands and
    # add the tree fields' defaults rather than re-running the checks on derived values
    tree = config_cls.__new__(config_cls)
    tree.__dict__.update(args.__dict__)
    for f in dataclasses.fields(config_cls):
        if f.name.startswith("tree_") and f.name not in tree.__dict__:
            setattr(tree, f.name, f.default)
    tree._check_tree_fields()
    return tree
