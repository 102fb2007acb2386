"""Per-head RMSNorm + rotary embedding of queries and keys in one Triton kernel.

Eager torch spends eight kernels per layer on this (two norms, two three-op rotations); in a graph
replay bound by kernel count that is most of a layer's small-kernel cost. One program normalizes and
rotates one head of one token, in float32, rounding once on the store.

``qk_norm_rope`` reads the query and key heads straight out of a fused QKV projection's rows (queries,
then keys, then values: the keys are the heads after the queries) and normalizes both in one launch,
each head with its own weight; ``norm_rope`` does one tensor of heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_kernel(x_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, out_ptr, x_stride, num_q_heads, num_heads,
                      cos_rows, eps, D: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, D)
    rot = (offs + D // 2) % D  # rotate_half's partner of each lane
    src = token.to(tl.int64) * x_stride + head * D
    x = tl.load(x_ptr + src + offs).to(tl.float32)
    xr = tl.load(x_ptr + src + rot).to(tl.float32)
    is_q = head < num_q_heads
    w = tl.where(is_q, tl.load(wq_ptr + offs), tl.load(wk_ptr + offs)).to(tl.float32)
    wr = tl.where(is_q, tl.load(wq_ptr + rot), tl.load(wk_ptr + rot)).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * scale * w
    yr = xr * scale * wr
    row = (token % cos_rows).to(tl.int64) * D
    cos = tl.load(cos_ptr + row + offs).to(tl.float32)
    sin = tl.load(sin_ptr + row + offs).to(tl.float32)  # sign-folded: -sin on the first half
    dst = (token.to(tl.int64) * num_heads + head) * D
    tl.store(out_ptr + dst + offs, (y * cos + yr * sin).to(out_ptr.dtype.element_ty))


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
              sin_folded: torch.Tensor) -> torch.Tensor:
    """x ``[B, L, heads, D]`` (contiguous); cos/sin ``[R, D]`` contiguous, token t = b * L + l uses row t % R
    (R = B * L: per token; R = L: shared by every row). Returns the normalized, rotated x, same shape."""
    b, n, heads, d = x.shape
    out = torch.empty_like(x)
    _norm_rope_kernel[(b * n, heads)](x, weight, weight, cos, sin_folded, out, heads * d, heads, heads,
                                      cos.shape[0], eps, D=d, num_warps=1)
    return out


def qk_norm_rope(qkv: torch.Tensor, num_q_heads: int, num_k_heads: int, wq: torch.Tensor, wk: torch.Tensor,
                 eps: float, cos: torch.Tensor, sin_folded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv ``[B, L, W]`` rows of a fused projection (contiguous; queries in ``[0, nq * D)``, keys next);
    returns normalized, rotated q ``[B, L, nq, D]`` and k ``[B, L, nk, D]`` (views of one output buffer)."""
    b, n, width = qkv.shape
    d = wq.shape[0]
    heads = num_q_heads + num_k_heads
    out = torch.empty((b, n, heads, d), dtype=qkv.dtype, device=qkv.device)
    _norm_rope_kernel[(b * n, heads)](qkv, wq, wk, cos, sin_folded, out, width, num_q_heads, heads,
                                      cos.shape[0], eps, D=d, num_warps=1)
    return out[:, :, :num_q_heads], out[:, :, num_q_heads:]
