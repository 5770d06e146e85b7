"""Mamba-2's chunked SSD scan over a prefix tree: transformers' ``mamba2_chunk_scan`` (Nemotron-H,
Bamba, Granite-4 hybrid, Falcon-H1, Zamba2's mixers; mamba-ssm's ``mamba_chunk_scan_combined`` where
transformers routes it there), each node from its parent's final state (``scan.py``).

The layer calls it with ``x [1, n, H, P]``, ``dt [1, n, H]`` (raw: the kernel adds ``dt_bias``, takes
the softplus and clamps to ``dt_limit``), ``A [H]``, ``B, C [1, n, G, N]`` and ``D``. Padding that
leaves the state alone needs ``dt = 0`` after discretisation, so the step is discretised here, as the
kernel would, before padding, and the kernel runs on it with none of those options: a padded row has
``dt = 0`` — no decay, no input — and ``x = B = C = 0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .scan import carried_state, hand_on, scan_segments, segments_of


def tree_ssd_scan(call, original, hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  C: torch.Tensor, chunk_size: int, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                  initial_states: torch.Tensor | None = None, dt_softplus: bool = False,
                  dt_limit: tuple[float, float] = (0.0, float("inf")), return_final_states: bool = False,
                  z: torch.Tensor | None = None, **kwargs):
    """The kernel over the tree call's row; returns what the kernel returns (the output ``[1, n, H,
    P]``, and the final state with ``return_final_states``)."""
    if initial_states is not None:
        raise ValueError("a tree call carries no cache: the scan starts from each node's parent's state")
    if z is not None:
        raise ValueError("mamba2_chunk_scan with a gate z inside the kernel: transformers' layers apply the gate in "
                         "their norm, and the tree runs only that form")
    meta, kernel = call.meta, call.key("scan")
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])

    def scan(x_, dt_, b_, c_, initial):
        return original(x_, dt_, A, b_, c_, chunk_size=chunk_size, D=D, initial_states=initial,
                        return_final_states=True)

    _, _, heads, head_dim = hidden_states.shape
    zero = hidden_states.new_zeros(heads, head_dim, B.shape[-1], dtype=torch.float32)
    out, final = scan_segments(segments_of(meta), [hidden_states[0], dt[0], B[0], C[0]], scan,
                               carried_state(meta, kernel, hidden_states), zero)
    out = hand_on(meta, kernel, out, final).unsqueeze(0)
    return (out, final.unsqueeze(0)) if return_final_states else out
