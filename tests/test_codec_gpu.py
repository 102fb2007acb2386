"""The codec stage on CUDA: graph replay of the streaming step (rows padded to a batch bucket, chunks to a
frame bucket) returns the same PCM as the eager step and as the one-shot decode, and leaves the same state;
the fused SnakeBeta kernel equals the plain torch ops.

float32 with TF32 off, so the only differences are kernel-choice rounding.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
import torch

from omniloop.models.qwen3_tts.speech_decoder import SpeechDecoder
from omniloop.models.qwen3_tts.speech_layers import SnakeBeta
from omniloop.models.qwen3_tts.speech_stream import CodecStreams
from omniloop.models.qwen3_tts.speech_tokenizer import SpeechTokenizer
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint

pytestmark = pytest.mark.gpu
SPF = 1920


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


@cache
def _decoder(dtype: torch.dtype) -> SpeechDecoder:
    return SpeechTokenizer.load(ensure_tiny_checkpoint("custom_voice"), device="cuda", dtype=dtype,
                                load_format="dummy", with_encoder=False, seed=3).decoder


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _stream_all(streams: CodecStreams, codes: dict[str, np.ndarray], sizes: dict[str, list[int]]) -> dict:
    """Interleave the requests: each step decodes the next chunk of every request not yet done."""
    out = {r: [] for r in codes}
    pos = dict.fromkeys(codes, 0)
    step = 0
    for r in codes:
        streams.open(r)
    while any(pos[r] < len(c) for r, c in codes.items()):
        batch = []
        for r, c in codes.items():
            if pos[r] < len(c):
                n = sizes[r][step % len(sizes[r])]
                batch.append((r, c[pos[r]:pos[r] + n]))
                pos[r] += n
        for (r, _), pcm in zip(batch, streams.decode_host(batch)):
            out[r].append(pcm.copy())
        step += 1
    return {r: np.concatenate(p) for r, p in out.items()}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, None)])
def test_graph_stream_equals_eager_and_one_shot(dtype: torch.dtype, tol: float | None) -> None:
    """float32: graphs == eager == the one-shot decode. bf16: the same frames and sample counts, finite and
    in range, but no closeness bound: graph steps group rows by frame bucket, so the batch shapes (and the
    kernels cuDNN picks for them) differ from eager, and bf16 rounding compounds through this random,
    saturating decoder (12.7% relative L2 measured on the H200)."""
    dec = _decoder(dtype)
    rng = np.random.default_rng(0)
    codes = {f"r{i}": rng.integers(0, 2048, (n, 16), dtype=np.int64) for i, n in enumerate((80, 37, 9))}
    sizes = {"r0": [1, 2, 4, 8, 25, 3], "r1": [2, 35], "r2": [1, 0, 7]}  # pad to buckets; 35 > 32: eager
    graphs = CodecStreams(dec, max_streams=8, initial_slots=2, graphs=True)  # grows: graphs recaptured
    eager = CodecStreams(dec, max_streams=8, initial_slots=2, graphs=False)
    got, want = _stream_all(graphs, codes, sizes), _stream_all(eager, codes, sizes)
    assert graphs.num_graphs > 0 and eager.num_graphs == 0
    for r, c in codes.items():
        one_shot = dec.decode(torch.from_numpy(c)[None])[0].cpu().numpy()
        assert got[r].shape == want[r].shape == one_shot.shape == (len(c) * SPF,)
        assert np.isfinite(got[r]).all() and np.abs(got[r]).max() <= 1.0
        if tol is not None:
            assert _rel(got[r], want[r]) < tol
            assert _rel(got[r], one_shot) < tol
    for r, c in codes.items():
        assert graphs.frames_done(r) == eager.frames_done(r) == len(c)
    assert graphs.num_frames_decoded == eager.num_frames_decoded == sum(len(c) for c in codes.values())


def random_snake(dtype: torch.dtype) -> SnakeBeta:
    """A 96-channel SnakeBeta on CUDA with random alpha and beta (seeded)."""
    torch.manual_seed(0)
    act = SnakeBeta(96).cuda()
    with torch.no_grad():
        act.alpha.normal_(0, 0.3)
        act.beta.normal_(0, 0.3)
    return act.to(dtype)


def snake_reference(act: SnakeBeta, x: torch.Tensor) -> torch.Tensor:
    """The reference formula in float32: x + sin^2(x * e^alpha) / (e^beta + 1e-9), per channel."""
    xf = x.float()
    alpha = act.alpha.float().exp()[None, :, None]
    beta = act.beta.float().exp()[None, :, None]
    return xf + (1.0 / (beta + 1e-9)) * torch.sin(xf * alpha).pow(2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fused_snake_equals_torch_ops(dtype: torch.dtype, tol: float) -> None:
    act = random_snake(dtype)
    x = torch.randn(3, 96, 1000, device="cuda", dtype=dtype) * 2
    buf = torch.zeros(3, 96, 1005, device="cuda", dtype=dtype)
    with torch.no_grad():
        fused = act(x)
        act(x[..., 1:], out=buf[..., 6:])  # strided input, written into a tail buffer
        want = snake_reference(act, x)
    assert (fused.float() - want).abs().max() / want.abs().max() < tol
    assert (buf[..., 6:].float() - want[..., 1:]).abs().max() / want.abs().max() < tol
    assert buf[..., :6].abs().max() == 0


def test_warmed_up_streams_split_large_steps_instead_of_capturing() -> None:
    """After ``warmup(limit)`` a step larger than any captured graph (here 6 rows x 4 frames > 8) is run as
    several captured replays: no capture while serving, and the PCM equals the eager step's."""
    dec = _decoder(torch.float32)
    rng = np.random.default_rng(1)
    codes = {f"r{i}": rng.integers(0, 2048, (8, 16), dtype=np.int64) for i in range(6)}
    sizes = {r: [4] for r in codes}
    graphs = CodecStreams(dec, max_streams=8, initial_slots=8, graphs=True)
    num = graphs.warmup(8)
    assert num > 0 and (8, 4) not in graphs._graphs.graphs and graphs._graphs.max_rows(4) == 2
    got = _stream_all(graphs, codes, sizes)
    assert graphs.num_graphs == num  # nothing captured after warm-up
    want = _stream_all(CodecStreams(dec, max_streams=8, initial_slots=8, graphs=False), codes, sizes)
    for r in codes:
        assert got[r].shape == want[r].shape == (8 * SPF,)
        assert _rel(got[r], want[r]) < 1e-4


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_fused_transformer_equals_torch_path(dtype: torch.dtype, tol: float) -> None:
    """The decoder's transformer through the Triton kernels (layer-scaled add + norm, RoPE: what CUDA half
    precision runs) against its torch ops, on the GPU: the output and every new KV cache. Norm weights and layer
    scales are random, so one applied in the wrong place cannot pass."""
    tr = _decoder(dtype).pre_transformer
    saved = {name: p.detach().clone() for name, p in tr.named_parameters()}
    try:
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in tr.named_parameters():
                if "norm" in name:
                    p.copy_(torch.rand_like(p, dtype=torch.float32) + 0.5)
                elif "layer_scale" in name:
                    p.copy_(torch.randn_like(p, dtype=torch.float32) * 0.3)
            b, n, w = 3, 8, tr.cache_len
            cfg = _decoder(dtype).cfg
            x = torch.randn(b, n, cfg.latent_dim, device="cuda", dtype=dtype)
            pos, lens = torch.tensor([0, 5, 90], device="cuda"), torch.tensor([8, 3, 8], device="cuda")
            caches = [torch.randn(b, cfg.num_key_value_heads, w, cfg.attn_head_dim, device="cuda", dtype=dtype)
                      for _ in range(2 * cfg.num_hidden_layers)]
            want = tr(x, pos, lens, caches, fused=False)
            got = tr(x, pos, lens, caches, fused=True)
        for g, wnt in zip([got[0], *got[1]], [want[0], *want[1]]):
            assert g.shape == wnt.shape
            assert ((g.float() - wnt.float()).norm() / wnt.float().norm()).item() < tol
    finally:
        with torch.no_grad():
            for name, p in tr.named_parameters():
                p.copy_(saved[name])
