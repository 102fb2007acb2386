"""Checks a ``SpeechRequest`` against the checkpoint before it is admitted; every failure is a 400 that
says what is wrong and, for names, what would have been valid. Where qwen-tts would silently ignore an
input (instructions on Base or the 0.6B CustomVoice model), we refuse it instead, so a client never
believes an input took effect when it did not."""

from __future__ import annotations

from omniloop.errors import RequestError
from omniloop.models.qwen3_tts.config import TASKS, TtsConfig
from omniloop.transport.messages import Sampling, SpeechRequest

BAD_REQUEST = 400


def _fail(message: str) -> RequestError:
    return RequestError(BAD_REQUEST, message)


def _check_sampling(cfg: TtsConfig, s: Sampling) -> None:
    g = cfg.generation
    for prefix, do_sample, temperature, top_k, top_p in (
            ("", s.do_sample if s.do_sample is not None else g.do_sample, s.temperature, s.top_k, s.top_p),
            ("sub_", s.sub_do_sample if s.sub_do_sample is not None else g.sub_do_sample, s.sub_temperature,
             s.sub_top_k, s.sub_top_p)):
        if temperature is not None and do_sample and temperature <= 0:
            raise _fail(f"sampling.{prefix}temperature must be > 0 when sampling, got {temperature}")
        if top_k is not None and top_k < 0:
            raise _fail(f"sampling.{prefix}top_k must be >= 0 (0 = off), got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise _fail(f"sampling.{prefix}top_p must be in (0, 1], got {top_p}")
    if s.repetition_penalty is not None and s.repetition_penalty <= 0:
        raise _fail(f"sampling.repetition_penalty must be > 0, got {s.repetition_penalty}")
    if s.seed is not None and not -(2**63) <= s.seed < 2**63:
        raise _fail(f"sampling.seed must fit in int64, got {s.seed}")


def validate_speech_request(cfg: TtsConfig, request: SpeechRequest, max_text_chars: int = 4096) -> None:
    """Raise ``RequestError(400, ...)`` if the checkpoint cannot serve ``request`` as given."""
    if not request.text or not request.text.strip():
        raise _fail("text is empty")
    if len(request.text) > max_text_chars:
        raise _fail(f"text has {len(request.text)} characters; the limit is {max_text_chars}")
    task = request.task or cfg.model_type
    if task not in TASKS:
        raise _fail(f"unknown task {task!r}; valid: {list(TASKS)}")
    if task != cfg.model_type:
        raise _fail(f"this checkpoint is a {cfg.model_type} model; task {task!r} needs a {task} checkpoint")
    language = (request.language or "auto").lower()
    if language not in cfg.languages:
        raise _fail(f"unknown language {request.language!r}; valid: {list(cfg.languages)}")

    if task == "custom_voice":
        if not request.speaker:
            raise _fail(f"task custom_voice needs a speaker; valid: {sorted(cfg.speakers)}")
        if request.speaker.lower() not in cfg.talker.spk_id:
            raise _fail(f"unknown speaker {request.speaker!r}; valid: {sorted(cfg.speakers)}")
    elif request.speaker:
        raise _fail(f"task {task} takes no speaker (got {request.speaker!r}); the voice comes from "
                    + ("the reference audio" if task == "base" else "the instructions"))
    if request.instructions and not cfg.accepts_instructions:
        raise _fail(f"this {cfg.model_type} checkpoint (size {cfg.model_size or '?'}) does not take instructions")

    if task == "base":
        if not request.ref_audio:
            raise _fail("task base needs ref_audio (the voice to clone)")
        if not request.x_vector_only and not (request.ref_text and request.ref_text.strip()):
            raise _fail("task base needs ref_text (the transcript of ref_audio) unless x_vector_only is true")
    elif request.ref_audio or request.ref_text or request.x_vector_only:
        raise _fail(f"ref_audio / ref_text / x_vector_only are only for task base, not {task}")

    if request.max_frames is not None and request.max_frames < 1:
        raise _fail(f"max_frames must be >= 1, got {request.max_frames}")
    if request.initial_chunk_frames is not None and request.initial_chunk_frames < 1:
        raise _fail(f"initial_chunk_frames must be >= 1, got {request.initial_chunk_frames}")
    _check_sampling(cfg, request.sampling)
