"""A stage whose scheduler holds work back until a moment on the clock (``next_wakeup``) is woken at that
moment by the stage loop's one timer, with no input and no step in flight to wake it otherwise."""

from __future__ import annotations

import asyncio
import time

from omniloop.actors.engine import Engine
from omniloop.profile import load_profile
from omniloop.transport.messages import SpeechRequest
from tests.holding_codec import HOLD_S


async def test_held_back_work_runs_when_its_deadline_passes() -> None:
    sets = ["stages.talker.placement=thread", "stages.codec.placement=thread", "transport=inproc",
            "stages.codec.model=fake.holding_codec"]
    engine = await Engine.start(load_profile("fake", sets, platform="cpu"))
    try:
        start = time.monotonic()
        outs = [out async for out in engine.generate(SpeechRequest(text="abc"))]
        waited = time.monotonic() - start
        assert outs[-1].finish is not None and outs[-1].finish.reason == "stop"
        assert sum(len(o.pcm) for o in outs if o.pcm is not None) == 3 * 1920
        # every frame reached the codec long before the hold ended (fake talker: 2 ms steps): only the
        # timer can have started the codec step
        assert HOLD_S <= waited < HOLD_S + 5
    finally:
        await asyncio.wait_for(engine.shutdown(), 30)
