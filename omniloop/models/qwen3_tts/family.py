"""What the frontend and every Qwen3-TTS stage agree on: where the checkpoint is, its config, request
validation and the model's public info.

With no ``model_dir`` in the profile, the embedded tiny layout (``tiny.py``) is used with random weights:
the server works at once on any machine, and says loudly that its audio is noise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omniloop.log import get_logger
from omniloop.models.qwen3_tts.config import TtsConfig, load_tts_config
from omniloop.models.qwen3_tts.validate import validate_speech_request
from omniloop.models.registry import ModelInfo, Worker, register, register_info, register_validator
from omniloop.errors import RequestError
from omniloop.transport.messages import SpeechRequest

log = get_logger(__name__)
BUILTIN = "builtin:"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    load_format: str  # "auto" | "dummy"
    is_tiny: bool  # the embedded random-weight default


def resolve_checkpoint(profile: Any) -> Checkpoint:
    """The checkpoint a profile names, or an embedded layout with random weights: none named -> the tiny
    one; ``builtin:<size>[:<variant>]`` (size tiny | 0.6b | 1.7b) -> the released shapes, for benchmarks."""
    if profile.model_dir and profile.model_dir.startswith(BUILTIN):
        from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint

        size, _, variant = profile.model_dir[len(BUILTIN):].partition(":")
        return Checkpoint(ensure_tiny_checkpoint(variant or "custom_voice", size=size), "dummy",
                          is_tiny=size == "tiny")
    if profile.model_dir:
        path = Path(profile.model_dir).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model_dir {str(path)!r}: no config.json there (expected the released "
                                    "Qwen3-TTS layout: config.json, model.safetensors, speech_tokenizer/, ...)")
        return Checkpoint(path, profile.load_format, is_tiny=False)
    from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint

    return Checkpoint(ensure_tiny_checkpoint("custom_voice"), "dummy", is_tiny=True)


@functools.lru_cache(maxsize=8)
def _config(path: Path) -> TtsConfig:
    return load_tts_config(path)


def config_of(profile: Any) -> TtsConfig:
    return _config(resolve_checkpoint(profile).path)


@register_validator("qwen3_tts")
def validate(request: Any, profile: Any) -> None:
    if not isinstance(request, SpeechRequest):
        raise RequestError(400, f"model {profile.name!r} is text-to-speech only; it takes speech requests, "
                                "not chat requests")
    validate_speech_request(config_of(profile), request, profile.max_text_chars)


@register_info("qwen3_tts")
def info(profile: Any) -> ModelInfo:
    ckpt = resolve_checkpoint(profile)
    cfg = config_of(profile)
    if ckpt.is_tiny:
        log.warning("no model_dir given: serving a TINY Qwen3-TTS with RANDOM weights (the audio is noise); "
                    "pass --model DIR for a real checkpoint", path=str(ckpt.path))
    elif ckpt.load_format == "dummy":
        log.warning("load_format dummy: real shapes, RANDOM weights (benchmarking only)", path=str(ckpt.path))
    name = "qwen3-tts-tiny-random" if ckpt.is_tiny else ckpt.path.name.split("-v1-")[0]
    return ModelInfo(name=name, task_types=(cfg.model_type,), speakers=tuple(sorted(cfg.speakers)),
                     languages=tuple(cfg.languages))


# The stage builders import torch and the model code; only the stage actors that run them pay for it.
@register("qwen3_tts.talker")
def build_talker(stage: Any, profile: Any) -> Worker:
    from omniloop.models.qwen3_tts.stage_talker import build_talker as build

    return build(stage, profile)


@register("qwen3_tts.codec")
def build_codec(stage: Any, profile: Any) -> Worker:
    from omniloop.models.qwen3_tts.stage_codec import build_codec as build

    return build(stage, profile)
