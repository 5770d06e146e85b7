"""Qwen3-Next's gated DeltaNet (``Qwen3NextGatedDeltaNet``) over a prefix tree.

The layer's own pieces, in its order: ``in_proj_qkvz`` / ``in_proj_ba`` and its head ordering; the
causal convolution over ``[q; k; v]`` (each token over its root path, ``conv.py``) and its
activation; ``beta = sigmoid(b)`` and the log-decay ``g = -exp(A_log) * softplus(a + dt_bias)``;
the gated delta rule through transformers' own chunked kernel (``torch_chunk_gated_delta_rule``,
or the flash-linear-attention kernel transformers routes it to) with each node's initial state
its parent's final state (``scan.py``); the gated RMS norm with ``z``; ``out_proj``.

Padding that leaves the state alone: a padded row has ``k = 0`` (its L2 norm stays 0), ``v = 0``,
``beta = 0`` (no write) and ``g = 0`` (no decay).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from .conv import tree_causal_conv
from .scan import carried_state, hand_on, model_kernel, scan_segments, segments_of

#: transformers' chunked gated delta rule, in the layer's own module
KERNEL = "torch_chunk_gated_delta_rule"


def gated_deltanet(module, hidden_states: torch.Tensor, meta) -> torch.Tensor:
    """The layer on the tree call's row ``hidden_states [1, n, H]``."""
    n = hidden_states.shape[1]
    query, key, value, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden_states),
                                                                     module.in_proj_ba(hidden_states))
    mixed = torch.cat([x.reshape(n, -1) for x in (query, key, value)], dim=-1)
    conv = tree_causal_conv(mixed, module.conv1d.weight, module.conv1d.bias, meta, module.layer_idx)
    mixed = ACT2FN[module.activation](conv).to(mixed.dtype)
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(n, -1, module.head_k_dim)
    key = key.reshape(n, -1, module.head_k_dim)
    value = value.reshape(n, -1, module.head_v_dim)
    if module.num_v_heads > module.num_k_heads:  # as the layer does (older kernels take equal head counts)
        query, key = (x.repeat_interleave(module.num_v_heads // module.num_k_heads, dim=1) for x in (query, key))
    beta = b[0].sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a[0].float() + module.dt_bias)
    kernel = model_kernel(module, KERNEL)

    def scan(q, k, v, g_, beta_, initial):
        return kernel(q, k, v, g=g_, beta=beta_, initial_state=initial, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)

    zero = value.new_zeros(module.num_v_heads, module.head_k_dim, module.head_v_dim, dtype=torch.float32)
    out, final = scan_segments(segments_of(meta), [query, key, value, g, beta], scan,
                               carried_state(meta, module.layer_idx, value), zero)
    core = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    output = module.out_proj(core.reshape(1, n, -1))
    return hand_on(meta, module.layer_idx, output, final)
