"""Partial attention with a log-sum-exp merge (attention/partial.py) against plain attention.

The depth-first walk's FlashAttention path splits each unit's attention into the cached prefix
and the unit's own tree; these tests check the math of that split on the CPU: the merge equals
attention over all keys, and each part's backward, fed the merged output and log-sum-exp, returns
exactly its share of the gradients (the GPU kernels follow the same contract; check_gpu runs them).
"""

from __future__ import annotations

import pytest
import torch

from trl_tree.engine.attention.partial import (
    math_dense_backward,
    math_dense_forward,
    math_partial_backward,
    math_partial_forward,
    merge_partials,
)


def reference(q, k, v, mask, scale):
    """Masked attention over all keys, GQA by repeating K/V heads: ``[n, H, D]``."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def own_tree_case(seed: int = 0):
    """A prefix of 5 keys seen by every query, then 3 nodes: a root (3 tokens) with two children
    (2 and 4 tokens); each node sees its in-unit ancestors and itself, causally."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D, d = 4, 2, 8, 5
    node_tokens = [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    node_keys = [[0, 1, 2], [0, 1, 2, 3, 4], [0, 1, 2, 5, 6, 7, 8]]  # in-unit rows, ancestors first
    n = 9
    q = torch.randn(n, H, D, generator=g, dtype=torch.float64)
    k_all = torch.randn(d + n, Hkv, D, generator=g, dtype=torch.float64)
    v_all = torch.randn(d + n, Hkv, D, generator=g, dtype=torch.float64)
    mask = torch.zeros(n, d + n, dtype=torch.bool)
    mask[:, :d] = True
    for toks, keys in zip(node_tokens, node_keys):
        for i, t in enumerate(toks):
            visible = keys[: len(keys) - len(toks) + i + 1]
            mask[t, [d + r for r in visible]] = True
    kv_local = torch.tensor([r for keys in node_keys for r in keys])
    cu_q = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 8, 15], dtype=torch.int32)
    return q, k_all, v_all, mask, d, kv_local, cu_q, cu_k


def split_forward(q, k_all, v_all, d, kv_local, cu_q, cu_k, scale):
    k_own, v_own = k_all[d:].index_select(0, kv_local), v_all[d:].index_select(0, kv_local)
    out_o, lse_o, _ = math_partial_forward(q, k_own, v_own, cu_q, cu_k, 4, 7, True, scale)
    pre_cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    pre_cu_k = torch.tensor([0, d], dtype=torch.int32)
    out_p, lse_p, _ = math_partial_forward(q, k_all[:d], v_all[:d], pre_cu_q, pre_cu_k, q.shape[0], d, False, scale)
    out, lse = merge_partials(out_p, lse_p, out_o, lse_o)
    return out, lse, (k_own, v_own, pre_cu_q, pre_cu_k)


def test_merge_equals_attention_over_all_keys():
    q, k_all, v_all, mask, d, kv_local, cu_q, cu_k = own_tree_case()
    out, lse, _ = split_forward(q, k_all, v_all, d, kv_local, cu_q, cu_k, 0.3)
    torch.testing.assert_close(out, reference(q, k_all, v_all, mask, 0.3), rtol=1e-12, atol=1e-12)
    rep = q.shape[1] // k_all.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q, k_all.repeat_interleave(rep, 1)) * 0.3
    torch.testing.assert_close(lse, torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1))


def test_partial_backwards_sum_to_the_full_gradient():
    q, k_all, v_all, mask, d, kv_local, cu_q, cu_k = own_tree_case(1)
    scale = 0.3
    grad_out = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(2))
    q_, k_, v_ = (x.clone().requires_grad_() for x in (q, k_all, v_all))
    reference(q_, k_, v_, mask, scale).backward(grad_out)

    out, lse, (k_own, v_own, pre_cu_q, pre_cu_k) = split_forward(q, k_all, v_all, d, kv_local, cu_q, cu_k, scale)
    dq_o, dk_rows, dv_rows = math_partial_backward(grad_out, q, k_own, v_own, out, lse, None, cu_q, cu_k, 4, 7,
                                                   True, scale)
    dq_p, dk_p, dv_p = math_partial_backward(grad_out, q, k_all[:d], v_all[:d], out, lse, None, pre_cu_q, pre_cu_k,
                                             q.shape[0], d, False, scale)
    n = q.shape[0]
    dk_own = torch.zeros(n, *k_all.shape[1:], dtype=q.dtype).index_add_(0, kv_local, dk_rows)
    dv_own = torch.zeros(n, *v_all.shape[1:], dtype=q.dtype).index_add_(0, kv_local, dv_rows)
    torch.testing.assert_close(dq_o + dq_p, q_.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat([dk_p, dk_own]), k_.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat([dv_p, dv_own]), v_.grad, rtol=1e-10, atol=1e-10)


def root_block_and_rectangle_case(seed: int = 0, R: int = 6, below: int = 5):
    """Every packed query of one tree against its root's ``R`` keys: the root's rows causally, the
    ``below`` rows under the root all of them (what the dense pair computes in one call)."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = 4, 2, 8
    q = torch.randn(R + below, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(R, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(R, Hkv, D, generator=g, dtype=torch.float64)
    return q, k, v, R


def test_dense_pair_aligns_its_causal_mask_top_left():
    """The dense pair's causal mask: query i sees keys 0..i, so with more queries than keys the rows
    past the last key see every key — one call equals the root's causal block and the rectangle
    below it run apart, forward and backward (the root keys' gradient is the sum of the two)."""
    q, k, v, R = root_block_and_rectangle_case()
    n, scale = q.shape[0], 0.3
    mask = torch.arange(R)[None, :] <= torch.arange(n)[:, None]
    out, lse, _ = math_dense_forward(q, k, v, None, None, n, R, True, scale)
    torch.testing.assert_close(out, reference(q, k, v, mask, scale), rtol=1e-12, atol=1e-12)
    cu = lambda *xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    o_root, l_root, _ = math_partial_forward(q[:R], k, v, cu(0, R), cu(0, R), R, R, True, scale)
    o_rect, l_rect, _ = math_partial_forward(q[R:], k, v, cu(0, n - R), cu(0, R), n - R, R, False, scale)
    torch.testing.assert_close(out, torch.cat([o_root, o_rect]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.cat([l_root, l_rect], dim=1), rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    dq, dk, dv = math_dense_backward(g, q, k, v, out, lse, None, None, None, n, R, True, scale)
    dq_r, dk_r, dv_r = math_partial_backward(g[:R], q[:R], k, v, o_root, l_root, None, cu(0, R), cu(0, R), R, R, True,
                                             scale)
    dq_x, dk_x, dv_x = math_partial_backward(g[R:], q[R:], k, v, o_rect, l_rect, None, cu(0, n - R), cu(0, R), n - R,
                                             R, False, scale)
    torch.testing.assert_close(dq, torch.cat([dq_r, dq_x]), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dk, dk_r + dk_x, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dv, dv_r + dv_x, rtol=1e-10, atol=1e-10)


def test_dense_pair_refuses_a_causal_block_with_fewer_queries_than_keys():
    """Top-left alignment would hide keys a bottom-right (tree) mask shows: refused, not computed."""
    q, k, v, R = root_block_and_rectangle_case()
    with pytest.raises(ValueError, match="at least as many queries as keys"):
        math_dense_forward(q[: R - 1], k, v, None, None, R - 1, R, True, 0.3)
    out, _, _ = math_dense_forward(q[: R - 1], k, v, None, None, R - 1, R, False, 0.3)  # non-causal: any shape
    assert out.shape == q[: R - 1].shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PyTorch's FlashAttention needs a CUDA device")
def test_flash_kernels_follow_the_math_contract():
    from trl_tree.engine.attention.partial import flash_partial_backward, flash_partial_forward

    q, k_all, v_all, mask, d, kv_local, cu_q, cu_k = own_tree_case(3)
    q, k_all, v_all = (x.to("cuda", torch.bfloat16).repeat(1, 1, 8) for x in (q, k_all, v_all))  # head_dim 64
    cu_q, cu_k, kv_local = cu_q.cuda(), cu_k.cuda(), kv_local.cuda()
    k_own, v_own = k_all[d:].index_select(0, kv_local), v_all[d:].index_select(0, kv_local)
    out_f, lse_f, state = flash_partial_forward(q, k_own, v_own, cu_q, cu_k, 4, 7, True, 0.1)
    out_m, lse_m, _ = math_partial_forward(q, k_own, v_own, cu_q, cu_k, 4, 7, True, 0.1)
    torch.testing.assert_close(out_f.float(), out_m.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse_f, lse_m, rtol=1e-3, atol=1e-3)
    g = torch.randn_like(out_f)
    for a, b in zip(flash_partial_backward(g, q, k_own, v_own, out_f, lse_f, state, cu_q, cu_k, 4, 7, True, 0.1),
                    math_partial_backward(g, q, k_own, v_own, out_f, lse_f, None, cu_q, cu_k, 4, 7, True, 0.1)):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's fused attention needs a CUDA device")
def test_cudnn_dense_pair_follows_the_math_contract():
    """cuDNN's causal mask with more queries than keys is aligned top-left, like the math dense pair."""
    from trl_tree.engine.attention.partial import cudnn_dense_backward, cudnn_dense_forward

    q, k, v, R = root_block_and_rectangle_case(4, R=80, below=70)
    q, k, v = (x.to("cuda", torch.bfloat16).repeat(1, 1, 8) for x in (q, k, v))  # head_dim 64
    n = q.shape[0]
    out_c, lse_c, state = cudnn_dense_forward(q, k, v, None, None, n, R, True, 0.1)
    out_m, lse_m, _ = math_dense_forward(q, k, v, None, None, n, R, True, 0.1)
    torch.testing.assert_close(out_c.float(), out_m.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse_c, lse_m, rtol=1e-3, atol=1e-3)
    g = torch.randn_like(out_c)
    for a, b in zip(cudnn_dense_backward(g, q, k, v, out_c, lse_c, state, None, None, n, R, True, 0.1),
                    math_dense_backward(g, q, k, v, out_c, lse_c, None, None, None, n, R, True, 0.1)):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)
