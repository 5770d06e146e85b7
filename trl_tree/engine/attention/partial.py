"""Partial attention: softmax attention over one part of the keys, mergeable by log-sum-exp.

Attention over keys ``K = K_a ∪ K_b`` equals the two partial attentions merged with their
log-sum-exps: ``out = e^(lse_a - lse)·out_a + e^(lse_b - lse)·out_b``, ``lse = logaddexp(lse_a,
lse_b)``. The backward needs no merge rule of its own: FlashAttention's backward of one part,
handed the *merged* output and log-sum-exp, returns exactly that part's share of ``dq`` and its
keys' ``dk``/``dv`` (it rebuilds ``P = exp(scale·QKᵀ - lse)`` and ``D = rowsum(dO ∘ O)`` from what
it is given) — the recipe ring attention uses across devices.

The depth-first walk uses it to attend a unit's queries to the cached prefix (one dense,
non-causal rectangle read in place from the K/V stack) and to the unit's own tree (a small varlen
gather), instead of gathering the whole prefix once per node of the unit.

Kernel pairs share one contract (varlen layout ``q [n, H, D]``, ``k``/``v [m, Hkv, D]``,
``lse [H, n]`` float32):

- ``flash_partial_forward/backward``: PyTorch's built-in FlashAttention-2 varlen kernels (also
  the kernels under the packed mode's ``torch_flash`` backend, with one part); causal aligned
  bottom-right (a node's queries are the last keys of its path);
- ``cudnn_dense_forward/backward``: cuDNN's fused attention for a single dense segment (about
  twice FA2's speed on Hopper), used where a part is one segment; causal aligned *top-left*
  (query ``i`` sees keys ``0..i``): the same mask on a square block, and with more queries than
  keys the rows past the last key see every key — a root's causal block and the rectangle of
  every query below it, in one call;
- ``math_partial_forward/backward`` and ``math_dense_forward/backward``: the same in plain
  PyTorch, per-segment references that let the CPU tests check the split, the merge and the
  backward in fp32.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint keys into the attention over their union.

    The sum runs in the log-sum-exp's precision (fp32; fp64 stays fp64): ``out_a·w_a`` promotes
    the model-dtype output in the multiply itself and ``addcmul`` adds ``out_b·w_b``, so no cast
    kernels — on small models every launch costs host time. ``out``: write the result there (a
    slice of the layer's whole output, saving the copy a concatenation would make); it may alias
    ``out_b``, which is read before it is written.
    """
    _check_lse_layout(lse_a, out_a)
    _check_lse_layout(lse_b, out_b)
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).transpose(0, 1).unsqueeze(-1)  # [n, H, 1]
    w_b = torch.exp(lse_b - lse).transpose(0, 1).unsqueeze(-1)
    merged = torch.addcmul(out_a * w_a, out_b, w_b)
    if out is None:
        return merged.to(out_a.dtype), lse
    out.copy_(merged)
    return out, lse


def _check_lse_layout(lse: torch.Tensor, out: torch.Tensor) -> None:
    """The merge reads ``lse`` as ``[heads, tokens]``; refuse a kernel that lays it out otherwise."""
    if lse.shape != (out.shape[1], out.shape[0]):
        raise RuntimeError(
            f"FlashAttention varlen returned a log-sum-exp of shape {tuple(lse.shape)}, expected "
            f"[heads, tokens] = {(out.shape[1], out.shape[0])}; this PyTorch build lays it out differently"
        )


def _window_kwargs(window: int | None) -> dict:
    """A sliding window for FlashAttention: each query sees its own row and the ``window - 1`` before
    it on its segment (bottom-right aligned: a node's query rows are its path's last rows)."""
    return {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}


def flash_partial_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                          window: int | None = None):
    """PyTorch's FA2 varlen forward; returns ``(out, lse, state)`` (state: what backward needs).
    ``window``: a causal sliding window (see ``_window_kwargs``)."""
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, **_window_kwargs(window)
    )
    return out, lse, (rng_state, unused)


def flash_partial_backward(grad_out, q, k, v, out, lse, state, cu_q, cu_k, max_q: int, max_k: int,
                           causal: bool, scale: float, window: int | None = None):
    """``(dq, dk, dv)`` of one part, given the merged ``out`` and ``lse`` (model dtype)."""
    rng_state, unused = state
    return torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale,
        **_window_kwargs(window)
    )


def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        yield slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])


def _accumulator(x: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (the reference must not be the less precise side)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _segment_probs_logits(q, k, causal: bool, scale: float, top_left: bool = False,
                          window: int | None = None) -> torch.Tensor:
    """Scaled scores ``[H, lq, lk]`` with -inf where a causal mask (bottom-right aligned, or
    ``top_left``) hides a key, or a sliding ``window`` (keys more than ``window - 1`` rows back)."""
    acc = _accumulator(q)
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(acc), k.to(acc)) * scale
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        qpos = torch.arange(lq, device=q.device)[:, None] + (0 if top_left else lk - lq)
        keys = torch.arange(lk, device=q.device)[None, :]
        hidden = keys > qpos
        if window is not None:
            hidden = hidden | (keys <= qpos - window)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def math_partial_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                         window: int | None = None):
    """Reference of :func:`flash_partial_forward` (computes in fp32; same layouts)."""
    return _math_forward(q, k, v, _segments(cu_q, cu_k), causal, scale, top_left=False, window=window)


def math_dense_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    """Reference of :func:`cudnn_dense_forward`: one segment, causal aligned top-left."""
    _check_dense_causal(q, k, causal)
    return _math_forward(q, k, v, _one_segment(q, k), causal, scale, top_left=True)


def _one_segment(q, k):
    return [(slice(0, q.shape[0]), slice(0, k.shape[0]))]


def _math_forward(q, k, v, segments, causal: bool, scale: float, top_left: bool, window: int | None = None):
    acc = _accumulator(q)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device)
    rep = q.shape[1] // k.shape[1]
    for sq, sk in segments:
        if sq.start == sq.stop or sk.start == sk.stop:  # an empty segment: rows keep out 0, lse -inf
            continue
        scores = _segment_probs_logits(q[sq], k[sk], causal, scale, top_left, window)
        seg_lse = torch.logsumexp(scores, dim=-1)  # [H, lq]
        probs = torch.exp(scores - seg_lse[..., None])
        vv = v[sk].to(acc).repeat_interleave(rep, dim=1)
        out[sq] = torch.einsum("hqk,khd->qhd", probs, vv)
        lse[:, sq] = seg_lse
    return out.to(q.dtype), lse, None


def math_partial_backward(grad_out, q, k, v, out, lse, state, cu_q, cu_k, max_q: int, max_k: int,
                          causal: bool, scale: float, window: int | None = None):
    """Reference of :func:`flash_partial_backward`: ``dS = P ∘ (dP - rowsum(dO ∘ O))``."""
    return _math_backward(grad_out, q, k, v, out, lse, _segments(cu_q, cu_k), causal, scale, top_left=False,
                          window=window)


def math_dense_backward(grad_out, q, k, v, out, lse, state, cu_q, cu_k, max_q: int, max_k: int,
                        causal: bool, scale: float):
    """Reference of :func:`cudnn_dense_backward` (one segment, causal aligned top-left)."""
    _check_dense_causal(q, k, causal)
    return _math_backward(grad_out, q, k, v, out, lse, _one_segment(q, k), causal, scale, top_left=True)


def _math_backward(grad_out, q, k, v, out, lse, segments, causal: bool, scale: float, top_left: bool,
                   window: int | None = None):
    acc = _accumulator(q)
    rep = q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    delta = (grad_out.to(acc) * out.to(acc)).sum(-1).transpose(0, 1)  # [H, n]
    for sq, sk in segments:
        if sq.start == sq.stop or sk.start == sk.stop:
            continue
        scores = _segment_probs_logits(q[sq], k[sk], causal, scale, top_left, window)
        probs = torch.exp(scores - lse[:, sq, None])  # [H, lq, lk] under the merged normaliser
        kk = k[sk].to(acc).repeat_interleave(rep, dim=1)
        vv = v[sk].to(acc).repeat_interleave(rep, dim=1)
        do = grad_out[sq].to(acc)
        dv_seg = torch.einsum("hqk,qhd->khd", probs, do)
        dp = torch.einsum("qhd,khd->hqk", do, vv)
        ds = probs * (dp - delta[:, sq, None]) * scale
        dq[sq] += torch.einsum("hqk,khd->qhd", ds, kk)
        dk_seg = torch.einsum("hqk,qhd->khd", ds, q[sq].to(acc))
        # fold the query heads back onto their K/V head (GQA)
        dk[sk] += dk_seg.view(dk_seg.shape[0], k.shape[1], rep, -1).sum(2)
        dv[sk] += dv_seg.view(dv_seg.shape[0], v.shape[1], rep, -1).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """Varlen ``[n, heads, D]`` as the ``[1, heads, n, D]`` view SDPA kernels take (no copy)."""
    return x.transpose(0, 1).unsqueeze(0)


def cudnn_dense_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    """cuDNN's fused attention over *one* dense segment (the varlen arguments are not read).

    Why a second kernel: on Hopper GPUs cuDNN's kernels run dense attention markedly faster than
    PyTorch's FA2 varlen, forward and backward (measured: ``docs/benchmarks/notes.md`` §12). A tree's big dense blocks — a root's causal self-attention, the rectangle of all queries
    below a root against its keys, the depth-first walk's cached prefix — are single segments.
    GQA is native (K/V keep their heads); the log-sum-exp is the natural-log one FA2 returns, so
    the two kernels' partials merge (``merge_partials``). ``causal`` is aligned top-left (query
    ``i`` sees keys ``0..i``; its outputs equal the square block's and the rectangle's, run apart,
    bit for bit): a root's causal block and the rectangle of every query below it are one call,
    faster than two calls and with no copies to join them (measured: notes §18).
    """
    _check_dense_causal(q, k, causal)
    out, lse, cum_q, cum_k, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, causal, False, scale=scale)
    return out[0].transpose(0, 1), lse.reshape(q.shape[1], q.shape[0]), (cum_q, cum_k, mq, mk, seed, offset)


def _check_dense_causal(q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    """Top-left alignment means what the tree needs only with at least as many queries as keys."""
    if causal and q.shape[0] < k.shape[0]:
        raise ValueError(f"dense causal attention aligns the mask top-left and needs at least as many queries as "
                         f"keys, got {q.shape[0]} queries and {k.shape[0]} keys")


def cudnn_dense_backward(grad_out, q, k, v, out, lse, state, cu_q, cu_k, max_q: int, max_k: int,
                         causal: bool, scale: float):
    """``(dq, dk, dv)`` of :func:`cudnn_dense_forward`'s segment given the merged ``out`` and ``lse``."""
    cum_q, cum_k, mq, mk, seed, offset = state
    heads, n = q.shape[1], q.shape[0]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _bhsd(grad_out.contiguous()), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.reshape(1, heads, n, 1),
        seed, offset, None, cum_q, cum_k, mq, mk, 0.0, causal, scale=scale)
    return dq[0].transpose(0, 1), dk[0].transpose(0, 1), dv[0].transpose(0, 1)


#: varlen kernel pairs by backend name (tests swap in the math pair to run the split path on a CPU;
#: ``attention/fa4.py`` adds FlashAttention-4's under ``"flash"`` when that backend is asked for)
PARTIAL_KERNELS = {"torch_flash": (flash_partial_forward, flash_partial_backward)}

#: kernel pairs for one dense segment, where faster than the varlen pair (see ``dense_kernels``)
DENSE_KERNELS = {"torch_flash": (cudnn_dense_forward, cudnn_dense_backward)}

#: head dimensions the dense (cuDNN) pair is used for: up to 128 (cuDNN's limit here), and from
#: 128 on when the host launches the kernels: at head_dim 64 a cuDNN call's extra host time made a
#: host-bound small model's step slower than FA2 varlen alone, at 128 the split is faster
#: (measured in docs/benchmarks/notes.md §12)
CUDNN_MIN_HEAD_DIM = 128
CUDNN_MAX_HEAD_DIM = 128
#: ... and from 64 on in a replayed CUDA graph (``trl_tree.engine.graphs``), where the host's cost per call
#: is gone and only the kernels' GPU time counts (notes §17)
CUDNN_GRAPHED_MIN_HEAD_DIM = 64
#: fewest query and key rows a part needs to go to the dense pair (cuDNN refuses 1 x 1 blocks,
#: and a block smaller than a tile gains nothing from a second kernel)
DENSE_MIN_ROWS = 64


#: backends whose dense pair plans each new shape before running it: cuDNN builds an execution plan
#: per shape, which costs a large share of a step where no shape repeats (free-length GRPO groups;
#: measured in docs/benchmarks/notes.md §17)
PLANNED_DENSE = {"torch_flash"}
#: such a pair runs a shape from this sighting on (the first ones take the varlen pair): a shape
#: that never comes back is never planned, nor one seen twice (GRPO's ``num_iterations = 2``: a
#: plan for one more call costs more than it saves; fixed shapes pay from their third call)
DENSE_AT_SIGHTING = 3
#: dense shapes remembered (least recently seen forgotten first)
DENSE_SHAPES_KEPT = 4096
_DENSE_SHAPES: OrderedDict = OrderedDict()


def dense_shape_seen(backend: str, key: tuple) -> bool:
    """Count a sighting of the dense blocks ``key`` (their shapes, heads, dtype); whether the dense
    pair should run them now: always for a pair without plans, from the ``DENSE_AT_SIGHTING``-th
    sighting for one that plans each shape (``PLANNED_DENSE``)."""
    if backend not in PLANNED_DENSE:
        return True
    seen = _DENSE_SHAPES.pop(key, 0) + 1
    _DENSE_SHAPES[key] = seen
    while len(_DENSE_SHAPES) > DENSE_SHAPES_KEPT:
        _DENSE_SHAPES.popitem(last=False)
    return seen >= DENSE_AT_SIGHTING


def dense_pair(backend: str, q_rows: int | None = None, k_rows: int | None = None):
    """``backend``'s dense pair for a block of ``q_rows`` x ``k_rows`` (when given), else None; where
    it may run at all (device, dtype, head dimension) is :func:`dense_kernels`' question."""
    pair = DENSE_KERNELS.get(backend)
    if pair is None or any(rows is not None and rows < DENSE_MIN_ROWS for rows in (q_rows, k_rows)):
        return None
    return pair


def dense_kernels(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                  q_rows: int | None = None, k_rows: int | None = None, graphed: bool = False):
    """The dense pair of ``backend`` if it runs here (for a block of ``q_rows`` x ``k_rows``, when
    given), else None (the varlen pair serves instead).

    cuDNN's fused attention: CUDA, fp16/bf16, head dimension 128 (``CUDNN_MIN/MAX_HEAD_DIM``; from
    ``CUDNN_GRAPHED_MIN_HEAD_DIM`` in a call that is ``graphed``), blocks of at least
    ``DENSE_MIN_ROWS`` each way, and PyTorch's cuDNN SDPA switch on
    (``torch.backends.cuda.enable_cudnn_sdp``: a user who turned it off gets the varlen kernels
    everywhere).
    """
    pair = dense_pair(backend, q_rows, k_rows)
    if pair is None or pair[0] is not cudnn_dense_forward:
        return pair
    ok = (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
          and (CUDNN_GRAPHED_MIN_HEAD_DIM if graphed else CUDNN_MIN_HEAD_DIM) <= head_dim <= CUDNN_MAX_HEAD_DIM
          and torch.backends.cudnn.is_available()
          and torch.backends.cuda.cudnn_sdp_enabled())
    return pair if ok else None
