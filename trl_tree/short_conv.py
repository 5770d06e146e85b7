"""Short causal convolutions (LFM2's ``Lfm2ShortConv``) over a prefix tree, exact.

Why it can be exact: a depthwise causal convolution of kernel ``k`` gives each token a weighted
sum of its own input and the inputs of the ``k - 1`` tokens before it in its sequence. In a prefix
tree those are the token's nearest ``k - 1`` ancestors on its root path, the same in every
sequence through it, so the tree computes each unique token's output once, as it does its
attention. The packed layout already lists every node's root path (``kv_index``, the keys its
attention reads); the ancestor ``j`` steps up of a token at depth ``d`` is that path's entry
``d - j``, or the sequence's zero padding where ``d < j`` — ``F.conv1d``'s left padding.

How it is wired: the layer's own module stays in the model, its ``forward`` wrapped once
(:func:`install_tree_convs`). A call that carries tree metadata gathers each token's ancestors'
inputs and weighs them with the layer's own ``conv`` weight; every other call (generation, TRL's
own forward, the padded batch the engine runs where nothing is shared — right padding sits after
every real token) runs the original forward. The metadata reaches the convolution with the
attention's keyword arguments: where the decoder layer hands them down to its mixer (recent
transformers), directly; where it does not, through the layer, whose ``forward`` receives them and
whose wrapper keeps the metadata in a context variable for the layer's duration. Either way HF's
checkpointed recompute, which calls the layer again with the same arguments during the backward,
finds it too — a recompute that ran the model's own convolution would change the numbers (and
torch's checkpoint refuses it: another count of saved tensors).

The depth-first walk carries a convolution's inputs down its stack as it carries attention's K/V
(:func:`unit_short_conv`): a unit writes its tokens' inputs into the layer's stack slots (its
pushed node's slots are its tokens' depths), reads the ``k - 1`` slots below its depth for the
tokens whose ancestors sit there, and in its backward adds those slots' gradients into the
stack's gradient buffer, which the owning node takes into its own backward when it is popped —
the K/V stack's protocol (``dfs/stack.py``), one buffer per convolution layer.
"""

from __future__ import annotations

import functools
from contextvars import ContextVar

import torch

from .attention.metadata import TREE_KWARG, DenseCausalBatch, TreeAttentionMetadata

#: layer type (``config.layer_types``) -> the module class that implements it, per family
CONV_MODULES = {"conv": ("Lfm2ShortConv",)}

#: the tree metadata of the decoder layer running now (set by the layer's wrapped forward)
_CURRENT_CALL: ContextVar = ContextVar("trl_tree_conv_call", default=None)


def conv_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's short-convolution mixers (modules of a class in :data:`CONV_MODULES`)."""
    names = {n for classes in CONV_MODULES.values() for n in classes}
    return [m for m in model.modules() if type(m).__name__ in names]


def install_tree_convs(backbone: torch.nn.Module) -> int:
    """Wrap, once, every short convolution of ``backbone`` and the decoder layer holding it (see the
    module docstring); returns how many convolutions the model has. Later calls (every engine call
    validates its model) read the count kept on the backbone instead of walking its modules again."""
    installed = getattr(backbone, "_trl_tree_convs", None)
    if installed is not None:
        return installed
    convs = conv_modules(backbone)
    held = {id(c) for c in convs}
    for layer in backbone.modules():
        if any(id(m) in held for m in layer.children()):
            layer.forward = _carrying_call(layer.forward)
    for conv in convs:
        conv.forward = functools.partial(_conv_forward, conv, conv.forward)
    backbone._trl_tree_convs = len(convs)
    return len(convs)


def _carrying_call(forward):
    @functools.wraps(forward)
    def layer_forward(*args, **kwargs):
        carried = kwargs.get(TREE_KWARG)
        token = _CURRENT_CALL.set(carried.meta if carried is not None else None)
        try:
            return forward(*args, **kwargs)
        finally:
            _CURRENT_CALL.reset(token)

    return layer_forward


def _conv_forward(module, original, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    carried = kwargs.pop(TREE_KWARG, None)  # transformers versions that hand the layer's kwargs down
    meta = carried.meta if carried is not None else _CURRENT_CALL.get()
    if meta is None:
        return original(hidden_states, *args, **kwargs)
    if isinstance(meta, DenseCausalBatch):  # the padded batch: the model's own convolution is exact there
        meta.calls += 1
        return original(hidden_states, *args, **kwargs)
    meta.calls += 1
    if isinstance(meta, TreeAttentionMetadata):
        return tree_short_conv(module, hidden_states, path_ancestors(meta, module.conv.weight.shape[-1]))
    return unit_short_conv(module, hidden_states, meta)


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


def _gates(module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(C, B * x)`` of LFM2's input projection, for a row ``[1, n, H]``."""
    b, c, inputs = module.in_proj(hidden_states[0]).chunk(3, dim=-1)
    return c, b * inputs


def _convolved(module, c: torch.Tensor, sources: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """``out_proj(C * conv)``, the convolution of each row over ``sources[ancestors[row]]`` (column
    ``j``: the input ``j`` steps up the row's path; the last source row is the zero padding)."""
    weight = module.conv.weight  # [H, 1, k]: tap i multiplies the input k - 1 - i steps back
    taps = weight[:, 0, :].flip(-1).t()  # [k, H]: row j weighs the ancestor j steps up
    conv = torch.einsum("ukh,kh->uh", sources.to(weight.dtype)[ancestors], taps)
    if module.conv.bias is not None:
        conv = conv + module.conv.bias
    return module.out_proj(c * conv.to(c.dtype)).unsqueeze(0)


def tree_short_conv(module, hidden_states: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """LFM2's short convolution (``in_proj`` into gates B, C and input x; ``C * conv(B * x)``;
    ``out_proj``) on the packed row ``hidden_states [1, U, H]``, each token's convolution over
    its root path (``ancestors``, :func:`path_ancestors`) instead of the row's order."""
    c, bx = _gates(module, hidden_states)
    return _convolved(module, c, torch.cat([bx, bx.new_zeros(1, bx.shape[-1])]), ancestors)


def unit_short_conv(module, hidden_states: torch.Tensor, meta) -> torch.Tensor:
    """The convolution of one unit of the depth-first walk (``dfs.stack.UnitAttentionMetadata``)
    against the layer's stack slots: see the module docstring."""
    if meta.own_slots is not None:
        raise ValueError("a walk unit padded to buckets (CUDA graphs) does not run short convolutions")
    k = module.conv.weight.shape[-1]
    c, bx = _gates(module, hidden_states)
    sources, ancestors = _unit_sources(meta, module.layer_idx, k, bx)
    return _convolved(module, c, sources, ancestors)


@torch.compiler.disable
def _unit_sources(meta, layer: int, k: int, bx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The unit's convolution sources and their table (:func:`unit_ancestors`), its inputs written
    into the layer's stack slots. Eager under compiled layers (``trl_tree.compile``): it reads and
    writes the walk's Python-side stack, which a compiled graph would freeze."""
    stack, depth, n = meta.stack, meta.depth, meta.num_tokens
    buf, _ = stack.buffers(layer, bx)  # [slots, H]: the path's inputs by depth, then the unit's own
    buf[depth : depth + n] = bx.detach()
    low = max(0, depth - (k - 1))
    grads = stack.grad_buffers(layer)[0] if torch.is_grad_enabled() else None
    sources = _StackedInputs.apply(bx, buf, grads, low, depth, meta.pushed_tokens)
    return torch.cat([sources, sources.new_zeros(1, sources.shape[-1])]), unit_ancestors(meta, k, low)


class _StackedInputs(torch.autograd.Function):
    """``[the stack's slots low..depth; the unit's own inputs]``; the backward adds the stack slots'
    gradient into the stack's fp32 gradient buffer (their owners take it when popped) and hands the
    unit's pushed rows the gradient their descendants left in their slots, emptying them."""

    @staticmethod
    def forward(ctx, bx, buf, grads, low: int, depth: int, pushed: int):
        ctx.grads, ctx.low, ctx.depth, ctx.pushed = grads, low, depth, pushed
        return torch.cat([buf[low:depth], bx])

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
