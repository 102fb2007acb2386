"""Run by ``test_kernels_interpret.py`` in a subprocess with ``TRITON_INTERPRET=1``: the CUDA path's Triton
kernels, executed by Triton's CPU interpreter, against the torch code they replace. Small shapes: the
interpreter runs each program in numpy."""

from __future__ import annotations

import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from omniloop.gpu.kernels.qk_norm_rope import norm_rope, qk_norm_rope  # noqa: E402
from omniloop.gpu.kernels.silu_mul import silu_mul  # noqa: E402
from omniloop.gpu.kernels.sampler import sample_rows  # noqa: E402
from omniloop.models.qwen3_tts import sampling  # noqa: E402
from omniloop.models.qwen3_tts.layers import RMSNorm, _rotate_half  # noqa: E402


def check_sampler() -> None:
    torch.manual_seed(0)
    b, vocab = 12, 300  # not a power of two: the kernel pads to 512
    logits = torch.randn(b, vocab) * 3
    logits[:, :9] = logits[:, :1]  # a 9-way tie at the top: top-k keeps every tied value
    logits[3, 50:] = float("-inf")  # processed code-0 logits carry -inf
    noise = sampling.gumbel_noise(torch.rand(b, vocab))
    do_sample = torch.arange(b) % 4 != 0
    temperature = torch.rand(b) + 0.5
    top_k = torch.tensor([0, 1, 5, 8, 9, 10, 50, 299, 300, 400, 3, 0])
    sampling.FUSED_SAMPLER = False  # sample_noisy is the torch path from here on (CPU tensors anyway)
    for top_p in (torch.ones(b), torch.rand(b) * 0.9 + 0.05):
        got = sample_rows(logits, do_sample, temperature, top_k, top_p, noise)
        want = sampling.sample_noisy(logits, do_sample, temperature, top_k, top_p, noise)
        mismatches = int((got != want).sum())
        assert mismatches <= (0 if bool((top_p == 1).all()) else 1), (got.tolist(), want.tolist())
        assert torch.equal(got[~do_sample], logits[~do_sample].argmax(-1))
    check_boundaries(logits.shape[1])
    # strided rows (the code predictor's noise is a [B, 15, V] slice)
    wide = torch.stack([noise, noise], 1)[:, 1]
    assert torch.equal(sample_rows(logits, do_sample, temperature, top_k, torch.ones(b), wide),
                       sampling.sample_noisy(logits, do_sample, temperature, top_k, torch.ones(b), noise))


def check_boundaries(vocab: int) -> None:
    """Noise that makes the last kept token and the first removed one the two best candidates: the sampled
    token is the kept one exactly when the top-k / top-p cut sits where the torch path puts it."""
    torch.manual_seed(3)
    b = 8
    logits = torch.randn(b, vocab) * 2
    order = logits.argsort(-1, descending=True)
    do_sample, temperature = torch.ones(b, dtype=torch.bool), torch.ones(b)
    ks = torch.arange(b) * 7 + 2
    noise = torch.zeros(b, vocab)
    rows = torch.arange(b)
    noise[rows, order[rows, ks - 1]] = 50.0  # the k-th best: kept
    noise[rows, order[rows, ks]] = 60.0  # the (k+1)-th: removed
    got = sample_rows(logits, do_sample, temperature, ks, torch.ones(b), noise)
    assert torch.equal(got, order[rows, ks - 1]), "top-k cut"
    probs = logits.softmax(-1).gather(-1, order)
    before = probs.cumsum(-1) - probs
    j = torch.arange(b) + 3  # keep the best j + 1 tokens: top_p halfway into token j's mass
    top_p = before[rows, j] + probs[rows, j] / 2
    noise = torch.zeros(b, vocab)
    noise[rows, order[rows, j]] = 50.0
    noise[rows, order[rows, j + 1]] = 60.0
    got = sample_rows(logits, do_sample, temperature, torch.zeros(b, dtype=torch.int64), top_p, noise)
    assert torch.equal(got, order[rows, j]), "top-p cut"
    assert torch.equal(got, sampling.sample_noisy(logits, do_sample, temperature, torch.zeros(b, dtype=torch.int64),
                                                  top_p, noise))


def check_norm_rope() -> None:
    torch.manual_seed(1)
    b, n, nq, nk, d = 2, 3, 4, 2, 16
    qkv = torch.randn(b, n, (nq + 2 * nk) * d)
    wq, wk = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    cos, sin = torch.rand(b * n, d), torch.rand(b * n, d)
    folded = torch.cat((-sin[:, :d // 2], sin[:, d // 2:]), -1)
    q, k = qk_norm_rope(qkv, nq, nk, wq, wk, 1e-6, cos, folded)
    for got, start, heads, w in ((q, 0, nq, wq), (k, nq * d, nk, wk)):
        x = qkv[..., start:start + heads * d].reshape(b, n, heads, d)
        norm = RMSNorm(d, 1e-6)
        norm.weight.data = w
        normed = norm(x)
        c, s = cos.view(b, n, 1, d), sin.view(b, n, 1, d)
        want = normed * c + _rotate_half(normed) * s
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        single = norm_rope(x.contiguous(), w, 1e-6, cos, folded)
        assert torch.equal(single, got)


def check_silu_mul() -> None:
    torch.manual_seed(2)
    gate_up = torch.randn(5, 2 * 1500) * 3  # 1500: more than one block, not a multiple of it
    want = torch.nn.functional.silu(gate_up[:, :1500]) * gate_up[:, 1500:]
    torch.testing.assert_close(silu_mul(gate_up), want, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    check_sampler()
    check_norm_rope()
    check_silu_mul()
    print("kernels ok")
