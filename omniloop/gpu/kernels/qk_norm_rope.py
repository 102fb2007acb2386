"""Per-head RMSNorm + rotary embedding of queries and keys in one Triton kernel.

Eager torch spends eight kernels per layer on this (two norms, two three-op rotations); in a graph
replay bound by kernel count that is most of a layer's small-kernel cost. One program normalizes and
rotates one head of one token, in float32, rounding once on the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, cos_rows, eps,
                      D: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, D)
    rot = (offs + D // 2) % D  # rotate_half's partner of each lane
    base = (token.to(tl.int64) * num_heads + head) * D
    x = tl.load(x_ptr + base + offs).to(tl.float32)
    xr = tl.load(x_ptr + base + rot).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * scale * tl.load(w_ptr + offs).to(tl.float32)
    yr = xr * scale * tl.load(w_ptr + rot).to(tl.float32)
    row = (token % cos_rows).to(tl.int64) * D
    cos = tl.load(cos_ptr + row + offs).to(tl.float32)
    sin = tl.load(sin_ptr + row + offs).to(tl.float32)  # sign-folded: -sin on the first half
    tl.store(out_ptr + base + offs, (y * cos + yr * sin).to(out_ptr.dtype.element_ty))


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
              sin_folded: torch.Tensor) -> torch.Tensor:
    """x ``[B, L, heads, D]`` (contiguous); cos/sin ``[R, D]`` contiguous, token t = b * L + l uses row t % R
    (R = B * L: per token; R = L: shared by every row). Returns the normalized, rotated x, same shape."""
    b, n, heads, d = x.shape
    out = torch.empty_like(x)
    _norm_rope_kernel[(b * n, heads)](x, weight, cos, sin_folded, out, heads, cos.shape[0], eps, D=d,
                                      num_warps=1)
    return out
