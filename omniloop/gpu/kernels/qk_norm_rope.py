"""Per-head RMSNorm + rotary embedding of queries and keys in one Triton kernel.

Eager torch spends eight kernels per layer on this (two norms, two three-op rotations); in a graph
replay bound by kernel count that is most of a layer's small-kernel cost. One program normalizes and
rotates one head of one token, in float32, rounding once on the store.

``qk_norm_rope`` reads the query and key heads straight out of a fused QKV projection's rows (queries,
then keys, then values: the keys are the heads after the queries) and normalizes both in one launch,
each head with its own weight; ``norm_rope`` does one tensor of heads, ``rope`` the rotation alone (for the
codec decoder's transformer, which has no q/k norm). ``qk_norm_rope_cache`` also
writes the keys and the (untouched) values straight into the KV cache at each token's slot and position,
so a layer needs no separate cache-write kernels: one launch for q, k and v.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _normed_rotated(x_ptr, src, wq_ptr, wk_ptr, is_q, cos_ptr, sin_ptr, cos_row, eps, live, D: tl.constexpr):
    """The D values at ``x_ptr + src`` of each token of a block (``src``, ``cos_row``, ``live``: ``[T]``),
    RMS-normalized (query or key weight) and rotated, in float32: ``[T, D]``."""
    offs = tl.arange(0, D)[None, :]
    rot = (offs + D // 2) % D  # rotate_half's partner of each lane
    lane = live[:, None] & (offs < D)
    x = tl.load(x_ptr + src[:, None] + offs, mask=lane, other=0.0).to(tl.float32)
    xr = tl.load(x_ptr + src[:, None] + rot, mask=lane, other=0.0).to(tl.float32)
    w = tl.where(is_q, tl.load(wq_ptr + offs), tl.load(wk_ptr + offs)).to(tl.float32)
    wr = tl.where(is_q, tl.load(wq_ptr + rot), tl.load(wk_ptr + rot)).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    return _rotate(x * scale * w, xr * scale * wr, cos_ptr, sin_ptr, cos_row, lane, D)


@triton.jit
def _rotate(y, yr, cos_ptr, sin_ptr, cos_row, lane, D: tl.constexpr):
    """``y`` rotated (``yr``: y with its halves swapped, ``[T, D]``) by cos/sin row ``cos_row`` of each token."""
    offs = tl.arange(0, D)[None, :]
    row = cos_row.to(tl.int64)[:, None] * D
    cos = tl.load(cos_ptr + row + offs, mask=lane, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row + offs, mask=lane, other=0.0).to(tl.float32)  # sign-folded: -sin, first half
    return y * cos + yr * sin


@triton.jit(do_not_specialize=["num_tokens"])
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, x_stride, cos_rows, num_tokens, row_len, D: tl.constexpr,
                 T: tl.constexpr):
    """``_norm_rope_kernel`` without the norm: head ``program_id(1)`` of a block of T tokens, rotated, stored
    heads first (``[B, heads, L, D]``; token t is position ``t % row_len`` of row ``t // row_len``)."""
    token = tl.program_id(0) * T + tl.arange(0, T)
    head = tl.program_id(1)
    live = token < num_tokens
    offs = tl.arange(0, D)[None, :]
    lane = live[:, None] & (offs < D)
    src = (token.to(tl.int64) * x_stride + head * D)[:, None]
    x = tl.load(x_ptr + src + offs, mask=lane, other=0.0).to(tl.float32)
    xr = tl.load(x_ptr + src + (offs + D // 2) % D, mask=lane, other=0.0).to(tl.float32)
    y = _rotate(x, xr, cos_ptr, sin_ptr, token % cos_rows, lane, D)
    t = token.to(tl.int64)
    dst = (((t // row_len) * tl.num_programs(1) + head) * row_len + t % row_len) * D
    tl.store(out_ptr + dst[:, None] + offs, y.to(out_ptr.dtype.element_ty), mask=lane)


@triton.jit(do_not_specialize=["start", "num_tokens"])
def _norm_rope_kernel(x_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, out_ptr, x_stride, num_q_heads, num_k_heads,
                      out_heads, cos_rows, eps, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, start, row_len,
                      num_slots, num_positions, slot_stride, head_stride, pos_stride, num_tokens,
                      D: tl.constexpr, TO_CACHE: tl.constexpr, KEEP_K: tl.constexpr, T: tl.constexpr):
    token = tl.program_id(0) * T + tl.arange(0, T)  # a block of T tokens: one per decode row, more in prefill
    head = tl.program_id(1)
    live = token < num_tokens
    offs = tl.arange(0, D)[None, :]
    lane = live[:, None] & (offs < D)
    src = token.to(tl.int64) * x_stride + head * D
    is_q = head < num_q_heads
    out_dst = (token.to(tl.int64) * out_heads + head) * D
    if TO_CACHE:
        row = token // row_len
        if slot_ptr is None:
            slot = row.to(tl.int64)
        else:
            slot = tl.load(slot_ptr + row, mask=live, other=-1).to(tl.int64)
        if pos_ptr is None:
            pos = (start + token % row_len).to(tl.int64)
        else:
            pos = tl.load(pos_ptr + token, mask=live, other=-1).to(tl.int64)
        # an index outside the cache drops the write instead of scribbling over other memory
        inside = lane & ((slot >= 0) & (slot < num_slots) & (pos >= 0) & (pos < num_positions))[:, None]
        cache_row = (slot * slot_stride + pos * pos_stride)[:, None]
        if head >= num_q_heads + num_k_heads:  # a value head: copied as it is, no rounding
            dst = cache_row + (head - num_q_heads - num_k_heads).to(tl.int64) * head_stride
            tl.store(v_cache_ptr + dst + offs, tl.load(x_ptr + src[:, None] + offs, mask=lane), mask=inside)
        else:
            y = _normed_rotated(x_ptr, src, wq_ptr, wk_ptr, is_q, cos_ptr, sin_ptr, token % cos_rows, eps, live, D)
            if not is_q:
                dst = cache_row + (head - num_q_heads).to(tl.int64) * head_stride
                tl.store(k_cache_ptr + dst + offs, y.to(k_cache_ptr.dtype.element_ty), mask=inside)
            if is_q or KEEP_K:  # with KEEP_K the keys also go to the output, after the queries (prefix prefill)
                tl.store(out_ptr + out_dst[:, None] + offs, y.to(out_ptr.dtype.element_ty), mask=lane)
    else:
        y = _normed_rotated(x_ptr, src, wq_ptr, wk_ptr, is_q, cos_ptr, sin_ptr, token % cos_rows, eps, live, D)
        tl.store(out_ptr + out_dst[:, None] + offs, y.to(out_ptr.dtype.element_ty), mask=lane)


BLOCK_FROM = 512  # calls over at least this many tokens (prefill) give each program a block of tokens


def _grid(num_tokens: int, heads: int) -> tuple[tuple[int, int], int, int]:
    """(grid, tokens per program, warps): one token per program and one warp for decode-sized calls (many
    programs, each light), 16 tokens and 4 warps for prefill-sized ones (a program per token and head of a
    5,120-token prefill was ~100 us a layer)."""
    t = 16 if num_tokens >= BLOCK_FROM else 1
    return (triton.cdiv(num_tokens, t), heads), t, 1 if t == 1 else 4


def _launch(x: torch.Tensor, x_stride: int, wq: torch.Tensor, wk: torch.Tensor, cos: torch.Tensor,
            sin_folded: torch.Tensor, out: torch.Tensor, num_q_heads: int, eps: float) -> None:
    """Queries and keys only: every head of ``out`` ``[B, L, heads, D]`` (the first ``num_q_heads`` queries,
    the rest keys) is read from token row ``t`` of x at ``t * x_stride + head * D``, normalized and rotated."""
    b, n, heads, d = out.shape
    grid, t, warps = _grid(b * n, heads)
    _norm_rope_kernel[grid](x, wq, wk, cos, sin_folded, out, x_stride, num_q_heads, heads - num_q_heads, heads,
                            cos.shape[0], eps, None, None, None, None, 0, 1, 0, 0, 0, 0, 0, b * n,
                            D=d, TO_CACHE=False, KEEP_K=False, T=t, num_warps=warps)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
              sin_folded: torch.Tensor) -> torch.Tensor:
    """x ``[B, L, heads, D]`` (contiguous); cos/sin ``[R, D]`` contiguous, token t = b * L + l uses row t % R
    (R = B * L: per token; R = L: shared by every row). Returns the normalized, rotated x, same shape."""
    out = torch.empty_like(x)
    _launch(x, x.shape[2] * x.shape[3], weight, weight, cos, sin_folded, out, x.shape[2], eps)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin_folded: torch.Tensor) -> torch.Tensor:
    """x ``[B, L, heads, D]`` (contiguous) rotated, no norm: ``x * cos + rotate_half(x) * sin`` in float32, rounded
    once; cos/sin as in ``norm_rope``. Returns ``[B, heads, L, D]``, contiguous in that order (what attention and
    a KV cache of that layout read: a ``torch.cat`` onto the cache then takes its vectorized path)."""
    if not x.is_contiguous():
        raise ValueError("rope takes contiguous [B, L, heads, D] heads")
    b, n, heads, d = x.shape
    out = torch.empty((b, heads, n, d), dtype=x.dtype, device=x.device)
    grid, t, warps = _grid(b * n, heads)
    _rope_kernel[grid](x, cos, sin_folded, out, heads * d, cos.shape[0], b * n, n, D=d, T=t, num_warps=warps)
    return out


def qk_norm_rope(qkv: torch.Tensor, num_q_heads: int, num_k_heads: int, wq: torch.Tensor, wk: torch.Tensor,
                 eps: float, cos: torch.Tensor, sin_folded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv ``[B, L, W]`` rows of a fused projection (contiguous; queries in ``[0, nq * D)``, keys next);
    returns normalized, rotated q ``[B, L, nq, D]`` and k ``[B, L, nk, D]`` (views of one output buffer)."""
    b, n, width = qkv.shape
    out = torch.empty((b, n, num_q_heads + num_k_heads, wq.shape[0]), dtype=qkv.dtype, device=qkv.device)
    _launch(qkv, width, wq, wk, cos, sin_folded, out, num_q_heads, eps)
    return out[:, :, :num_q_heads], out[:, :, num_q_heads:]


def qk_norm_rope_cache(qkv: torch.Tensor, num_q_heads: int, num_k_heads: int, wq: torch.Tensor, wk: torch.Tensor,
                       eps: float, cos: torch.Tensor, sin_folded: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, positions: torch.Tensor | int,
                       slots: torch.Tensor | None, keep_keys: bool = False) -> torch.Tensor:
    """``qk_norm_rope`` that stores keys and values in the cache instead of returning them (``keep_keys``:
    returns ``[B, L, nq + nk, D]``, the keys after the queries, as well as storing them).

    qkv ``[B, L, (nq + 2 * nk) * D]`` (contiguous; values after the keys); k_cache, v_cache one layer's
    ``[num_slots, nk, num_positions, D]`` of qkv's dtype (same strides, D contiguous). Token ``l`` of row ``b``
    goes to slot ``slots[b]`` (``b`` when ``slots`` is None) at position ``positions + l`` (an int shared by
    every row) or ``positions[b, l]`` (an integer tensor of ``B * L`` elements in row-major ``[B, L]`` order,
    e.g. a ``[B, 1, L]`` view). Keys are written exactly as ``qk_norm_rope`` returns them, values as they are
    in qkv. Returns the normalized, rotated q ``[B, L, nq, D]``. No host sync: graph-capturable."""
    b, n, width = qkv.shape
    d = wq.shape[0]
    if width != (num_q_heads + 2 * num_k_heads) * d:
        raise ValueError(f"qkv rows of width {width} are not {num_q_heads} + 2 * {num_k_heads} heads of {d}")
    if (k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype or k_cache.shape != v_cache.shape
            or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or k_cache.shape[1] != num_k_heads
            or k_cache.shape[3] != d):
        raise ValueError("k_cache and v_cache must be [slots, kv_heads, positions, head_dim] of qkv's dtype "
                         "with the same strides and a contiguous last dim")
    if isinstance(positions, int):
        if positions < 0 or positions + n > k_cache.shape[2]:
            raise ValueError(f"positions {positions}..{positions + n - 1} are outside the cache's "
                             f"{k_cache.shape[2]} positions")
        pos, start = None, positions
    else:
        pos, start = positions.reshape(-1), 0  # a view when contiguous (the per-row write index is)
        if pos.numel() != b * n:
            raise ValueError(f"{pos.numel()} cache positions for {b} x {n} tokens")
    if slots is not None:
        slots = slots.reshape(-1)
        if slots.numel() != b:
            raise ValueError(f"{slots.numel()} slots for {b} rows")
    elif b > k_cache.shape[0]:
        raise ValueError(f"{b} rows but only {k_cache.shape[0]} cache slots")
    out_heads = num_q_heads + (num_k_heads if keep_keys else 0)
    q = torch.empty((b, n, out_heads, d), dtype=qkv.dtype, device=qkv.device)
    grid, t, warps = _grid(b * n, num_q_heads + 2 * num_k_heads)
    _norm_rope_kernel[grid](
        qkv, wq, wk, cos, sin_folded, q, width, num_q_heads, num_k_heads, out_heads, cos.shape[0], eps,
        k_cache, v_cache, pos, slots, start, n, k_cache.shape[0], k_cache.shape[2], k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), b * n, D=d, TO_CACHE=True, KEEP_K=keep_keys, T=t,
        num_warps=warps)
    return q
