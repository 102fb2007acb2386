"""POST /v1/chat/completions for thinker models (Qwen3-Omni): OpenAI's request and response shapes.

The request is validated and mapped to a ChatRequest whatever model is loaded, so a bad body gets its
400 even on a TTS-only server, which then answers 404 "does not support chat completions". Responses
follow OpenAI's audio-output shape: text in ``content``; with audio also ``audio`` {id, data, transcript}
(streaming: ``delta.content`` and ``delta.audio.transcript`` carry the text delta, ``delta.audio.data`` is
base64 pcm16 24 kHz).
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from typing import Any, AsyncIterator, Literal

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omniloop.serve.api_errors import ApiError
from omniloop.serve.audio_format import SUPPORTED, encode_file, to_s16le
from omniloop.serve.context import ServeContext
from omniloop.serve.engine_api import supports_chat
from omniloop.serve.generation import Generation, GenerationStream, start_generation
from omniloop.serve.request_body import decode_body
from omniloop.transport.messages import ChatRequest, Sampling

_AUDIO_FORMATS = {"wav", "pcm16", "flac", "mp3", "opus"}


class AudioParams(msgspec.Struct):
    voice: str | None = None
    format: str = "wav"


class ChatBody(msgspec.Struct, kw_only=True):
    messages: list[dict[str, Any]]
    model: str | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioParams | None = None
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None


class ChatPlan(msgspec.Struct, frozen=True):
    request: ChatRequest
    stream: bool
    audio_format: str


def parse_chat(raw: bytes, ctx: ServeContext) -> ChatPlan:
    body = decode_body(raw, ChatBody, "/v1/chat/completions")
    if body.model is not None and body.model not in ctx.served_names():
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {sorted(ctx.served_names())}", "model")
    if not body.messages:
        raise ApiError(400, "messages must not be empty", "messages")
    for i, message in enumerate(body.messages):
        _check_message(i, message)
    modalities = body.modalities or (["text", "audio"] if body.audio is not None else ["text"])
    want_audio = "audio" in modalities
    audio = body.audio or AudioParams()
    if audio.format not in _AUDIO_FORMATS:
        raise ApiError(400, f"audio.format {audio.format!r} is not one of {sorted(_AUDIO_FORMATS)}", "audio")
    fmt = "pcm" if audio.format == "pcm16" else audio.format
    if fmt not in SUPPORTED:
        raise ApiError(400, f"audio.format {audio.format!r} cannot be encoded on this server", "audio")
    if want_audio and body.stream and fmt != "pcm":
        raise ApiError(400, "streaming audio output needs audio.format 'pcm16' (as in OpenAI's API)", "audio")
    request = ChatRequest(
        messages=body.messages,
        speaker=audio.voice,
        want_audio=want_audio,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        sampling=Sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed),
    )
    return ChatPlan(request, body.stream, fmt)


def _check_message(i: int, message: dict[str, Any]) -> None:
    where = f"messages[{i}]"
    if message.get("role") not in ("system", "user", "assistant", "developer", "tool"):
        raise ApiError(400, f"{where}.role must be system, user, assistant, developer or tool", "messages")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of content parts", "messages")
    for j, part in enumerate(content):
        _check_part(f"{where}.content[{j}]", part)


def _check_part(where: str, part: Any) -> None:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.text must be a string", "messages")
    elif kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
            raise ApiError(400, f"{where}.input_audio must be {{data: base64, format}}", "messages")
        _check_base64(where, audio["data"])
    elif kind in ("image_url", "audio_url"):
        url = (part.get(kind) or {}).get("url") if isinstance(part.get(kind), dict) else None
        if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
            raise ApiError(400, f"{where}.{kind}.url must be a base64 data URI (URLs are not fetched)", "messages")
        _check_base64(where, url.partition(";base64,")[2])
    else:
        raise ApiError(400, f"{where}.type {kind!r} is not supported; use text, input_audio, image_url or audio_url", "messages")


def _check_base64(where: str, data: str) -> None:
    try:
        base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: the data is not valid base64", "messages") from None


async def create_chat(ctx: ServeContext, request: Request, raw: bytes) -> Response:
    plan = parse_chat(raw, ctx)
    if ctx.engine is not None and not supports_chat(ctx.engine.info):
        raise ApiError(404, f"model {ctx.model_name} does not support chat completions", "model")
    gen = await start_generation(ctx, request, plan.request, api="chat")
    assembler = ChatAssembler(ctx.model_name, plan.request.want_audio)
    if plan.stream:
        return GenerationStream(gen, assembler.stream(gen), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Request-Id": gen.req_id})
    return JSONResponse(await assembler.whole(gen, plan.audio_format))


class ChatAssembler:
    """Builds OpenAI chat responses from the engine's (pcm, text) outputs."""

    def __init__(self, model: str, want_audio: bool) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.audio_id = f"audio-{uuid.uuid4().hex}"
        self.model, self.want_audio = model, want_audio
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    async def whole(self, gen: Generation, fmt: str) -> dict:
        texts: list[str] = []
        pieces: list[np.ndarray] = []
        async for pcm, text in gen.outputs(count_error=False):  # a failure is raised: the app's handler counts it
            if text:
                texts.append(text)
            if pcm is not None and len(pcm):
                pieces.append(pcm)
        if gen.error is not None:
            raise gen.error
        text = "".join(texts)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.want_audio:
            pcm = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
            # the text is both the message content (what vLLM-Omni clients read) and the audio's transcript
            # (what OpenAI's audio-output clients read)
            message["audio"] = {
                "id": self.audio_id,
                "data": base64.b64encode(encode_file(pcm, fmt)).decode(),
                "expires_at": self.created + 3600,
                "transcript": text,
            }
        return self._envelope("chat.completion", [{"index": 0, "message": message, "finish_reason": gen.finish_reason}])

    async def stream(self, gen: Generation) -> AsyncIterator[bytes]:
        yield self._chunk({"role": "assistant", "content": ""})
        async for pcm, text in gen.outputs():
            if text:
                delta: dict[str, Any] = {"content": text}
                if self.want_audio:
                    delta["audio"] = {"id": self.audio_id, "transcript": text}
                yield self._chunk(delta)
            if pcm is not None and len(pcm) and self.want_audio:
                yield self._chunk({"audio": {"id": self.audio_id, "data": base64.b64encode(to_s16le(pcm)).decode()}})
        if gen.error is not None:
            yield _data(gen.error.body())
        else:
            yield self._chunk({}, gen.finish_reason)
        yield b"data: [DONE]\n\n"

    def _chunk(self, delta: dict, finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        return _data(self._envelope("chat.completion.chunk", [choice]))


def _data(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
