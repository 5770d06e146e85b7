"""Tree attention backends: one function per kernel, all with the same contract.

Each takes HF-layout tensors ``query [1, H, U, D]``, ``key``/``value [1, Hkv, U, D]`` of the
packed forest and returns ``[1, U, H, D]`` (what HF attention functions return). GQA is handled
where the kernel cannot (head expansion in the order of HF's ``repeat_kv``).

- ``eager``/``sdpa``: explicit ``[U, U]`` tree mask — exact references, CPU-friendly, O(U²) memory.
- ``torch_flash``: PyTorch's built-in FlashAttention-2 varlen kernels; each node's queries against
  its gathered root path (``cu_seqlens_q != cu_seqlens_k``, causal aligned bottom-right, which is exact here
  because a node's queries are the last keys of its path).
- ``flash``: the flash-attn package: FA4 (``flash_attn.cute``) as a partial-kernel pair with every
  path of ``torch_flash`` (``attention/fa4.py``), or FA2's ``flash_attn_varlen_func`` over the
  gathered root paths.
- ``flex``: compiled ``flex_attention`` with a block mask from ``subtree_end``; no gather.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .metadata import TreeAttentionMetadata
from .partial import PARTIAL_KERNELS, dense_pair, merge_partials

BACKENDS = ("flash", "torch_flash", "flex", "sdpa", "eager")


def _expand_kv(x: torch.Tensor, n_rep: int, dim: int) -> torch.Tensor:
    """Repeat K/V heads for GQA: head h of the queries reads K/V head h // n_rep (HF ``repeat_kv``)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=dim)


def masked_attention(q, k, v, mask: torch.Tensor, scaling: float, kind: str, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Reference attention with an explicit boolean mask ``[Lq, Lk]``; returns ``[1, Lq, H, D]``.

    ``kind="eager"`` mirrors HF's eager path (fp32 softmax), ``"sdpa"`` PyTorch's SDPA (which takes
    neither a soft-cap nor sinks: those run the eager math). ``softcap``: Gemma-2's
    ``softcap · tanh(scores / softcap)`` before the mask; ``sinks [H]``: a per-head logit that joins
    every row's softmax and attends to nothing (GPT-OSS's eager formula).
    """
    n_rep = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, n_rep, 1), _expand_kv(v, n_rep, 1)
    if kind == "sdpa" and softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2)


def _masked_by_tree(q, k, v, meta: TreeAttentionMetadata, scaling: float, kind: str, window: int | None,
                    softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """:func:`masked_attention` over the forest's trees one at a time: no query sees another tree's
    keys, so a forest of several trees (a window's groups in one call) costs the sum of its trees'
    squares, not the square of their sum, in time and in mask memory — the CPU's path (sdpa)."""
    spans = meta.spans()
    if len(spans) == 1:
        return masked_attention(q, k, v, meta.dense_mask(window), scaling, kind, softcap, sinks)
    return torch.cat([masked_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], meta.span_mask(s, e, window),
                                       scaling, kind, softcap, sinks) for s, e in spans], dim=1)


def eager_tree_attention(q, k, v, meta: TreeAttentionMetadata, scaling: float, window: int | None = None,
                         softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return _masked_by_tree(q, k, v, meta, scaling, "eager", window, softcap, sinks)


def sdpa_tree_attention(q, k, v, meta: TreeAttentionMetadata, scaling: float, window: int | None = None,
                        softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return _masked_by_tree(q, k, v, meta, scaling, "sdpa", window, softcap, sinks)


class _GatherRows(torch.autograd.Function):
    """``x.index_select(0, index)`` whose backward sums the gathered gradients in fp32.

    A shared prefix's K/V rows are gathered once per descendant node; their gradients are summed
    back with ``index_add_``. In bf16 that sum would round at every addition (and bf16 atomics are
    slow); an fp32 buffer keeps it exact up to one final rounding.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.num_rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return _scatter_sum_rows(grad, index, ctx.num_rows), None


def _scatter_sum_rows_fp32(grad: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    out = grad.new_zeros((num_rows, *grad.shape[1:]), dtype=torch.float32)
    out.index_add_(0, index, grad.float())
    return out


def _scatter_sum_rows(grad: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    return _scatter_sum_rows_fp32(grad, index, num_rows).to(grad.dtype)


def to_varlen(x: torch.Tensor) -> torch.Tensor:
    """HF ``[1, heads, U, D]`` to varlen ``[U, heads, D]``. ``squeeze``, not ``x[0]``: the backward
    of a view stays a view, where ``select``'s allocates a zero tensor and copies into it (two kernels
    per tensor and layer). After HF's RoPE the layout is usually ``[U, heads, D]`` already, so the
    ``contiguous`` is free too."""
    return x.squeeze(0).transpose(0, 1).contiguous()


class _Attended(NamedTuple):
    """One forward of the packed FlashAttention function: what its backward needs besides q, k, v."""

    out: torch.Tensor  # [U, H, D]
    lse: tuple[torch.Tensor, ...]  # [H, U] fp32, natural log; one tree: (every row, the rows below the root)
    states: tuple  # the kernels' per-part RNG states (no dropout here, but their backward takes them)
    one_tree: bool  # split with the root block and rectangle in one call of the dense kernel
    rect_on_dense: bool  # split, several trees: the rectangle on the dense kernel
    dense: tuple | None  # the dense kernel pair, if any


def _attend(q, k, v, meta: TreeAttentionMetadata, scale: float, window: int | None = None) -> _Attended:
    """Gathered root paths through the varlen kernel, or the split of ``attention/root_split.py``.
    ``window``: a sliding window — every node against its whole root path, the kernel's own window
    (its left edge counted back from each query's depth, which is its row on its path); no split."""
    varlen, _ = PARTIAL_KERNELS[meta.backend]
    if window is not None:
        out, lse, state = varlen(q, k.index_select(0, meta.kv_index), v.index_select(0, meta.kv_index),
                                 meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k, True,
                                 scale, window=window)
        return _Attended(out, (lse,), (state, None), False, False, None)
    split = meta.root_split
    dense = None
    if split is not None and meta.dense:  # a dense pair for the rectangle (and, one tree, the root block)
        dense = dense_pair(meta.backend, split.rect_max_seqlen_q, split.root_rows or split.rect_max_seqlen_k)
    if dense is not None and split.root_rows is not None:
        # every query against the root's keys, causal aligned top-left: the root's own causal block and
        # the rectangle below it in one call (partial.cudnn_dense_forward)
        R, dense_fwd = split.root_rows, dense[0]
        whole, l_all, s_all = dense_fwd(q, k[:R], v[:R], None, None, q.shape[0], R, True, scale)  # one segment: no cu
        below = split.nodes_kv_index  # each node's path below the root: rows [R, U) only
        k_nodes, v_nodes = k[R:], v[R:]
        out, lse, state = varlen(q[R:], k_nodes.index_select(0, below), v_nodes.index_select(0, below),
                                 split.nodes_cu_seqlens_q, split.nodes_cu_seqlens_k, split.nodes_max_seqlen_q,
                                 split.nodes_max_seqlen_k, True, scale)
        _, lse = merge_partials(whole[R:], l_all[:, R:], out, lse, out=whole[R:])  # in place: no concatenation
        l_all[:, R:] = lse  # the dense backward reads every row's final LSE; the varlen one its own rows, contiguous
        return _Attended(whole, (l_all, lse), (s_all, state), True, False, dense)
    kv_index, cu_k, max_k = _path_keys(meta)
    out, lse, state = varlen(q, k.index_select(0, kv_index), v.index_select(0, kv_index), meta.cu_seqlens_q,
                             cu_k, meta.max_seqlen_q, max_k, True, scale)
    if split is None:
        return _Attended(out, (lse,), (state, None), False, False, dense)
    rows, keys = split.queries, split.keys
    rect_fwd = dense[0] if dense is not None and rows.span and keys.span else varlen
    o_rect, l_rect, s_rect = rect_fwd(rows.take(q), keys.take(k), keys.take(v), split.rect_cu_seqlens_q,
                                      split.rect_cu_seqlens_k, split.rect_max_seqlen_q,
                                      split.rect_max_seqlen_k, False, scale)
    in_place = rows.take(out) if rows.span is not None else None  # contiguous rows: merge into them
    o_m, l_m = merge_partials(o_rect, l_rect, rows.take(out), rows.take(lse, dim=1), out=in_place)
    if in_place is None:
        rows.put(out, o_m)
    rows.put(lse, l_m, dim=1)
    return _Attended(out, (lse,), (state, s_rect), False, rect_fwd is not varlen, dense)


class _TorchFlashTreeAttention(torch.autograd.Function):
    """Gathered root paths + FlashAttention varlen kernels as one autograd node, optionally split
    at the roots (``attention/root_split.py``).

    Why not ``torch.nn.attention.varlen.varlen_attn``: autograd would save the *gathered* K/V
    (Σ path lengths rows per layer, several times U on deep trees), and in PyTorch 2.11 it cannot
    do GQA, forcing a head expansion. Here only the packed K/V are saved and re-gathered in
    backward, the kernel reads the K/V heads natively (FA2 takes ``num_heads % num_heads_k == 0``)
    and the gathered gradients are summed back in fp32.

    Split, the parts are: each node against its path below the root (varlen), the rectangle of
    every query below a root against the root's keys, merged by log-sum-exp; and, when the forest
    is one tree and a dense kernel runs here (cuDNN, ``partial.dense_kernels``; decided in
    ``meta.dense``), every packed query against the root's keys in one dense call whose causal mask
    is aligned top-left — the root's own causal block and the rectangle below it together, so the
    root's key gradients come out of one kernel, summed there. Each part's backward is handed the
    *merged* output and log-sum-exp.
    """

    @staticmethod
    def forward(ctx, q, k, v, meta: TreeAttentionMetadata, scale: float, layer: object = None,
                window: int | None = None):
        kept = meta.kept if layer is not None else None  # kept outputs: attention/kept.py
        result = kept.recomputed(meta.calls, layer) if kept is not None else None
        if result is not None and result.out.shape != q.shape:
            raise RuntimeError(f"kept attention output {tuple(result.out.shape)} does not match the recomputed "
                               f"queries {tuple(q.shape)}; the checkpointed forward ran another layout")
        if result is None:
            result = _attend(q, k, v, meta, scale, window)
            if kept is not None:
                kept.keep_from_forward(meta.calls, layer, result._replace(out=result.out.detach()))
        ctx.meta, ctx.scale, ctx.window = meta, scale, window
        ctx.one_tree, ctx.rect_on_dense, ctx.states, ctx.dense = (result.one_tree, result.rect_on_dense,
                                                                  result.states, result.dense)
        ctx.save_for_backward(q, k, v, result.out, *result.lse)
        return result.out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, *lse_parts = ctx.saved_tensors
        meta, scale, split = ctx.meta, ctx.scale, ctx.meta.root_split
        _, varlen = PARTIAL_KERNELS[meta.backend]
        n = k.shape[0]
        if ctx.one_tree:
            R, dense = split.root_rows, ctx.dense[1]
            s_all, state = ctx.states
            l_all, l_nodes = lse_parts
            # the root's keys get their whole gradient from the one dense call (summed in the kernel)
            dq_all, dk_root, dv_root = dense(grad_out, q, k[:R], v[:R], out, l_all, s_all, None, None, q.shape[0], R,
                                             True, scale)
            below = split.nodes_kv_index
            k_nodes, v_nodes = k[R:], v[R:]
            dq, dkg, dvg = varlen(grad_out[R:], q[R:], k_nodes.index_select(0, below), v_nodes.index_select(0, below),
                                  out[R:], l_nodes, state, split.nodes_cu_seqlens_q, split.nodes_cu_seqlens_k,
                                  split.nodes_max_seqlen_q, split.nodes_max_seqlen_k, True, scale)
            dq_all[R:] += dq  # a row's two partial dq: one sum, one rounding (as in fp32 then cast)
            dk, dv = torch.empty_like(k), torch.empty_like(v)
            dk[:R], dv[:R] = dk_root, dv_root
            dk[R:] = _scatter_sum_rows_fp32(dkg, below, n - R)  # the rows below: gathered per node, summed in fp32
            dv[R:] = _scatter_sum_rows_fp32(dvg, below, n - R)
            return dq_all, dk, dv, None, None, None, None
        state, s_rect = ctx.states
        (lse,) = lse_parts
        if ctx.window is not None:
            split = None
            kv_index, cu_k, max_k = meta.kv_index, meta.cu_seqlens_k, meta.max_seqlen_k
            windowed = {"window": ctx.window}
        else:
            kv_index, cu_k, max_k = _path_keys(meta)
            windowed = {}
        dq, dkg, dvg = varlen(grad_out, q, k.index_select(0, kv_index), v.index_select(0, kv_index), out, lse,
                              state, meta.cu_seqlens_q, cu_k, meta.max_seqlen_q, max_k, True, scale, **windowed)
        dk, dv = _scatter_sum_rows_fp32(dkg, kv_index, n), _scatter_sum_rows_fp32(dvg, kv_index, n)
        if split is not None:
            rect_bwd = ctx.dense[1] if ctx.rect_on_dense else varlen
            rows, keys = split.queries, split.keys
            dq_r, dk_r, dv_r = rect_bwd(rows.take(grad_out), rows.take(q), keys.take(k), keys.take(v), rows.take(out),
                                        rows.take(lse, dim=1).contiguous(), s_rect, split.rect_cu_seqlens_q,
                                        split.rect_cu_seqlens_k, split.rect_max_seqlen_q, split.rect_max_seqlen_k,
                                        False, scale)
            rows.add(dq, dq_r)  # a row's two partial dq: one sum, rounded once
            keys.add(dk, dk_r)
            keys.add(dv, dv_r)
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), None, None, None, None


def _path_keys(meta: TreeAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each node's key rows: its whole root path, or (split) its path below the root."""
    split = meta.root_split
    if split is None:
        return meta.kv_index, meta.cu_seqlens_k, meta.max_seqlen_k
    return split.path_kv_index, split.path_cu_seqlens_k, split.path_max_seqlen_k


def torch_flash_tree_attention(q, k, v, meta: TreeAttentionMetadata, scaling: float, window: int | None = None,
                               layer: object = None) -> torch.Tensor:
    """``layer``: the calling attention module, the key of its kept outputs when ``meta.kept`` is set."""
    out = _TorchFlashTreeAttention.apply(to_varlen(q), to_varlen(k), to_varlen(v), meta, scaling, layer, window)
    return out.unsqueeze(0)


@functools.cache
def _flash_attn_varlen() -> tuple[Callable, str]:
    """flash-attn's varlen function: FA2/FA3 (``flash_attn``) first, FA4 (``flash_attn.cute``) else."""
    for module, flavour in (("flash_attn", "fa2"), ("flash_attn.cute", "fa4")):
        try:
            return importlib.import_module(module).flash_attn_varlen_func, flavour
        except (ImportError, AttributeError, OSError):
            continue
    raise ImportError("attn_backend='flash' needs the flash-attn package: pip install 'trl-tree[flash]'")


@functools.cache
def _flash_kwargs_accepted() -> frozenset[str] | None:
    """Keyword names the installed varlen function takes (FA4's ``flash_attn.cute`` differs from FA2)."""
    import inspect

    params = inspect.signature(_flash_attn_varlen()[0]).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(params)


def flash_tree_attention(q, k, v, meta: TreeAttentionMetadata, scaling: float, window: int | None = None,
                         softcap: float | None = None, layer: object = None) -> torch.Tensor:
    """flash-attn over the tree. FA4 (``attention/fa4.py``) runs as a partial-kernel pair — every path
    of ``torch_flash``: root split, kept outputs, dense blocks; with a soft-cap (which the pair does
    not take) and with FA2 the gathered root paths go through the package's own varlen function."""
    if softcap is None and meta.backend in PARTIAL_KERNELS:
        return torch_flash_tree_attention(q, k, v, meta, scaling, window, layer)
    fn, _ = _flash_attn_varlen()
    kv_index = meta.kv_index  # flash-attn handles GQA natively
    kwargs = {
        "cu_seqlens_q": meta.cu_seqlens_q,
        "cu_seqlens_k": meta.cu_seqlens_k,
        "max_seqlen_q": meta.max_seqlen_q,
        "max_seqlen_k": meta.max_seqlen_k,
        "softmax_scale": scaling,
        "causal": True,
    }
    if window is not None:
        kwargs["window_size"] = (window - 1, 0)  # bottom-right aligned: back from each query's depth
    if softcap is not None:
        kwargs["softcap"] = softcap
    accepted = _flash_kwargs_accepted()
    if accepted is not None:
        missing = sorted({"window_size", "softcap"} & set(kwargs) - accepted)
        if missing:
            raise ValueError(f"the installed flash-attn's varlen function takes no {', '.join(missing)}; it cannot "
                             "compute this model's attention over the tree")
        kwargs = {name: value for name, value in kwargs.items() if name in accepted}
    out = fn(to_varlen(q), _GatherRows.apply(to_varlen(k), kv_index), _GatherRows.apply(to_varlen(v), kv_index), **kwargs)
    if isinstance(out, tuple):  # FA4 returns (out, lse)
        out = out[0]
    return out.unsqueeze(0)


@functools.cache
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_tree_attention(q, k, v, meta: TreeAttentionMetadata, scaling: float, window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    enable_gqa = q.shape[1] != k.shape[1]
    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.tanh(score / softcap) * softcap

    out = _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=meta.block_mask(window), scale=scaling,
                           enable_gqa=enable_gqa)
    return out.transpose(1, 2)


TREE_ATTENTION: dict[str, Callable] = {
    "eager": eager_tree_attention,
    "sdpa": sdpa_tree_attention,
    "torch_flash": torch_flash_tree_attention,
    "flash": flash_tree_attention,
    "flex": flex_tree_attention,
}


def packed_attention(meta: TreeAttentionMetadata, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, scaling: float, window: int | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Tree attention of the packed forest with ``meta``'s backend, ``[1, U, H, D]``; the variants
    (``attention/support.py``) go to the backends that take them."""
    variants = {name: value for name, value in (("window", window), ("softcap", softcap), ("sinks", sinks))
                if value is not None}
    if meta.kept is not None:  # only set for the partial-kernel backends, whose function takes the key
        return TREE_ATTENTION[meta.backend](query, key, value, meta, scaling, layer=module, **variants)
    return TREE_ATTENTION[meta.backend](query, key, value, meta, scaling, **variants)


# ---------------------------------------------------------------------- availability / choice
def backend_available(name: str, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether backend ``name`` can run on ``device`` with ``dtype``, and why not."""
    if name not in TREE_ATTENTION:
        return False, f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)} or 'auto'"
    if name in ("eager", "sdpa"):
        return True, ""
    if device.type != "cuda":
        return False, f"attn_backend={name!r} needs a CUDA device (the model is on {device.type})"
    half = dtype in (torch.float16, torch.bfloat16)
    if name == "torch_flash":
        if not hasattr(torch.ops.aten, "_flash_attention_forward"):
            return False, "attn_backend='torch_flash' needs PyTorch's built-in FlashAttention"
        if not half:
            return False, f"attn_backend='torch_flash' runs in fp16/bf16 only (the model computes in {dtype})"
        return True, ""
    if name == "flash":
        try:
            _, flavour = _flash_attn_varlen()
        except ImportError as e:
            return False, str(e)
        if not half:
            return False, f"attn_backend='flash' runs in fp16/bf16 only (the model computes in {dtype})"
        if flavour == "fa4":
            from .fa4 import fa4_runs_on, register_fa4

            if not fa4_runs_on(device):
                return False, "attn_backend='flash' found FlashAttention-4, which runs on Hopper and Blackwell GPUs only"
            register_fa4()  # its forward/backward pair: every FlashAttention path of the tree
        return True, ""
    if name == "flex":
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except ImportError:
            return False, "attn_backend='flex' needs torch.nn.attention.flex_attention"
        return True, ""
    return False, name  # unreachable


#: where ``auto`` takes FlashAttention-4 (``attention/fa4.py``) over PyTorch's FA2, by mode: every call
#: that replays CUDA graphs, and eager calls of models with at least this hidden size. Why a width:
#: FA4's kernels are as fast or faster on every measured shape, but its Python launch path costs more
#: host time per call than FA2's, which a narrow model's eager step (or the walk's many eager calls)
#: waits on; a replayed graph has no launch path (measured on an H200: docs/benchmarks/notes.md §22)
FA4_EAGER_MIN_HIDDEN = {"packed": 1536, "dfs": 3584}


def fa4_pays(device: torch.device, dtype: torch.dtype, hidden_size: int | None, graphed: bool,
             mode: str = "packed") -> bool:
    """Whether ``auto`` runs FlashAttention-4 for this call (``FA4_EAGER_MIN_HIDDEN``): installed,
    on a GPU it runs on, in fp16/bf16, and graphed or wide enough. Registers FA4's pair when it does."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if not graphed and (hidden_size is None or hidden_size < FA4_EAGER_MIN_HIDDEN[mode]):
        return False
    from .fa4 import fa4_pair_available, fa4_runs_on, register_fa4

    return fa4_pair_available() and fa4_runs_on(device) and register_fa4()


#: the compiled flex kernel's smallest head dimension: Triton's matrix product needs 16 along each
#: side, so below it ``torch.compile(flex_attention)`` fails while lowering (a tiny test model's 8)
FLEX_MIN_HEAD_DIM = 16


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype, window: int | None = None,
                    softcap: float | None = None, sinks: bool = False, hidden_size: int | None = None,
                    graphed: bool = False, head_dim: int | None = None) -> str:
    """Resolve ``"auto"`` to the fastest backend that runs here; validate an explicit choice.

    auto: on CUDA in fp16/bf16, FlashAttention-4 where it was measured faster (:func:`fa4_pays`:
    installed, and the call replays CUDA graphs — ``graphed`` — or the model's ``hidden_size`` is
    large enough), else PyTorch's FlashAttention varlen (with cuDNN for the dense blocks), else
    flash-attn; on CUDA in fp32, flex (no O(U²) mask); on CPU, sdpa. An installed package alone
    never changes the choice: a narrow model's eager step was slower through FA4 than through FA2,
    its host-side launches being the bound. A model with attention logit soft-capping
    (``softcap``) skips the kernels that cannot apply it (``attention/support.py``); ``window`` and
    ``sinks`` are listed for the same reason (every backend takes a window; sinks only the
    references, which auto does not pick on CUDA: they build a [U, U] mask). A ``head_dim`` below
    ``FLEX_MIN_HEAD_DIM`` rules flex out (sdpa instead, where nothing else runs).
    """
    flex_runs = device.type != "cuda" or head_dim is None or head_dim >= FLEX_MIN_HEAD_DIM
    if requested == "auto":
        if softcap is None and not sinks and fa4_pays(device, dtype, hidden_size, graphed):
            return "flash"
        order = ("torch_flash", "flash", "flex") if device.type == "cuda" else ()
        if softcap is not None:
            order = tuple(b for b in order if b != "torch_flash")
        for name in order:
            if (name != "flex" or flex_runs) and backend_available(name, device, dtype)[0]:
                return name
        return "sdpa"
    ok, why = backend_available(requested, device, dtype)
    if not ok:
        raise ValueError(why)
    if requested == "flex" and not flex_runs:
        raise ValueError(f"attn_backend='flex' compiles a Triton kernel that needs a head dimension of at least "
                         f"{FLEX_MIN_HEAD_DIM} (this model's is {head_dim}); use 'sdpa' or 'auto'")
    return requested


DFS_BACKENDS = ("torch_flash", "flash", "sdpa", "eager")


def resolve_dfs_backend(requested: str, device: torch.device, dtype: torch.dtype, window: int | None = None,
                        softcap: float | None = None, sinks: bool = False, hidden_size: int | None = None,
                        graphed: bool = False, head_dim: int | None = None) -> str:
    """The walk's kernel: on CUDA in fp16/bf16 FlashAttention-4 where it was measured faster
    (``fa4_pays``: replayed units, or a model of ``hidden_size`` at least
    ``FA4_EAGER_MIN_HIDDEN["dfs"]``), else ``torch_flash``; ``sdpa`` elsewhere, and for a model with
    soft-capping or sinks (which FlashAttention's partial kernels do not take)."""
    if requested == "auto":
        if softcap is None and not sinks and backend_available("torch_flash", device, dtype)[0]:
            return "flash" if fa4_pays(device, dtype, hidden_size, graphed, "dfs") else "torch_flash"
        return "sdpa"
    if requested == "flex":
        raise ValueError(
            f"attn_backend={requested!r} is not available in mode='dfs' (its kernel would need the K/V "
            f"stack interface); use one of {', '.join(DFS_BACKENDS)} or 'auto'"
        )
    ok, why = backend_available(requested, device, dtype)  # also rejects unknown names
    if not ok:
        raise ValueError(why)
    if requested == "flash" and requested not in PARTIAL_KERNELS:
        raise ValueError("attn_backend='flash' runs the walk with FlashAttention-4 (flash_attn.cute), whose kernels "
                         "return and take the log-sum-exp; the installed flash-attn 2 is not used in mode='dfs': "
                         "use 'torch_flash' or 'auto'")
    return requested
