"""FlashAttention-4 (flash-attn-4's ``flash_attn.cute``) as a partial-kernel pair.

Why a pair and not FA4's autograd function: the tree's FlashAttention paths — the root split, the
kept outputs for the checkpointed recompute, the depth-first walk's prefix rectangle read in place
from the K/V stack — all need a forward that returns the log-sum-exp and a backward that takes the
*merged* output and log-sum-exp of several parts (``attention/partial.py`` says why that is exact).
FA4's private ``_flash_attn_fwd`` / ``_flash_attn_bwd`` are exactly that, with the contract of
PyTorch's FA2 pair: varlen ``q [n, H, D]``, ``k``/``v [m, Hkv, D]`` (GQA native), causal aligned
bottom-right, ``lse [H, n]`` float32 in natural log. With the pair registered under ``"flash"``,
that backend runs every path ``torch_flash`` runs (packed, split, kept, dfs, CUDA graphs); the
single-segment blocks keep the dense pair chosen in ``partial.dense_kernels`` (cuDNN, whose causal
mask aligns top-left: the one-call root block needs that; a user who turns cuDNN's SDPA off gets
FA4 for every block).

Registration is lazy (:func:`register_fa4`): importing ``flash_attn.cute`` loads the CuTe DSL and
takes seconds, so it happens only when a call asks for ``attn_backend="flash"`` and FA2's
``flash_attn`` is not what is installed.
"""

from __future__ import annotations

import functools
import importlib
import os
import time

import torch

from . import fa4_ahead, partial
from .fa4_ahead import PERSISTENT_CACHE_VARIABLE, bwd_call, fwd_call  # noqa: F401 (also this module's names)

#: what the calls that added kernels to FA4's caches (compiled, or loaded from its disk cache) took
_compiles = {"kernels": 0, "seconds": 0.0}


@functools.cache
def _interface():
    """FA4's interface module, or None where it cannot be imported; its compile caches guarded
    (``fa4_ahead``: a miss can raise instead of compiling)."""
    os.environ.setdefault(PERSISTENT_CACHE_VARIABLE, "1")
    try:
        module = importlib.import_module("flash_attn.cute.interface")
    except (ImportError, AttributeError, OSError, RuntimeError):
        return None
    fa4_ahead.guard_caches(module)
    return module


@functools.cache
def _jit_caches() -> tuple[dict, ...]:
    """FA4's in-memory JIT caches (the dict of every ``compile_cache`` of its interface), found once."""
    caches = (getattr(getattr(value, "compile_cache", None), "cache", None) for value in vars(_interface()).values())
    return tuple(cache for cache in caches if isinstance(cache, dict))


def _cached_kernels() -> int:
    return sum(len(cache) for cache in _jit_caches())


def _counting_compiles(call, *args, **kwargs):
    """``call(*args, **kwargs)``; where it added kernels to FA4's caches, its host time is counted
    as compiling (the kernel's own run is queued, not waited for)."""
    before, start = _cached_kernels(), time.perf_counter()
    out = call(*args, **kwargs)
    added = _cached_kernels() - before
    if added:
        _compiles["kernels"] += added
        _compiles["seconds"] += time.perf_counter() - start
    return out


def take_compile_time() -> tuple[int, float]:
    """``(kernels, seconds)`` FA4 compiled (or loaded from its disk cache) since the last call."""
    taken = (_compiles["kernels"], _compiles["seconds"])
    _compiles["kernels"], _compiles["seconds"] = 0, 0.0
    return taken


def _no_dropout_state():
    """PyTorch's FA2 backward's dropout arguments where no FA2 forward made them (unread without
    dropout: what its forward returns then)."""
    return torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)


def fa4_partial_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                        window: int | None = None):
    """FA4's varlen forward: ``(out, lse, None)`` (no state: its backward recomputes from ``lse``).
    A variant FA4 has not built yet runs on PyTorch's FA2 while it compiles off the step (``fa4_ahead``):
    then the state is FA2's."""
    options = dict(max_q=max_q, max_k=max_k, causal=causal, scale=scale, window=window)

    def call():
        out, lse, *_ = _counting_compiles(fwd_call, _interface(), q, k, v, cu_q, cu_k, **options)
        return out, lse, None

    def fallback():
        return partial.PARTIAL_KERNELS["torch_flash"][0](q, k, v, cu_q, cu_k, max_q, max_k, causal, scale,
                                                         window=window)

    return fa4_ahead.run("fwd", call, fallback, {"q": q, "k": k, "v": v}, cu_q, cu_k, options)


def fa4_partial_backward(grad_out, q, k, v, out, lse, state, cu_q, cu_k, max_q: int, max_k: int,
                         causal: bool, scale: float, window: int | None = None):
    """``(dq, dk, dv)`` of one part given the merged ``out`` and ``lse`` (model dtype); PyTorch's FA2
    where FA4's variant is still compiling (exact either way: both rebuild the probabilities from
    the merged ``lse``)."""
    grad_out, lse = grad_out.contiguous(), lse.contiguous()
    options = dict(max_q=max_q, max_k=max_k, causal=causal, scale=scale, window=window)

    def call():
        return _counting_compiles(bwd_call, _interface(), grad_out, q, k, v, out, lse, cu_q, cu_k, **options)[:3]

    def fallback():
        fa2_state = state if state is not None else _no_dropout_state()
        return tuple(partial.PARTIAL_KERNELS["torch_flash"][1](grad_out, q, k, v, out, lse, fa2_state, cu_q, cu_k,
                                                               max_q, max_k, causal, scale, window=window)[:3])

    tensors = {"grad_out": grad_out, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    return fa4_ahead.run("bwd", call, fallback, tensors, cu_q, cu_k, options)


#: the keyword arguments this module passes to FA4's private functions: a release that renamed any
#: of them is not used (``auto`` then keeps PyTorch's FA2) rather than failing inside a training step
_FWD_ARGS = frozenset({"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
                       "return_lse", "window_size_left", "window_size_right"})
_BWD_ARGS = frozenset({"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "window_size_left",
                       "window_size_right"})


@functools.cache
def fa4_pair_available() -> bool:
    """Whether FA4's forward/backward pair can be imported here and takes the arguments this module
    passes (not whether a GPU can run it)."""
    import inspect

    module = _interface()
    if module is None or not all(hasattr(module, f) for f in ("_flash_attn_fwd", "_flash_attn_bwd")):
        return False
    try:
        fwd = inspect.signature(module._flash_attn_fwd).parameters
        bwd = inspect.signature(module._flash_attn_bwd).parameters
    except (TypeError, ValueError):
        return False
    return _FWD_ARGS <= set(fwd) and _BWD_ARGS <= set(bwd)


def register_fa4() -> bool:
    """Put FA4's pair under ``"flash"`` in ``partial.PARTIAL_KERNELS`` (and cuDNN as its dense pair,
    planned per shape like ``torch_flash``'s); True when it is registered."""
    if "flash" in partial.PARTIAL_KERNELS:
        return True
    if not fa4_pair_available():
        return False
    partial.PARTIAL_KERNELS["flash"] = (fa4_partial_forward, fa4_partial_backward)
    partial.DENSE_KERNELS["flash"] = (partial.cudnn_dense_forward, partial.cudnn_dense_backward)
    partial.PLANNED_DENSE.add("flash")
    return True


def fa4_runs_on(device: torch.device) -> bool:
    """FA4's kernels exist for Hopper (sm90) and Blackwell (sm100 to sm120) only."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (9, 10, 11, 12)
