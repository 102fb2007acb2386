"""One weight tensor for several projections that read the same input (q/k/v, gate/up, ...): the parameters
become views of the concatenation, so one matmul computes them all and only one copy of the weights exists."""

from __future__ import annotations

import torch
from torch import nn


def is_fused(fused: torch.Tensor | None, *parts: torch.Tensor) -> bool:
    """Every part is still the view of ``fused`` that ``fuse`` made (same dtype, its rows, in order)."""
    if fused is None:
        return False
    offset = fused.data_ptr()
    for p in parts:
        if p.dtype != fused.dtype or p.data_ptr() != offset:
            return False
        offset += p.numel() * p.element_size()
    return True


def check_fused(fused: torch.Tensor, *parts: torch.Tensor) -> None:
    """The separate parameters must still be views of the fused tensor: a ``.to()`` or a load that replaced
    any of them after ``fuse`` would leave the fused matmul on stale weights, silently."""
    if not is_fused(fused, *parts):
        raise RuntimeError("fused projection weights are stale (parameters were replaced after fuse()); "
                           "call Qwen3TtsModel.fuse_projections() again")


def fuse(params: list[nn.Parameter]) -> torch.Tensor:
    """Concatenate parameters along dim 0 and make each a view of the result, so only one copy exists."""
    fused = torch.cat([p.data for p in params])
    start = 0
    for p in params:
        p.data = fused[start:start + p.shape[0]]
        start += p.shape[0]
    return fused
