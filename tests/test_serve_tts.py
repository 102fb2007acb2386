"""The real server on the embedded default (tiny Qwen3-TTS, random weights, stages in processes): what the
README's first command starts. The OpenAI SDK gets audio; a seeded request is reproducible over HTTP;
concurrent streams all complete; bad voices and languages get clear 400s and the server keeps serving;
a voice clone with reference audio works over HTTP against a Base fixture checkpoint."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from tests.serve_util import ServerProc, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(tmp_path_factory.mktemp("tts"), "qwen3_tts", "--platform", "cpu", timeout_s=180)
    yield srv
    assert srv.stop() == 0


def _speech(server: ServerProc, **body) -> httpx.Response:
    payload = {"model": "qwen3_tts", "input": "Hello from the test suite.", "voice": "ryan", **body}
    return httpx.post(f"{server.url}/v1/audio/speech", json=payload, timeout=120)


def test_openai_sdk_gets_a_wav_of_whole_frames(server: ServerProc) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    wav = client.audio.speech.create(model="qwen3_tts", voice="ryan", input="Testing, one two three.",
                                     response_format="wav", extra_body={"max_new_tokens": 12}).content
    pcm, rate = sf.read(io.BytesIO(wav), dtype="float32")
    assert rate == 24000 and len(pcm) > 0 and len(pcm) % 1920 == 0 and len(pcm) <= 12 * 1920


def test_seeded_request_is_reproducible_and_seeds_differ(server: ServerProc) -> None:
    a = _speech(server, response_format="pcm", seed=5, max_new_tokens=10)
    b = _speech(server, response_format="pcm", seed=5, max_new_tokens=10)
    c = _speech(server, response_format="pcm", seed=6, max_new_tokens=10)
    assert a.status_code == b.status_code == c.status_code == 200
    pa, pb, pc = (np.frombuffer(r.content, dtype="<i2").astype(np.int32) for r in (a, b, c))
    # same codes, so the same length and the same audio up to rounding: the codec's chunk boundaries follow
    # timing, and the tiny random decoder (saturating, untrained) amplifies float32 rounding at other
    # boundaries to a few int16 steps (17 of 32767 seen). Stream vs one-shot is tested at float tolerance elsewhere.
    assert len(pa) == len(pb) > 0 and np.abs(pa - pb).max() <= 0.005 * 32767
    assert len(pa) != len(pc) or np.abs(pa - pc).mean() > 500


async def test_concurrent_streams_all_complete(server: ServerProc) -> None:
    async with httpx.AsyncClient(timeout=180) as client:
        async def one(i: int) -> int:
            body = {"model": "qwen3_tts", "input": f"Stream number {i}.", "voice": "ryan", "stream": True,
                    "stream_format": "audio", "response_format": "pcm", "max_new_tokens": 8, "seed": i}
            total = 0
            async with client.stream("POST", f"{server.url}/v1/audio/speech", json=body) as r:
                assert r.status_code == 200
                async for part in r.aiter_bytes():
                    total += len(part)
            return total
        sizes = await asyncio.gather(*(one(i) for i in range(8)))
    assert all(s > 0 and s % (1920 * 2) == 0 for s in sizes)  # s16le, whole frames


@pytest.mark.parametrize("body, needle", [
    ({"voice": "nobody"}, "nobody"),
    ({"language": "klingon"}, "klingon"),
    ({"input": ""}, "input"),
    ({"temperature": -1.0}, "temperature"),
])
def test_bad_requests_are_400_and_the_server_keeps_serving(server: ServerProc, body: dict, needle: str) -> None:
    r = _speech(server, **body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert _speech(server, response_format="pcm", max_new_tokens=3).status_code == 200


def test_voice_clone_over_http(tts_fixtures, tmp_path) -> None:
    ckpt = tts_fixtures.ckpt("a", "base")
    case = tts_fixtures.case("a", "base_icl")
    srv = start_server(tmp_path, "qwen3_tts", "--platform", "cpu", "--model", str(ckpt), timeout_s=180)
    try:
        buf = io.BytesIO()
        sf.write(buf, case["ref_wav"], 24000, format="WAV")
        body = {"model": "qwen3_tts", "input": case["text"], "task_type": "Base", "response_format": "pcm",
                "ref_audio": "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode(),
                "ref_text": case["ref_text"], "max_new_tokens": 6, "seed": 1}
        r = httpx.post(f"{srv.url}/v1/audio/speech", json=body, timeout=120)
        assert r.status_code == 200, r.text
        pcm = np.frombuffer(r.content, dtype="<i2")
        assert 0 < len(pcm) <= 6 * 1920 and len(pcm) % 1920 == 0
        missing = httpx.post(f"{srv.url}/v1/audio/speech", json={**body, "ref_text": None}, timeout=60)
        assert missing.status_code == 400 and "ref_text" in missing.json()["error"]["message"]
    finally:
        assert srv.stop() == 0
