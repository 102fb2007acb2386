"""``omniloop speak`` on the embedded tiny model: a 24 kHz WAV whose length matches the codes it wrote; a
codec frame limit ends a request with a clear ``codec_limit`` error after the audio so far."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import soundfile as sf

from omniloop.actors.engine import Engine
from omniloop.profile import load_profile
from omniloop.transport.messages import Sampling, SpeechRequest


def test_speak_writes_wav_and_codes(tmp_path) -> None:
    out, codes_out = tmp_path / "a.wav", tmp_path / "a.npy"
    cmd = [sys.executable, "-m", "omniloop", "speak", "--text", "Hello there.", "--speaker", "ryan",
           "--seed", "3", "--max-frames", "9", "--platform", "cpu", "--out", str(out), "--codes-out", str(codes_out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    pcm, rate = sf.read(out, dtype="float32")
    codes = np.load(codes_out)
    assert rate == 24000 and codes.dtype == np.int64 and codes.shape[1] == 16
    assert 1 <= len(codes) <= 9 and len(pcm) == 1920 * len(codes)
    assert ((codes >= 0) & (codes < 2048)).all()
    again = tmp_path / "b.npy"
    proc = subprocess.run(cmd[:-1] + [str(again)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and np.array_equal(np.load(again), codes)  # seeded: reproducible


def test_speak_rejects_unknown_speaker(tmp_path) -> None:
    cmd = [sys.executable, "-m", "omniloop", "speak", "--text", "Hi.", "--speaker", "nobody", "--platform", "cpu",
           "--out", str(tmp_path / "x.wav")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "nobody" in proc.stderr and not (tmp_path / "x.wav").exists()


async def test_codec_limit_ends_with_a_clear_error_after_the_audio_so_far() -> None:
    profile = load_profile("qwen3_tts", ["transport=inproc", "stages.talker.placement=thread",
                                         "stages.codec.placement=thread", "chunking.max_codec_frames=5"],
                           platform="cpu")
    engine = await Engine.start(profile)
    try:
        pcm, finish = [], None
        async for out in engine.generate(SpeechRequest(text="A long sentence that goes on.", speaker="ryan",
                                                       sampling=Sampling(seed=1), max_frames=40)):
            if out.pcm is not None:
                pcm.append(out.pcm)
            finish = out.finish or finish
    finally:
        await engine.shutdown(timeout_s=5)
    assert finish is not None and finish.reason == "codec_limit"
    assert "5" in finish.error and "limit" in finish.error
    assert sum(len(p) for p in pcm) == 5 * 1920  # the frames before the limit were played, nothing after


async def test_tts_stages_release_threads_on_shutdown_with_requests_in_flight() -> None:
    import asyncio
    import threading

    from omniloop.transport.channel import context_users

    before = {t.ident for t in threading.enumerate()}
    profile = load_profile("qwen3_tts", ["transport=inproc", "stages.talker.placement=thread",
                                         "stages.codec.placement=thread"], platform="cpu")
    engine = await Engine.start(profile)
    finishes = []

    async def consume(i: int) -> None:
        # seeded: these seeds run all 200 frames on the tiny model (codes do not depend on the batch), so no
        # request can end on a sampled EOS before the shutdown (unseeded, one did in a CI run)
        request = SpeechRequest(text=f"Request {i}.", speaker="ryan", max_frames=200, sampling=Sampling(seed=i))
        async for out in engine.generate(request):
            if out.finish is not None:
                finishes.append(out.finish)

    tasks = [asyncio.create_task(consume(i)) for i in range(3)]
    await asyncio.sleep(0.5)  # requests are mid-stream
    await engine.shutdown(timeout_s=0.1)
    await asyncio.gather(*tasks)
    assert [f.reason for f in finishes] == ["shutdown"] * 3  # cut off mid-stream, each told so
    leftover = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert leftover == [], leftover
    assert context_users() == 0
