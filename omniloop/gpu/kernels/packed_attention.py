"""Causal attention over packed prompts: many sequences laid end to end in one token axis, no padding.

A batched prefill padded to ``rows x tokens`` (18 prompts of ~218 tokens run as 20 x 256) spends ~30 % of
its matmuls on padding; packed, the matmuls see only the real tokens (rounded up to a token bucket), and
attention needs each token's sequence start: token ``t`` attends keys ``seq_start[t] .. t``.

One program owns ``BLOCK_M`` consecutive tokens of one query head (a block may straddle two sequences: each
row keeps its own start) and runs an online softmax over keys from the block's earliest start to its last
token, in blocks of ``BLOCK_N``. ``packed_attention_reference`` is the same math in torch (a dense mask),
for CPU and for checking the kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from omniloop.gpu.kernels.decode_attention import LOG2E, _softmax_block, dot_head_dim_ok


@triton.jit
def _packed_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, start_ptr, num_tokens, qk_scale,
                             q_stride, k_stride, v_stride, out_stride,
                             GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    head = tl.program_id(1)
    kv_head = head // GROUPS
    t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = t < num_tokens
    d = tl.arange(0, D)
    first = tl.load(start_ptr + t, mask=live, other=num_tokens).to(tl.int32)
    t64 = t.to(tl.int64)
    q = tl.load(q_ptr + t64[:, None] * q_stride + head * D + d[None, :], mask=live[:, None], other=0.0)
    lo = tl.min(first, axis=0)
    hi = tl.minimum(tl.program_id(0) * BLOCK_M + BLOCK_M, num_tokens)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for begin in range(lo, hi, BLOCK_N):
        n = begin + tl.arange(0, BLOCK_N)
        in_keys = (n < hi)[:, None]
        n64 = n.to(tl.int64)
        k = tl.load(k_ptr + n64[:, None] * k_stride + kv_head * D + d[None, :], mask=in_keys, other=0.0)
        v = tl.load(v_ptr + n64[:, None] * v_stride + kv_head * D + d[None, :], mask=in_keys, other=0.0)
        visible = (n[None, :] >= first[:, None]) & (n[None, :] <= t[:, None])
        m_i, l_i, acc = _softmax_block(q, k, v, visible, qk_scale, m_i, l_i, acc, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + t64[:, None] * out_stride + head * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=live[:, None])


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_start: torch.Tensor) -> None:
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not [P, Hq, D] and "
                         "[P, Hkv, D] over the same tokens")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    if seq_start.shape != (q.shape[0],):
        raise ValueError(f"seq_start {tuple(seq_start.shape)} is not [{q.shape[0]}]")


def packed_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               seq_start: torch.Tensor) -> torch.Tensor:
    """torch's ``packed_attention``: a dense ``[P, P]`` mask (fine for tests and CPU-sized calls)."""
    _check(q, k, v, seq_start)
    idx = torch.arange(q.shape[0], device=q.device)
    mask = (idx[None, :] >= seq_start[:, None]) & (idx[None, :] <= idx[:, None])
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask[None, None], enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_start: torch.Tensor) -> torch.Tensor:
    """q ``[P, Hq, D]``, k and v ``[P, Hkv, D]`` (token rows may be strided, heads and D contiguous), seq_start
    ``[P]`` (the packed index where each token's sequence begins; nondecreasing within a sequence, a padding
    token its own index): token ``t`` attends keys ``seq_start[t] .. t``, scale ``1 / sqrt(D)``. Returns
    ``[P, Hq, D]`` contiguous. Read on the device: no host sync, graph-capturable."""
    _check(q, k, v, seq_start)
    p, hq, d = q.shape
    if not dot_head_dim_ok(d):
        raise ValueError(f"head dim {d} is not a power of two of at least 16")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError(f"{name} needs contiguous heads of contiguous D within a token row")
    out = torch.empty((p, hq, d), dtype=q.dtype, device=q.device)
    if p == 0:
        return out
    block_m, block_n = 64, 64
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _packed_attention_kernel[(triton.cdiv(p, block_m), hq)](
        q, k, v, out, seq_start, p, LOG2E / d ** 0.5, q.stride(0), k.stride(0), v.stride(0), out.stride(0),
        GROUPS=hq // k.shape[1], D=d, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, num_warps=8)
    return out
