"""The counter-based uniforms of ``sampling.counter_uniform`` in one Triton kernel.

The torch version emulates 32-bit wrapping multiplies with int64 ops (~45 elementwise kernels per
call); here the hash runs in native uint32, where multiply wraps and shifts are logical, so the bits
are the same and the output is bit-identical (``tests/test_kernels_gpu.py`` checks it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _mix32(x):
    # every step re-typed as uint32: whatever type a literal promotes to, the bits are the same and the
    # shifts stay logical
    x = x.to(tl.uint32)
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D).to(tl.uint32)
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B).to(tl.uint32)
    return (x ^ (x >> 16)).to(tl.uint32)


@triton.jit
def _uniform_kernel(seed_ptr, step_ptr, out_ptr, first_group, num_groups, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # b * num_groups + group offset
    b = row // num_groups
    group = (row % num_groups + first_group).to(tl.uint32)
    seed = tl.load(seed_ptr + b)
    step = tl.load(step_ptr + b)
    h = _mix32((seed >> 32).to(tl.uint32) ^ 0x5BD1E995)
    h = _mix32(h ^ seed.to(tl.uint32))
    h = _mix32(h ^ step.to(tl.uint32))
    h = _mix32(h ^ (group ^ 0x68E31DA4))
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    hv = _mix32(_mix32(h ^ v.to(tl.uint32)) + 0x1B56C4E9)
    hv = hv >> 8
    u = (hv.to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    tl.store(out_ptr + row.to(tl.int64) * vocab + v, u, mask=v < vocab)


def counter_uniform_cuda(seed: torch.Tensor, step: torch.Tensor, first_group: int, num_groups: int,
                         vocab: int) -> torch.Tensor:
    """``[B, num_groups, vocab]`` float32, equal to ``sampling.counter_uniform_groups``."""
    b = seed.shape[0]
    out = torch.empty(b, num_groups, vocab, dtype=torch.float32, device=seed.device)
    grid = (b * num_groups, triton.cdiv(vocab, _BLOCK))
    _uniform_kernel[grid](seed.to(torch.int64), step.to(torch.int64), out, first_group, num_groups, vocab,
                          BLOCK=_BLOCK)
    return out
