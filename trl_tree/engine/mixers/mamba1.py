"""Jamba's Mamba (Mamba-1, ``JambaMambaMixer``) over a prefix tree.

The layer's own pieces, in its order: ``in_proj`` into ``x`` and the gate; the causal convolution
over ``x`` (each token over its root path, ``conv.py``) and its activation; ``x_proj`` into the
step's low-rank input, ``B`` and ``C`` and their RMS norms; ``dt_proj``; the selective scan;
``out_proj``.

The scan is written here: transformers' ``mamba_selective_scan`` (and mamba-ssm's
``selective_scan_fn`` it routes to) takes no initial state, which every node but a root needs. It
is Mamba-1's recurrence as transformers' torch path runs it, step by step in fp32:
``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t h_t + D x_t``, ``y_t · silu(z_t)``. A
padded row has ``dt = 0`` (discretised before padding): no decay, no input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .conv import tree_causal_conv
from .scan import carried_state, hand_on, scan_segments, segments_of


def selective_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-1's scan of ``x, dt [B, L, D]`` (``dt`` discretised), ``b, c [B, L, N]`` from ``initial
    [B, D, N]`` with ``a [D, N]``: the outputs ``C_t h_t`` ``[B, L, D]`` (fp32) and the final state."""
    decay = torch.exp(a[None, None] * dt.float()[..., None])  # [B, L, D, N]
    inputs = (dt.float() * x.float())[..., None] * b.float()[:, :, None, :]
    state, outs = initial.float(), []
    for t in range(x.shape[1]):
        state = decay[:, t] * state + inputs[:, t]
        outs.append(torch.einsum("bdn,bn->bd", state, c[:, t].float()))
    return torch.stack(outs, dim=1), state


def jamba_mamba(module, hidden_states: torch.Tensor, meta) -> torch.Tensor:
    """The mixer on the tree call's row ``hidden_states [1, n, H]``."""
    dtype = hidden_states.dtype
    x, gate = module.in_proj(hidden_states)[0].chunk(2, dim=-1)
    conv = tree_causal_conv(x, module.conv1d.weight, module.conv1d.bias, meta, module.layer_idx)
    x = module.act(conv).to(x.dtype)
    step, b, c = torch.split(module.x_proj(x), [module.time_step_rank, module.ssm_state_size,
                                                module.ssm_state_size], dim=-1)
    step, b, c = module.dt_layernorm(step), module.b_layernorm(b), module.c_layernorm(c)
    dt = step @ module.dt_proj.weight.t()  # the layer's bias goes in below, in fp32, as its scan adds it
    if module.dt_proj.bias is not None:
        dt = dt + module.dt_proj.bias.float().to(dt.dtype)
    dt = F.softplus(dt)
    a = -torch.exp(module.A_log.float())
    zero = x.new_zeros(module.intermediate_size, module.ssm_state_size, dtype=torch.float32)
    out, final = scan_segments(segments_of(meta), [x, dt, b, c],
                               lambda x_, dt_, b_, c_, initial: selective_scan(x_, dt_, a, b_, c_, initial),
                               carried_state(meta, module.layer_idx, x), zero)
    y = (out + x.float() * module.D.float()) * F.silu(gate.float())
    output = module.out_proj(y.to(dtype).unsqueeze(0))
    return hand_on(meta, module.layer_idx, output, final)
