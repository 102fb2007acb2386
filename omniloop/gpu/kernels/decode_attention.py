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

from omniloop.gpu.kernels.qk_norm_rope import _normed_rotated

LOG2E = 1.4426950408889634
# software-pipeline depth of the key loop; None: Triton's default. At 64 rows x 8 kv heads the talker's decode
# is 512 programs of ~70 KB shared memory at the default depth: 3 a SM on the H200, 1.3 waves. A knob for the
# on-device measurement of shallower pipelines (more programs a SM), not a tuned value
NUM_STAGES: int | None = None
# keys a program reads per loop step (at most): BLOCK_N_MAX where there are at least two programs (row, kv head) a
# SM, else BLOCK_N_FEW; warps a program. The talker's decode at 64 rows x 320 keys (512 programs) took 26.0 us a
# layer with 32 keys a step against 29.7 with 64 (floor 19.7); at 1 and 8 rows 64 was faster (7.2 vs 8.5 us at 256
# keys, 11.1 vs 13.8 at 2,048; tools/bench_attention.py, benchmarks/talker-steps.md)
BLOCK_N_MAX = 32
BLOCK_N_FEW = 64
NUM_WARPS = 4
_SM_COUNT: dict[int, int] = {}


def _block_n(kv_len: int, num_programs: int, device: torch.device) -> int:
    """Keys a program reads per loop step for a launch of ``num_programs`` over ``kv_len`` keys at most."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _SM_COUNT:
            _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
        most = BLOCK_N_MAX if num_programs >= 2 * _SM_COUNT[index] else BLOCK_N_FEW
    else:
        most = BLOCK_N_MAX
    return min(most, max(16, triton.next_power_of_2(kv_len)))


def _stages() -> dict[str, int]:
    return {} if NUM_STAGES is None else {"num_stages": NUM_STAGES}


@triton.jit
def _softmax_block(q, k, v, visible, qk_scale, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One block of keys ``k``/values ``v`` ``[N, D]`` into the online softmax of queries ``q`` ``[M, D]``
    (``visible`` ``[M, N]``): the updated running max, sum and accumulator."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 units
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a query row with no visible key yet keeps m = -inf; subtracting 0 instead keeps exp2 free of NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_keys", "start"])
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, slot_ptr, len_ptr, num_keys, qk_scale,
                             q_stride_b, q_stride_l, q_stride_h, k_stride_s, k_stride_h, k_stride_t,
                             v_stride_s, v_stride_h, v_stride_t,
                             wq_ptr, wk_ptr, cos_ptr, sin_ptr, cos_rows, eps, pos_ptr, start, num_positions,
                             num_slots, num_q_heads,
                             L: tl.constexpr, GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                             FRESH: tl.constexpr):
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
    k_base = k_ptr + slot * k_stride_s + kv_head.to(tl.int64) * k_stride_h
    v_base = v_ptr + slot * v_stride_s + kv_head.to(tl.int64) * v_stride_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if FRESH:
        # q_ptr holds the projection's raw rows: the queries of this kv head and the row's L new keys are
        # normalized and rotated here (as qk_norm_rope_cache would, rounded once to the cache's dtype), the
        # new keys and values stored at their cache positions, and attended from registers after the cached
        # keys: the loop reads only positions below length - L, which no program of this launch writes
        q = _normed_rotated(q_ptr, q_rows, wq_ptr, wk_ptr, True, cos_ptr, sin_ptr,
                            (row * L + token) % cos_rows, eps, is_query, D).to(k_ptr.dtype.element_ty)
        f = tl.arange(0, BLOCK_M)  # the new tokens, padded to the tile's rows
        is_new = f < L
        new_rows = row.to(tl.int64) * q_stride_b + f * q_stride_l
        k_new = _normed_rotated(q_ptr, new_rows + (num_q_heads + kv_head) * q_stride_h, wq_ptr, wk_ptr, False,
                                cos_ptr, sin_ptr, (row * L + f) % cos_rows, eps, is_new, D).to(k_ptr.dtype.element_ty)
        v_new = tl.load(q_ptr + (new_rows + (num_q_heads + num_q_heads // GROUPS + kv_head) * q_stride_h)[:, None]
                        + d[None, :], mask=is_new[:, None] & in_d[None, :], other=0.0)
        if pos_ptr is None:
            pos = (start + f).to(tl.int64)
        else:
            pos = tl.load(pos_ptr + row * L + f, mask=is_new, other=-1).to(tl.int64)
        # an index outside the cache drops the write instead of scribbling over other memory
        lane = is_new[:, None] & in_d[None, :]
        slot_of = tl.zeros([BLOCK_M], tl.int64) + slot  # per new token (a scalar condition would not broadcast)
        inside = lane & ((slot_of >= 0) & (slot_of < num_slots) & (pos >= 0) & (pos < num_positions))[:, None]
        tl.store(k_base + pos[:, None] * k_stride_t + d[None, :], k_new, mask=inside)
        tl.store(v_base + pos[:, None] * v_stride_t + d[None, :], v_new, mask=inside)
        cached = length - L
    else:
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=is_query[:, None] & in_d[None, :], other=0.0)
        cached = length
    for begin in range(0, cached, BLOCK_N):
        n = begin + tl.arange(0, BLOCK_N)
        in_keys = (n < cached)[:, None] & in_d[None, :]
        k = tl.load(k_base + n[:, None] * k_stride_t + d[None, :], mask=in_keys, other=0.0)
        v = tl.load(v_base + n[:, None] * v_stride_t + d[None, :], mask=in_keys, other=0.0)
        visible = (n[None, :] < limit[:, None]) & (n < cached)[None, :]  # FRESH: the new keys come after
        m_i, l_i, acc = _softmax_block(q, k, v, visible, qk_scale, m_i, l_i, acc, PRECISION)
    if FRESH:  # new token f sits at position cached + f: token t sees the new ones up to itself
        visible = (f[None, :] <= token[:, None]) & is_new[None, :] & (cached + f[None, :] >= 0)
        m_i, l_i, acc = _softmax_block(q, k_new, v_new, visible, qk_scale, m_i, l_i, acc, PRECISION)
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
    hkv, positions = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != d or hq % hkv != 0:
        raise ValueError(f"q {tuple(q.shape)} and caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} "
                         "are not [B, L, Hq, D] and [S, Hkv, T, D] with Hkv dividing Hq")
    if not 0 < kv_len <= positions:
        raise ValueError(f"kv_len {kv_len} outside the cache's {positions} positions")
    if q.stride(3) != 1:
        q = q.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last dim")
    return _launch(q, q.stride()[:3], (b, n, hq, d), k_cache, v_cache, kv_len, lengths, slots)


def _launch(src: torch.Tensor, q_strides: tuple[int, ...], shape: tuple[int, int, int, int], k_cache: torch.Tensor,
            v_cache: torch.Tensor, kv_len: int, lengths: torch.Tensor | None, slots: torch.Tensor | None,
            fresh: tuple | None = None) -> torch.Tensor:
    """What both wrappers share: the rows' lengths and slots checked, the output ``shape`` ``[B, L, Hq, D]``
    made, the kernel launched over (row, kv head) with the queries of row ``b``, token ``l``, head ``h`` at
    ``src`` + ``q_strides`` · (b, l, h); ``fresh``: the kernel's new-key arguments (``FRESH``), else none."""
    b, n, hq, d = shape
    num_slots, hkv = k_cache.shape[:2]
    if slots is None and b > num_slots:
        raise ValueError(f"{b} rows but only {num_slots} cache slots")
    for name, t in (("lengths", lengths), ("slots", slots)):
        if t is not None and t.numel() != b:
            raise ValueError(f"{t.numel()} {name} for {b} rows")
    out = torch.empty(shape, dtype=src.dtype, device=src.device)
    if b == 0:
        return out
    groups = hq // hkv
    _decode_attention_kernel[(b, hkv)](
        src, k_cache, v_cache, out, slots, lengths, kv_len, LOG2E / d ** 0.5, *q_strides, *k_cache.stride()[:3],
        *v_cache.stride()[:3], *(fresh or (None, None, None, None, 1, 0.0, None, 0, 0, 0, 0)),
        L=n, GROUPS=groups, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_M=max(16, triton.next_power_of_2(n * groups)),
        BLOCK_N=_block_n(kv_len, b * hkv, src.device),
        PRECISION="ieee" if src.dtype == torch.float32 else "tf32",  # tf32 is ignored for half inputs
        FRESH=fresh is not None, num_warps=NUM_WARPS, **_stages())
    return out


def dot_head_dim_ok(d: int) -> bool:
    """Whether the kernels that run a head as one tile dimension (``decode_attention_fresh``'s per-head norm and
    rope, ``packed_attention``) take heads of ``d``: a power of two of at least 16."""
    return d >= 16 and not d & (d - 1)


def decode_attention_fresh(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, wq: torch.Tensor,
                           wk: torch.Tensor, eps: float, cos: torch.Tensor, sin_folded: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor | int, kv_len: int,
                           lengths: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """``qk_norm_rope_cache`` followed by ``decode_attention`` in one launch, from the fused projection's rows.

    qkv ``[B, L, (Hq + 2 * Hkv) * D]`` (queries, keys, values; D contiguous); wq, wk the per-head RMSNorm
    weights ``[D]``; cos, sin_folded the rope rows ``[R, D]`` (token ``b * L + l`` uses row ``(b * L + l) % R``);
    each row's L new keys (normalized, rotated) and values are stored in its slot at ``positions + l`` (an int
    shared by every row) or ``positions[b, l]`` (write positions, the scratch one for padding rows); then, as
    ``decode_attention``, token ``l`` attends the first ``length - (L - 1 - l)`` keys, the new ones among
    them. Returns ``[B, L, Hq, D]`` contiguous. No host sync: graph-capturable."""
    b, n, width = qkv.shape
    d = wq.shape[0]
    num_slots, hkv, max_positions, _ = k_cache.shape
    if width != (num_q_heads + 2 * num_kv_heads) * d or hkv != num_kv_heads or num_q_heads % num_kv_heads:
        raise ValueError(f"qkv rows of width {width} are not {num_q_heads} + 2 * {num_kv_heads} heads of {d}, "
                         f"or the cache holds {hkv} kv heads")
    if not dot_head_dim_ok(d):
        raise ValueError(f"head dim {d} is not a power of two of at least 16")
    if (k_cache.dtype != qkv.dtype or k_cache.shape != v_cache.shape or k_cache.stride(3) != 1
            or v_cache.stride(3) != 1 or k_cache.shape[3] != d):
        raise ValueError("k_cache and v_cache must be [slots, kv_heads, positions, head_dim] of qkv's dtype")
    if not 0 < kv_len <= max_positions or n > kv_len:
        raise ValueError(f"kv_len {kv_len} outside the cache's {max_positions} positions or below {n} new tokens")
    if isinstance(positions, int):
        if positions < 0 or positions + n > max_positions:
            raise ValueError(f"positions {positions}..{positions + n - 1} are outside the cache")
        pos, start = None, positions
    else:
        pos, start = positions.reshape(-1), 0
        if pos.numel() != b * n:
            raise ValueError(f"{pos.numel()} cache positions for {b} x {n} tokens")
    if qkv.stride(2) != 1:
        qkv = qkv.contiguous()
    fresh = (wq, wk, cos, sin_folded, cos.shape[0], eps, pos, start, max_positions, num_slots, num_q_heads)
    return _launch(qkv, (qkv.stride(0), qkv.stride(1), d), (b, n, num_q_heads, d), k_cache, v_cache, kv_len,
                   lengths, slots, fresh)
