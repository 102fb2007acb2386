"""The OpenAI-compatible HTTP API against a real server subprocess running the fake profile."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from tests.serve_util import ServerProc, expected_pcm, metric, s16, start_server, wait_idle

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServerProc:
    tmp = tmp_path_factory.mktemp("http")
    (tmp / "refs").mkdir()
    srv = start_server(tmp, "fake", "--ref-audio-dir", str(tmp / "refs"))
    srv.tmp = tmp  # type: ignore[attr-defined]
    yield srv
    assert srv.stop() == 0, srv.log()


def _speech(server: ServerProc, **body: object) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/audio/speech", json={"voice": "fake", **body}, timeout=30)


def test_openai_sdk_speech_whole_and_streaming(server: ServerProc) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    text = "Hello from the OpenAI SDK"
    wav = client.audio.speech.create(model=model, voice="fake", input=text, response_format="wav").content
    pcm, sr = sf.read(io.BytesIO(wav), dtype="int16")
    assert sr == 24000
    assert np.abs(pcm.astype(np.int32) - s16(expected_pcm(text))).max() <= 1

    with client.audio.speech.with_streaming_response.create(
        model=model, voice="fake", input=text, response_format="pcm", extra_body={"stream_format": "audio"}
    ) as response:
        streamed = b"".join(response.iter_bytes())
    assert np.array_equal(np.frombuffer(streamed, "<i2"), s16(expected_pcm(text)))


def test_raw_pcm_wav_and_sse_streams_carry_the_same_audio(server: ServerProc) -> None:
    text = "streaming three ways"
    want = s16(expected_pcm(text))
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=30,
                      json={"input": text, "voice": "fake", "response_format": "pcm", "stream_format": "audio"}) as r:
        assert r.headers["content-type"] == "audio/pcm"
        pieces = list(r.iter_bytes())
    assert np.array_equal(np.frombuffer(b"".join(pieces), "<i2"), want)

    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=30,
                      json={"input": text, "voice": "fake", "response_format": "wav", "stream_format": "audio"}) as r:
        body = r.read()
    assert body[:4] == b"RIFF" and struct.unpack("<I", body[4:8])[0] == 0xFFFFFFFF
    assert np.array_equal(np.frombuffer(body[44:], "<i2"), want)

    events = []
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=30,
                      json={"input": text, "voice": "fake", "response_format": "pcm", "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert events[-1]["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert np.array_equal(np.frombuffer(audio, "<i2"), want)


def test_flac_whole_file_and_max_new_tokens(server: ServerProc) -> None:
    r = _speech(server, input="cut me short please", response_format="flac", max_new_tokens=3)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/flac"
    pcm, _ = sf.read(io.BytesIO(r.content), dtype="int16")
    assert len(pcm) == 3 * 1920
    assert r.headers["x-finish-reason"] == "length"


async def test_32_concurrent_streams_all_complete(server: ServerProc) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> bool:
        text = f"concurrent stream number {i}"
        body = {"input": text, "voice": "fake", "response_format": "pcm", "stream_format": "audio"}
        async with client.stream("POST", "/v1/audio/speech", json=body) as r:
            data = b"".join([chunk async for chunk in r.aiter_bytes()])
        return r.status_code == 200 and np.array_equal(np.frombuffer(data, "<i2"), s16(expected_pcm(text)))

    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
        results = await asyncio.gather(*(one(client, i) for i in range(32)))
    assert all(results)


def test_client_disconnect_mid_stream_frees_the_request(server: ServerProc) -> None:
    before = httpx.get(f"{server.url}/metrics").text
    aborted_before = _metric_or_zero(before, 'omniloop:engine_num_finished{reason="abort"}')
    body = {"input": "x" * 500, "voice": "fake", "response_format": "pcm", "stream_format": "audio"}
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=body, timeout=30) as r:
        first = next(r.iter_bytes())
        assert first
    text = wait_idle(server)
    assert _metric_or_zero(text, 'omniloop:engine_num_finished{reason="abort"}') == aborted_before + 1


def _metric_or_zero(text: str, name: str) -> float:
    try:
        return metric(text, name)
    except KeyError:
        return 0.0


WAV_1S = io.BytesIO()
sf.write(WAV_1S, np.zeros(2400, np.float32), 24000, format="WAV")


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        ({"input": 5}, 400, "$.input"),
        ({"input": "   "}, 400, "must not be empty"),
        ({"input": "x" * 513}, 400, "limit is 512"),
        ({"input": "hi", "voice": "nobody"}, 400, "voice 'nobody'"),
        ({"input": "hi", "task_type": "Karaoke"}, 400, "task_type 'Karaoke'"),
        ({"input": "hi", "task_type": "VoiceDesign"}, 400, "not supported by this model"),
        ({"input": "hi", "language": "Klingon"}, 400, "language 'Klingon'"),
        ({"input": "hi", "response_format": "aac"}, 400, "response_format 'aac'"),
        ({"input": "hi", "speed": 1.5}, 400, "speed 1.5 is not supported"),
        ({"input": "hi", "response_format": "flac", "stream": True}, 400, "pcm or wav"),
        ({"input": "hi", "model": "gpt-4o-mini-tts"}, 404, "does not exist"),
        ({"input": "hi", "top_p": 0}, 400, "top_p"),
        ({"input": "hi", "ref_audio": "bm90IGF1ZGlv"}, 400, "not a decodable audio file"),
        ({"input": "hi", "ref_audio": "%%%"}, 400, "base64"),
        ({"input": "hi", "ref_audio": "/etc/passwd"}, 403, "outside the allowed directories"),
        ({"input": "hi", "ref_audio": "A" * (23 * 1024 * 1024)}, 413, "larger than the limit"),
    ],
)
def test_bad_inputs_get_clear_errors_and_the_server_keeps_serving(server: ServerProc, body: object, status: int,
                                                                  needle: str) -> None:
    url = f"{server.url}/v1/audio/speech"
    r = httpx.post(url, content=body, timeout=30) if isinstance(body, bytes) else httpx.post(url, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["code"] == status and error["type"]
    assert _speech(server, input="still fine").status_code == 200


def test_ref_audio_path_traversal_is_refused(server: ServerProc) -> None:
    refs = server.tmp / "refs"  # type: ignore[attr-defined]
    (refs / "ok.wav").write_bytes(WAV_1S.getvalue())
    sneaky = f"{refs}/../refs/../../../etc/passwd"
    r = _speech(server, input="hi", ref_audio=sneaky)
    assert r.status_code == 403 and "outside the allowed directories" in r.json()["error"]["message"]
    # inside the allow-list the file is read; this fake model has no Base task, which is the error left
    r = _speech(server, input="hi", ref_audio=str(refs / "ok.wav"))
    assert r.status_code == 400 and "task_type 'base'" in r.json()["error"]["message"]


def test_voices_models_and_metrics(server: ServerProc) -> None:
    assert httpx.get(f"{server.url}/v1/audio/voices").json()["voices"] == ["fake"]
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "fake"
    _speech(server, input="measure me")
    text = httpx.get(f"{server.url}/metrics").text
    assert metric(text, "omniloop:time_to_first_audio_seconds_count") >= 1
    assert metric(text, "omniloop:audio_seconds_total") > 0
    assert 'omniloop:stage_step_ms{stage="talker"}' in text
    assert httpx.get(f"{server.url}/nope").json()["error"]["code"] == 404


def test_chat_on_a_tts_only_model_says_so(server: ServerProc) -> None:
    url = f"{server.url}/v1/chat/completions"
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and "does not support chat completions" in r.json()["error"]["message"]
    bad = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}
    r = httpx.post(url, json=bad)
    assert r.status_code == 400 and "data URI" in r.json()["error"]["message"]


async def test_chat_response_assembly_over_the_real_engine_with_the_fake_thinker() -> None:
    # The chat path's parsing and OpenAI response assembly, driven directly over a real Engine running
    # thinker -> talker -> codec (tests/test_serve_chat.py covers the same through a server).
    from omniloop.actors.engine import Engine
    from omniloop.profile import load_profile
    from omniloop.serve.chat_api import ChatAssembler, parse_chat
    from omniloop.serve.context import ServeContext
    from omniloop.serve.generation import start_generation
    from omniloop.serve.metrics import ServeMetrics
    from omniloop.serve.ref_audio import RefAudioResolver

    engine = await Engine.start(load_profile("fake3"))
    try:
        ctx = ServeContext("fake3", 512, ServeMetrics(), RefAudioResolver([]), engine=engine)
        text = "tell me a story"
        body = {"messages": [{"role": "user", "content": text}], "modalities": ["text", "audio"],
                "audio": {"voice": "fake", "format": "pcm16"}, "stream": True}
        plan = parse_chat(json.dumps(body).encode(), ctx)
        chunks = []
        async for raw in ChatAssembler("fake3", True).stream(await start_generation(ctx, None, plan.request, "chat")):
            chunks.append(raw.decode())
        assert chunks[-1] == "data: [DONE]\n\n"
        deltas = [json.loads(c[6:])["choices"][0] for c in chunks[:-1]]
        transcript = "".join(d["delta"].get("audio", {}).get("transcript", "") for d in deltas)
        audio = b"".join(base64.b64decode(d["delta"]["audio"]["data"]) for d in deltas if "data" in d["delta"].get("audio", {}))
        assert transcript == text
        assert np.array_equal(np.frombuffer(audio, "<i2"), s16(expected_pcm(text)))
        assert deltas[-1]["finish_reason"] == "stop"

        plan = parse_chat(json.dumps({"messages": [{"role": "user", "content": text}]}).encode(), ctx)
        whole = await ChatAssembler("fake3", False).whole(await start_generation(ctx, None, plan.request, "chat"), "wav")
        assert whole["choices"][0]["message"]["content"] == text
        assert ctx.metrics.num_running == 0 and not ctx.in_flight
    finally:
        await engine.shutdown(5)
