"""The ZeroMQ client protocol through the Python clients, against a real server subprocess."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import uvloop
import zmq

from omniloop.serve.client import AsyncClient, Client
from omniloop.transport.frames import decode, encode
from omniloop.transport.messages import Credit, SpeechRequest, Submit
from tests.serve_util import ServerProc, expected_pcm, start_server, wait_idle

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServerProc:
    srv = start_server(tmp_path_factory.mktemp("zmq"), "fake")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_sync_speak_and_stream_return_the_models_audio(server: ServerProc) -> None:
    with Client(server.zmq_addr) as client:
        pcm, finish = client.speak("hello over zeromq", speaker="fake", seed=3)
        assert finish.reason == "stop" and finish.error is None
        assert np.array_equal(pcm, expected_pcm("hello over zeromq"))
        items = list(client.stream("cut", max_frames=2))
    assert items[-1].finish is not None and items[-1].finish.reason == "length"
    assert np.array_equal(np.concatenate([i.pcm for i in items if i.pcm is not None]), expected_pcm("cut", 2))


def test_a_slow_reader_with_a_tiny_window_still_gets_every_sample(server: ServerProc) -> None:
    # 1920 bytes of credit at a time: the server must merge and split PCM, never drop or reorder it.
    with Client(server.zmq_addr, window_bytes=1920) as client:
        items = list(client.stream("a long sentence to merge while the reader lags behind"))
    pcm = np.concatenate([i.pcm for i in items if i.pcm is not None])
    assert np.array_equal(pcm, expected_pcm("a long sentence to merge while the reader lags behind"))
    assert max(len(i.pcm) for i in items if i.pcm is not None) * 4 <= 1920


def test_invalid_request_gets_an_error_finish_and_the_next_one_works(server: ServerProc) -> None:
    with Client(server.zmq_addr) as client:
        _, finish = client.speak("")
        assert finish.reason == "error" and "must not be empty" in (finish.error or "")
        _, finish = client.speak("x" * 600)
        assert finish.reason == "error" and "limit is 512" in (finish.error or "")
        _, finish = client.speak("hi", ref_audio=b"not audio")
        assert finish.reason == "error" and "not a decodable audio file" in (finish.error or "")
        pcm, finish = client.speak("fine again")
        assert finish.reason == "stop" and len(pcm) == len(expected_pcm("fine again"))


def test_async_client_under_uvloop_runs_concurrent_streams(server: ServerProc) -> None:
    async def main() -> list[bool]:
        async with AsyncClient(server.zmq_addr) as client:
            async def one(i: int) -> bool:
                text = f"async stream {i}"
                pieces = [item.pcm async for item in client.stream(text) if item.pcm is not None]
                return np.array_equal(np.concatenate(pieces), expected_pcm(text))

            return await asyncio.gather(*(one(i) for i in range(8)))

    assert all(uvloop.run(main()))


def test_vanished_client_gets_its_requests_aborted(server: ServerProc) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.zmq_addr)
    sock.send_multipart(encode(Submit("gone-1", SpeechRequest("y" * 500))))
    sock.send_multipart(encode(Credit("gone-1", 1920 * 4)))
    msg, arrays = decode(sock.recv_multipart())
    assert arrays["pcm"].size > 0
    sock.close(linger=0)  # no Abort: the server must notice on its own
    ctx.term()
    wait_idle(server, timeout_s=15)
