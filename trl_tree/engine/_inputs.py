"""Validation of the token sequences handed to the tree engine.

Bad input must produce a clear error, never a wrong number: a float id silently truncated to an
int, or a bool tensor read as 0/1 ids, would train on different tokens than the user meant. All
checks here are cheap (one pass over the ids) compared with the forward they protect.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

SequenceLike = Sequence[int] | torch.Tensor | np.ndarray


def normalize_sequences(seqs: Sequence[SequenceLike]) -> tuple[list[np.ndarray], torch.device | None]:
    """Turn ``seqs`` into a list of 1-D int64 numpy arrays.

    Returns the arrays and the device the tensors lived on (``None`` for lists/arrays). Raises
    ``TypeError`` for ids that are not integers and ``ValueError`` for empty input, empty
    sequences, tensors that are not 1-D and tensors spread over several devices.
    """
    if isinstance(seqs, torch.Tensor):
        if seqs.dim() != 2:
            raise ValueError(
                f"sequences must be a list of 1-D id sequences (or a 2-D tensor of rows); got a {seqs.dim()}-D tensor"
            )
        seqs = list(seqs)
    if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence):
        raise TypeError(f"sequences must be a list of token-id sequences, got {type(seqs).__name__}")
    if len(seqs) == 0:
        raise ValueError("no sequences: the forest needs at least one non-empty sequence")

    devices = {seq.device for seq in seqs if isinstance(seq, torch.Tensor)}
    if len(devices) > 1:
        raise ValueError(
            f"sequence tensors are on different devices ({', '.join(sorted(map(str, devices)))}); "
            "put them on one device"
        )
    arrays: list[np.ndarray] = []
    for i, seq in enumerate(seqs):
        if isinstance(seq, torch.Tensor):
            if seq.dim() != 1:
                raise ValueError(f"sequence {i} is a {seq.dim()}-D tensor; each sequence must be 1-D")
            if seq.dtype == torch.bool or seq.dtype.is_floating_point or seq.dtype.is_complex:
                raise TypeError(f"sequence {i} has dtype {seq.dtype}; token ids must be an integer dtype")
            arr = seq.detach().to("cpu", torch.int64).numpy()
        elif isinstance(seq, np.ndarray):
            if seq.ndim != 1:
                raise ValueError(f"sequence {i} is a {seq.ndim}-D array; each sequence must be 1-D")
            if seq.dtype.kind not in "iu":
                raise TypeError(f"sequence {i} has dtype {seq.dtype}; token ids must be integers")
            arr = seq.astype(np.int64, copy=False)
        elif isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
            raise TypeError(
                f"sequence {i} is a {type(seq).__name__}; expected a list of ints or a 1-D integer tensor"
            )
        else:
            kinds = set(map(type, seq))
            if not all(k is int or (issubclass(k, np.integer)) for k in kinds):
                bad = next(x for x in seq if type(x) is not int and not isinstance(x, np.integer))
                raise TypeError(
                    f"sequence {i} holds a non-integer id ({bad!r} of type {type(bad).__name__}); "
                    "token ids must be Python or numpy integers"
                )
            arr = np.asarray(seq, dtype=np.int64) if len(seq) else np.zeros(0, dtype=np.int64)
        if arr.shape[0] == 0:
            raise ValueError(f"sequence {i} is empty; every sequence needs at least one token")
        arrays.append(arr)
    return arrays, (devices.pop() if devices else None)


def normalize_score_from(score_from: int | Sequence[int] | None, lengths: Sequence[int]) -> np.ndarray:
    """Per-sequence index of the first token whose log-prob is wanted (default 1: every token but the first)."""
    n = len(lengths)
    if score_from is None:
        out = np.ones(n, dtype=np.int64)
    elif isinstance(score_from, (int, np.integer)) and not isinstance(score_from, bool):
        out = np.full(n, int(score_from), dtype=np.int64)
    else:
        out = np.asarray(list(score_from))
        if out.shape != (n,) or (n and out.dtype.kind not in "iu"):
            raise ValueError(f"score_from must be an int or one int per sequence ({n}), got {score_from!r}")
        out = out.astype(np.int64)
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    bad = np.flatnonzero((out < 1) | (out > lengths_arr))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"score_from[{i}] = {int(out[i])} is outside [1, {int(lengths_arr[i])}] for a sequence of "
            f"{int(lengths_arr[i])} tokens (the first token has no log-prob; the value is the index of the "
            "first token to score)"
        )
    return out
