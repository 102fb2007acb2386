"""``silu(gate) * up`` of a fused gate/up projection in one Triton kernel (torch: two kernels and a
temporary). Computed in float32, rounded once on the store."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * 2 * inter + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up ``[..., 2 * I]`` (contiguous; gate first) -> ``silu(gate) * up`` ``[..., I]``."""
    inter = gate_up.shape[-1] // 2
    rows = gate_up.numel() // gate_up.shape[-1]
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4)
    return out
