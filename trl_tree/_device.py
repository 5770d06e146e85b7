"""Moving many small index arrays to the device in one copy, without stalling the GPU.

``torch.from_numpy(x).to("cuda")`` from ordinary (pageable) memory makes PyTorch wait for the
stream to drain after the copy: the CPU stops queueing kernels until the GPU has finished all
earlier work. A depth-first walk needs about ten index arrays per unit; uploaded one by one
between units, each upload would drain the queue and leave the GPU idle while Python launches
the next unit. Here all of them travel in one pinned, non-blocking copy made before the first
kernel, and each array is a view of that buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_NUMPY_OF = {torch.int64: np.int64, torch.int32: np.int32}


def upload(arrays: Sequence[np.ndarray], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """``[torch.as_tensor(a, dtype=dtype, device=device) for a in arrays]`` as one copy.

    Returns views of one device buffer, shaped like the inputs; ``dtype`` is an integer dtype.
    """
    if dtype not in _NUMPY_OF:
        raise ValueError(f"upload takes int64 or int32 arrays, got {dtype}")
    if not arrays:
        return []
    flat = np.concatenate([np.asarray(a, dtype=_NUMPY_OF[dtype]).reshape(-1) for a in arrays])
    host = torch.from_numpy(flat)
    if device.type == "cuda":
        # pinned + non_blocking: the copy is queued on the stream, the CPU goes on launching
        buffer = host.pin_memory().to(device, non_blocking=True)
    else:
        buffer = host.to(device)
    sizes = [int(np.asarray(a).size) for a in arrays]
    return [part.view(np.asarray(a).shape) for part, a in zip(buffer.split(sizes), arrays)]
