"""The codec stage's ``options.sm_count`` (its kernels confined to that many SMs by a CUDA green context,
``gpu/sm_partition.py``): refused with the stage and option named where it cannot apply; on a GPU, a runner
on such a stream decodes the same PCM as one on a plain stream and releases its stream at close."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from omniloop.gpu.sm_partition import PartitionedStream, check_sm_count
from omniloop.models.qwen3_tts import stage_codec
from omniloop.profile import load_profile


def test_sm_count_needs_a_cuda_stage() -> None:
    with pytest.raises(ValueError, match=r"stage 'codec': options.sm_count confines CUDA kernels; .* cpu"):
        check_sm_count("codec", torch.device("cpu"), 16)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "many", True])
def test_sm_count_must_be_a_positive_integer(monkeypatch: pytest.MonkeyPatch, bad: object) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        multi_processor_count=132))
    with pytest.raises(ValueError, match=r"stage 'codec': options.sm_count must be a positive integer"):
        check_sm_count("codec", torch.device("cuda", 0), bad)


def test_sm_count_cannot_exceed_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        multi_processor_count=132))
    assert check_sm_count("codec", torch.device("cuda", 0), 100) == 100
    with pytest.raises(ValueError, match=r"options.sm_count 200 exceeds the 132 SMs of cuda:0"):
        check_sm_count("codec", torch.device("cuda", 0), 200)


def test_the_codec_stage_refuses_sm_count_on_cpu_before_loading_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--set stages.codec.options.sm_count=N`` reaches the codec stage's options; on a CPU stage it fails
    at once with the option named (no checkpoint is read: loading would fail differently)."""
    profile = load_profile("qwen3_tts", ["stages.codec.options.sm_count=48"], platform="cpu")
    codec = next(s for s in profile.stages if s.name == "codec")
    assert codec.options["sm_count"] == 48
    monkeypatch.setattr(stage_codec, "resolve_checkpoint", lambda profile: None)
    monkeypatch.setattr(stage_codec.SpeechTokenizer, "load", lambda *a, **kw: pytest.fail("loaded a checkpoint"))
    with pytest.raises(ValueError, match="options.sm_count confines CUDA kernels"):
        stage_codec.build_codec(codec, profile)


@pytest.mark.gpu
async def test_a_partitioned_codec_runner_decodes_the_same_pcm() -> None:
    """Graphs captured on the confined stream (as ``build_codec`` does) decode what plain ones do, and the
    runner releases the partition at close."""
    from omniloop.models.qwen3_tts.speech_stream import CodecStreams
    from omniloop.models.qwen3_tts.speech_tokenizer import SpeechTokenizer
    from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint
    from omniloop.scheduler.plan import CodecSeq, CodecStepPlan

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    decoder = SpeechTokenizer.load(ensure_tiny_checkpoint("custom_voice"), device="cuda", dtype=torch.float32,
                                   load_format="dummy", with_encoder=False, seed=3).decoder
    codes = np.random.default_rng(3).integers(0, 2048, (2, 6, 16), dtype=np.int64)
    pcm = {}
    for sms in (None, 8):
        partition = PartitionedStream(sms, torch.device("cuda")) if sms is not None else None
        streams = CodecStreams(decoder, max_streams=2, initial_slots=2,
                               capture_stream=partition.stream if partition is not None else None)
        runner = stage_codec.CodecRunner(streams, partition=partition)
        try:
            plans = [CodecStepPlan(step, [CodecSeq(f"r{i}", i, 3 * step, 3 * step + 3,
                                                   codes[i, 3 * step:3 * step + 3], step == 0, step == 1)
                                          for i in range(2)])
                     for step in (0, 1)]
            pcm[sms] = [np.concatenate(p) for p in zip(*(runner.step(plan).pcm for plan in plans))]
        finally:
            runner.close()
        if sms is not None:
            assert runner._partition is None and runner._stream is None  # the green context is released
    for got, want in zip(pcm[8], pcm[None]):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
