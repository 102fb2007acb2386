"""/v1/chat/completions through a real server on the fake three-stage pipeline (thinker -> talker -> codec):
the OpenAI SDK gets the thinker's text and the audio, whole and streamed, in OpenAI's shapes."""

from __future__ import annotations

import base64
import io

import openai
import pytest
import soundfile as sf

from tests.serve_util import start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(tmp_path_factory.mktemp("chat"), "fake3")
    yield srv
    assert srv.stop() == 0


def test_chat_with_audio_whole_and_streamed(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "say three words"}]
    whole = client.chat.completions.create(model="fake3", messages=messages, modalities=["text", "audio"],
                                           audio={"voice": "fake", "format": "wav"})
    msg = whole.choices[0].message
    assert "say" in (msg.content or msg.audio.transcript) and "words" in (msg.content or msg.audio.transcript)
    pcm, rate = sf.read(io.BytesIO(base64.b64decode(msg.audio.data)), dtype="float32")
    assert rate == 24000 and len(pcm) > 0 and len(pcm) % 1920 == 0

    text, audio = [], bytearray()
    for chunk in client.chat.completions.create(model="fake3", messages=messages, stream=True,
                                                modalities=["text", "audio"], audio={"voice": "fake", "format": "pcm16"}):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        if delta.content:
            text.append(delta.content)
        data = getattr(getattr(delta, "audio", None), "data", None)
        if data:
            audio += base64.b64decode(data)
    assert "say" in "".join(text) and len(audio) == 2 * len(pcm)  # the same audio, as s16le
