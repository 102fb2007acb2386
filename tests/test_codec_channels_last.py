"""The codec decoder's channels-last layout (the CUDA default: activations and conv tails stored [B, T, C],
convs as NHWC 2-D convs) decodes the same PCM as the reference layout, one-shot and streamed with state
carried across chunks, on CPU.

Tolerances: float64 < 1e-10 (only rounding differs, so this is the test of the tail layout and the state
logic); float32 relative L2 < 5e-5 and max abs < 1e-4 (measured ~1.5e-5 / ~3e-5: the 2-D convs sum in a
different order than the 1-D ones).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.models.qwen3_tts import speech_layers
from omniloop.models.qwen3_tts.speech_decoder import SpeechDecoder
from omniloop.models.qwen3_tts.speech_layers import (
    CausalConv, CausalTransConv, ResidualUnit, new_frames, snake_layout,
)
from omniloop.models.qwen3_tts.speech_stream import CodecStreams
from omniloop.models.qwen3_tts.speech_tokenizer import SpeechTokenizer
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint
from tests.test_tts_codec_stream import stream_round_robin

SPF = 1920
DTYPES = [torch.float32, torch.float64]


@pytest.fixture(scope="module")
def decoders(tts_fixtures):
    """dtype -> (reference layout, channels-last) decoders with the same weights."""
    ckpt = tts_fixtures.ckpt("a", "base")
    return {dt: tuple(SpeechTokenizer.load(ckpt, with_encoder=False, dtype=dt, channels_last=cl).decoder
                      for cl in (False, True)) for dt in DTYPES}


def assert_same_pcm(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == np.float64:
        assert np.abs(got - want).max() < 1e-10
    else:
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-5
        assert np.abs(got - want).max() < 1e-4


def test_cpu_default_is_the_reference_layout(decoders) -> None:
    ref, cl = decoders[torch.float32]
    assert not ref.channels_last and cl.channels_last


def test_weights_relaid_in_place_not_copied(decoders) -> None:
    ref, cl = decoders[torch.float32]
    ref_sd, cl_sd = ref.state_dict(), cl.state_dict()
    assert ref_sd.keys() == cl_sd.keys()
    assert all(torch.equal(ref_sd[k], cl_sd[k]) and ref_sd[k].shape == cl_sd[k].shape for k in ref_sd)

    def nbytes(m: torch.nn.Module) -> int:
        return sum(t.untyped_storage().nbytes() for t in {p.untyped_storage().data_ptr(): p
                                                          for p in m.parameters()}.values())
    assert nbytes(cl) == nbytes(ref)
    convs = [m.conv.weight for m in cl.modules() if isinstance(m, (CausalConv, CausalTransConv))]
    assert convs and all(w.unsqueeze(2).is_contiguous(memory_format=torch.channels_last) for w in convs)


def test_convs_see_channels_last_tensors(decoders, monkeypatch) -> None:
    """Every conv of the channels-last decoder runs 2-D on NHWC-contiguous input and weight and returns NHWC
    (so cuDNN would transpose nothing); none runs as a 1-D conv. The residual units' 1x1 convs run as the
    matmul over channels they are (the residual add in the matmul, not a separate pass), so they are not among
    them."""
    _, cl = decoders[torch.float32]
    seen: list[bool] = []
    F = torch.nn.functional

    def watch(fn):
        def conv(x, w, *args, **kw):
            y = fn(x, w, *args, **kw)
            seen.append(all(t.is_contiguous(memory_format=torch.channels_last) for t in (x, w, y)))
            return y
        return conv

    def no_conv1d(*args, **kw):
        raise AssertionError("a 1-D conv in the channels-last decoder")
    for name in ("conv2d", "conv_transpose2d"):
        monkeypatch.setattr(F, name, watch(getattr(F, name)))
    for name in ("conv1d", "conv_transpose1d"):
        monkeypatch.setattr(F, name, no_conv1d)
    codes = torch.from_numpy(np.random.default_rng(0).integers(0, 2048, (2, 3, 16)))
    cl.decode(codes, torch.tensor([3, 1]))
    num_convs = sum(isinstance(m, (CausalConv, CausalTransConv)) for m in cl.modules())
    num_units = sum(isinstance(m, ResidualUnit) for m in cl.modules())
    assert num_units and len(seen) == num_convs - num_units and all(seen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_shot_equals_reference_layout(decoders, dtype: torch.dtype) -> None:
    ref, cl = decoders[dtype]
    rng = np.random.default_rng(1)
    codes = torch.from_numpy(rng.integers(0, 2048, (3, 40, 16)))
    lens = torch.tensor([40, 23, 1])
    want = ref.decode(codes, lens).numpy()
    for chunk_frames in (300, 7):  # 7: the one-shot decode carries its own state across internal chunks
        got = cl.decode(codes, lens, chunk_frames=chunk_frames).numpy()
        for row, n in enumerate(lens.tolist()):
            assert_same_pcm(got[row, :n * SPF], want[row, :n * SPF])


@pytest.mark.parametrize("dtype", DTYPES)
def test_streamed_rows_equal_reference_one_shot(decoders, dtype: torch.dtype) -> None:
    """Three streams of different lengths and chunk sizes in shared batched steps (padded rows, a row
    that has already finished sending empty chunks): each equals its one-shot decode in the reference layout."""
    ref, cl = decoders[dtype]
    lengths, sizes = {"x": 80, "y": 23, "z": 9}, {"x": [1, 2, 3, 7, 25], "y": [4, 1], "z": [2]}
    codes = {r: np.random.default_rng(20 + i).integers(0, 2048, (n, 16)) for i, (r, n) in enumerate(lengths.items())}
    streams = CodecStreams(cl, initial_slots=1)  # grows: tails are copied between pools
    out, _ = stream_round_robin(streams, codes, sizes, keep_finished=True)
    for r, c in codes.items():
        want = ref.decode(torch.from_numpy(c)[None])[0].numpy()
        assert_same_pcm(np.concatenate(out[r]), want)
        assert streams.frames_done(r) == lengths[r]


def test_pool_packs_tails_in_the_decoder_layout(decoders) -> None:
    """The slot pool hands the channels-last layers their tails as [B, P, C]-stored views (no transposing
    copy on gather) and packs what they return back unchanged."""
    _, cl = decoders[torch.float32]
    streams = CodecStreams(cl, initial_slots=2)
    streams.open("a")
    streams.decode([("a", np.random.default_rng(3).integers(0, 2048, (5, 16)))])
    pool = streams._pool
    idx = torch.tensor([streams.slot_of["a"]])
    state = pool.gather(idx)
    tails = state[-len(pool.tail_shapes):]
    assert all(t.stride(1) == 1 and t.stride(2) == t.shape[1] for t in tails)
    assert all(t.untyped_storage().data_ptr() == tails[0].untyped_storage().data_ptr() for t in tails)
    before = pool.tails.clone()
    pool.scatter(idx, state)
    assert torch.equal(pool.tails, before) and before[idx].abs().sum() > 0


@pytest.mark.gpu
def test_cuda_channels_last_graphs_equal_reference_layout() -> None:
    """On CUDA (float32, TF32 off): the channels-last decoder's captured graph steps give the PCM of the
    reference layout's eager steps (cuDNN's NHWC kernels and the channels-last SnakeBeta kernel included)."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ckpt = ensure_tiny_checkpoint("custom_voice")  # the GPU machine has no reference venv for the fixtures
        kw = dict(device="cuda", with_encoder=False, load_format="dummy", seed=3)  # same seed: same weights
        ref, cl = (SpeechTokenizer.load(ckpt, channels_last=on, **kw).decoder for on in (False, True))
        assert SpeechTokenizer.load(ckpt, **kw).decoder.channels_last  # the default on CUDA
        rng = np.random.default_rng(5)
        codes = {r: rng.integers(0, 2048, (n, 16)) for r, n in (("x", 40), ("y", 17))}
        got = {r: [] for r in codes}
        graphs, eager = CodecStreams(cl, graphs=True), CodecStreams(ref, graphs=False)
        for s in (graphs, eager):
            for r in codes:
                s.open(r)
        for start, n in ((0, 1), (1, 2), (3, 8), (11, 8), (19, 25)):
            batch = [(r, c[start:start + n]) for r, c in codes.items()]
            for (r, _), a, b in zip(batch, graphs.decode_host(batch), eager.decode_host(batch)):
                assert a.shape == b.shape and (not a.size or np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-4)
                got[r].append(a)
        assert graphs.num_graphs > 0
        for r, c in codes.items():
            want = ref.decode(torch.from_numpy(c)[None])[0].cpu().numpy()
            assert np.linalg.norm(np.concatenate(got[r]) - want) / np.linalg.norm(want) < 1e-4
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_cuda_snake_kernel_channels_last(dtype: torch.dtype, tol: float) -> None:
    from tests.test_codec_gpu import random_snake, snake_reference

    act = random_snake(dtype)
    src = new_frames(torch.empty(3, 96, 0, device="cuda", dtype=dtype), 1003, True).normal_(0, 2)
    x = src[..., 2:]  # a trimmed transposed-conv output: rows strided, frames dense
    buf = new_frames(x, 1007, True).zero_()
    assert snake_layout(x, buf[..., 6:]) is True
    with torch.no_grad():
        act(x, out=buf[..., 6:])
        fused = act(x.contiguous().transpose(1, 2).contiguous().transpose(1, 2))
        want = snake_reference(act, x)
    assert fused.stride(1) == 1  # the layout is kept
    for got in (buf[..., 6:], fused):
        assert (got.float() - want).abs().max() / want.abs().max() < tol
    assert buf[..., :6].abs().max() == 0


def test_only_channels_last_units_take_an_input_lacking_a_bias(decoders) -> None:
    """The decoder block leaves its transposed conv's bias to the first residual unit only where the units
    fold biases (channels-last); the reference layout's unit refuses such an input instead of dropping it."""
    ref, cl = decoders[torch.float32]
    ref_unit, cl_unit = (next(m for m in d.modules() if isinstance(m, ResidualUnit)) for d in (ref, cl))
    assert cl_unit.folds_bias() and not ref_unit.folds_bias()
    x = torch.zeros(1, ref_unit.conv1.conv.in_channels, 2)
    tail = torch.zeros(1, *ref_unit.conv1.tail_shape())
    with pytest.raises(ValueError, match="x_bias"):
        ref_unit(x, tail, torch.tensor([2]), x_bias=torch.zeros(x.shape[1]))


@pytest.fixture(scope="module")
def biased_decoder() -> SpeechDecoder:
    """A float64 channels-last decoder whose conv biases are all clearly non-zero (|b| >= 0.05) and whose last
    conv is scaled down so the PCM is not clamped: a bias dropped or added twice shows in the output."""
    ckpt = ensure_tiny_checkpoint("custom_voice")
    decoder = SpeechTokenizer.load(ckpt, with_encoder=False, load_format="dummy", seed=3, dtype=torch.float64,
                                   channels_last=True).decoder
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in decoder.modules():
            if isinstance(m, (CausalConv, CausalTransConv)):
                b = torch.randn(m.conv.bias.shape, generator=gen, dtype=torch.float64)
                m.conv.bias.copy_(0.1 * b.sign() * (0.5 + b.abs()))
        decoder.decoder[-1].conv.weight.mul_(0.01)
    return decoder


@torch.inference_mode()
def decode_in_chunks(decoder: SpeechDecoder, codes: torch.Tensor, lens: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``decoder.step`` over chunks of the cycling ``sizes``, the state carried from one to the next."""
    state, pieces, start = decoder.init_state(codes.shape[0]), [], 0
    while start < codes.shape[1]:
        num = min(sizes[len(pieces) % len(sizes)], codes.shape[1] - start)
        pcm, state = decoder.step(codes[:, start:start + num], (lens - start).clamp(0, num), state)
        pieces.append(pcm)
        start += num
    return torch.cat(pieces, dim=1)


def test_folded_units_hand_their_biases_on_exactly(biased_decoder, monkeypatch) -> None:
    """Where the residual units fold biases, each adds its residual inside conv2's matmul (in place on its input)
    and leaves conv2's bias, and the one its input lacked, to whoever reads its output next (the next block's
    SnakeBeta, the final one): the PCM equals that of the separate bias and residual passes, one-shot and
    streamed in chunks of varying size (float64: only rounding differs)."""
    decoder = biased_decoder
    units = [m for m in decoder.modules() if isinstance(m, ResidualUnit)]
    codes = torch.from_numpy(np.random.default_rng(7).integers(0, 2048, (3, 30, 16)))
    lens = torch.tensor([30, 17, 4])
    sizes = [1, 3, 2, 7, 5]
    num_steps = 9  # chunks of 1, 3, 2, 7, 5, 1, 3, 2 and 6 frames cover the 30
    matmuls: list[torch.Size] = []
    baddbmm_ = torch.Tensor.baddbmm_

    def watch(self: torch.Tensor, *args, **kw) -> torch.Tensor:
        matmuls.append(self.shape)
        return baddbmm_(self, *args, **kw)
    monkeypatch.setattr(torch.Tensor, "baddbmm_", watch)

    def decode_both_ways() -> list[np.ndarray]:
        return [decoder.decode(codes, lens).numpy(), decode_in_chunks(decoder, codes, lens, sizes).numpy()]

    monkeypatch.setattr(speech_layers, "FOLD_CONV_BIAS", False)
    assert not any(u.folds_bias() for u in units)
    separate = decode_both_ways()
    assert not matmuls
    monkeypatch.setattr(speech_layers, "FOLD_CONV_BIAS", True)
    assert units and all(u.folds_bias() for u in units)
    folded = decode_both_ways()
    assert len(matmuls) == len(units) * (1 + num_steps)
    want = separate[0]
    for got in (*folded, separate[1]):
        assert got.shape == want.shape
        for row, n in enumerate(lens.tolist()):
            g, w = got[row, :n * SPF], want[row, :n * SPF]
            assert 0.05 < np.abs(w).max() < 0.99  # neither silent nor clamped
            assert np.abs(g - w).max() < 1e-10 * np.abs(w).max()
