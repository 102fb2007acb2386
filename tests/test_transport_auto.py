"""``transport: auto``: inproc for every inbox whose owner and senders all live in the frontend's process,
ipc for the rest; a mixed pipeline (one stage a thread, one a process) still runs end to end."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from omniloop.actors.engine import Engine
from omniloop.actors.supervisor import Addresses
from omniloop.profile import load_profile
from omniloop.transport.messages import SpeechRequest
from tests.test_pipeline_fake import collect, expected_pcm, no_leftovers


def placed(talker: str, codec: str):
    return load_profile("fake", ["transport=auto", f"stages.talker.placement={talker}",
                                 f"stages.codec.placement={codec}"], platform="cpu")


@pytest.mark.parametrize("talker, codec, inproc", [
    ("thread", "thread", {"talker", "codec", "frontend"}),
    ("process", "process", set()),
    ("thread", "process", {"talker"}),  # the codec process binds its inbox and sends to the frontend's
    ("process", "thread", set()),  # the talker process sends to the codec thread's inbox
])
def test_auto_picks_inproc_only_where_both_ends_share_the_process(talker, codec, inproc):
    addresses = Addresses(placed(talker, codec))
    try:
        assert {n for n, a in addresses.of.items() if a.startswith("inproc://")} == inproc
        assert all(a.startswith("ipc://") for n, a in addresses.of.items() if n not in inproc)
        assert (addresses.run_dir is None) == (len(inproc) == 3)
    finally:
        addresses.remove()


async def test_a_mixed_pipeline_runs_on_auto():
    before = set(threading.enumerate())
    engine = await Engine.start(placed("thread", "process"))
    try:
        pcm, _, finish = await collect(engine, SpeechRequest("mixed placement"))
        assert finish.reason == "stop"
        np.testing.assert_array_equal(pcm, expected_pcm("mixed placement"))
    finally:
        await engine.shutdown()
    no_leftovers(before)  # threads, sockets and the shared ZMQ context of both transports released
