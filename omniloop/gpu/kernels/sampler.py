"""One token per row in one Triton program: greedy argmax, or temperature, top-k (ties at the k-th value
kept), top-p (smallest set whose mass reaches p), then argmax of the kept logits plus the row's Gumbel noise.

The same steps, in the same float32 arithmetic, as ``sampling.sample_noisy`` (about twenty torch kernels,
a segmented sort among them, per sampling; a frame samples 16 times). Top-p's running sum is a
different summation order than torch's ``cumsum``, so a token whose mass-before sits within rounding of
``top_p`` may fall on the other side; with ``top_p = 1`` (off) the two are identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_kernel(logits_ptr, logits_stride, noise_ptr, noise_stride, do_sample_ptr, temp_ptr, top_k_ptr,
                   top_p_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    valid = offs < vocab
    neg_inf = float("-inf")
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=valid, other=neg_inf).to(tl.float32)
    greedy = tl.argmax(x, axis=0)
    do_sample = tl.load(do_sample_ptr + row) != 0
    temp = tl.where(do_sample, tl.load(temp_ptr + row).to(tl.float32), 1.0)
    xs = x / temp
    top_k = tl.load(top_k_ptr + row)
    k = tl.where(top_k > 0, tl.minimum(top_k, vocab), vocab)
    desc = tl.sort(xs, descending=True)
    kth = tl.max(tl.where(offs == k - 1, desc, neg_inf), axis=0)
    kept = tl.where(desc < kth, neg_inf, desc)
    e = tl.exp(kept - tl.max(kept, axis=0))
    probs = e / tl.sum(e, axis=0)
    before = tl.cumsum(probs, axis=0) - probs
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    limit = tl.where(top_p < 1.0, top_p, float("inf"))
    kept_min = tl.min(tl.where(before >= limit, float("inf"), kept), axis=0)
    threshold = tl.maximum(kth, kept_min)
    noise = tl.load(noise_ptr + row * noise_stride + offs, mask=valid, other=0.0)
    scored = tl.where(xs < threshold, neg_inf, xs) + noise
    sampled = tl.argmax(tl.where(valid, scored, neg_inf), axis=0)
    tl.store(out_ptr + row, tl.where(do_sample, sampled, greedy).to(tl.int64))


def sample_rows(logits: torch.Tensor, do_sample: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``sampling.sample_noisy`` in one launch: logits ``[B, V]`` and noise ``[B, V]`` (rows may be strided,
    the last dim contiguous), per-row parameters ``[B]``; returns int64 ``[B]``."""
    b, vocab = logits.shape
    if logits.stride(1) != 1 or noise.stride(1) != 1:
        raise ValueError("sample_rows needs the vocabulary dimension contiguous")
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    block = triton.next_power_of_2(vocab)
    _sample_kernel[(b,)](logits, logits.stride(0), noise, noise.stride(0), do_sample, temperature, top_k, top_p,
                         out, vocab, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out
