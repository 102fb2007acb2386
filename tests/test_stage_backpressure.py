"""Backpressure: a stage whose outbox holds a backlog (its peer stopped reading) launches no new step until
the backlog drains, then carries on; nothing is lost."""

from __future__ import annotations

import asyncio

from omniloop.actors.engine import Engine
from omniloop.profile import load_profile
from omniloop.transport.channel import Outbox
from omniloop.transport.messages import SpeechRequest
from tests.test_pipeline_fake import expected_pcm


async def test_a_congested_outbox_pauses_launches_until_it_drains() -> None:
    sets = ["stages.talker.placement=thread", "stages.codec.placement=thread", "transport=inproc"]
    engine = await Engine.start(load_profile("fake", sets, platform="cpu"))
    try:
        talker = engine.supervisor.handles["talker"].actor
        congested = [True]

        class Held(Outbox):  # the talker's outbox to the codec, reporting a backlog while ``congested``
            @property
            def is_congested(self) -> bool:
                return congested[0]

        talker._to_next.__class__ = Held
        steps_before = talker.num_steps
        text = "backpressure"
        task = asyncio.ensure_future(_collect(engine, SpeechRequest(text=text)))
        await asyncio.sleep(0.3)
        assert talker.num_steps == steps_before and not task.done()  # admitted, but no step launched
        congested[0] = False
        talker._doorway.post(talker._on_drain)  # what the outbox does when its backlog empties
        pcm = await asyncio.wait_for(task, 10)
        assert talker.num_steps > steps_before
        assert pcm.tobytes() == expected_pcm(text).tobytes()
    finally:
        await asyncio.wait_for(engine.shutdown(), 30)


async def _collect(engine: Engine, request: SpeechRequest):
    import numpy as np

    parts = [out.pcm async for out in engine.generate(request) if out.pcm is not None]
    return np.concatenate(parts)
