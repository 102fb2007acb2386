"""The Qwen3-TTS stage glue: admission computes the exact prefill length without the model, rejects bad
requests with clear errors, and the codec runner streams exactly what the one-shot decoder gives."""

from __future__ import annotations

import io
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from omniloop.errors import RequestError
from omniloop.models.qwen3_tts.checkpoint import build_model
from omniloop.models.qwen3_tts.generate import tts_input_from_request
from omniloop.models.qwen3_tts.prompt import build_prompt, prompt_length
from omniloop.models.qwen3_tts.stage_talker import TalkerAdmission
from omniloop.models.qwen3_tts.tokenizer import TextTokenizer
from omniloop.transport.messages import Sampling, SpeechRequest, Submit

CASES = ("custom_voice_instruct", "custom_voice_plain", "voice_design", "base_icl", "base_xvec")


@cache
def _model(ckpt: Path):
    model, _ = build_model(ckpt)
    return model, TextTokenizer.from_dir(ckpt)


def _wav_bytes(pcm: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, pcm, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


@pytest.mark.parametrize("shape", ("a", "b"))
@pytest.mark.parametrize("name", CASES)
def test_prompt_length_matches_built_prompt(tts_fixtures, shape: str, name: str) -> None:
    case = tts_fixtures.case(shape, name)
    model, tok = _model(tts_fixtures.ckpt(shape, case["variant"]))
    req = SpeechRequest(text=case["text"], speaker=case["speaker"], language=case["language"],
                        instructions=case["instructions"], ref_text=case["ref_text"],
                        x_vector_only=case["x_vector_only"], sampling=Sampling(seed=1))
    x_vector = torch.from_numpy(case["x_vector"]) if "x_vector" in case else None
    ref_code = torch.from_numpy(case["ref_code"]) if "ref_code" in case else None
    full = tts_input_from_request(model.cfg, tok, req, x_vector, ref_code)
    built = build_prompt(model, full).embeds.shape[0]
    # admission knows only the number of reference frames, not the codes
    bare = tts_input_from_request(model.cfg, tok, req)
    num_ref = ref_code.shape[0] if ref_code is not None else 0
    assert prompt_length(model.cfg, bare, num_ref) == built


def test_admission_reference_audio_and_errors(tts_fixtures) -> None:
    ckpt = tts_fixtures.ckpt("a", "base")
    model, tok = _model(ckpt)
    case = tts_fixtures.case("a", "base_icl")
    admit = TalkerAdmission(model.cfg, tok, voice=object(), max_model_len=4096, max_text_chars=100,
                            max_ref_seconds=30.0)
    ref = _wav_bytes(case["ref_wav"], 24000)
    prompt = admit("r1", Submit("r1", SpeechRequest(text=case["text"], ref_audio=ref, ref_text=case["ref_text"])), {})
    assert prompt.payload.ref_pcm is not None and len(prompt.payload.ref_pcm) == len(case["ref_wav"])
    assert prompt.num_prompt_tokens > case["ref_code"].shape[0]  # the reference frames are in the prefill

    def refused(req: SpeechRequest) -> str:
        with pytest.raises(RequestError) as err:
            admit("r", Submit("r", req), {})
        assert err.value.status == 400
        return str(err.value.message)

    assert "ref_audio" in refused(SpeechRequest(text="hi", ref_audio=b"not audio at all", ref_text="x"))
    assert "ref_text" in refused(SpeechRequest(text="hi", ref_audio=ref))
    assert "100" in refused(SpeechRequest(text="x" * 101, ref_audio=ref, ref_text="x"))
    tiny = TalkerAdmission(model.cfg, tok, voice=object(), max_model_len=20, max_text_chars=100, max_ref_seconds=30)
    assert "max_model_len" in refused_by(tiny, SpeechRequest(text=case["text"], ref_audio=ref, ref_text="x"))


def refused_by(admit: TalkerAdmission, req: SpeechRequest) -> str:
    with pytest.raises(RequestError) as err:
        admit("r", Submit("r", req), {})
    return str(err.value.message)


def test_admission_caps_frames_to_the_slot(tts_fixtures) -> None:
    model, tok = _model(tts_fixtures.ckpt("a", "custom_voice"))
    admit = TalkerAdmission(model.cfg, tok, voice=None, max_model_len=64, max_text_chars=100, max_ref_seconds=30)
    prompt = admit("r", Submit("r", SpeechRequest(text="hello", speaker="ryan", max_frames=1000)), {})
    assert prompt.num_prompt_tokens + prompt.max_frames < 64
    prompt = admit("r", Submit("r", SpeechRequest(text="hello", speaker="ryan", max_frames=5)), {})
    assert prompt.max_frames == 5


async def test_codec_stage_streams_equal_one_shot(tts_fixtures) -> None:
    """Three requests interleaved through the codec scheduler + runner (adaptive chunks, batched steps):
    each request's concatenated PCM equals the one-shot decode of its codes, sample for sample in count."""
    from omniloop.models.qwen3_tts.speech_stream import CodecStreams
    from omniloop.models.qwen3_tts.speech_tokenizer import SpeechTokenizer
    from omniloop.models.qwen3_tts.stage_codec import CodecRunner
    from omniloop.scheduler.codec import CodecConfig, CodecScheduler
    from omniloop.transport.messages import Chunk, Finish

    codes = tts_fixtures.codec("a")["codes"]
    tok = SpeechTokenizer.load(tts_fixtures.ckpt("a", "custom_voice"), with_encoder=False)
    runner = CodecRunner(CodecStreams(tok.decoder, max_streams=4, initial_slots=2))
    sched = CodecScheduler(CodecConfig(max_num_seqs=4, max_frames_per_step=64, initial_frames=1, frames=8))
    parts = {"a": codes[:17], "b": codes[5:30], "c": codes[:9]}
    got: dict[str, list[np.ndarray]] = {k: [] for k in parts}
    finished: set[str] = set()
    try:
        for rid in parts:
            sched.add(rid, Submit(rid, SpeechRequest(text="x")), {})
        fed = dict.fromkeys(parts, 0)
        while len(finished) < len(parts):
            for rid, c in parts.items():  # upstream trickles frames in, 3 at a time
                if fed[rid] < len(c):
                    n = min(3, len(c) - fed[rid])
                    final = fed[rid] + n == len(c)
                    sched.extend(rid, Chunk(rid, fed[rid], final=final, reason="stop" if final else None),
                                 {"codes": c[fed[rid]:fed[rid] + n]})
                    fed[rid] += n
            plan = sched.schedule()
            if plan is None:
                continue
            for emit in sched.update(plan, await runner.submit(plan)):
                if isinstance(emit.msg, Finish):
                    finished.add(emit.msg.req_id)
                elif emit.arrays and "pcm" in emit.arrays:
                    got[emit.msg.req_id].append(emit.arrays["pcm"])
    finally:
        runner.close()
    for rid, c in parts.items():
        want = tok.decoder.decode(torch.from_numpy(c)[None])[0].numpy()
        pcm = np.concatenate(got[rid])
        assert pcm.shape == want.shape == (1920 * len(c),)
        assert np.linalg.norm(pcm - want) / np.linalg.norm(want) < 5e-5
    assert sched.num_requests == 0 and runner.streams.num_active == 0


def test_codec_memory_budget_names_the_numbers_and_the_knobs(monkeypatch) -> None:
    """The codec's share is checked after each graph capture (``CodecMemoryBudget``); here the CUDA
    allocator is simulated, the stage's reserved bytes growing by 30 GiB a capture."""
    import torch

    from omniloop.models.qwen3_tts.stage_codec import CodecMemoryBudget

    gib = 2**30
    reserved = [5 * gib]

    class Props:
        total_memory = 100 * gib

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved[0])
    budget = CodecMemoryBudget("codec", "cuda", 0.6, 512)  # 60 GiB, counted from the 5 GiB already held
    for graphs in (1, 2):
        reserved[0] += 30 * gib
        budget.check(graphs)  # 30, then 60 GiB: within
    reserved[0] += 30 * gib
    with pytest.raises(ValueError) as err:
        budget.check(3)
    msg = str(err.value)
    assert "90.0 GiB" in msg and "3 captured step graphs" in msg and "60.0 GiB" in msg
    assert "warmup_rows_x_frames (now 512)" in msg and "gpu_memory_fraction" in msg
