"""The CUDA decode path against the reference path: the Triton counter hash is bit-identical to the
torch one, and the CUDA layer path (rope table, GQA-as-query-length decode attention, shared-position
code-predictor steps) computes what the CPU reference computes, in float32."""

from __future__ import annotations

import pytest
import torch

from omniloop.models.qwen3_tts.checkpoint import build_model
from omniloop.models.qwen3_tts.config import load_tts_config
from omniloop.models.qwen3_tts.generate import GREEDY
from omniloop.models.qwen3_tts.sampling import SamplingParams, counter_uniform, counter_uniform_groups
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint

pytestmark = pytest.mark.gpu


def test_triton_counter_uniform_is_bit_identical() -> None:
    seed = torch.tensor([7, 1 << 40, -3, 0, (1 << 63) - 1, -(1 << 62)], device="cuda")
    step = torch.tensor([0, 5, 2, 1 << 33, 17, 3], device="cuda")
    u = counter_uniform_groups(seed, step, 1, 15, 2048)
    for g in range(1, 16):
        assert torch.equal(u[:, g - 1], counter_uniform(seed, step, g, 2048)), g
    assert torch.equal(counter_uniform_groups(seed, step, 0, 1, 3072)[:, 0], counter_uniform(seed, step, 0, 3072))


@torch.no_grad()
def test_cuda_layer_path_matches_the_cpu_reference() -> None:
    cfg = load_tts_config(ensure_tiny_checkpoint("custom_voice"))
    cpu = build_model(cfg=cfg, load_format="dummy", seed=1)[0]
    gpu = build_model(cfg=cfg, load_format="dummy", seed=1, device="cuda")[0]
    h = cfg.talker.decoder.hidden_size
    torch.manual_seed(0)
    prompts = [torch.randn(n, h) for n in (9, 5, 12)]
    x = torch.randn(3, h)
    positions = torch.tensor([9, 5, 12])
    out = {}
    for name, model in (("cpu", cpu), ("gpu", gpu)):
        dev = model.device
        model.allocate(4, 32)
        slots = torch.tensor([0, 1, 2], device=dev)
        model.prefill(slots, [p.to(dev) for p in prompts])
        # decode with per-row positions (slots given, and rows = slots 0..2 as in the graph step)
        a = model.decode_step(slots, x.to(dev), positions.to(dev), kv_len=16)
        b = model.talker.model(x.to(dev)[:, None], positions.to(dev)[:, None] + 1, model.cache.k, model.cache.v,
                               None, 16)[:, 0]
        hidden, emb = x.to(dev), x.flip(0).to(dev)
        params = SamplingParams.stack([dict(GREEDY, seed=i) for i in range(3)], dev)
        codes = model.code_predictor.predict(hidden, emb, params, torch.zeros(3, dtype=torch.int64, device=dev))
        out[name] = (a.cpu(), b.cpu(), codes.cpu())
    for i in range(2):
        torch.testing.assert_close(out["gpu"][i], out["cpu"][i], atol=2e-4, rtol=2e-4)
    same = (out["gpu"][2] == out["cpu"][2]).float().mean().item()
    assert same > 0.9, same  # greedy codes: float32 CPU vs CUDA may flip a rare near-tie


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_rope_matches_torch(dtype: torch.dtype) -> None:
    from omniloop.gpu.kernels.qk_norm_rope import norm_rope

    torch.manual_seed(0)
    b, n, heads, d = 5, 3, 16, 128
    x = torch.randn(b, n, heads, d, device="cuda", dtype=dtype)
    w = torch.randn(d, device="cuda", dtype=dtype)
    angle = torch.randn(b * n, d, device="cuda")
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    folded = torch.cat((-sin[:, : d // 2], sin[:, d // 2:]), -1)
    x32 = x.float()
    y = w.float() * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    rot = torch.cat((-y[..., d // 2:], y[..., : d // 2]), -1)
    c, s_ = cos.float().view(b, n, 1, d), sin.float().view(b, n, 1, d)
    want = y * c + rot * s_
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(norm_rope(x, w, 1e-6, cos, folded).float(), want, **tol)
    # shared rows: R = L, every batch row uses the same positions
    shared = norm_rope(x, w, 1e-6, cos[:n].contiguous(), folded[:n].contiguous()).float()
    want_shared = y * c[:1] + rot * s_[:1]
    torch.testing.assert_close(shared, want_shared, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_qkv_norm_rope_and_silu_mul_match_the_separate_path(dtype: torch.dtype) -> None:
    """A layer with fused QKV / gate-up weights (one matmul each, q and k normalized in one launch, SiLU *
    up in one kernel) gives what the separate projections give."""
    from omniloop.gpu.kernels.qk_norm_rope import norm_rope, qk_norm_rope
    from omniloop.gpu.kernels.silu_mul import silu_mul

    torch.manual_seed(0)
    b, n, nq, nk, d, hidden = 3, 5, 16, 8, 128, 256
    x = torch.randn(b, n, hidden, device="cuda", dtype=dtype)
    w = torch.randn((nq + 2 * nk) * d, hidden, device="cuda", dtype=dtype) / hidden ** 0.5
    wq, wk = (torch.rand(d, device="cuda", dtype=dtype) + 0.5 for _ in range(2))
    cos = torch.rand(b * n, d, device="cuda", dtype=dtype)
    sin = torch.rand(b * n, d, device="cuda", dtype=dtype)
    qkv = torch.nn.functional.linear(x, w)
    q, k = qk_norm_rope(qkv, nq, nk, wq, wk, 1e-6, cos, sin)
    want_q = norm_rope(qkv[..., :nq * d].contiguous().view(b, n, nq, d), wq, 1e-6, cos, sin)
    want_k = norm_rope(qkv[..., nq * d:(nq + nk) * d].contiguous().view(b, n, nk, d), wk, 1e-6, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    gate_up = torch.randn(7, 2 * 3000, device="cuda", dtype=dtype) * 3
    want = (torch.nn.functional.silu(gate_up[:, :3000].float()) * gate_up[:, 3000:].float())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(silu_mul(gate_up).float(), want, **tol)


@pytest.mark.parametrize("vocab", [2048, 3072])
def test_fused_sampler_matches_the_torch_path(vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy, temperature, top-k (ties kept) and top-p rows: the Triton sampler picks the torch path's
    token; with top-p on, a row whose boundary sits within rounding may differ (allowed: at most 1 in 64)."""
    from omniloop.models.qwen3_tts import sampling

    torch.manual_seed(1)
    b = 256
    logits = torch.randn(b, vocab, device="cuda") * 3
    logits[:, :40] = logits[:, :1]  # a 40-way tie at the top: top-k must keep every tied value
    logits[5, 100:] = float("-inf")  # processed code-0 logits carry -inf
    noise = sampling.gumbel_noise(torch.rand(b, vocab, device="cuda"))
    do_sample = torch.arange(b, device="cuda") % 4 != 0
    temperature = torch.rand(b, device="cuda") + 0.5
    top_k = torch.randint(0, 80, (b,), device="cuda")
    for top_p in (torch.ones(b, device="cuda"), torch.rand(b, device="cuda") * 0.9 + 0.05):
        fused = sampling.sample_noisy(logits, do_sample, temperature, top_k, top_p, noise)
        monkeypatch.setattr(sampling, "FUSED_SAMPLER", False)
        want = sampling.sample_noisy(logits, do_sample, temperature, top_k, top_p, noise)
        monkeypatch.setattr(sampling, "FUSED_SAMPLER", True)
        mismatches = int((fused != want).sum())
        if bool((top_p == 1).all()):
            assert mismatches == 0
        else:
            assert mismatches <= b // 64
        assert torch.equal(fused[~do_sample], logits[~do_sample].argmax(-1))
    strided = sampling.sample_noisy(logits[:, :2048], do_sample, temperature, top_k, top_p,
                                    torch.stack([noise[:, :2048]] * 2, 1)[:, 1])
    monkeypatch.setattr(sampling, "FUSED_SAMPLER", False)
    assert (strided != sampling.sample_noisy(logits[:, :2048], do_sample, temperature, top_k, top_p,
                                             noise[:, :2048])).sum() <= b // 64
