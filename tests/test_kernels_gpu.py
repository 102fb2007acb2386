"""The CUDA decode path against the reference path: the Triton counter hash is bit-identical to the
torch one, and the CUDA layer path (rope table, GQA-as-query-length decode attention, shared-position
code-predictor steps) computes what the CPU reference computes, in float32."""

from __future__ import annotations

import pytest
import torch

from tests.kv_write_reference import separate_writes
from tests.sampler_edge_rows import edge_rows

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


@pytest.mark.parametrize("vocab", [2048, 3072])
def test_fused_sampler_edge_rows_and_graph_replay(vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ties across the k-th place and at the top-p cut, all-equal, -inf and +-0.0 rows, top-k of 1 and past the
    vocabulary, temperatures, greedy rows: exactly the torch path's token, eager and replayed from a CUDA
    graph captured on other rows (the sampler syncs nothing with the host)."""
    from omniloop.gpu.kernels.sampler import sample_rows
    from omniloop.models.qwen3_tts import sampling

    rows = {name: t.cuda() for name, t in edge_rows(vocab, repeats=8).items()}
    monkeypatch.setattr(sampling, "FUSED_SAMPLER", False)
    want = sampling.sample_noisy(**rows)
    assert torch.equal(sample_rows(**rows), want)
    inputs = {name: torch.zeros_like(t) for name, t in rows.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample_rows(**inputs)
    for name, t in rows.items():
        inputs[name].copy_(t)
    graph.replay()
    assert torch.equal(out, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_add_rms_norm_matches_torch(dtype: torch.dtype) -> None:
    """The sum is torch's ``x + residual`` bit for bit; the norm is ``F.rms_norm`` of that sum: one rounding of
    the same float32 value, so only the mean's summation order differs, which can move a value across a
    rounding boundary: at most one unit in the last place, and rarely."""
    from omniloop.gpu.kernels.add_rms_norm import add_rms_norm

    torch.manual_seed(0)
    for shape in ((64, 1, 2048), (7, 1000), (3, 5, 1024), (2, 8192)):
        h = shape[-1]
        x = torch.randn(shape, device="cuda").to(dtype) * 2
        residual = torch.randn(shape, device="cuda").to(dtype) * 8
        weight = (torch.rand(h, device="cuda") + 0.5).to(dtype)
        normed, new_residual = add_rms_norm(x, residual, weight, 1e-6)
        assert torch.equal(new_residual, x + residual), shape
        want = torch.nn.functional.rms_norm(x + residual, (h,), weight, 1e-6)
        if dtype == torch.float32:
            torch.testing.assert_close(normed, want, rtol=1e-5, atol=1e-5)
            continue
        ulps = (normed.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 1, shape
        assert (normed == want).float().mean().item() > 0.99, shape


@torch.no_grad()
def test_fused_add_norm_stack_matches_the_unfused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 decoder stack with every residual add fused into the next norm gives the unfused stack's output
    for prefill, decode and shared-position (code predictor) calls. Tolerance: the two paths differ only
    where a norm's summation order moves a bf16 value by one unit in the last place (< 1% of values); such
    flips feed the later layers: 2.6e-3 relative measured on this stack with *every* row's rstd moved by one
    float32 ulp (bf16 vs float32 is 5.7e-3), while a norm applied in the wrong place (each norm has its own
    weight here) is off by O(0.1)."""
    from omniloop.gpu.kernels import add_rms_norm as kernel
    from omniloop.models.qwen3_tts import layers
    from omniloop.models.qwen3_tts.config import DecoderConfig

    cfg = DecoderConfig(vocab_size=32, hidden_size=1024, intermediate_size=2048, num_layers=4, num_heads=8,
                        num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=10000.0, mrope_section=None,
                        mrope_interleaved=False, max_position_embeddings=64, attention_bias=False)
    torch.manual_seed(0)
    stack = layers.DecoderStack(cfg, "cuda", torch.bfloat16)
    for module in stack.modules():
        if isinstance(module, layers.RMSNorm):
            module.weight.data = (torch.rand_like(module.weight, dtype=torch.float32) + 0.5).to(torch.bfloat16)
    stack.fuse()
    calls = []
    fused_kernel = kernel.add_rms_norm
    monkeypatch.setattr(kernel, "add_rms_norm", lambda *a: calls.append(1) or fused_kernel(*a))
    b, n, h = 3, 6, cfg.hidden_size
    x = torch.randn(b, n, h, device="cuda", dtype=torch.bfloat16)
    prefill = torch.arange(n, device="cuda").repeat(b, 1)
    calls_of = {  # args after x: positions, slots, kv_len
        "prefill": (x, prefill, None, n),
        "decode": (x[:, :1], torch.tensor([[6], [4], [5]], device="cuda"), None, 7),
        "shared": (x[:, :2], 0, None, 2),
    }
    cache = torch.randn(cfg.num_layers, b, cfg.num_kv_heads, 9, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    for name, (inp, positions, slots, kv_len) in calls_of.items():
        out = {}
        for fused in (True, False):
            monkeypatch.setattr(layers, "FUSED_ADD_NORM", fused)
            calls.clear()
            out[fused] = stack(inp, positions, cache.clone(), cache.clone(), slots, kv_len).float()
            assert len(calls) == (2 * cfg.num_layers if fused else 0), name
        assert out[True].shape == inp.shape
        err = ((out[True] - out[False]).norm() / out[False].norm()).item()
        assert err < 1e-2, (name, err)


@torch.no_grad()
def test_projections_as_partial_sums_match_the_plain_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """``layers.DOWN_PARTS`` / ``O_PARTS``: the output and down projections as float32 partial sums of bf16 inputs
    (``torch.bmm(..., out_dtype=float32)``), summed by the norm kernel, give the plain fused stack's output (they
    skip one bf16 rounding, so not bit for bit) and ``linear_parts`` sums to the float32 product."""
    from omniloop.models.qwen3_tts import layers
    from omniloop.models.qwen3_tts.config import DecoderConfig

    x = torch.randn(64, 3072, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16) / 3072 ** 0.5
    partial = layers.linear_parts(x, w, 4)
    assert partial.shape == (4, 64, 1024) and partial.dtype == torch.float32
    want = x.float() @ w.float().T
    assert ((partial.sum(0) - want).norm() / want.norm()).item() < 1e-5
    cfg = DecoderConfig(vocab_size=32, hidden_size=1024, intermediate_size=3072, num_layers=4, num_heads=16,
                        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=10000.0, mrope_section=None,
                        mrope_interleaved=False, max_position_embeddings=64, attention_bias=False)
    torch.manual_seed(0)
    stack = layers.DecoderStack(cfg, "cuda", torch.bfloat16)
    stack.fuse()
    h = torch.randn(64, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(cfg.num_layers, 64, cfg.num_kv_heads, 20, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    out = {}
    for parts in (0, 4):
        monkeypatch.setattr(layers, "DOWN_PARTS", parts)
        monkeypatch.setattr(layers, "O_PARTS", parts)
        out[parts] = stack(h, 9, cache.clone(), cache.clone(), None, 10).float()
    err = ((out[4] - out[0]).norm() / out[0].norm()).item()
    assert 0 < err < 1e-2, err  # not equal: the partial sums did run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_cache_writes_what_the_separate_writes_write(dtype: torch.dtype) -> None:
    """One launch for q, k and v: q equals ``qk_norm_rope``'s, and both caches equal the slice copy /
    ``index_put_`` result bit for bit, positions not written included (the caches start random)."""
    from omniloop.gpu.kernels.qk_norm_rope import qk_norm_rope_cache

    torch.manual_seed(0)
    dev = "cuda"
    nq, nk, d, num_slots, max_len = 16, 8, 128, 6, 40
    prefill = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, max_len]], device=dev)  # one token on the scratch
    decode = torch.tensor([[4], [max_len], [0], [39]], device=dev)  # row 1 inactive: scratch
    cases = [(64, 1, 9, None), (64, 2, 0, None), (4, 1, decode, None), (4, 1, decode, torch.tensor([5, 0, 2, 3])),
             (2, 5, prefill, torch.tensor([3, 1])), (2, 5, prefill, None)]
    wq, wk = ((torch.rand(d, device=dev) + 0.5).to(dtype) for _ in range(2))
    for b, n, positions, slots in cases:
        slots = None if slots is None else slots.to(dev)
        qkv = torch.randn(b, n, (nq + 2 * nk) * d, device=dev).to(dtype)
        angle = torch.randn(n if isinstance(positions, int) else b * n, d, device=dev)
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
        folded = torch.cat((-sin[:, :d // 2], sin[:, d // 2:]), -1)
        cache = torch.randn(2, max(num_slots, b), nk, max_len + 1, d, device=dev).to(dtype)
        want_k, want_v = cache.clone()
        want_q = separate_writes(qkv, nq, nk, wq, wk, cos, folded, want_k, want_v, positions, slots)
        k_cache, v_cache = cache.clone()
        at = positions if isinstance(positions, int) else positions[:, None]  # the [B, 1, L] view Attention passes
        q = qk_norm_rope_cache(qkv, nq, nk, wq, wk, 1e-6, cos, folded, k_cache, v_cache, at, slots)
        case = (b, n, slots)
        assert torch.equal(q, want_q), case
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), case
        assert int((k_cache != cache[0]).any(-1).sum()) == b * n * nk, case  # every token's keys landed


def _tiny_stack(dtype: torch.dtype):
    from omniloop.models.qwen3_tts.config import DecoderConfig
    from omniloop.models.qwen3_tts.layers import DecoderStack

    cfg = DecoderConfig(vocab_size=32, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8,
                        num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=10000.0, mrope_section=None,
                        mrope_interleaved=False, max_position_embeddings=256, attention_bias=False)
    torch.manual_seed(0)
    stack = DecoderStack(cfg, device="cuda", dtype=dtype)
    with torch.no_grad():
        for p in stack.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1 if p.dim() == 1 else 0))
    stack.fuse()
    return cfg, stack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stack_with_fused_kv_write_equals_the_separate_writes(dtype: torch.dtype,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused decoder stack run twice, once writing the KV cache inside the norm+rope kernel and once with
    torch's separate writes: batched per-row prefill (padding tokens on the scratch position), per-row decode
    with and without slots, and the code predictor's shared-start steps give equal outputs and equal caches
    (the prefill's scratch position aside: several padding tokens race for it on either path). The decode
    attention apart (``FUSED_QKV_ATTENTION`` off): inside it, the new keys are attended from registers, equal
    only to bf16 rounding (``test_stack_with_fresh_decode_attention_matches_the_fused_stack``)."""
    from omniloop.models.qwen3_tts import layers

    monkeypatch.setattr(layers, "FUSED_QKV_ATTENTION", False)
    cfg, stack = _tiny_stack(dtype)
    h, max_len, dev = cfg.hidden_size, 24, "cuda"
    pad = max_len + 3
    prefill_pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, pad, pad], [4, 5, 6, 7, 8, 9, 10]], device=dev)
    decode_pos = torch.tensor([[7], [5], [11], [max_len]], device=dev)
    x_prefill, x_decode = torch.randn(3, 7, h, device=dev).to(dtype), torch.randn(4, 1, h, device=dev).to(dtype)
    x_cp = torch.randn(3, 2, h, device=dev).to(dtype)
    out, caches = {}, {}
    for fused in (True, False):
        monkeypatch.setattr(layers, "FUSED_KV_WRITE", fused)
        shape = (cfg.num_layers, 5, cfg.num_kv_heads, max_len + 1, cfg.head_dim)
        k, v = torch.zeros(shape, device=dev, dtype=dtype), torch.zeros(shape, device=dev, dtype=dtype)
        cp_k, cp_v = (torch.zeros(cfg.num_layers, 3, cfg.num_kv_heads, 4, cfg.head_dim, device=dev, dtype=dtype)
                      for _ in range(2))
        with torch.no_grad():
            out[fused] = [
                stack(x_prefill, prefill_pos, k, v, torch.tensor([2, 0, 3], device=dev), 11),
                stack(x_decode, decode_pos, k, v, None, max_len),
                stack(x_decode[:2], decode_pos[:2] + 1, k, v, torch.tensor([4, 1], device=dev), max_len),
                stack(x_cp, 0, cp_k, cp_v, None, 2),
                stack(x_cp[:, :1], 2, cp_k, cp_v, None, 3),
            ]
        caches[fused] = (k[..., :max_len, :], v[..., :max_len, :], cp_k, cp_v)
    for i, (a, b) in enumerate(zip(out[True], out[False])):
        assert torch.equal(a, b), i
    for i, (a, b) in enumerate(zip(caches[True], caches[False])):
        assert torch.equal(a, b), i
    assert bool(caches[True][0][:, 4, :, 8].any())  # not vacuous: the second decode wrote slot 4 at position 8


@torch.no_grad()
def test_fused_kv_write_replays_in_a_cuda_graph() -> None:
    """The decode step with the fused write captures in a CUDA graph, and a replay reads the positions and
    slots as they are at replay time (no host value baked in): same output and cache as an eager step."""
    cfg, stack = _tiny_stack(torch.bfloat16)
    h, max_len, dev = cfg.hidden_size, 24, "cuda"
    shape = (cfg.num_layers, 4, cfg.num_kv_heads, max_len + 1, cfg.head_dim)
    k, v = torch.randn(shape, device=dev, dtype=torch.bfloat16), torch.randn(shape, device=dev, dtype=torch.bfloat16)
    x = torch.randn(2, 1, h, device=dev, dtype=torch.bfloat16)
    positions, slots = torch.tensor([[3], [5]], device=dev), torch.tensor([1, 2], device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compiles, rope table built) off the capture
        stack(x, positions, k.clone(), v.clone(), slots, max_len)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    k_graph, v_graph = k.clone(), v.clone()
    with torch.cuda.graph(graph):
        hidden = stack(x, positions, k_graph, v_graph, slots, max_len)
    x.copy_(torch.randn_like(x))
    positions.copy_(torch.tensor([[9], [0]], device=dev))
    slots.copy_(torch.tensor([3, 0], device=dev))
    k_graph.copy_(k), v_graph.copy_(v)
    graph.replay()
    k_eager, v_eager = k.clone(), v.clone()
    want = stack(x, positions, k_eager, v_eager, slots, max_len)
    assert torch.equal(hidden, want)
    assert torch.equal(k_graph, k_eager) and torch.equal(v_graph, v_eager)
    assert not torch.equal(k_graph[:, 3, :, 9], k[:, 3, :, 9])  # the replay wrote where the new inputs say


def _masked_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q ``[B, L, Hq, D]``, keys/values ``[B, Hkv, T, D]``, visible bool ``[B, L, T]`` -> ``[B, L, Hq, D]``."""
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), keys, values,
                                                           attn_mask=visible[:, None], enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_matches_sdpa(dtype: torch.dtype) -> None:
    """The decode-attention kernel at the 1.7B's shapes (16 query heads on 8 kv heads of 128) against float32
    SDPA of the same half-precision inputs with the mask it stands for: the talker's decode over a 256-key
    bucket (per-row lengths, rows on the scratch position read the whole bucket, with and without slots), a
    long context, and the code predictor's causal first step and its last step. Its error is at most about
    the error of the half-precision SDPA it replaces (both round the probabilities and the output once)."""
    from omniloop.gpu.kernels.decode_attention import decode_attention

    torch.manual_seed(0)
    dev, nq, nk, d = "cuda", 16, 8, 128
    talker = torch.randn(2, 72, nk, 2049, d, device=dev).to(dtype)
    cp = torch.randn(2, 64, nk, 17, d, device=dev).to(dtype)
    pos = torch.randint(0, 256, (64,), device=dev)
    pos[::7] = 2048  # scratch: inactive or fresh rows
    cases = [  # (B, L, cache, kv_len, positions or None, slots)
        (64, 1, talker, 256, pos, None),
        (64, 1, talker, 256, pos, torch.randperm(72, device=dev)[:64]),
        (4, 1, talker, 2048, torch.tensor([2047, 1000, 5, 2048], device=dev), torch.tensor([70, 3, 9, 0], device=dev)),
        (64, 2, cp, 2, None, None),
        (64, 1, cp, 17, None, None),
    ]
    for b, n, (k_cache, v_cache), kv_len, positions, slots in cases:
        q = torch.randn(b, n, (nq + 2 * nk) * d, device=dev).to(dtype)[..., :nq * d].view(b, n, nq, d)
        rows = torch.arange(b, device=dev) if slots is None else slots
        keys, values = k_cache[rows, :, :kv_len], v_cache[rows, :, :kv_len]
        if positions is None:  # shared length; token l of L sees keys below kv_len - (L - 1 - l)
            limit = kv_len - (n - 1) + torch.arange(n, device=dev)
            visible = (torch.arange(kv_len, device=dev) < limit[:, None]).expand(b, n, kv_len)
        else:
            visible = (torch.arange(kv_len, device=dev) <= positions[:, None])[:, None]
        want = _masked_sdpa(q.float(), keys.float(), values.float(), visible)
        got = decode_attention(q, k_cache, v_cache, kv_len, None if positions is None else positions + 1, slots)
        assert got.dtype == dtype and got.shape == (b, n, nq, d) and got.is_contiguous()
        case = (b, n, kv_len, slots is None)
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2, msg=str(case))
        sdpa_err = (_masked_sdpa(q, keys, values, visible).float() - want).abs().max().item()
        err = (got.float() - want).abs().max().item()
        assert err <= 2 * sdpa_err + 1e-3, (case, err, sdpa_err)


@torch.no_grad()
def test_stack_with_decode_attention_kernel_matches_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 decoder stack with ``FUSED_DECODE_ATTENTION`` on (the Triton kernel for every decode and code-
    predictor attention, no mask built) and off (SDPA): talker decode with and without slots (a row on the
    scratch position among them) and the code predictor's shared-start steps give the same outputs to bf16
    rounding and the same caches bit for bit; a prefill keeps SDPA."""
    from omniloop.gpu.kernels import decode_attention as kernel
    from omniloop.models.qwen3_tts import layers

    cfg, stack = _tiny_stack(torch.bfloat16)
    # the plain decode kernel (the q/k norm+rope and KV write apart): decode_attention_fresh has its own test
    monkeypatch.setattr(layers, "FUSED_QKV_ATTENTION", False)
    calls = []
    fused_kernel = kernel.decode_attention
    monkeypatch.setattr(kernel, "decode_attention", lambda *a: calls.append(1) or fused_kernel(*a))
    h, max_len, dev = cfg.hidden_size, 40, "cuda"
    shape = (cfg.num_layers, 6, cfg.num_kv_heads, max_len + 1, cfg.head_dim)
    k, v = (torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(2))
    cp_k, cp_v = (torch.randn(cfg.num_layers, 4, cfg.num_kv_heads, 17, cfg.head_dim, device=dev,
                              dtype=torch.bfloat16) for _ in range(2))
    decode_pos = torch.tensor([[7], [max_len], [30], [0]], device=dev)
    x = torch.randn(4, 2, h, device=dev, dtype=torch.bfloat16)
    calls_of = {  # name: (x, positions, caches, slots, kv_len, uses the kernel)
        "decode": (x[:, :1], decode_pos, (k, v), None, 32, True),
        "decode slots": (x[:, :1], decode_pos, (k, v), torch.tensor([5, 0, 2, 3], device=dev), 32, True),
        "cp first": (x, 0, (cp_k, cp_v), None, 2, True),
        "cp step": (x[:, :1], 9, (cp_k, cp_v), None, 10, True),
        "prefill": (x, torch.tensor([[3, 4]] * 4, device=dev), (k, v), None, 5, False),
    }
    for name, (inp, positions, (k_cache, v_cache), slots, kv_len, uses_kernel) in calls_of.items():
        out = {}
        for fused in (True, False):
            monkeypatch.setattr(layers, "FUSED_DECODE_ATTENTION", fused)
            calls.clear()
            kc, vc = k_cache.clone(), v_cache.clone()
            out[fused] = (stack(inp, positions, kc, vc, slots, kv_len).float(), kc, vc)
            assert len(calls) == (cfg.num_layers if fused and uses_kernel else 0), name
        assert torch.equal(out[True][1], out[False][1]) and torch.equal(out[True][2], out[False][2]), name
        err = ((out[True][0] - out[False][0]).norm() / out[False][0].norm()).item()
        assert err < 1e-2, (name, err)


@torch.no_grad()
def test_stack_with_fresh_decode_attention_matches_the_fused_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """``FUSED_QKV_ATTENTION`` (``decode_attention_fresh``) on vs off: the bf16 stack's decode-sized calls (talker
    decode with slots and a row parked on the scratch position, the code predictor's steps) take the new
    kernels and match the path they replace to bf16 rounding, caches included (the parked row's output is
    unused: not compared); a prefill keeps the old path."""
    from omniloop.gpu.kernels import decode_attention as attention_kernels
    from omniloop.models.qwen3_tts import layers

    cfg, stack = _tiny_stack(torch.bfloat16)
    runs = []
    real = attention_kernels.decode_attention_fresh
    monkeypatch.setattr(attention_kernels, "decode_attention_fresh", lambda *a: runs.append(1) or real(*a))
    per_call = cfg.num_layers
    h, max_len, dev = cfg.hidden_size, 40, "cuda"
    k, v = (torch.randn(cfg.num_layers, 6, cfg.num_kv_heads, max_len + 1, cfg.head_dim, device=dev,
                        dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(4, 2, h, device=dev, dtype=torch.bfloat16)
    decode_pos = torch.tensor([[7], [max_len], [30], [0]], device=dev)
    calls_of = {  # name: (x, positions, slots, kv_len, decode-sized)
        "decode slots": (x[:, :1], decode_pos, torch.tensor([5, 0, 2, 3], device=dev), 32, True),
        "cp first": (x, 0, None, 2, True),
        "cp step": (x[:, :1], 9, None, 10, True),
        "prefill": (x, torch.tensor([[3, 4]] * 4, device=dev), None, 5, False),
    }
    for name, (inp, positions, slots, kv_len, decode_sized) in calls_of.items():
        out = {}
        for fused in (True, False):
            monkeypatch.setattr(layers, "FUSED_QKV_ATTENTION", fused)
            runs.clear()
            kc, vc = k.clone(), v.clone()
            # the scratch position (max_len) absorbs the parked row's writes: not compared
            out[fused] = (stack(inp, positions, kc, vc, slots, kv_len).float(), kc[..., :max_len, :].float(),
                          vc[..., :max_len, :].float())
            assert len(runs) == (per_call if fused and decode_sized else 0), name
        live = torch.ones(inp.shape[0], dtype=torch.bool, device=dev)
        if isinstance(positions, torch.Tensor) and decode_sized:
            live = positions[:, 0] < kv_len
        out = {f: (o[0][live], *o[1:]) for f, o in out.items()}
        for got, want in zip(out[True], out[False]):
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-2, (name, err)
