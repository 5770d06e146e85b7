"""FlashAttention-4's variants compiled off the step (``engine/attention/fa4_ahead.py``), on the CPU.

A stand-in FA4 interface keeps FA4's structure where it matters here: each function looks its
compile key up in a ``compile_cache`` (memory, then a shared "disk") and compiles on a miss; the
stand-in worker writes the key to the disk, as a worker process exports it to FA4's disk cache.
Checked: an unbuilt variant never compiles in the call — it runs the fallback pair and is handed
to one worker; calls while it compiles fall back without handing it over again; once the worker is
done FA4 runs (a load, counted); a variant the worker cannot make findable is compiled in the call
after ``MAX_TRIES``; off (``TRL_TREE_FA4_COMPILE_AHEAD=0``) it compiles in the call; and every path
gives the same outputs and gradients (fp32, against the math pair).
"""

from __future__ import annotations

import threading
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from trl_tree.engine.attention import fa4, fa4_ahead, partial

DISK: dict = {}
COMPILED: list = []
FALLBACKS: list = []


class FakeCache:
    """FA4's persistent JIT cache: memory first, then the disk (loaded into memory when found)."""

    def __init__(self):
        self.cache = {}

    def __contains__(self, key) -> bool:
        if key in self.cache:
            return True
        if key in DISK:
            self.cache[key] = DISK[key]
            return True
        return False

    def __getitem__(self, key):
        return self.cache[key]

    def __setitem__(self, key, fn) -> None:
        self.cache[key] = fn
        DISK[key] = fn


def _key(kind: str, causal: bool, window_left, head_dim: int, tag: str = "") -> tuple:
    return (kind, causal, window_left, head_dim, tag)


def make_interface(tag: str = ""):
    """A stand-in ``flash_attn.cute.interface``; ``tag`` joins its compile keys (another process
    whose keys differ: a worker that cannot make a variant findable)."""

    def fwd(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None,
            causal=False, window_size_left=None, window_size_right=None, return_lse=False, **_):
        key = _key("fwd", causal, window_size_left, q.shape[-1], tag)
        if key not in fwd.compile_cache:
            COMPILED.append(key)
            fwd.compile_cache[key] = True
        window = None if window_size_left is None else window_size_left + 1
        out, lse, _ = partial.math_partial_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   causal, softmax_scale, window=window)
        return out, lse, None, None, None

    def bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, cu_seqlens_q=None,
            cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, window_size_left=None, window_size_right=None,
            **_):
        key = _key("bwd", causal, window_size_left, q.shape[-1], tag)
        if key not in bwd.compile_cache:
            COMPILED.append(key)
            bwd.compile_cache[key] = True
        window = None if window_size_left is None else window_size_left + 1
        return partial.math_partial_backward(dout, q, k, v, out, lse, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, causal, softmax_scale, window=window)

    fwd.compile_cache, bwd.compile_cache = FakeCache(), FakeCache()
    return types.SimpleNamespace(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd)


@pytest.fixture
def ahead(monkeypatch):
    """FA4's stand-in with guarded caches; workers that wait for ``gate`` and then compile the call
    in a fresh stand-in (its own memory, the shared disk); the fallback pair counted."""
    DISK.clear(), COMPILED.clear(), FALLBACKS.clear()
    interface = make_interface()
    assert fa4_ahead.guard_caches(interface) == 2
    monkeypatch.setattr(fa4, "_interface", lambda: interface)
    fa4._jit_caches.cache_clear()  # found again in this interface (functools.cache)
    monkeypatch.setenv(fa4.PERSISTENT_CACHE_VARIABLE, "1")
    monkeypatch.delenv(fa4_ahead.ENABLE_VARIABLE, raising=False)
    pool = ThreadPoolExecutor(max_workers=2)
    for name, value in (("_tries", {}), ("_pending", {}), ("_inline", set())):
        monkeypatch.setattr(fa4_ahead, name, value)
    fa4_ahead.take_stats()
    state = types.SimpleNamespace(gate=threading.Event(), worker_tag="", specs=[])

    def worker(spec):
        state.specs.append(spec)
        state.gate.wait(10)
        fresh = make_interface(state.worker_tag)
        made = {n: torch.zeros(t["shape"], dtype=getattr(torch, t["dtype"])) for n, t in spec["tensors"].items()}
        cu_q, cu_k = torch.tensor(spec["cu_q"], dtype=torch.int32), torch.tensor(spec["cu_k"], dtype=torch.int32)
        if spec["kind"] == "fwd":
            fa4.fwd_call(fresh, made["q"], made["k"], made["v"], cu_q, cu_k, **spec["options"])
        else:
            fa4.bwd_call(fresh, made["grad_out"], made["q"], made["k"], made["v"], made["out"], made["lse"], cu_q,
                         cu_k, **spec["options"])
        return True

    monkeypatch.setattr(fa4_ahead, "_submit", lambda spec: pool.submit(worker, spec))

    def counted_forward(*args, **kwargs):
        FALLBACKS.append("fwd")
        return partial.math_partial_forward(*args, **kwargs)

    def counted_backward(*args, **kwargs):
        FALLBACKS.append("bwd")
        return partial.math_partial_backward(*args, **kwargs)

    monkeypatch.setitem(partial.PARTIAL_KERNELS, "torch_flash", (counted_forward, counted_backward))
    yield state
    state.gate.set()
    pool.shutdown(wait=True)
    fa4._jit_caches.cache_clear()


def _call(causal: bool = True, window: int | None = None, n: int = 7):
    """One part's forward and backward through FA4's pair (two sequences, ``n`` tokens): ``(out, lse,
    dq, dk, dv)``."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 16
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    cu = torch.tensor([0, 3, n], dtype=torch.int32)
    out, lse, state = fa4.fa4_partial_forward(q, k, v, cu, cu, 4, 4, causal, dim ** -0.5, window=window)
    grad = torch.randn_like(out)
    dq, dk, dv = fa4.fa4_partial_backward(grad, q, k, v, out, lse, state, cu, cu, 4, 4, causal, dim ** -0.5,
                                          window=window)
    return out, lse, dq, dk, dv


def _reference(causal: bool = True, window: int | None = None):
    torch.manual_seed(0)
    n, heads, kv_heads, dim = 7, 4, 2, 16
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out, lse, _ = partial.math_partial_forward(q, k, v, cu, cu, 4, 4, causal, dim ** -0.5, window=window)
    grad = torch.randn_like(out)
    return (out, lse, *partial.math_partial_backward(grad, q, k, v, out, lse, None, cu, cu, 4, 4, causal, dim ** -0.5,
                                                     window=window))


def _wait(state) -> None:
    """Let the workers finish what was handed over."""
    state.gate.set()
    for future in list(fa4_ahead._pending.values()):
        future.result(10)
    state.gate.clear()


def test_an_unbuilt_variant_runs_the_fallback_while_a_worker_compiles_it(ahead):
    reference = _reference()
    for got, want in zip(_call(), reference):  # first call: nothing built, nothing compiled in the call
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert COMPILED == [] and FALLBACKS == ["fwd", "bwd"]
    stats = fa4_ahead.take_stats()
    assert stats["fallback_calls"] == 2 and stats["submitted"] == 2
    _call()  # still compiling: the fallback again, not handed over twice
    _call(n=11)  # another length: FA4's varlen kernels take it, the variant in flight covers it
    assert FALLBACKS == ["fwd", "bwd"] * 3 and fa4_ahead.take_stats()["submitted"] == 0
    _wait(ahead)
    assert sorted(k[0] for k in COMPILED) == ["bwd", "fwd"]  # by the workers, into the disk
    COMPILED.clear()
    fa4.take_compile_time()
    for got, want in zip(_call(), reference):  # built: FA4 runs, loading its kernels from the disk
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert COMPILED == [] and FALLBACKS == ["fwd", "bwd"] * 3
    kernels, _ = fa4.take_compile_time()
    assert kernels == 2  # the loads, counted as the step's compile time (milliseconds on a GPU)
    _call()
    assert fa4.take_compile_time() == (0, 0.0) and fa4_ahead.take_stats()["fallback_calls"] == 0


def test_each_variant_is_handed_over_on_its_own(ahead):
    _call(causal=True)
    _call(causal=False)
    _call(causal=True, window=3)
    assert fa4_ahead.take_stats()["submitted"] == 6  # forward and backward of three variants
    _wait(ahead)
    FALLBACKS.clear()
    for causal, window in ((True, None), (False, None), (True, 3)):
        for got, want in zip(_call(causal, window), _reference(causal, window)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert FALLBACKS == [] and COMPILED and all(k[-1] == "" for k in COMPILED)


def test_a_variant_the_workers_cannot_make_findable_is_compiled_in_the_call(ahead):
    ahead.worker_tag = "other process"  # the worker's keys differ from the call's
    for _ in range(fa4_ahead.MAX_TRIES):
        _call()
        _wait(ahead)
    assert fa4_ahead.take_stats()["submitted"] == 2 * fa4_ahead.MAX_TRIES
    COMPILED.clear()
    for got, want in zip(_call(), _reference()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert sorted(k[0] for k in COMPILED) == ["bwd", "fwd"]  # in the call, as without the module
    assert fa4_ahead.take_stats()["submitted"] == 0


def test_off_compiles_in_the_call(ahead, monkeypatch):
    monkeypatch.setenv(fa4_ahead.ENABLE_VARIABLE, "0")
    _call()
    assert sorted(k[0] for k in COMPILED) == ["bwd", "fwd"] and FALLBACKS == [] and ahead.specs == []
    monkeypatch.setenv(fa4_ahead.ENABLE_VARIABLE, "1")
    monkeypatch.setenv(fa4.PERSISTENT_CACHE_VARIABLE, "0")  # no disk cache: no hand-over
    COMPILED.clear(), DISK.clear()
    for cache in (fa4._interface()._flash_attn_fwd.compile_cache, fa4._interface()._flash_attn_bwd.compile_cache):
        cache.inner.cache.clear()
    _call()
    assert len(COMPILED) == 2 and FALLBACKS == []


def test_graph_warm_ups_and_captures_compile_in_place(ahead, monkeypatch):
    """CUDA graphs record the kernels their warm-ups ran: inside ``GraphRunner.capture`` FA4 compiles
    in the call, never handing over nor falling back."""
    from trl_tree.engine import graphs

    with fa4_ahead.compiling_in_place():
        _call()
    assert sorted(k[0] for k in COMPILED) == ["bwd", "fwd"] and FALLBACKS == [] and ahead.specs == []
    COMPILED.clear(), DISK.clear()
    for cache in (fa4._interface()._flash_attn_fwd.compile_cache, fa4._interface()._flash_attn_bwd.compile_cache):
        cache.inner.cache.clear()
    seen = []
    monkeypatch.setattr(graphs.GraphRunner, "_warm_up_and_capture",
                        lambda self, *a: seen.append(fa4_ahead._guard.inline) or _call())
    graphs.GraphRunner.capture(object.__new__(graphs.GraphRunner), None, torch.device("cpu"), lambda: ())
    assert seen == [True] and len(COMPILED) == 2 and FALLBACKS == []


def test_a_worker_that_fails_is_not_tried_again(ahead, monkeypatch):
    from concurrent.futures import Future

    def failed(spec):
        future = Future()
        future.set_result(False)
        return future

    monkeypatch.setattr(fa4_ahead, "_submit", failed)
    _call()
    _call()  # the failed variants: compiled in the call
    assert sorted(k[0] for k in COMPILED) == ["bwd", "fwd"]
    assert fa4_ahead.take_stats()["submitted"] == 2


def test_a_worker_process_compiles_each_line_and_replies(monkeypatch, capsys):
    """The worker's loop (``--serve``): one reply line per spec, marked among the compiler's own
    output; a spec that fails is reported, and the loop goes on."""
    import io
    import json

    seen = []

    def compile_spec(spec):
        print("compiler chatter")
        if spec["kind"] == "bad":
            raise ValueError("no such\nvariant")
        seen.append(spec["kind"])

    monkeypatch.setattr(fa4_ahead, "compile_spec", compile_spec)
    specs = [{"kind": "fwd"}, {"kind": "bad"}, {"kind": "bwd"}]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(json.dumps(s) + "\n" for s in specs)))
    fa4_ahead.serve()
    replies = [line for line in capsys.readouterr().out.splitlines() if line.startswith(fa4_ahead.REPLY)]
    assert seen == ["fwd", "bwd"]
    assert replies == [f"{fa4_ahead.REPLY} ok", f"{fa4_ahead.REPLY} fail ValueError: no such variant",
                       f"{fa4_ahead.REPLY} ok"]


def test_guarded_cache_passes_everything_through_when_not_guarded():
    interface = make_interface("plain")
    fa4_ahead.guard_caches(interface)
    fa4_ahead.guard_caches(interface)  # once
    cache = interface._flash_attn_fwd.compile_cache
    assert isinstance(cache, fa4_ahead.GuardedCache) and not isinstance(cache.inner, fa4_ahead.GuardedCache)
    assert ("x",) not in cache
    with fa4_ahead.guarded(), pytest.raises(fa4_ahead.NotCompiled):
        ("x",) in cache  # noqa: B015
    cache[("x",)] = 1
    with fa4_ahead.guarded():
        assert ("x",) in cache and cache[("x",)] == 1 and cache.cache == {("x",): 1}


def test_the_worker_pipe_reports_a_failed_compile(monkeypatch):
    """The real hand-over, end to end on a CPU: a worker process started by a daemon feeder thread,
    the spec sent down its standard input, its reply read back; without a GPU its compile fails, and
    the future says so (the training process then compiles that variant in the step)."""
    monkeypatch.setattr(fa4_ahead, "_queue", None)
    monkeypatch.setattr(fa4_ahead, "_workers", lambda: 1)
    spec = {"kind": "fwd", "device": 0, "tensors": {n: {"shape": [3, 2, 16], "stride": [32, 16, 1], "dtype": "bfloat16"}
                                                    for n in ("q", "k", "v")},
            "cu_q": [0, 3], "cu_k": [0, 3], "options": {"max_q": 3, "max_k": 3, "causal": True, "scale": 0.25}}
    before = fa4_ahead.take_stats()
    assert fa4_ahead._submit(spec).result(120) is False
    stats = fa4_ahead.take_stats()
    assert stats["compiled"] == 0 and stats["worker_seconds"] > 0 and before["compiled"] == 0
