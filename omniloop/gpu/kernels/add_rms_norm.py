"""Residual add + RMSNorm in one Triton kernel: ``s = x + residual``, ``normed = RMSNorm(s) * weight``.

A pre-norm decoder layer ends every sub-block with ``x + f(x)`` and starts the next one with a norm of that
sum: two launches (a bf16 add, then ``F.rms_norm``) that read the same row twice. One program here owns
one row: it adds in float32 and rounds the sum once (what torch's bf16 add stores), then takes the norm's
statistics in float32 from that *rounded* sum and rounds ``s * rstd * weight`` once (what torch's fused
``F.rms_norm`` does), so both outputs equal the two-kernel path up to the order of the mean's reduction.

Outputs are new tensors rather than an in-place update of ``residual``: on the first layer the residual is
the stack's input (a caller's tensor, or a CUDA graph's static input buffer) and must not be overwritten;
the bytes moved are the same either way, and inside a graph the extra buffers cost no allocation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 8192  # one row per program, held in registers: BLOCK = next power of two of H


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, scale_ptr, normed_ptr, sum_ptr, x_stride, res_stride, hidden, eps,
                         part_stride, BLOCK: tl.constexpr, SCALE: tl.constexpr, PARTS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    for p in tl.static_range(1, PARTS):  # x: float32 partial sums of one product, added before any rounding
        x += tl.load(x_ptr + p * part_stride + row * x_stride + offs, mask=mask, other=0.0)
    if SCALE:
        x *= tl.load(scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * hidden + offs, s, mask=mask)
    s = s.to(tl.float32)  # the norm reads the sum as stored, as the unfused path's norm would
    rstd = tl.rsqrt(tl.sum(s * s, axis=0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + row * hidden + offs, (s * rstd * w).to(normed_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual ``[..., H]`` (same shape and dtype), weight ``[H]`` -> ``(normed, new_residual)``, both
    ``[..., H]`` contiguous: ``new_residual = x + residual``, ``normed = F.rms_norm(new_residual, (H,),
    weight, eps)``. ``scale`` ``[H]``: x is multiplied by it first, in float32 (a layer scale; the sum is
    then rounded once, where torch rounds the product too). x may also be ``[P, ..., H]`` float32: P partial
    sums of one product (``layers.linear_parts``), summed here with the residual and rounded once, so the
    product needs no reduce kernel of its own."""
    parts = x.shape[0] if x.dim() == residual.dim() + 1 else 1
    if parts > 1 and (x.shape[1:] != residual.shape or x.dtype != torch.float32 or scale is not None):
        raise ValueError(f"partial sums {tuple(x.shape)} {x.dtype} must be float32 [P, *{tuple(residual.shape)}], "
                         "without a scale")
    if parts == 1 and (x.dim() != residual.dim() or x.shape != residual.shape or x.dtype != residual.dtype):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} {residual.dtype} "
                         "must have the same shape and dtype")
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN or weight.shape != (hidden,) or (scale is not None and scale.shape != (hidden,)):
        raise ValueError(f"hidden size {hidden} (at most {MAX_HIDDEN}), weight {tuple(weight.shape)} and scale "
                         f"{None if scale is None else tuple(scale.shape)} mismatch")
    r2 = residual.reshape(-1, hidden)
    x2 = x.reshape(parts, -1, hidden) if parts > 1 else x.reshape(-1, hidden)
    x2, r2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x2, r2))
    normed = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    new_residual = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    rows = r2.shape[0]
    if rows == 0:
        return normed, new_residual
    block = triton.next_power_of_2(hidden)
    weight = weight.contiguous()
    _add_rms_norm_kernel[(rows,)](x2, r2, weight, weight if scale is None else scale.contiguous(), normed,
                                  new_residual, x2.stride(-2), r2.stride(0), hidden, eps,
                                  x2.stride(0) if parts > 1 else 0, BLOCK=block, SCALE=scale is not None,
                                  PARTS=parts, num_warps=min(max(block // 256, 1), 16))
    return normed, new_residual
