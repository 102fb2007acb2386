"""Decode attention over a slot KV cache in one Triton kernel: one or two query tokens per row.

The two attention calls of a frame step that dominate it are tiny: the talker's decode (one token per row,
each row its own length, a bucket of keys) and the code predictor's steps (one or two tokens per row, every
row at the same length, at most 17 keys). SDPA's flash / memory-efficient kernels spend most of their time on
set-up and tiling meant for long query blocks, and the talker's per-row lengths need an additive mask built
per step. Here one program owns one (row, kv head): it reads that kv head's keys and values once, for all of
its query heads (GQA without repeating K/V) and both query tokens, with an online softmax in float32 over
blocks of keys, and stops at the row's own length (read on the device: graph-capturable, no host sync).

Query rows of a program are ``m = l * groups + g`` (token ``l``, query head ``kv_head * groups + g``), padded
to 16 so the two products run on tensor cores; token ``l`` of ``L`` sees keys below
``length - (L - 1 - l)`` (causal, the last token sees them all).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_keys"])
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, slot_ptr, len_ptr, num_keys, qk_scale,
                             q_stride_b, q_stride_l, q_stride_h, k_stride_s, k_stride_h, k_stride_t,
                             v_stride_s, v_stride_h, v_stride_t,
                             L: tl.constexpr, GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    token = m // GROUPS
    is_query = m < L * GROUPS
    d = tl.arange(0, BLOCK_D)
    in_d = d < D
    if len_ptr is None:
        length = num_keys
    else:
        # clamped: a row parked on the scratch position (length past the bucket) reads the bucket, no further
        length = tl.maximum(tl.minimum(tl.load(len_ptr + row).to(tl.int32), num_keys), 0)
    if slot_ptr is None:
        slot = row.to(tl.int64)
    else:
        slot = tl.load(slot_ptr + row).to(tl.int64)
    limit = tl.where(is_query, length - (L - 1 - token), length)  # padding rows: any limit, never stored
    head = kv_head * GROUPS + m % GROUPS
    q_rows = row.to(tl.int64) * q_stride_b + token * q_stride_l + head * q_stride_h
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=is_query[:, None] & in_d[None, :], other=0.0)
    k_base = k_ptr + slot * k_stride_s + kv_head.to(tl.int64) * k_stride_h
    v_base = v_ptr + slot * v_stride_s + kv_head.to(tl.int64) * v_stride_h

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, length, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        in_keys = (n < length)[:, None] & in_d[None, :]
        k = tl.load(k_base + n[:, None] * k_stride_t + d[None, :], mask=in_keys, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 units
        s = tl.where(n[None, :] < limit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a query row with no visible key yet keeps m = -inf; subtracting 0 instead keeps exp2 free of NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * v_stride_t + d[None, :], mask=in_keys, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no visible key at all: zeros, not NaN
    out_rows = ((row.to(tl.int64) * L + token) * (GROUPS * tl.num_programs(1)) + head) * D
    tl.store(out_ptr + out_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=is_query[:, None] & in_d[None, :])


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: int,
                     lengths: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``L`` (1 or 2) new tokens per row over that row's cached keys.

    q ``[B, L, Hq, D]`` (any strides with D contiguous, e.g. a view of fused QKV rows); k_cache, v_cache one
    layer's ``[S, Hkv, T, D]`` (D contiguous), Hq a multiple of Hkv; row ``b`` reads slot ``slots[b]`` (``b``
    when ``slots`` is None). Row ``b`` has ``min(lengths[b], kv_len)`` valid keys (``kv_len`` when
    ``lengths`` is None), the first ones of its slot, and token ``l`` attends the first
    ``length - (L - 1 - l)`` of them (causal). Scale ``1 / sqrt(D)``. Returns ``[B, L, Hq, D]`` contiguous
    (``o_proj`` reads it as ``[B, L, Hq * D]`` without a copy). A row with no visible key gets zeros. Lengths
    and slots are read on the device: no host sync, graph-capturable."""
    b, n, hq, d = q.shape
    num_slots, hkv, positions, _ = k_cache.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != d or hq % hkv != 0:
        raise ValueError(f"q {tuple(q.shape)} and caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} "
                         "are not [B, L, Hq, D] and [S, Hkv, T, D] with Hkv dividing Hq")
    if not 0 < kv_len <= positions:
        raise ValueError(f"kv_len {kv_len} outside the cache's {positions} positions")
    if slots is None and b > num_slots:
        raise ValueError(f"{b} rows but only {num_slots} cache slots")
    for name, t in (("lengths", lengths), ("slots", slots)):
        if t is not None and t.numel() != b:
            raise ValueError(f"{t.numel()} {name} for {b} rows")
    if q.stride(3) != 1:
        q = q.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last dim")
    groups = hq // hkv
    out = torch.empty((b, n, hq, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    block_n = min(64, max(16, triton.next_power_of_2(kv_len)))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for half inputs
    _decode_attention_kernel[(b, hkv)](
        q, k_cache, v_cache, out, slots, lengths, kv_len, LOG2E / d ** 0.5,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        L=n, GROUPS=groups, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_M=max(16, triton.next_power_of_2(n * groups)), BLOCK_N=block_n, PRECISION=precision, num_warps=4)
    return out
