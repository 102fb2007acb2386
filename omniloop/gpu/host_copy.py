"""Host-to-device copies that never wait for the GPU.

A pageable host-to-device copy is synchronous with the stream: it waits for the step in flight, which the
async overlap must not do. On CUDA every small per-step input therefore goes through pinned memory with a
non-blocking copy; torch's caching host allocator keeps the pinned block alive until the copy has run. On
CPU it is a plain copy (or none).
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(data: np.ndarray | torch.Tensor, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """``data`` (a numpy array or a tensor) on ``device``, or copied into ``out`` (then returned)."""
    t = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
        return out.copy_(t, non_blocking=True) if out is not None else t.to(device, non_blocking=True)
    return out.copy_(t) if out is not None else t.to(device)
