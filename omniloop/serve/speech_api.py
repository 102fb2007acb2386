"""POST /v1/audio/speech: OpenAI's fields plus vLLM-Omni's Qwen3-TTS extensions -> SpeechRequest.

Unknown fields are accepted and ignored (logged), as vLLM does, so newer OpenAI SDKs keep working.
Response modes, as in vLLM-Omni: no ``stream_format`` and ``stream=false`` -> the whole file;
``stream_format="audio"`` -> raw bytes as produced (pcm s16le, or wav with a 0xFFFFFFFF length);
``stream_format="sse"`` or ``stream=true`` -> ``speech.audio.delta`` / ``speech.audio.done`` events.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import AsyncIterator

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from omniloop.log import get_logger
from omniloop.serve.api_errors import ApiError
from omniloop.serve.audio_format import CONTENT_TYPE, STREAMABLE, SUPPORTED, encode_file, to_s16le, wav_stream_header
from omniloop.serve.context import ServeContext
from omniloop.serve.generation import Generation, GenerationStream, StreamBroken, start_generation
from omniloop.serve.request_body import decode_body
from omniloop.transport.messages import Sampling, SpeechRequest

log = get_logger(__name__)

TASK_OF: dict[str, str] = {
    "customvoice": "custom_voice",
    "custom_voice": "custom_voice",
    "voicedesign": "voice_design",
    "voice_design": "voice_design",
    "base": "base",
}


class SpeechBody(msgspec.Struct, kw_only=True):
    """The JSON body. Field names are the public API; see docs (vLLM-Omni speech API)."""

    input: str
    model: str | None = None
    voice: str | None = None
    instructions: str | None = None
    response_format: str = "wav"
    speed: float = 1.0
    stream_format: str | None = None
    stream: bool = False
    task_type: str | None = None
    language: str | None = None
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    seed: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    initial_codec_chunk_frames: int | None = None


@dataclass(frozen=True)
class SpeechPlan:
    request: SpeechRequest
    response_format: str
    mode: str  # "file" | "audio" | "sse"


def parse_speech(raw: bytes, ctx: ServeContext) -> SpeechPlan:
    """Validate the body and map it to a SpeechRequest; raises ApiError naming the bad field."""
    body = decode_body(raw, SpeechBody, "/v1/audio/speech")
    if body.model is not None and body.model not in ctx.served_names():
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {sorted(ctx.served_names())}", "model")
    if not body.input.strip():
        raise ApiError(400, "input must not be empty", "input")
    if len(body.input) > ctx.max_text_chars:
        raise ApiError(400, f"input is {len(body.input)} characters; the limit is {ctx.max_text_chars}", "input")
    fmt = body.response_format.lower()
    if fmt not in SUPPORTED:
        raise ApiError(400, f"response_format {body.response_format!r} is not supported; use one of {list(SUPPORTED)}", "response_format")
    if body.speed != 1.0:
        raise ApiError(400, f"speed {body.speed} is not supported; only 1.0", "speed")
    mode = _mode(body)
    if mode != "file" and fmt not in STREAMABLE:
        raise ApiError(400, f"streaming needs response_format pcm or wav, not {fmt!r}", "response_format")
    request = _speech_request(body, ctx)
    if ctx.engine is not None:
        check_against_model(request, ctx.engine.info)
    return SpeechPlan(request, fmt, mode)


def check_against_model(request: SpeechRequest, info: object) -> None:
    """Voice, language and task against what the loaded model lists (an empty list means "any")."""
    speakers = {s.lower() for s in getattr(info, "speakers", ())}
    if request.speaker is not None and speakers and request.speaker.lower() not in speakers:
        raise ApiError(400, f"voice {request.speaker!r} is not available; voices: {sorted(speakers)}", "voice")
    languages = {lang.lower() for lang in getattr(info, "languages", ())}
    if request.language is not None and languages and request.language.lower() not in languages | {"auto"}:
        raise ApiError(400, f"language {request.language!r} is not supported; languages: {sorted(languages)}", "language")
    tasks = set(getattr(info, "task_types", ()))
    if request.task is not None and tasks and request.task not in tasks:
        raise ApiError(400, f"task_type {request.task!r} is not supported by this model; it supports {sorted(tasks)}", "task_type")


def _mode(body: SpeechBody) -> str:
    if body.stream_format is None:
        return "sse" if body.stream else "file"
    if body.stream_format not in ("audio", "sse"):
        raise ApiError(400, f"stream_format must be 'audio' or 'sse', not {body.stream_format!r}", "stream_format")
    return body.stream_format


def _speech_request(body: SpeechBody, ctx: ServeContext) -> SpeechRequest:
    task = None
    if body.task_type is not None:
        task = TASK_OF.get(body.task_type.lower())
        if task is None:
            raise ApiError(400, f"task_type {body.task_type!r} is unknown; use CustomVoice, VoiceDesign or Base", "task_type")
    elif body.ref_audio is not None or body.ref_text is not None:
        task = "base"  # vLLM-Omni infers Base from reference inputs
    _check_ranges(body)
    ref_audio = ctx.ref_audio.resolve(body.ref_audio) if body.ref_audio is not None else None
    # The voice only selects a preset speaker; cloning and design take theirs from ref_audio/instructions.
    speaker = body.voice if task in (None, "custom_voice") else None
    sampling = Sampling(
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
    )
    return SpeechRequest(
        text=body.input,
        task=task,
        speaker=speaker,
        language=body.language,
        instructions=body.instructions or None,
        ref_audio=ref_audio,
        ref_text=body.ref_text,
        x_vector_only=bool(body.x_vector_only_mode),
        sampling=sampling,
        max_frames=body.max_new_tokens,
        initial_chunk_frames=body.initial_codec_chunk_frames,
    )


def _check_ranges(body: SpeechBody) -> None:
    checks = [
        ("temperature", body.temperature, lambda v: v >= 0, "must be >= 0"),
        ("top_k", body.top_k, lambda v: v >= 0, "must be >= 0 (0 = off)"),
        ("top_p", body.top_p, lambda v: 0 < v <= 1, "must be in (0, 1]"),
        ("repetition_penalty", body.repetition_penalty, lambda v: v > 0, "must be > 0"),
        ("max_new_tokens", body.max_new_tokens, lambda v: v >= 1, "must be >= 1"),
        ("initial_codec_chunk_frames", body.initial_codec_chunk_frames, lambda v: v >= 1, "must be >= 1"),
    ]
    for name, value, ok, rule in checks:
        if value is not None and not ok(value):
            raise ApiError(400, f"{name} {value} {rule}", name)


async def create_speech(ctx: ServeContext, request: Request, raw: bytes) -> Response:
    plan = parse_speech(raw, ctx)
    gen = await start_generation(ctx, request, plan.request, api="speech")
    if plan.mode == "file":
        return await _whole_file(ctx, gen, plan.response_format)
    body = _sse_events(ctx, gen, plan.response_format) if plan.mode == "sse" else _raw_stream(ctx, gen, plan.response_format)
    media = "text/event-stream" if plan.mode == "sse" else CONTENT_TYPE[plan.response_format]
    headers = {"Cache-Control": "no-cache", "X-Request-Id": gen.req_id}
    return GenerationStream(gen, body, media_type=media, headers=headers)


async def _whole_file(ctx: ServeContext, gen: Generation, fmt: str) -> Response:
    pieces: list[np.ndarray] = []
    async for pcm, _ in gen.outputs(count_error=False):  # a failure is raised: the app's handler counts it
        if pcm is not None:
            pieces.append(pcm)
    if gen.error is not None:
        raise gen.error
    pcm = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
    headers = {"X-Request-Id": gen.req_id, "X-Finish-Reason": gen.finish_reason or ""}
    return Response(encode_file(pcm, fmt), media_type=CONTENT_TYPE[fmt], headers=headers)


async def _raw_stream(ctx: ServeContext, gen: Generation, fmt: str) -> AsyncIterator[bytes]:
    header = wav_stream_header() if fmt == "wav" else b""
    async for pcm, _ in gen.outputs():
        if pcm is not None and len(pcm):
            yield header + to_s16le(pcm)
            header = b""
    if gen.error is not None:
        # No byte-level way to say "failed" in a raw stream: end it without the final chunk so the
        # client sees a truncated transfer instead of a clean, short file.
        raise StreamBroken(gen.error.message)
    if header:
        yield header


async def _sse_events(ctx: ServeContext, gen: Generation, fmt: str) -> AsyncIterator[bytes]:
    header = wav_stream_header() if fmt == "wav" else b""
    async for pcm, _ in gen.outputs():
        if pcm is not None and len(pcm):
            audio = base64.b64encode(header + to_s16le(pcm)).decode()
            header = b""
            yield _sse("speech.audio.delta", {"audio": audio, "response_format": fmt})
    if gen.error is not None:
        yield _sse("speech.audio.error", gen.error.body())
        return
    yield _sse("speech.audio.done", {"finish_reason": gen.finish_reason, "usage": {"output_tokens": gen.num_frames}})


def _sse(event: str, data: dict) -> bytes:
    payload = {"type": event, **data}
    return f"event: {event}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()
