"""One token per row in one Triton program: greedy argmax, or temperature, top-k (ties at the k-th value
kept), top-p (smallest set whose mass reaches p), then argmax of the kept logits plus the row's Gumbel noise.

The same steps, in the same float32 arithmetic, as ``sampling.sample_noisy`` (about twenty torch kernels,
a segmented sort among them, per sampling; a frame samples 16 times), without sorting: each cut is a
threshold found by searching over the logits' bit patterns, with the row held in registers.

- The float32 bits of the scaled logits, with the low 31 bits flipped on negatives, order as int32 exactly as
  the floats do (-0.0 just below +0.0; the final cut compares floats again, so the two stay tied).
- Top-k keeps ``{x >= t}`` for the largest ``t`` with ``count(x >= t) >= k``: the k-th largest value, ties
  included. Counts are exact, and ``_PROBES`` of them travel packed in one integer sum, so each round of the
  search (one reduction across the program's warps, the cost that matters) splits the range in
  ``_PROBES + 1``.
- Top-p keeps ``{x >= t}`` for the largest ``t`` with ``mass(x >= t) >= p``: a token is kept when the mass of
  the strictly better tokens is below ``p``, which is torch's "mass before" of the first of its tied group.
  The mass is a float32 sum in another order than torch's ``cumsum``, so a token whose mass-before sits
  within rounding of ``top_p`` may fall on the other side; with ``top_p = 1`` (off) the two paths pick the
  same token. ``top_p`` is in (0, 1] (``validate.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the order key of -inf: a cut there keeps every entry
_KEY_NEG_INF: tl.constexpr = tl.constexpr(-2139095041)
_PROBES = 2  # counts in 16-bit fields of one int32: at most 2, for rows of up to 65535 ids


def _rounds(probes: int) -> int:
    """Rounds that shrink the int32 range to one key when each keeps a ``1 / (probes + 1)`` part of it."""
    span, rounds = 2**32 - 1, 0
    while span:
        span, rounds = span // (probes + 1), rounds + 1
    return rounds


@triton.jit
def _order_key(x):
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_value(key):
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _kth_key(key, k, PROBES: tl.constexpr, ROUNDS: tl.constexpr):
    """The largest ``t`` with ``count(key >= t) >= k`` (padding keys INT_MIN, ``1 <= k <= vocab``). Invariant:
    ``t`` in ``[lo, hi]``; each round counts the keys at ``PROBES`` evenly spaced probes in one int32 sum and
    keeps the part between the last probe that still reaches ``k`` and the first that does not."""
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    for _ in tl.static_range(ROUNDS):
        step = (hi - lo + PROBES) // (PROBES + 1)
        packed = (key >= tl.minimum(lo + step, hi).to(tl.int32)).to(tl.int32)
        for j in tl.static_range(1, PROBES):
            packed += (key >= tl.minimum(lo + (j + 1) * step, hi).to(tl.int32)).to(tl.int32) << (16 * j)
        counts = tl.sum(packed, axis=0)
        reached = ((counts & 0xFFFF) >= k).to(tl.int64)  # counts fall from probe to probe: 1..reached reach k
        for j in tl.static_range(1, PROBES):
            reached += (((counts >> (16 * j)) & 0xFFFF) >= k).to(tl.int64)
        next_lo = tl.minimum(lo + reached * step, hi)
        hi = tl.where(reached == PROBES, hi, tl.minimum(lo + (reached + 1) * step, hi) - 1)
        lo = next_lo
    return lo.to(tl.int32)


@triton.jit
def _mass_key(key, probs, p):
    """The largest ``t`` with ``sum(probs[key >= t]) >= p``, one bit per round from the top (in the unsigned
    order ``t + 2**31``); INT_MIN when rounding leaves the whole row short of ``p``. A float sum of a
    superset is never smaller, so the search is a plain bisection."""
    prefix = tl.full([], 0, tl.int64)
    for i in tl.static_range(32):
        probe = (prefix + (1 << (31 - i)) - 2147483648).to(tl.int32)
        mass = tl.sum(tl.where(key >= probe, probs, 0.0), axis=0)
        prefix += (mass >= p).to(tl.int64) << (31 - i)
    return (prefix - 2147483648).to(tl.int32)


@triton.jit
def _sample_kernel(logits_ptr, logits_stride, noise_ptr, noise_stride, do_sample_ptr, temp_ptr, top_k_ptr,
                   top_p_ptr, out_ptr, vocab, BLOCK: tl.constexpr, PROBES: tl.constexpr,
                   ROUNDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    valid = offs < vocab
    neg_inf = float("-inf")
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=valid, other=neg_inf).to(tl.float32)
    token = tl.argmax(x, axis=0)
    if tl.load(do_sample_ptr + row) != 0:  # greedy rows stop at the argmax
        noise = tl.load(noise_ptr + row * noise_stride + offs, mask=valid, other=0.0)
        xs = x / tl.load(temp_ptr + row).to(tl.float32)
        key = _order_key(xs)
        cut = tl.full([], _KEY_NEG_INF, tl.int32)
        top_k = tl.load(top_k_ptr + row)
        if (top_k > 0) & (top_k < vocab):
            cut = _kth_key(tl.where(valid, key, -2147483648), top_k, PROBES, ROUNDS)
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        if top_p < 1.0:
            e = tl.exp(tl.where(xs < _key_value(cut), neg_inf, xs) - tl.max(xs, axis=0))
            top_p_cut = _mass_key(key, e / tl.sum(e, axis=0), top_p)
            cut = tl.maximum(cut, top_p_cut)  # INT_MIN (mass short of p by rounding) keeps the top-k set
        scored = tl.where(xs < _key_value(cut), neg_inf, xs) + noise
        token = tl.argmax(tl.where(valid, scored, neg_inf), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_rows(logits: torch.Tensor, do_sample: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``sampling.sample_noisy`` in one launch: logits ``[B, V]`` and noise ``[B, V]`` (rows may be strided,
    the last dim contiguous), per-row parameters ``[B]``; returns int64 ``[B]``."""
    b, vocab = logits.shape
    if logits.stride(1) != 1 or noise.stride(1) != 1:
        raise ValueError("sample_rows needs the vocabulary dimension contiguous")
    if vocab >= 1 << 16:
        raise ValueError("sample_rows packs counts of up to 65535 ids")
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    block = triton.next_power_of_2(vocab)
    _sample_kernel[(b,)](logits, logits.stride(0), noise, noise.stride(0), do_sample, temperature, top_k, top_p,
                         out, vocab, BLOCK=block, PROBES=_PROBES,
                         ROUNDS=_rounds(_PROBES), num_warps=8)
    return out
