"""Causal depthwise convolutions over a prefix tree: transformers' ``causal_conv1d_fn`` — LFM2's and
LFM3's short convolution, and the convolution in front of every gated DeltaNet, Kimi Delta
Attention and Mamba scan.

Why it can be exact: a depthwise causal convolution of kernel ``k`` gives each token a weighted
sum of its own input and the inputs of the ``k - 1`` tokens before it in its sequence. In a prefix
tree those are the token's nearest ``k - 1`` ancestors on its root path, the same in every
sequence through it, so the tree computes each unique token's output once, as it does its
attention. The packed layout already lists every node's root path (``kv_index``, the keys its
attention reads); the ancestor ``j`` steps up of a token at depth ``d`` is that path's entry
``d - j``, or the sequence's zero padding where ``d < j`` — ``F.conv1d``'s left padding.

The depth-first walk carries a convolution's inputs down a stack as it carries attention's K/V
(:func:`_unit_sources`): a unit writes its tokens' inputs into the layer's convolution slots (its
pushed node's slots are its tokens' depths), reads the ``k - 1`` slots below its depth for the
tokens whose ancestors sit there, and in its backward adds those slots' gradients into the
stack's gradient buffer, which the owning node takes into its own backward when it is popped —
the K/V stack's protocol (``dfs/stack.py``), one buffer per convolution. A convolution's slots are
its own (``KVStack.conv_buffer``, keyed by the kernel's call in its layer), so a layer may hold
attention and several convolutions.

A recompute by HF's gradient checkpointing finds the same tables (they are cached on the call's
metadata) and rewrites the same slot values; a recompute that ran the model's own convolution
would change the numbers (and torch's checkpoint refuses it: another count of saved tensors).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from transformers.activations import ACT2FN

from ..attention.metadata import TreeAttentionMetadata


@torch.compiler.disable
def path_ancestors(meta: TreeAttentionMetadata, k: int) -> torch.Tensor:
    """``[U, k]``: column ``j`` holds the packed index of each token's ancestor ``j`` steps up its
    root path (column 0 the token itself), ``U`` where the path is shorter (a zero row); built once
    per forest and kernel size."""
    key = ("path_ancestors", k)
    table = meta._cache.get(key)
    if table is None:
        device = meta.kv_index.device
        cu_q, cu_k = meta.cu_seqlens_q.long(), meta.cu_seqlens_k.long()
        node = torch.repeat_interleave(torch.arange(cu_q.numel() - 1, device=device), cu_q.diff())
        depth = meta.position_ids[0]
        steps = torch.arange(k, device=device)
        along = depth[:, None] - steps[None, :]  # the ancestor's depth on the path
        index = (cu_k[node][:, None] + along.clamp(min=0)).clamp(max=meta.kv_index.numel() - 1)
        table = torch.where(along >= 0, meta.kv_index[index], torch.full_like(index, meta.num_tokens))
        meta._cache[key] = table
    return table


def tree_causal_conv(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, meta,
                     kernel: Hashable) -> torch.Tensor:
    """The depthwise causal convolution ``[n, C] -> [n, C]`` (``weight [C, 1, k]``, as
    ``nn.Conv1d(groups=C)`` holds it) of a tree call's rows, each over its root path: from the packed
    forest's paths (``TreeAttentionMetadata``) or a walk unit's stack slots (``kernel``: whose slots)."""
    k = weight.shape[-1]
    if isinstance(meta, TreeAttentionMetadata):
        sources = torch.cat([inputs, inputs.new_zeros(1, inputs.shape[-1])])
        ancestors = path_ancestors(meta, k)
    else:
        if meta.own_slots is not None:
            raise ValueError("a walk unit padded to buckets (CUDA graphs) does not run convolutions")
        sources, ancestors = _unit_sources(meta, kernel, k, inputs)
    taps = weight[:, 0, :].flip(-1).t()  # [k, C]: row j weighs the ancestor j steps up (tap i: k - 1 - i back)
    out = torch.einsum("ukc,kc->uc", index_rows(sources.to(weight.dtype), ancestors), taps)
    if bias is not None:
        out = out + bias
    return out


def tree_causal_conv1d_fn(call, original, hidden_states: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None, activation: str | None = None, **kwargs) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn`` (``[1, C, n]`` channels first, ``weight [C, k]``, then the
    activation, in the weight's dtype, and back to the input's) over the tree call's rows."""
    out = tree_causal_conv(hidden_states[0].t(), weight.unsqueeze(1), bias, call.meta, call.key("conv"))
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.t().unsqueeze(0).to(hidden_states.dtype)


@torch.compiler.disable
def _unit_sources(meta, kernel: Hashable, k: int, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The unit's convolution sources and their table (:func:`unit_ancestors`), its inputs written
    into the convolution's stack slots. Eager under compiled layers (``trl_tree.engine.compile``): it reads and
    writes the walk's Python-side stack, which a compiled graph would freeze."""
    stack, depth, n = meta.stack, meta.depth, meta.num_tokens
    buf = stack.conv_buffer(kernel, inputs)  # [slots, C]: the path's inputs by depth, then the unit's own
    buf[depth : depth + n] = inputs.detach()
    low = max(0, depth - (k - 1))
    grads = stack.conv_grad_buffer(kernel) if torch.is_grad_enabled() else None
    sources = _StackedInputs.apply(inputs, buf, grads, low, depth, meta.pushed_tokens)
    return torch.cat([sources, sources.new_zeros(1, sources.shape[-1])]), unit_ancestors(meta, k, low)


class _StackedInputs(torch.autograd.Function):
    """``[the stack's slots low..depth; the unit's own inputs]``; the backward adds the stack slots'
    gradient into the stack's fp32 gradient buffer (their owners take it when popped) and hands the
    unit's pushed rows the gradient their descendants left in their slots, emptying them."""

    @staticmethod
    def forward(ctx, inputs, buf, grads, low: int, depth: int, pushed: int):
        ctx.grads, ctx.low, ctx.depth, ctx.pushed = grads, low, depth, pushed
        return torch.cat([buf[low:depth], inputs])

    @staticmethod
    def backward(ctx, grad):
        grads, low, depth, pushed = ctx.grads, ctx.low, ctx.depth, ctx.pushed
        prefix = depth - low
        if prefix:
            grads[low:depth] += grad[:prefix].float()
        own = grad[prefix:]
        if pushed:
            slots = grads[depth : depth + pushed]
            own = own.clone()
            own[:pushed] = (slots + own[:pushed]).to(own.dtype)  # summed in fp32, rounded once
            slots.zero_()
        return own, None, None, None, None, None


def unit_ancestors(meta, k: int, low: int) -> torch.Tensor:
    """``[n, k]`` rows of a unit's convolution sources (``[stack slots low..depth; own rows; zero]``):
    column ``j`` the ancestor ``j`` steps up each token's path — an own row where it is in the unit
    (the node's in-unit path, ``kv_local``), else the stack slot at its depth, else the zero row.
    Built once per unit and kernel size."""
    cache = meta._conv
    table = cache.get((k, low))
    if table is None:
        device = meta.position_ids.device
        n, depth = meta.num_tokens, meta.depth
        cu_q, cu_k = meta.cu_seqlens_q.long(), meta.cu_seqlens_k.long()
        q_len = cu_q.diff()
        node = torch.repeat_interleave(torch.arange(q_len.numel(), device=device), q_len)
        row = torch.arange(n, device=device)
        if meta.kv_local is None:  # each node's in-unit path is itself
            path_start, path_len, path = cu_q[node], q_len[node], row
        else:
            path_start, path_len, path = cu_k[node], cu_k.diff()[node], meta.kv_local
        at = path_len - q_len[node] + (row - cu_q[node])  # the token's place on its in-unit path
        steps = torch.arange(k, device=device)
        up = at[:, None] - steps[None, :]
        own = path[(path_start[:, None] + up.clamp(min=0)).clamp(max=path.numel() - 1)]
        slot = meta.position_ids[0][:, None] - steps[None, :]  # the ancestor's depth: its stack slot
        prefix = depth - low
        table = torch.where(up >= 0, prefix + own,
                            torch.where(slot >= low, slot - low, torch.full_like(slot, prefix + n)))
        cache[(k, low)] = table
    return table


def index_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for an index of any shape, through ``index_select``: its backward adds into the
    rows (an index_add), where advanced indexing's sorts the indices first."""
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])
