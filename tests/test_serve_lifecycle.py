"""Auth, and graceful shutdown: SIGTERM drains, aborts stragglers with a clear error, exits 0, leaves no process."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import numpy as np
import openai
import psutil
import pytest

from tests.serve_util import ServerProc, expected_pcm, s16, start_server

pytestmark = pytest.mark.timeout(120)

SLOW = ("--set", "stages.talker.options.step_ms=10")  # 200 chars -> ~2 s of generation


def _assert_no_process_left(server: ServerProc) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                              for p in server.children):
        time.sleep(0.1)
    alive = [p for p in server.children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert server.children and not alive, f"stage processes left behind: {alive}"


def test_api_key_guards_everything_but_health(tmp_path) -> None:
    server = start_server(tmp_path, "fake", api_key="s3cret")
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        for path in ("/ready", "/metrics", "/v1/models", "/v1/audio/voices"):
            r = httpx.get(f"{server.url}{path}")
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
        r = httpx.post(f"{server.url}/v1/audio/speech", json={"input": "hi"}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret")
        wav = client.audio.speech.create(model="fake", voice="fake", input="with the key").content
        assert wav[:4] == b"RIFF"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope").models.list()
    finally:
        assert server.stop() == 0, server.log()


def _stream_pcm(server: ServerProc, text: str, out: dict) -> None:
    body = {"input": text, "voice": "fake", "response_format": "pcm", "stream_format": "audio"}
    try:
        with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=body, timeout=60) as r:
            out["data"] = b"".join(r.iter_bytes())
            out["status"] = r.status_code
    except httpx.HTTPError as exc:
        out["error"] = exc


def test_sigterm_lets_in_flight_requests_finish_then_exits_cleanly(tmp_path) -> None:
    server = start_server(tmp_path, "fake", *SLOW)
    texts = ["a" * 200, "b" * 150]
    results = [{} for _ in texts]
    threads = [threading.Thread(target=_stream_pcm, args=(server, t, res)) for t, res in zip(texts, results)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # both streams are producing audio
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    refused = httpx.post(f"{server.url}/v1/audio/speech", json={"input": "late"}, timeout=10)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    for t in threads:
        t.join(30)
    assert server.stop() == 0, server.log()
    for text, res in zip(texts, results):
        assert res.get("status") == 200, res
        assert np.array_equal(np.frombuffer(res["data"], "<i2"), s16(expected_pcm(text)))
    _assert_no_process_left(server)


def test_sigterm_drain_timeout_aborts_stragglers_with_a_clear_error(tmp_path) -> None:
    server = start_server(tmp_path, "fake", *SLOW, "--shutdown-timeout", "0.3")
    events: list[dict] = []

    def sse() -> None:
        body = {"input": "c" * 300, "voice": "fake", "response_format": "pcm", "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=body, timeout=60) as r:
            events.extend(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: "))

    raw: dict = {}
    threads = [threading.Thread(target=sse), threading.Thread(target=_stream_pcm, args=(server, "d" * 300, raw))]
    for t in threads:
        t.start()
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    assert server.stop() == 0, server.log()
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "speech.audio.error" and "shutting down" in events[-1]["error"]["message"]
    # the raw stream ends without its final bytes: the client sees a truncated transfer, not a short file
    assert "error" in raw or len(raw.get("data", b"")) < len(s16(expected_pcm("d" * 300)).tobytes())
    _assert_no_process_left(server)
