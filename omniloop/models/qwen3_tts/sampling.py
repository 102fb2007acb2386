"""Batched sampling for the talker (codebook 0) and the code predictor (codebooks 1..15).

Rules follow qwen-tts / transformers' generate: on codebook 0 the repetition penalty (over the
request's earlier code-0 tokens), then EOS masked until ``min_new_tokens`` tokens exist, then the top
1024 codec ids except EOS suppressed; then temperature, top-k, top-p. Greedy rows take the argmax of the
processed logits.

Randomness is counter-based: the uniform number for request ``r``, step ``s``, codebook ``g`` and
vocabulary index ``v`` is a hash of ``(seed_r, s, g, v)`` built from int64 tensor ops. A seeded request
therefore samples the same codes alone or in any batch, and nothing here calls ``.item()`` or a
``torch.Generator`` — the whole function can live inside a captured CUDA graph. Sampling is the
Gumbel-max trick over the filtered distribution, which draws exactly from softmax(logits / T).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

MIN_NEW_TOKENS = 2
NUM_SUPPRESSED = 1024
# CUDA: one Triton kernel per sampling (``gpu/kernels/sampler.py``); a switch so benchmarks and tests can run
# the torch path it replaces
FUSED_SAMPLER = True
_M32 = 0xFFFFFFFF


@dataclass
class SamplingParams:
    """Per-row sampling parameters, every field a ``[B]`` tensor on the model's device."""

    do_sample: torch.Tensor  # bool
    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # float32, 1.0 = off
    repetition_penalty: torch.Tensor  # float32, 1.0 = off
    sub_do_sample: torch.Tensor
    sub_temperature: torch.Tensor
    sub_top_k: torch.Tensor
    sub_top_p: torch.Tensor
    seed: torch.Tensor  # int64

    @classmethod
    def stack(cls, rows: list[dict[str, float | int | bool]], device: torch.device | str = "cpu") -> "SamplingParams":
        """Build from one dict per request (keys = field names)."""
        dtypes = dict(do_sample=torch.bool, sub_do_sample=torch.bool, top_k=torch.int64, sub_top_k=torch.int64,
                      seed=torch.int64)
        return cls(**{f.name: torch.tensor([r[f.name] for r in rows], dtype=dtypes.get(f.name, torch.float32),
                                           device=device) for f in fields(cls)})

    def index(self, rows: torch.Tensor) -> "SamplingParams":
        return SamplingParams(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # 32-bit wrapping multiply from two 16-bit halves: every partial product stays below 2**49 in int64
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _row_hash(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``[B, 1]``: the hash of (seed, step), the per-row prefix of every counter."""
    seed = seed.to(torch.int64)[:, None]
    h = _mix32((seed >> 32) & _M32 ^ 0x5BD1E995)
    h = _mix32(h ^ (seed & _M32))
    return _mix32(h ^ (step.to(torch.int64)[:, None] & _M32))


def _to_uniform(h: torch.Tensor, vocab: int) -> torch.Tensor:
    """Prefix hashes ``[..., 1]`` -> uniforms ``[..., vocab]``."""
    v = torch.arange(vocab, dtype=torch.int64, device=h.device)
    h = _mix32(_mix32(h ^ v) + 0x1B56C4E9 & _M32)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def counter_uniform(seed: torch.Tensor, step: torch.Tensor, group: torch.Tensor | int, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) float32 ``[B, vocab]``; entry ``[r, v]`` depends only on (seed[r], step[r], group, v)."""
    h = _row_hash(seed, step)
    if isinstance(group, int):  # a Python constant: no host tensor to copy (that copy would sync the stream)
        h = _mix32(h ^ ((group & _M32) ^ 0x68E31DA4))
    else:
        h = _mix32(h ^ (group.to(torch.int64).reshape(-1, 1) & _M32) ^ 0x68E31DA4)
    return _to_uniform(h, vocab)


def counter_uniform_groups(seed: torch.Tensor, step: torch.Tensor, first_group: int, num_groups: int,
                           vocab: int) -> torch.Tensor:
    """``[B, num_groups, vocab]``: ``counter_uniform`` of groups ``first_group..first_group+num_groups-1`` in
    one call (one frame's uniforms at once instead of one call per codebook). Bit-identical to it; on CUDA
    one Triton kernel instead of ~45 int64 elementwise kernels."""
    if seed.is_cuda:
        from omniloop.gpu.kernels.counter_hash import counter_uniform_cuda

        return counter_uniform_cuda(seed, step, first_group, num_groups, vocab)
    groups = torch.arange(first_group, first_group + num_groups, dtype=torch.int64, device=seed.device)
    h = _mix32(_row_hash(seed, step) ^ ((groups & _M32) ^ 0x68E31DA4))  # [B, G]
    return _to_uniform(h[..., None], vocab)


# The largest uniform, (2^24 - 0.5) / 2^24, rounds to exactly 1.0 in float32, whose Gumbel noise is +inf: added
# to a removed token's -inf it makes NaN, which argmax picks. Clamping below 1 keeps every noise finite.
_U_MAX = 1.0 - 2.0**-24


def gumbel_noise(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u.clamp(max=_U_MAX)))


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k (ties at the k-th value kept), then top-p (smallest set whose mass reaches p,
    at least one token); removed entries become -inf. All parameters per row."""
    logits = logits.float() / temperature[:, None]
    vocab = logits.shape[-1]
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = sorted_logits.gather(-1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # mass of strictly better tokens
    # top_p >= 1 is off: a threshold of inf removes nothing
    removed = mass_before >= torch.where(top_p < 1.0, top_p, float("inf"))[:, None]
    # the threshold is the worst kept logit; everything below it (or below the k-th) goes
    kept_min = sorted_logits.masked_fill(removed, float("inf")).min(-1, keepdim=True).values
    return logits.masked_fill(logits < torch.maximum(kth, kept_min), float("-inf"))


def sample_noisy(logits: torch.Tensor, do_sample: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One token per row: argmax for greedy rows, argmax of filtered logits + ``noise`` (Gumbel, ``[B, V]``)
    for sampled rows. On CUDA one Triton kernel does it all (``gpu/kernels/sampler.py``)."""
    if logits.is_cuda and FUSED_SAMPLER:
        from omniloop.gpu.kernels.sampler import sample_rows

        return sample_rows(logits, do_sample, temperature, top_k, top_p, noise)
    greedy = logits.argmax(-1)
    safe_t = torch.where(do_sample, temperature, torch.ones_like(temperature))
    sampled = (filter_logits(logits, safe_t, top_k, top_p) + noise).argmax(-1)
    return torch.where(do_sample, sampled, greedy)


def sample(logits: torch.Tensor, do_sample: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, seed: torch.Tensor, step: torch.Tensor, group: torch.Tensor | int) -> torch.Tensor:
    """One token per row: argmax for greedy rows, Gumbel-max over the filtered logits for sampled rows."""
    noise = gumbel_noise(counter_uniform(seed, step, group, logits.shape[-1]))
    return sample_noisy(logits, do_sample, temperature, top_k, top_p, noise)


def frame_noise(seed: torch.Tensor, step: torch.Tensor, code0_vocab: int, num_groups: int,
                sub_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gumbel noise of one whole frame, drawn at once: codebook 0 ``[B, code0_vocab]`` and codebooks
    1..num_groups-1 ``[B, num_groups - 1, sub_vocab]``; equal to what ``sample`` draws per codebook."""
    code0 = gumbel_noise(counter_uniform_groups(seed, step, 0, 1, code0_vocab))[:, 0]
    return code0, gumbel_noise(counter_uniform_groups(seed, step, 1, num_groups - 1, sub_vocab))


def code0_logits(logits: torch.Tensor, seen: torch.Tensor, num_generated: torch.Tensor,
                 repetition_penalty: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Talker logits ``[B, V]`` -> processed logits: repetition penalty over ``seen`` (bool ``[B, V]``, code-0
    tokens this request produced), EOS masked while ``num_generated < MIN_NEW_TOKENS``, the top 1024 ids
    except EOS suppressed."""
    logits = logits.float()
    vocab = logits.shape[-1]
    penalty = repetition_penalty[:, None]
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    logits = torch.where(seen, penalized, logits)
    ids = torch.arange(vocab, device=logits.device)
    suppressed = (ids >= vocab - NUM_SUPPRESSED) & (ids != eos_id)
    logits = logits.masked_fill(suppressed[None, :], float("-inf"))
    too_early = (num_generated < MIN_NEW_TOKENS)[:, None] & (ids == eos_id)[None, :]
    return logits.masked_fill(too_early, float("-inf"))


def sample_code0(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor, step: torch.Tensor,
                 eos_id: int, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Codebook 0 for each row; ``step`` = frames this request generated so far; ``noise`` from
    ``frame_noise`` (drawn here when not given)."""
    processed = code0_logits(logits, seen, step, params.repetition_penalty, eos_id)
    if noise is None:
        noise = gumbel_noise(counter_uniform(params.seed, step, 0, logits.shape[-1]))
    return sample_noisy(processed, params.do_sample, params.temperature, params.top_k, params.top_p, noise)


def sample_sub(logits: torch.Tensor, params: SamplingParams, step: torch.Tensor, group: int,
               noise: torch.Tensor | None = None) -> torch.Tensor:
    """Codebook ``group`` (1..15) from the code predictor's logits, with the sub-talker parameters."""
    if noise is None:
        noise = gumbel_noise(counter_uniform(params.seed, step, group, logits.shape[-1]))
    return sample_noisy(logits, params.sub_do_sample, params.sub_temperature, params.sub_top_k, params.sub_top_p,
                        noise)
