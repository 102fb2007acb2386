"""Run by ``test_kernels_interpret.py`` in a subprocess with ``TRITON_INTERPRET=1``: the CUDA path's Triton
kernels, executed by Triton's CPU interpreter, against the torch code they replace. Small shapes: the
interpreter runs each program in numpy."""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from omniloop.gpu.kernels.add_rms_norm import add_rms_norm  # noqa: E402
from omniloop.gpu.kernels.decode_attention import decode_attention  # noqa: E402
from omniloop.gpu.kernels.packed_attention import packed_attention, packed_attention_reference  # noqa: E402
from omniloop.gpu.kernels.qk_norm_rope import norm_rope, qk_norm_rope, qk_norm_rope_cache, rope  # noqa: E402
from omniloop.gpu.kernels.silu_mul import silu_mul  # noqa: E402
from omniloop.gpu.kernels.sampler import sample_rows  # noqa: E402
from omniloop.models.qwen3_tts import layers, sampling  # noqa: E402
from omniloop.models.qwen3_tts.config import DecoderConfig  # noqa: E402
from omniloop.models.qwen3_tts.layers import DecoderStack, RMSNorm  # noqa: E402
from omniloop.models.qwen3_tts.rope import rotate_half  # noqa: E402
from omniloop.models.qwen3_tts.speech_config import DecoderConfig as CodecDecoderConfig  # noqa: E402
from omniloop.models.qwen3_tts.speech_decoder import _Transformer  # noqa: E402
from omniloop.models.qwen3_tts.speech_layers import SnakeBeta, apply_rope, new_frames, snake_layout  # noqa: E402
from tests.kv_write_reference import separate_writes  # noqa: E402
from tests.sampler_edge_rows import edge_rows  # noqa: E402


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


def check_sampler_edges() -> None:
    """Ties across the k-th place and at the top-p cut, all-equal rows, -inf rows, +-0.0, top-k of 1 and past
    the vocabulary, temperatures, greedy rows, a vocabulary of no power of two: the exact torch token."""
    sampling.FUSED_SAMPLER = False
    for vocab in (37, 300):
        rows = edge_rows(vocab)
        got = sample_rows(**rows)
        assert torch.equal(got, sampling.sample_noisy(**rows)), vocab
        greedy = ~rows["do_sample"]
        assert torch.equal(got[greedy], rows["logits"][greedy].argmax(-1))


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
        want = normed * c + rotate_half(normed) * s
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        single = norm_rope(x.contiguous(), w, 1e-6, cos, folded)
        assert torch.equal(single, got)


def check_rope() -> None:
    """``rope`` (no norm) is the codec's ``apply_rope`` in float32 math; rows of cos/sin per token."""
    torch.manual_seed(11)
    for b, n, heads, d in ((2, 3, 4, 16), (3, 200, 2, 8)):  # 600 tokens: the block-of-16 grid
        x = torch.randn(b, n, heads, d)
        cos, sin = torch.rand(b, n, d), torch.rand(b, n, d)
        folded = torch.cat((-sin[..., :d // 2], sin[..., d // 2:]), -1).reshape(b * n, d)
        got = rope(x, cos.reshape(b * n, d), folded)
        want = apply_rope(x.transpose(1, 2), cos, sin)
        assert got.shape == (b, heads, n, d) and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def check_norm_rope_blocks() -> None:
    """Calls of >= BLOCK_FROM tokens (blocks of tokens per program) compute what one token per program does."""
    torch.manual_seed(3)
    nq, nk, d = 2, 1, 16
    qkv = torch.randn(3, 175, (nq + 2 * nk) * d)  # 525 tokens: blocks, the last one part-empty
    wq, wk = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    angle = torch.randn(3 * 175, d)
    cos, sin = angle.cos(), angle.sin()
    folded = torch.cat((-sin[:, :d // 2], sin[:, d // 2:]), -1)
    q, k = qk_norm_rope(qkv, nq, nk, wq, wk, 1e-6, cos, folded)
    for i in range(0, 3):  # one row (175 tokens) at a time: one token per program
        qi, ki = qk_norm_rope(qkv[i:i + 1].contiguous(), nq, nk, wq, wk, 1e-6, cos[i * 175:(i + 1) * 175],
                              folded[i * 175:(i + 1) * 175])
        torch.testing.assert_close(q[i:i + 1], qi, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(k[i:i + 1], ki, rtol=1e-6, atol=1e-6)


def check_prefix_attention() -> None:
    """A whole-prompt prefill (``prefix``: every row from position 0, right-padded) attends its own keys
    causally; it must give the masked attention over the cache for every real token, and write the same cache,
    with the one-launch cache write on and off."""
    cfg = DecoderConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, mrope_section=None,
                        mrope_interleaved=False, max_position_embeddings=64, attention_bias=False)
    torch.manual_seed(9)
    max_len, n = 12, 6
    lens = [6, 4, 1]
    positions = torch.tensor([[i if i < m else max_len for i in range(n)] for m in lens])
    slots = torch.tensor([2, 0, 3])
    stack = DecoderStack(cfg)
    for p in stack.parameters():
        p.data = torch.randn(p.shape) * (0.2 if p.dim() > 1 else 1) + (1 if p.dim() == 1 else 0)
    stack.fuse()
    attn = stack.layers[0].self_attn
    cos_table, _, folded_table = stack.rope.table(max_len + 1, torch.float32)
    at = positions.clamp(max=max_len).reshape(-1)
    x = torch.randn(3, n, cfg.hidden_size)
    cache = torch.randn(2, 4, cfg.num_kv_heads, max_len + 1, cfg.head_dim)
    for fused in (True, False):
        layers.FUSED_KV_WRITE = fused
        out = {}
        for prefix in (True, False):
            step = stack._step(x, positions, cache[0], slots, n, prefix)
            step = dataclasses.replace(step, rows=(cos_table[at], folded_table[at]))
            assert (step.mask is None) is prefix
            k_cache, v_cache = cache.clone()
            with torch.no_grad():
                out[prefix] = (attn(x, k_cache, v_cache, step), k_cache, v_cache)
        for row, m in enumerate(lens):
            torch.testing.assert_close(out[True][0][row, :m], out[False][0][row, :m], rtol=1e-5, atol=1e-5)
        assert torch.equal(out[True][1][:, :max_len], out[False][1][:, :max_len])
        assert torch.equal(out[True][2][:, :max_len], out[False][2][:, :max_len])
    layers.FUSED_KV_WRITE = True


def check_silu_mul() -> None:
    torch.manual_seed(2)
    gate_up = torch.randn(5, 2 * 1500) * 3  # 1500: more than one block, not a multiple of it
    want = torch.nn.functional.silu(gate_up[:, :1500]) * gate_up[:, 1500:]
    torch.testing.assert_close(silu_mul(gate_up), want, rtol=1e-5, atol=1e-5)


def check_norm_rope_cache() -> None:
    """q equals ``qk_norm_rope``'s and the caches equal the separate writes' bit for bit, everything not
    written included (the caches start random), for a shared start and per-row positions, with and without
    slots, padding tokens on the scratch position among them."""
    torch.manual_seed(6)
    nq, nk, d, num_slots, max_len = 4, 2, 16, 5, 8
    wide = torch.tensor([[0, 1, 2, 3], [5, 6, 7, max_len]])  # prefill: row 1 ends on the scratch position
    cases = [  # (B, L, positions, slots)
        (3, 1, 5, None),  # code predictor decode step
        (2, 3, 0, None),  # code predictor first step
        (3, 1, torch.tensor([[4], [max_len], [0]]), None),  # talker decode: row 1 inactive (scratch)
        (3, 1, torch.tensor([[4], [max_len], [0]]), torch.tensor([4, 0, 2])),
        (2, 4, wide, torch.tensor([3, 1])),  # batched prefill
        (2, 4, wide, None),
        (2, 4, wide[:, None], torch.tensor([3, 1])),  # the [B, 1, L] view Attention passes (s.index[2])
        # a prefill of >= BLOCK_FROM tokens: programs take blocks of tokens, the last block part-empty
        (4, 131, torch.arange(131).repeat(4, 1).masked_fill(torch.arange(131) >= 120, max_len) % (max_len + 1),
         torch.tensor([4, 0, 2, 3])),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        wq, wk = ((torch.rand(d) + 0.5).to(dtype) for _ in range(2))
        for b, n, positions, slots in cases:
            qkv = torch.randn(b, n, (nq + 2 * nk) * d).to(dtype)
            rows = n if isinstance(positions, int) else b * n  # shared positions: one rope row per position
            angle = torch.randn(rows, d)
            cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
            folded = torch.cat((-sin[:, :d // 2], sin[:, d // 2:]), -1)
            cache = torch.randn(2, num_slots, nk, max_len + 1, d).to(dtype)
            want_k, want_v = cache.clone()
            per_row = positions if isinstance(positions, int) else positions.reshape(b, n)
            want_q = separate_writes(qkv, nq, nk, wq, wk, cos, folded, want_k, want_v, per_row, slots)
            k_cache, v_cache = cache.clone()
            q = qk_norm_rope_cache(qkv, nq, nk, wq, wk, 1e-6, cos, folded, k_cache, v_cache, positions, slots)
            case = (dtype, b, n, slots)
            assert torch.equal(q, want_q), case
            assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), case
            if b * n < 512:
                written = int((k_cache != cache[0]).any(-1).sum())
                assert written == b * n * nk, (case, written)  # not vacuous: every token's keys landed
            # keep_keys: the same writes, and the keys returned after the queries are qk_norm_rope's
            k_cache, v_cache = cache.clone()
            qk = qk_norm_rope_cache(qkv, nq, nk, wq, wk, 1e-6, cos, folded, k_cache, v_cache, positions, slots,
                                    keep_keys=True)
            _, want_keys = qk_norm_rope(qkv, nq, nk, wq, wk, 1e-6, cos, folded)
            assert torch.equal(qk[:, :, :nq], want_q) and torch.equal(qk[:, :, nq:], want_keys), case
            assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), case
    check_scratch_collisions()


def check_scratch_collisions() -> None:
    """Several padding tokens of a row all land on its scratch position: every real position equals the
    separate writes, the scratch holds one of those tokens (which one is unordered, as with index_put_), and
    a position outside the cache is dropped rather than written elsewhere."""
    torch.manual_seed(7)
    nq, nk, d, max_len = 2, 2, 16, 6
    b, n = 2, 4
    positions = torch.tensor([[2, 3, max_len, max_len], [0, 1, 2, 3]])
    qkv = torch.randn(b, n, (nq + 2 * nk) * d)
    wq, wk = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    angle = torch.randn(b * n, d)
    cos, sin = angle.cos(), angle.sin()
    folded = torch.cat((-sin[:, :d // 2], sin[:, d // 2:]), -1)
    slots = torch.tensor([1, 0])
    cache = torch.randn(2, 3, nk, max_len + 1, d)
    want_k, want_v = cache.clone()
    separate_writes(qkv, nq, nk, wq, wk, cos, folded, want_k, want_v, positions, slots)
    k_cache, v_cache = cache.clone()
    qk_norm_rope_cache(qkv, nq, nk, wq, wk, 1e-6, cos, folded, k_cache, v_cache, positions, slots)
    assert torch.equal(k_cache[..., :max_len, :], want_k[..., :max_len, :])
    assert torch.equal(v_cache[..., :max_len, :], want_v[..., :max_len, :])
    _, k = qk_norm_rope(qkv, nq, nk, wq, wk, 1e-6, cos, folded)
    v = qkv[..., (nq + nk) * d:].view(b, n, nk, d)
    for got, tokens in ((k_cache[1, :, max_len], k[0, 2:]), (v_cache[1, :, max_len], v[0, 2:])):
        for h in range(nk):
            assert any(torch.equal(got[h], t[h]) for t in tokens), h
    assert torch.equal(k_cache[[0, 2], :, max_len], cache[0][[0, 2], :, max_len])  # other slots' scratch kept
    outside = torch.tensor([[0, max_len + 1, 50, -1], [1, 2, 3, 4]])
    k_cache, v_cache = cache.clone()
    qk_norm_rope_cache(qkv, nq, nk, wq, wk, 1e-6, cos, folded, k_cache, v_cache, outside, slots)
    changed = (k_cache != cache[0]).any(-1) | (v_cache != cache[1]).any(-1)
    assert int(changed.sum()) == 5 * nk, int(changed.sum())  # the 5 positions inside, each kv head
    assert bool(changed[1, :, 0].all()) and bool(changed[0, :, 1:5].all())


def check_attention_writes_kv() -> None:
    """``Attention.forward`` on the fused path with ``FUSED_KV_WRITE`` on (one launch writes the cache) and
    off (``qk_norm_rope`` then torch's writes): equal outputs and equal caches, for the code predictor's shared
    start, the talker's per-row decode (with and without slots) and a batched per-row prefill. The step is the
    stack's own ``_step``; only the CUDA-only rope rows are added here, so the Triton kernels run on CPU."""
    cfg = DecoderConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, mrope_section=None,
                        mrope_interleaved=False, max_position_embeddings=64, attention_bias=True)
    torch.manual_seed(8)
    max_len = 8
    wide = torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, max_len + 3]])  # padding token: beyond max_len
    cases = [  # (B, L, positions, slots, kv_len)
        (3, 2, 0, None, 2),
        (3, 1, 2, None, 3),
        (3, 1, torch.tensor([[4], [max_len], [1]]), None, max_len),
        (3, 1, torch.tensor([[4], [max_len], [1]]), torch.tensor([2, 0, 3]), max_len),
        (2, 5, wide, torch.tensor([1, 3]), 7),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        stack = DecoderStack(cfg, dtype=dtype)
        for p in stack.parameters():
            p.data = torch.randn(p.shape).to(dtype) * (0.2 if p.dim() > 1 else 1) + (1 if p.dim() == 1 else 0)
        stack.fuse()
        attn = stack.layers[0].self_attn
        cos_table, _, folded_table = stack.rope.table(max_len + 1, dtype)
        for b, n, positions, slots, kv_len in cases:
            x = torch.randn(b, n, cfg.hidden_size).to(dtype)
            cache = torch.randn(2, 1, 4, cfg.num_kv_heads, max_len + 1, cfg.head_dim).to(dtype)
            step = stack._step(x, positions, cache[0], slots, kv_len)
            at = (torch.arange(positions, positions + n) if isinstance(positions, int)
                  else positions.clamp(max=max_len).reshape(-1))
            step = dataclasses.replace(step, rows=(cos_table[at], folded_table[at]))
            out = {}
            for fused in (True, False):
                layers.FUSED_KV_WRITE = fused
                k_cache, v_cache = cache.clone()
                with torch.no_grad():
                    out[fused] = (attn(x, k_cache[0], v_cache[0], step), k_cache, v_cache)
            layers.FUSED_KV_WRITE = True
            case = (dtype, b, n, slots)
            assert all(torch.equal(a, c) for a, c in zip(out[True], out[False])), case
            assert not torch.equal(out[True][1], cache[0]), case


def check_decode_attention() -> None:
    """The decode-attention kernel against SDPA with the mask it stands for, in float32: the talker's decode (one
    token per row, key <= position, a row parked on the scratch position past the bucket reads the whole bucket)
    through slots and with row = slot, over several key blocks; the code predictor's shared length with two causal
    tokens and with one. Queries are a strided view of fused QKV rows, as the unfused-write path passes them."""
    torch.manual_seed(9)
    nq, nk, d, num_slots, max_len = 4, 2, 16, 5, 150
    k_cache, v_cache = torch.randn(2, num_slots, nk, max_len + 1, d)
    positions = torch.tensor([4, max_len, 0, 130])  # row 1: scratch (inactive or fresh)
    cases = [  # (L, kv_len, positions, slots)
        (1, 140, positions, None),  # 140 keys: several blocks (of 32 or 64 keys), the last partial
        (1, 140, positions, torch.tensor([3, 0, 4, 1])),
        (1, 9, positions.clamp(max=8), torch.tensor([2, 2, 0, 1])),  # a slot read by two rows
        (2, 2, None, None),  # code predictor, first step: causal
        (1, 17, None, None),  # code predictor, last step
    ]
    import omniloop.gpu.kernels.decode_attention as da

    saved = da.BLOCK_N_MAX
    try:
        for block in (32, 64):  # the launch's two block sizes (_block_n: many programs / few)
            da.BLOCK_N_MAX = block
            _check_decode_cases(cases, k_cache, v_cache, nq, nk, d)
    finally:
        da.BLOCK_N_MAX = saved
    check_attention_decode_kernel()


def _check_decode_cases(cases: list, k_cache: torch.Tensor, v_cache: torch.Tensor, nq: int, nk: int, d: int) -> None:
    for n, kv_len, pos, slots in cases:
        b = 4
        q = torch.randn(b, n, (nq + 2 * nk) * d)[..., :nq * d].view(b, n, nq, d)
        rows = torch.arange(b) if slots is None else slots
        keys, values = k_cache[rows, :, :kv_len], v_cache[rows, :, :kv_len]
        if pos is None:
            want = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=n > 1, enable_gqa=True)
        else:
            mask = torch.arange(kv_len)[None, None, None, :] <= pos[:, None, None, None]
            want = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
        got = decode_attention(q, k_cache, v_cache, kv_len, None if pos is None else pos + 1, slots)
        assert got.shape == (b, n, nq, d) and got.is_contiguous()
        torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-5, msg=str((n, kv_len, slots)))


def check_attention_decode_kernel() -> None:
    """``Attention.forward`` through the decode kernel (``StackStep.decode_lengths`` set as ``_step`` sets it on
    CUDA in half precision) equals its SDPA path: talker decode with and without slots, a scratch row among
    them, and the code predictor's shared-start steps. float32 here (the step is the CPU one, plus the rope rows
    and lengths), so the comparison is to rounding."""
    cfg = DecoderConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, mrope_section=None,
                        mrope_interleaved=False, max_position_embeddings=64, attention_bias=False)
    torch.manual_seed(10)
    max_len = 12
    stack = DecoderStack(cfg)
    stack.fuse()
    attn = stack.layers[0].self_attn
    cos_table, _, folded_table = stack.rope.table(max_len + 1, torch.float32)
    decode = torch.tensor([[4], [max_len], [0]])
    cases = [(2, 0, None, 2), (1, 2, None, 3), (1, decode, None, 8), (1, decode, torch.tensor([2, 0, 3]), 8)]
    for n, positions, slots, kv_len in cases:
        x = torch.randn(3, n, cfg.hidden_size)
        cache = torch.randn(2, 1, 4, cfg.num_kv_heads, max_len + 1, cfg.head_dim)
        step = stack._step(x, positions, cache[0], slots, kv_len)
        at = (torch.arange(positions, positions + n) if isinstance(positions, int)
              else positions.clamp(max=max_len).reshape(-1))
        step = dataclasses.replace(step, rows=(cos_table[at], folded_table[at]))
        lengths = kv_len if isinstance(positions, int) else positions[:, 0] + 1
        out = []
        for s in (step, dataclasses.replace(step, decode_lengths=lengths, mask=None)):
            k_cache, v_cache = cache.clone()
            with torch.no_grad():
                out.append(attn(x, k_cache[0], v_cache[0], s))
        # a row parked on the scratch position (past kv_len): its output is unused, and with the q/k norm+rope
        # inside the kernel (FUSED_QKV_ATTENTION) it also attends its own new key there, which SDPA does not see
        live = positions[:, 0] < kv_len if isinstance(positions, torch.Tensor) else slice(None)
        torch.testing.assert_close(out[1][live], out[0][live], rtol=1e-5, atol=1e-5, msg=str((n, slots)))


MAX_LEN = 12  # cache positions of the decode checks (+1 scratch)


def _decode_stack(hidden: int, num_layers: int, seed: int) -> tuple[DecoderConfig, DecoderStack]:
    """A small stack whose norms each have their own weight (a norm applied in the wrong place shows)."""
    cfg = DecoderConfig(vocab_size=32, hidden_size=hidden, intermediate_size=96, num_layers=num_layers, num_heads=4,
                        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, mrope_section=None,
                        mrope_interleaved=False, max_position_embeddings=64, attention_bias=False)
    torch.manual_seed(seed)
    stack = DecoderStack(cfg)
    for norm in (m for m in stack.modules() if isinstance(m, RMSNorm)):
        norm.weight.data = torch.rand(norm.weight.shape[0]) + 0.5
    return cfg, stack


def _decode_cases() -> list[tuple]:
    """(tokens, positions, slots, kv_len): the code predictor's first step (two tokens) and a later one, the
    talker's decode without and with slots, a row parked on the scratch position among them."""
    decode = torch.tensor([[4], [MAX_LEN], [0]])
    return [(2, 0, None, 2), (1, 2, None, 3), (1, decode, None, 8), (1, decode, torch.tensor([2, 0, 3]), 8)]


def _kernel_step(stack: DecoderStack, x: torch.Tensor, positions, slots, kv_len: int,  # noqa: ANN001
                 cache_layer: torch.Tensor) -> "layers.StackStep":
    """``_step`` as CUDA builds it in half precision: rope rows and decode lengths set (no mask)."""
    n = x.shape[1]
    cos_table, _, folded_table = stack.rope.table(MAX_LEN + 1, x.dtype)
    step = stack._step(x, positions, cache_layer, slots, kv_len)
    at = (torch.arange(positions, positions + n) if isinstance(positions, int)
          else positions.clamp(max=MAX_LEN).reshape(-1))
    lengths = kv_len if isinstance(positions, int) else positions[:, 0] + 1
    return dataclasses.replace(step, rows=(cos_table[at], folded_table[at]), decode_lengths=lengths, mask=None)


def _live(positions, kv_len: int) -> torch.Tensor:  # noqa: ANN001
    """Rows whose output is used: not parked past the bucket."""
    return torch.ones(3, dtype=torch.bool) if isinstance(positions, int) else positions[:, 0] < kv_len


def check_fresh_attention() -> None:
    """``FUSED_QKV_ATTENTION``: the decode kernel that also normalizes, rotates and stores the new keys
    (``decode_attention_fresh``) gives ``Attention.forward``'s output and caches of the two-launch path
    (``qk_norm_rope_cache`` + ``decode_attention``) in every ``_decode_cases`` case; float32 to rounding,
    float16 to its rounding. Cache positions the step does not write stay untouched."""
    cfg, stack = _decode_stack(64, 1, 14)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        stack.to(dtype)
        stack.fuse()
        attn = stack.layers[0].self_attn
        for n, positions, slots, kv_len in _decode_cases():
            x = torch.randn(3, n, cfg.hidden_size).to(dtype)
            cache = torch.randn(2, 1, 4, cfg.num_kv_heads, MAX_LEN + 1, cfg.head_dim).to(dtype)
            step = _kernel_step(stack, x, positions, slots, kv_len, cache[0])
            out, default = {}, layers.FUSED_QKV_ATTENTION
            for fresh in (False, True):
                layers.FUSED_QKV_ATTENTION = fresh
                k_cache, v_cache = cache.clone()
                with torch.no_grad():
                    out[fresh] = (attn(x, k_cache[0], v_cache[0], step).float(), k_cache.float(), v_cache.float())
            layers.FUSED_QKV_ATTENTION = default
            # a row parked on the scratch position (past the bucket) writes there and its output is never
            # used: the two-launch path attends the bucket, this one the bucket's first keys and its new one
            live = _live(positions, kv_len)
            torch.testing.assert_close(out[True][0][live], out[False][0][live], rtol=tol, atol=tol,
                                       msg=str((dtype, n, slots)))
            for got, want in zip(out[True][1:], out[False][1:]):
                torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=str((dtype, n, slots)))
            assert not torch.equal(out[True][1], cache.float()), (dtype, n)  # the new keys were written


def check_packed_attention() -> None:
    """Packed causal attention: prompts of 5, 70 (straddling query blocks), 1, 30 and 64 tokens and 22 padding
    tokens laid end to end, GQA, rows strided as in the projection's output; equals the dense-mask reference
    and each prompt's own causal attention (float32 to rounding, float16 to its rounding)."""
    torch.manual_seed(15)
    lens, pad = [5, 70, 1, 30, 64], 22
    starts, offset = [], 0
    for n in lens:
        starts += [offset] * n
        offset += n
    p = offset + pad
    seq_start = torch.tensor(starts + list(range(offset, p)))
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        qkv = torch.randn(p, (4 + 2 * 2) * 16).to(dtype)
        q, k, v = qkv[:, :64].view(p, 4, 16), qkv[:, 64:96].view(p, 2, 16), qkv[:, 96:].view(p, 2, 16)
        got = packed_attention(q, k, v, seq_start)
        want = packed_attention_reference(q.float(), k.float(), v.float(), seq_start)
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
        offset = 0
        for n in lens:
            alone = F.scaled_dot_product_attention(*(t[offset:offset + n].float().transpose(0, 1) for t in (q, k, v)),
                                                   is_causal=True, enable_gqa=True).transpose(0, 1)
            torch.testing.assert_close(got[offset:offset + n].float(), alone, rtol=tol, atol=tol, msg=str(n))
            offset += n


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units of the last place between two same-signed bf16 tensors."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def to_dtype(t: torch.Tensor, dtype: torch.dtype, truncate: bool) -> torch.Tensor:
    """float32 -> dtype, rounded to nearest even (torch; Triton on a GPU) or, for bf16, truncated: the
    interpreter's float32 -> bf16 cast drops the low bits instead of rounding."""
    if truncate and dtype == torch.bfloat16:
        return (t.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # low 16 bits zero: exact
    return t.to(dtype)


def check_add_rms_norm() -> None:
    """Sum: float32, rounded once. Norm: float32 statistics of the rounded sum as stored, times the weight,
    rounded once; at most one unit in the last place from the formula (the mean's summation order) and
    almost always equal. In bf16 "rounded" is whatever the interpreter's cast does (see ``to_dtype``),
    the same cast for both outputs; the GPU test checks round-to-nearest against torch."""
    torch.manual_seed(4)
    eps = 1e-6
    for shape in ((5, 64), (3, 1000), (2, 3, 2048)):  # 1000: pads to 1024; 3-D: rows are the leading dims
        h = shape[-1]
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(*shape[:-1], 2 * h) * 2).to(dtype)[..., :h]  # rows strided, as a slice
            residual = (torch.randn(shape) * 8).to(dtype)
            weight = (torch.rand(h) + 0.5).to(dtype)
            normed, new_residual = add_rms_norm(x, residual, weight, eps)
            assert normed.shape == new_residual.shape == shape and normed.dtype == dtype
            truncate = not torch.equal(new_residual, x + residual)
            assert torch.equal(new_residual, to_dtype(x.float() + residual.float(), dtype, truncate)), (shape, dtype)
            s = new_residual.float()
            want = to_dtype(s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.float(), dtype, truncate)
            if dtype == torch.float32:
                torch.testing.assert_close(normed, want, rtol=1e-6, atol=1e-6)
            else:
                assert int(ulps(normed, want).max()) <= 1, (shape, dtype)
                assert (normed == want).float().mean().item() > 0.99, (shape, dtype)
            torch.testing.assert_close(normed, torch.nn.functional.rms_norm(x + residual, (h,), weight, eps),
                                       rtol=2e-2, atol=2e-2)


def check_add_rms_norm_scaled() -> None:
    """With a per-channel ``scale`` the sum is ``x * scale + residual`` in float32, rounded once."""
    torch.manual_seed(12)
    x, residual = torch.randn(4, 96), torch.randn(4, 96) * 4
    weight, scale = torch.rand(96) + 0.5, torch.randn(96) * 0.1
    normed, new_residual = add_rms_norm(x, residual, weight, 1e-6, scale=scale)
    torch.testing.assert_close(new_residual, x * scale + residual, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(normed, F.rms_norm(x * scale + residual, (96,), weight, 1e-6), rtol=1e-5, atol=1e-5)
    plain, _ = add_rms_norm(x, residual, weight, 1e-6)
    assert not torch.allclose(plain, normed)  # the scale is applied, not ignored


def check_add_rms_norm_parts() -> None:
    """x as float32 partial sums ``[P, ..., H]`` of one product: the kernel adds them in order, then the residual,
    and rounds once; the norm as always. Bit for bit against the same sums in torch (float32 addition in the
    same order), bf16 and float32 outputs."""
    torch.manual_seed(14)
    eps = 1e-6
    for dtype in (torch.bfloat16, torch.float32):
        parts = torch.randn(3, 2, 5, 96) * 3
        residual = (torch.randn(2, 5, 96) * 8).to(dtype)
        weight = (torch.rand(96) + 0.5).to(dtype)
        normed, new_residual = add_rms_norm(parts, residual, weight, eps)
        assert normed.shape == new_residual.shape == residual.shape and normed.dtype == dtype
        total = parts[0] + parts[1] + parts[2] + residual.float()
        truncate = not torch.equal(new_residual, total.to(dtype))
        assert torch.equal(new_residual, to_dtype(total, dtype, truncate)), dtype
        s = new_residual.float()
        want = to_dtype(s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.float(), dtype, truncate)
        if dtype == torch.float32:  # the mean's summation order: a few units in the last place
            torch.testing.assert_close(normed, want, rtol=1e-6, atol=1e-6)
        else:
            assert int(ulps(normed, want).max()) <= 1, dtype
    for bad in (torch.randn(3, 5, 96).to(torch.bfloat16), torch.randn(3, 4, 96)):  # not float32; wrong rows
        try:
            add_rms_norm(bad, torch.randn(5, 96), torch.ones(96), eps)
        except ValueError:
            continue
        raise AssertionError(f"partial sums {tuple(bad.shape)} {bad.dtype} were accepted")


def check_codec_transformer() -> None:
    """The codec decoder's sliding-window transformer through the Triton kernels (``_forward_fused``) computes
    its torch forward: outputs and the new KV caches, float32 to rounding, bf16 to a few units in the last
    place. Norm weights and layer scales are random, so one applied in the wrong place cannot pass."""
    cfg = CodecDecoderConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
                             num_hidden_layers=3, sliding_window=6, latent_dim=24, codebook_dim=8)
    torch.manual_seed(13)
    tr = _Transformer(cfg)
    for name, p in tr.named_parameters():
        if "norm" in name or "layer_scale" in name:
            p.data = torch.rand(p.shape) + 0.5 if "norm" in name else torch.randn(p.shape) * 0.3
    b, n, w = 3, 4, tr.cache_len
    x = torch.randn(b, n, cfg.latent_dim)
    pos, lens = torch.tensor([0, 3, 9]), torch.tensor([4, 2, 4])
    caches = [torch.randn(b, cfg.num_key_value_heads, w, cfg.attn_head_dim) for _ in range(2 * cfg.num_hidden_layers)]
    for dtype, rel in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        tr.to(dtype)
        with torch.no_grad():
            want, want_caches = tr(x.to(dtype), pos, lens, [c.to(dtype) for c in caches], fused=False)
            got, got_caches = tr(x.to(dtype), pos, lens, [c.to(dtype) for c in caches], fused=True)
        for g, wnt in zip([got, *got_caches], [want, *want_caches]):
            err = (g.float() - wnt.float()).norm() / wnt.float().norm()
            assert g.shape == wnt.shape and err < rel, (dtype, float(err))


def check_fused_stack() -> None:
    """The decoder stack carrying (normalized hidden, residual) with every add fused into the next norm
    computes the stack's unfused forward: float32 to rounding, bf16 to a few units in the last place.
    Every norm has its own weight, so a norm applied in the wrong place cannot pass."""
    cfg = DecoderConfig(vocab_size=32, hidden_size=48, intermediate_size=96, num_layers=3, num_heads=4,
                        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, mrope_section=None,
                        mrope_interleaved=False, max_position_embeddings=64, attention_bias=False)
    torch.manual_seed(5)
    stack = DecoderStack(cfg)
    norms = [m for m in stack.modules() if isinstance(m, RMSNorm) and m.weight.shape[0] == cfg.hidden_size]
    assert len(norms) == 2 * cfg.num_layers + 1
    for norm in norms:
        norm.weight.data = torch.rand(cfg.hidden_size) + 0.5
    b, n = 2, 5
    x = torch.randn(b, n, cfg.hidden_size)
    for dtype, rel in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        stack.to(dtype)
        cache = torch.zeros(cfg.num_layers, b, cfg.num_kv_heads, 9, cfg.head_dim, dtype=dtype)
        saved = layers.DOWN_PARTS, layers.O_PARTS
        layers.DOWN_PARTS = layers.O_PARTS = 0  # the plain projections first
        try:
            with torch.no_grad():
                want = stack(x.to(dtype), 0, cache.clone(), cache.clone(), None, n)
                k_cache, v_cache = cache.clone(), cache.clone()
                step = stack._step(x.to(dtype), 0, k_cache, None, n)
                got = stack._forward_fused(x.to(dtype), k_cache, v_cache, step)
        finally:
            layers.DOWN_PARTS, layers.O_PARTS = saved
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert got.shape == want.shape and err < rel, (dtype, float(err))
        # the output and down projections as float32 partial sums that the norms sum (DOWN_PARTS, O_PARTS)
        calls = []
        plain = layers.linear_parts

        def counted(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
            calls.append(parts)
            return plain(x, weight, parts)

        saved = layers.DOWN_PARTS, layers.O_PARTS, layers.linear_parts
        layers.DOWN_PARTS, layers.O_PARTS, layers.linear_parts = 2, 4, counted
        try:
            k_cache, v_cache = cache.clone(), cache.clone()
            with torch.no_grad():
                got = stack._forward_fused(x.to(dtype), k_cache, v_cache, step)
        finally:
            layers.DOWN_PARTS, layers.O_PARTS, layers.linear_parts = saved
        assert sorted(calls) == [2] * cfg.num_layers + [4] * cfg.num_layers, calls
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert got.shape == want.shape and err < rel, ("parts", dtype, float(err))


def check_fresh_attention_stack() -> None:
    """``DecoderStack._forward_fused`` with the decode attention kernels as on CUDA, the q/k norm+rope and KV
    write apart or inside the attention (``FUSED_QKV_ATTENTION``), computes the reference forward and writes
    the same cache: the code predictor's steps (shared start, one or two tokens) and the talker's
    decode (per-row positions and slots, a scratch row among them). float32 to rounding, float16 to a few
    units in the last place."""
    cfg, stack = _decode_stack(48, 2, 13)
    for dtype, rel in ((torch.float32, 1e-5), (torch.float16, 1e-2)):
        stack.to(dtype)
        stack.fuse()  # after the cast: fused weights are views of the parameters as they are now
        for n, positions, slots, kv_len in _decode_cases():
            x = torch.randn(3, n, cfg.hidden_size).to(dtype)
            cache = torch.randn(2, cfg.num_layers, 4, cfg.num_kv_heads, MAX_LEN + 1, cfg.head_dim).to(dtype)
            with torch.no_grad():
                want_k, want_v = cache.clone()
                want = stack(x, positions, want_k, want_v, slots, kv_len)
                step = _kernel_step(stack, x, positions, slots, kv_len, cache[0])
            # with FUSED_QKV_ATTENTION too; a row parked past the bucket has an unused output there (not compared)
            live = _live(positions, kv_len)
            default = layers.FUSED_QKV_ATTENTION
            for fresh in (False, True):
                layers.FUSED_QKV_ATTENTION = fresh
                k_cache, v_cache = cache.clone()
                with torch.no_grad():
                    got = stack._forward_fused(x, k_cache, v_cache, step)
                layers.FUSED_QKV_ATTENTION = default
                assert got.shape == want.shape, (dtype, n, fresh)
                err = (got[live].float() - want[live].float()).norm() / want[live].float().norm()
                assert err < rel, (dtype, n, fresh, float(err))
                for have, ref in ((k_cache, want_k), (v_cache, want_v)):  # the scratch position absorbs garbage
                    have, ref = have[..., :MAX_LEN, :].float(), ref[..., :MAX_LEN, :].float()
                    kv_err = (have - ref).norm() / ref.norm()
                    assert kv_err < rel, (dtype, n, fresh, float(kv_err))


def check_snake() -> None:
    """SnakeBeta's kernel in both layouts: NCL ([B, C, T], contiguous along T) and channels-last ([B, C, T]
    stored [B, T, C], as the CUDA decoder keeps its activations), read from a strided slice (a transposed
    conv's trimmed output) and written into the chunk part of a conv's [tail, chunk] buffer."""
    torch.manual_seed(6)
    b, c, n, p = 2, 24, 100, 6  # channels-last rows of 2,400 values: two blocks, the last one partial
    act = SnakeBeta(c)
    act.alpha.data.normal_(0, 0.3)
    act.beta.data.normal_(0, 0.3)
    alpha, beta = act.alpha.exp()[None, :, None], act.beta.exp()[None, :, None]
    for channels_last in (True, False):
        for bias in (None, torch.randn(c)):  # a conv's bias added inside the kernel (ResidualUnit)
            src = new_frames(torch.empty(b, c, 0), n + 5, channels_last).normal_(0, 2)
            x = src[..., 3:3 + n]
            buf = new_frames(x, p + n, channels_last).zero_()
            out = buf[..., p:]
            assert snake_layout(x, out) is channels_last
            with torch.no_grad():
                act._fused(x, out, channels_last, bias)
            xb = x if bias is None else x + bias[None, :, None]
            want = xb + (1.0 / (beta + 1e-9)) * torch.sin(xb * alpha).pow(2)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
            assert buf[..., :p].abs().max() == 0  # the tail part is left alone
    assert snake_layout(x, new_frames(x, n, True)) is None  # mixed layouts: the torch path


if __name__ == "__main__":
    check_sampler()
    check_sampler_edges()
    check_norm_rope()
    check_rope()
    check_norm_rope_blocks()
    check_prefix_attention()
    check_silu_mul()
    check_norm_rope_cache()
    check_attention_writes_kv()
    check_decode_attention()
    check_fresh_attention()
    check_packed_attention()
    check_add_rms_norm()
    check_add_rms_norm_scaled()
    check_add_rms_norm_parts()
    check_codec_transformer()
    check_fused_stack()
    check_fresh_attention_stack()
    check_snake()
    print("kernels ok")
