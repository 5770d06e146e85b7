"""Mamba-2 mixers of hybrids (Nemotron-H, Bamba, Granite-4 hybrid, Falcon-H1) over a prefix tree.

transformers' Mamba-2 mixers share one forward (they differ in their configs' field names; the
attention-free ``Mamba2ForCausalLM`` does not hand its layers the call's keyword arguments, so the
engine refuses it; Falcon-H1's adds multipliers around the input projection and may leave out the
gated norm): the
layer's own pieces, in its order: ``in_proj`` into gate, ``xBC`` and ``dt``; the causal convolution
over ``xBC`` (each token over its root path, ``conv.py``) and its activation; the selective scan
through transformers' own chunked SSD kernel (``mamba2_chunk_scan``, or mamba-ssm's
``mamba_chunk_scan_combined`` where transformers routes it there) with each node's initial state
its parent's final state (``scan.py``); the gated RMS norm; ``out_proj``.

Padding that leaves the state alone: the step is discretised (``softplus(dt + dt_bias)``, clamped to
the layer's limits) before padding, so a padded row has ``dt = 0`` — no decay, no input — and
``x = B = C = 0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .conv import tree_causal_conv
from .scan import carried_state, hand_on, model_kernel, scan_segments, segments_of

#: transformers' chunked SSD scan, in the layer's own module
KERNEL = "mamba2_chunk_scan"


def mamba2_mixer(module, hidden_states: torch.Tensor, meta) -> torch.Tensor:
    """The mixer on the tree call's row ``hidden_states [1, n, H]``."""
    n, dtype = hidden_states.shape[1], hidden_states.dtype
    heads, groups, state = module.num_heads, module.n_groups, module.ssm_state_size
    falcon = hasattr(module, "mup_vector")  # Falcon-H1: multipliers around the input projection
    projected = module.in_proj(hidden_states * module.ssm_in_multiplier if falcon else hidden_states)
    if falcon:
        projected = projected * module.mup_vector
    gate, xbc, dt = projected[0].split([module.intermediate_size, module.conv_dim, heads], dim=-1)
    conv = tree_causal_conv(xbc, module.conv1d.weight, module.conv1d.bias, meta, module.layer_idx)
    xbc = module.act(conv).to(xbc.dtype)
    x, b, c = torch.split(xbc, [module.intermediate_size, groups * state, groups * state], dim=-1)
    low, high = module.time_step_limit
    dt = torch.clamp(F.softplus(dt + module.dt_bias.to(dt.dtype)), min=low, max=high)
    a = -torch.exp(module.A_log.float())
    kernel = model_kernel(module, KERNEL)

    def scan(x_, dt_, b_, c_, initial):
        return kernel(x_, dt_, a, b_, c_, chunk_size=module.chunk_size, D=module.D, initial_states=initial,
                      return_final_states=True)

    zero = x.new_zeros(heads, module.head_dim, state, dtype=torch.float32)
    out, final = scan_segments(segments_of(meta),
                               [x.reshape(n, heads, module.head_dim), dt, b.reshape(n, groups, state),
                                c.reshape(n, groups, state)],
                               scan, carried_state(meta, module.layer_idx, x), zero)
    if getattr(module, "mamba_rms_norm", True):
        scanned = module.norm(out.reshape(1, n, -1), gate.unsqueeze(0))
    else:  # Falcon-H1 without its gated norm: the gate alone
        scanned = out.reshape(1, n, -1) * F.silu(gate.unsqueeze(0))
    output = module.out_proj(scanned.to(dtype))
    return hand_on(meta, module.layer_idx, output, final)
