"""Review: a request whose Submit cannot be sent (here: a field msgspec cannot encode) must not stay
registered in the engine: it would hold a max_pending seat, block its id, and stall shutdown's drain."""

from __future__ import annotations

import numpy as np

from omniloop.actors.engine import Engine
from omniloop.profile import load_profile
from omniloop.transport.messages import Sampling, SpeechRequest


async def test_a_submit_that_cannot_be_sent_leaves_nothing_behind():
    profile = load_profile("fake", ["stages.talker.placement=thread", "stages.codec.placement=thread",
                                    "transport=inproc"], platform="cpu")
    engine = await Engine.start(profile)
    try:
        bad = SpeechRequest("hello", sampling=Sampling(temperature=np.float32(0.5)))  # not encodable
        outs = [out async for out in engine.generate(bad, "r1")]
        assert [o.finish.reason for o in outs if o.finish] == ["error"] and outs[-1].finish is not None
        assert engine.stats()["num_pending"] == 0
        outs = [out async for out in engine.generate(SpeechRequest("hello"), "r1")]  # the id is free again
        assert outs[-1].finish.reason == "stop"
    finally:
        await engine.shutdown(timeout_s=5)
