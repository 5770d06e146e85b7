"""``mode="auto"``: pick packed or dfs, and the dfs chunk size, from a memory budget.

Analytic, from the model's config (documented in docs/architecture.md, "Choosing the mode"):

- activation bytes per token and layer of a decoder layer kept for backward, bf16:
  ``(8·hidden + 4·intermediate + 4·kv_heads·head_dim) · 2`` (norm inputs, q/k/v, attention output,
  MLP gate/up/act/down inputs); under gradient checkpointing only the layer input (``2·hidden``
  bytes) is kept per layer, plus one layer's full activations while it is recomputed;
- packed keeps that for the U unique tokens at once;
- dfs keeps it for one unit (≤ ``chunk_size`` tokens) plus the K/V stack of the path: per slot and
  layer ``kv_heads·head_dim`` values in K and V (model dtype) and their fp32 gradients.

Time: measured on an H200 (docs/benchmarks), packed was faster than dfs on every forest but one
(the 7B agentic tree, where dfs led by 4%) — dfs adds one launch-bound forward+backward per unit
— so the choice is memory-driven: packed whenever it fits, else dfs with the largest chunk that
fits (fewest calls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .forest import PrefixForest

#: chunk sizes tried for dfs, largest first
CHUNK_CANDIDATES = (16384, 8192, 4096, 2048, 1024, 512, 256)


@dataclass(frozen=True)
class ModeChoice:
    mode: str
    chunk_size: int | None
    estimated_bytes: int


def _per_token_bytes(config, gradient_checkpointing: bool, dtype_bytes: int = 2) -> tuple[int, int]:
    """(bytes kept per token for the whole layer stack, bytes of one layer's full activations per token)."""
    h = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = config.num_key_value_heads
    layer_full = (8 * h + 4 * config.intermediate_size + 4 * kv * head_dim) * dtype_bytes
    layers = config.num_hidden_layers
    if gradient_checkpointing:
        return layers * h * dtype_bytes, layer_full
    return layers * layer_full, 0


def estimate_bytes(config, tokens: int, gradient_checkpointing: bool, stack_slots: int = 0) -> int:
    """Activation bytes of one call over ``tokens`` (plus a K/V stack of ``stack_slots``)."""
    kept, transient = _per_token_bytes(config, gradient_checkpointing)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    stack = stack_slots * config.num_hidden_layers * config.num_key_value_heads * head_dim * (2 + 2 + 4 + 4)
    return tokens * (kept + transient) + stack


def choose_mode(forest: PrefixForest, config, memory_budget: int, gradient_checkpointing: bool) -> ModeChoice:
    """Packed if its activations fit ``memory_budget`` bytes, else dfs with the largest fitting chunk."""
    packed = estimate_bytes(config, forest.num_unique_tokens, gradient_checkpointing)
    if packed <= memory_budget:
        return ModeChoice("packed", None, packed)
    best = None
    for chunk in CHUNK_CANDIDATES:
        chunk = min(chunk, forest.max_depth)
        need = estimate_bytes(config, chunk, gradient_checkpointing, stack_slots=forest.max_depth + chunk)
        best = ModeChoice("dfs", chunk, need)
        if need <= memory_budget:
            return best
    return best  # the smallest chunk: the closest to the budget dfs can get


def default_memory_budget(device: torch.device) -> int | None:
    """80% of the free memory of a CUDA device; None (no limit) elsewhere."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * 0.8)
