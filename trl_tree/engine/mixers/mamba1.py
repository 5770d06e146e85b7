"""Mamba-1's selective scan over a prefix tree: transformers' ``mamba_selective_scan`` (Jamba's
mixer; mamba-ssm's ``selective_scan_fn`` where transformers routes it there).

The scan is written here, not run through the layer's kernel: that kernel (and mamba-ssm's) takes no
initial state, which every node but a root needs. It is Mamba-1's recurrence as transformers' torch
path runs it, step by step in fp32: ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t h_t +
D x_t``, ``y_t · silu(z_t)``, each node from its parent's final state (``scan.py``). The step is
discretised (``delta_bias``, softplus) before padding, so a padded row has ``dt = 0``: no decay, no
input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def tree_selective_scan(call, original, hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                        B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                        delta_bias: torch.Tensor | None = None, delta_softplus: bool = False,
                        return_last_state: bool = False, **kwargs):
    """The kernel (channels first: ``hidden_states, dt, z [1, D, n]``, ``B, C [1, N, n]``) over the tree
    call's row; returns the output ``[1, D, n]`` (and the final state with ``return_last_state``)."""
    meta, kernel = call.meta, call.key("scan")
    x, dt = hidden_states[0].t(), dt[0].t()
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)
    if delta_softplus:
        dt = F.softplus(dt)
    zero = x.new_zeros(A.shape[0], A.shape[1], dtype=torch.float32)
    out, final = scan_segments(segments_of(meta), [x, dt, B[0].t(), C[0].t()],
                               lambda x_, dt_, b_, c_, initial: selective_scan(x_, dt_, A, b_, c_, initial),
                               carried_state(meta, kernel, x), zero)
    if D is not None:
        out = out + x * D
    if z is not None:
        out = out * F.silu(z[0].t())
    out = hand_on(meta, kernel, out, final).t().unsqueeze(0)
    return (out, final.unsqueeze(0)) if return_last_state else out
