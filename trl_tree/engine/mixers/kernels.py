"""The sequence kernels hybrid layers call, run over a prefix tree: the tree is given to the kernel,
not to the layer.

transformers' hybrid layers (gated DeltaNet, Kimi Delta Attention, Mamba-1/2 mixers, short
convolutions) compute everything token by token except inside a few kernels, which every family
imports into its modeling module as module-level functions: ``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``, ``mamba2_chunk_scan``,
``mamba_selective_scan`` (each routed by transformers to flash-linear-attention, causal-conv1d or
mamba-ssm where installed). So a tree call runs the layer's own ``forward`` unchanged, and only
those kernels see the tree: each module-level kernel is replaced, once, by a dispatcher that passes
every call through to the original — except inside a tree call of a mixer (:func:`tree_call`),
where it runs the kernel's tree form: a convolution over each token's root path (``conv.py``), a
scan with each node starting from its parent's final state (``scan.py``). A new layer that calls the
same kernels — Qwen3.5's DeltaNet with its projections split, OLMo-hybrid's, LFM3's convolution —
runs without a form of its own.

Kernels a tree call declines: the fused Mamba-2 path (``mamba2_split_conv1d_scan_combined``, which
returns None where mamba-ssm is not installed and the layer then runs its unfused kernels) returns
None there too. Kernels of one decoding step with a cache are never reached by a tree call (it
carries none). A layer that calls a kernel none of these lists knows is refused at construction,
naming the layer and the kernel (:func:`unknown_kernels`).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Hashable
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from . import conv, deltanet, mamba1, mamba2

#: a kernel's name in transformers' modeling modules -> its tree form ``(call, original, *args, **kwargs)``
TREE_KERNELS: dict[str, Callable] = {
    "causal_conv1d_fn": conv.tree_causal_conv1d_fn,
    "torch_chunk_gated_delta_rule": deltanet.tree_delta_rule,
    "chunk_kimi_delta_attention": deltanet.tree_delta_rule,
    "mamba2_chunk_scan": mamba2.tree_ssd_scan,
    "mamba_selective_scan": mamba1.tree_selective_scan,
}
#: fused kernels a tree call declines (returns None): the layer then runs the kernels above
DECLINED = ("mamba2_split_conv1d_scan_combined",)
#: kernels of one decoding step from a cache, which a tree call never carries
DECODING = ("causal_conv1d_update", "torch_recurrent_gated_delta_rule", "recurrent_kimi_delta_attention",
            "mamba2_selective_state_update", "mamba_selective_state_update")
KNOWN = (*TREE_KERNELS, *DECLINED, *DECODING)


@dataclass
class KernelCall:
    """A mixer's tree call: its metadata, and each kernel's place in the layer — the key of what the
    depth-first walk keeps for it on the stack (a convolution's inputs, a scan's states). A
    checkpointed recompute calls the layer again and finds the same keys."""

    meta: object
    layer: Hashable
    counts: dict[str, int] = field(default_factory=dict)

    def key(self, kind: str) -> tuple:
        n = self.counts.get(kind, 0)
        self.counts[kind] = n + 1
        return (self.layer, kind, n)


_CALL: ContextVar[KernelCall | None] = ContextVar("trl_tree_kernel_call", default=None)


def tree_call(module: torch.nn.Module, meta):
    """Set the tree call for the kernels ``module``'s forward calls; returns the token to reset. The
    mixer's wrapper has checked the call is one packed row, so the kernels' tree forms take it so."""
    layer = getattr(module, "layer_idx", None)
    return _CALL.set(KernelCall(meta, layer if layer is not None else id(module)))


def end_tree_call(token) -> None:
    _CALL.reset(token)


def _dispatcher(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def kernel(*args, **kwargs):
        call = _CALL.get()
        if call is None:
            return original(*args, **kwargs)
        if name in DECLINED:
            return None
        if name in DECODING:
            raise RuntimeError(f"{name} (one decoding step from a cache) was called inside a tree call, which "
                               "carries no cache")
        return TREE_KERNELS[name](call, original, *args, **kwargs)

    kernel._trl_tree_original = original
    return kernel


def install_kernels(module_class: type) -> None:
    """Put the dispatchers in place of the kernels in the modeling module that defines ``module_class``
    (once per module; every other caller of those names gets the original behaviour back)."""
    namespace = sys.modules[module_class.__module__].__dict__
    for name in KNOWN:
        fn = namespace.get(name)
        if callable(fn) and not hasattr(fn, "_trl_tree_original"):
            namespace[name] = _dispatcher(name, fn)


def _kernel_like(fn) -> bool:
    """A function transformers routes to a kernel package (hub- or fallback-decorated: it wraps the
    torch implementation), or one of the kernels this module knows by name."""
    return callable(fn) and (hasattr(fn, "__wrapped__") or getattr(fn, "__name__", "") in KNOWN)


@functools.lru_cache(maxsize=None)
def kernels_called(module_class: type) -> tuple[str, ...]:
    """The kernel functions ``module_class``'s forward calls (read from the code: its names, those of
    the class's own methods it calls, such as ``torch_forward``, and its base classes' forwards, which
    ``super().forward`` reaches), each looked up in the modeling module of the class that calls it."""
    names: list[str] = []
    seen: set = set()
    for owner in module_class.__mro__:
        if "forward" not in vars(owner) or owner.__module__.startswith("torch."):
            continue
        namespace = sys.modules[owner.__module__].__dict__
        todo = [vars(owner)["forward"]]
        while todo:
            code = getattr(inspect.unwrap(todo.pop()), "__code__", None)
            if code is None or code in seen:
                continue
            seen.add(code)
            for name in code.co_names:
                target = namespace.get(name)
                if name not in names and (name in KNOWN or (_kernel_like(target) and _is_sequence_kernel(target))):
                    names.append(name)
                method = getattr(owner, name, None)
                if inspect.isfunction(method):
                    todo.append(method)
    return tuple(names)


def _is_sequence_kernel(fn) -> bool:
    """A decorated module function whose torch implementation mixes along the sequence: rotary and
    norm kernels are decorated too and are token-wise; they are told apart by name."""
    name = getattr(inspect.unwrap(fn), "__name__", "")
    return not any(word in name for word in ("rotary", "rope", "norm", "rms", "swiglu", "silu", "gelu", "mlp",
                                             "moe", "expert", "router", "softmax"))


def is_mixer(module: torch.nn.Module) -> bool:
    """A module whose forward calls a sequence kernel this module runs over the tree."""
    return any(name in TREE_KERNELS for name in kernels_called(type(module)))


def unknown_kernels(module: torch.nn.Module) -> list[str]:
    """The sequence kernels ``module``'s forward calls that the tree does not know."""
    return [name for name in kernels_called(type(module)) if name not in KNOWN]
