"""Review: a reference audio too short for the speaker encoder's front end used to pass admission and
fail inside the batched talker step, which fails every request in that step, not just its own."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import soundfile as sf

from omniloop.actors.engine import Engine
from omniloop.profile import load_profile
from omniloop.transport.messages import Sampling, SpeechRequest


def _wav(num_samples: int) -> bytes:
    buf = io.BytesIO()
    pcm = (0.1 * np.random.default_rng(0).standard_normal(num_samples)).astype(np.float32)
    sf.write(buf, pcm, 24000, format="WAV", subtype="FLOAT")
    return buf.getvalue()


async def _finish(engine: Engine, request: SpeechRequest):
    finish = None
    async for out in engine.generate(request):
        finish = out.finish or finish
    return finish


async def test_short_reference_audio_fails_only_its_own_request(tts_fixtures):
    overrides = [f"model_dir={tts_fixtures.ckpt('a', 'base')}", "transport=inproc",
                 "stages.talker.placement=thread", "stages.codec.placement=thread"]
    engine = await Engine.start(load_profile("qwen3_tts", overrides, platform="cpu"))
    try:
        good = SpeechRequest(text="Hello there.", ref_audio=_wav(24000), x_vector_only=True,
                             sampling=Sampling(seed=1), max_frames=4)
        short = SpeechRequest(text="Hello there.", ref_audio=_wav(1000), x_vector_only=True,
                              sampling=Sampling(seed=1), max_frames=4)
        fin_good, fin_short = await asyncio.wait_for(
            asyncio.gather(_finish(engine, good), _finish(engine, short)), 60)
        assert fin_good.reason in ("stop", "length"), fin_good  # was: error, the short one's step failure
        assert fin_short.reason == "error" and "ref_audio" in fin_short.error, fin_short
    finally:
        await engine.shutdown(timeout_s=5)
