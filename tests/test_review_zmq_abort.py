"""Review: a ZMQ client's Abort that arrives right behind its Submit (before the stream's task has run
and admitted the request into the engine) must still end the request with reason abort."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from omniloop.actors.engine import Engine
from omniloop.profile import load_profile
from omniloop.serve.context import ServeContext
from omniloop.serve.metrics import ServeMetrics
from omniloop.serve.ref_audio import RefAudioResolver
from omniloop.serve.zmq_api import ZmqFrontend
from omniloop.transport.frames import decode, encode
from omniloop.transport.messages import Abort, Credit, Finish, SpeechRequest, Submit


@contextlib.asynccontextmanager
async def _zmq_server(tmp_path, step_ms: int) -> AsyncIterator[tuple[zmq.asyncio.Socket, ZmqFrontend]]:
    """A fake pipeline (stages as threads, ``step_ms`` per talker step) behind a ZMQ front end, and a DEALER
    client connected to it; everything is closed afterwards."""
    profile = load_profile("fake", ["stages.talker.placement=thread", "stages.codec.placement=thread",
                                    "transport=inproc", f"stages.talker.options.step_ms={step_ms}"], platform="cpu")
    engine = await Engine.start(profile)
    ctx = ServeContext(model_name="fake", max_text_chars=4096, metrics=ServeMetrics(),
                       ref_audio=RefAudioResolver([]), engine=engine)
    address = f"ipc://{tmp_path}/zmq.sock"
    front = ZmqFrontend(ctx, address)
    front.start()
    zctx = zmq.asyncio.Context()
    client = zctx.socket(zmq.DEALER)
    client.connect(address)
    try:
        yield client, front
    finally:
        client.close(linger=0)
        zctx.term()
        await front.close()
        await engine.shutdown(timeout_s=5)


async def test_abort_right_behind_submit_is_not_lost(tmp_path):
    async with _zmq_server(tmp_path, step_ms=5) as (client, front):
        # one batch on the wire: the server reads all three without yielding to the stream's task
        for msg in (Submit("r1", SpeechRequest("x" * 200)), Credit("r1", 1 << 30), Abort("r1")):
            await client.send_multipart(encode(msg, None))
        finish = None
        while finish is None:
            msg, _ = decode(await asyncio.wait_for(client.recv_multipart(), 20))
            if isinstance(msg, Finish):
                finish = msg
        assert finish.reason == "abort", finish  # was "stop": the Abort went nowhere


@pytest.mark.parametrize("num_chars", [100, 500])  # the engine finished before the Abort / still running
async def test_abort_of_a_stream_waiting_for_credit_is_answered_and_freed(tmp_path, num_chars):
    """The clients abort a stream they leave and grant it no more credit; the server must still answer
    with its Finish (docs/zmq-protocol.md: "a FINISH with reason abort follows") and drop the stream,
    not keep it, and its backlog of unwanted audio, for as long as the client stays connected."""
    async with _zmq_server(tmp_path, step_ms=2) as (client, front):
        await client.send_multipart(encode(Submit("r1", SpeechRequest("x" * num_chars)), None))
        await client.send_multipart(encode(Credit("r1", 1920 * 4), None))  # one frame of float32
        msg, _ = decode(await asyncio.wait_for(client.recv_multipart(), 20))
        assert not isinstance(msg, Finish)
        await asyncio.sleep(0.3)  # the engine keeps producing into the backlog
        await client.send_multipart(encode(Abort("r1"), None))
        finish, deadline = None, time.monotonic() + 5  # the server's liveness probes keep coming
        while finish is None and time.monotonic() < deadline:
            if await client.poll(100):
                msg, _ = decode(await client.recv_multipart())
                finish = msg if isinstance(msg, Finish) else None
        assert finish is not None and finish.reason == "abort", finish
        assert front.streams == {}


async def test_abort_before_first_audio_finishes_with_reason_abort(tmp_path):
    async with _zmq_server(tmp_path, step_ms=300) as (client, front):
        await client.send_multipart(encode(Submit("r1", SpeechRequest("hello")), None))
        await client.send_multipart(encode(Credit("r1", 1 << 30), None))
        await asyncio.sleep(0.1)  # admitted, no audio yet
        await client.send_multipart(encode(Abort("r1"), None))
        msg, _ = decode(await asyncio.wait_for(client.recv_multipart(), 5))
        assert isinstance(msg, Finish) and msg.reason == "abort", msg
