"""Stage implementations by registry key ("fake.ar", "qwen3_tts.talker", ...), never by class path.

A model family module registers builders with ``@register(key)``; ``build_worker`` imports the
family module named by the key's prefix on first use, so only the families a profile uses get
imported (a fake stage process never imports torch). A family may also register a request
validator and its ``ModelInfo`` for the frontend.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from omniloop.scheduler.interface import Scheduler


class Worker(NamedTuple):
    scheduler: Scheduler
    runner: Any  # omniloop.gpu.runner.Runner: submit(plan) -> asyncio.Future, close()


class ModelInfo(msgspec.Struct, frozen=True):
    name: str
    task_types: tuple[str, ...] = ()
    speakers: tuple[str, ...] = ()
    languages: tuple[str, ...] = ()
    sample_rate: int = 24000
    supports_chat: bool = False  # takes ChatRequest (a thinker stage first), not only SpeechRequest


Builder = Callable[[Any, Any], Worker]  # (StageConfig, Profile) -> Worker
Validator = Callable[[Any, Any], None]  # (request, Profile) -> None, raises RequestError
InfoFn = Callable[[Any], ModelInfo]  # (Profile) -> ModelInfo

_builders: dict[str, Builder] = {}
_validators: dict[str, Validator] = {}
_infos: dict[str, InfoFn] = {}


def family_of(key: str) -> str:
    family, sep, _ = key.partition(".")
    if not sep or not family.isidentifier():
        raise KeyError(f"registry key {key!r} must look like '<family>.<stage>', e.g. 'fake.ar'")
    return family


def register(key: str) -> Callable[[Builder], Builder]:
    family_of(key)

    def decorate(fn: Builder) -> Builder:
        if key in _builders and _builders[key] is not fn:
            raise KeyError(f"registry key {key!r} is registered twice")
        _builders[key] = fn
        return fn

    return decorate


def register_validator(family: str) -> Callable[[Validator], Validator]:
    def decorate(fn: Validator) -> Validator:
        _validators[family] = fn
        return fn

    return decorate


def register_info(family: str) -> Callable[[InfoFn], InfoFn]:
    def decorate(fn: InfoFn) -> InfoFn:
        _infos[family] = fn
        return fn

    return decorate


def _load_family(key: str) -> str:
    family = family_of(key)
    try:
        importlib.import_module(f"omniloop.models.{family}")
    except ModuleNotFoundError as exc:
        if exc.name != f"omniloop.models.{family}":
            raise
        raise KeyError(f"unknown model family {family!r} (from registry key {key!r})") from None
    return family


# Stages placed as threads of one process are built one at a time: a CUDA graph capture in one stage fails
# ("operation not permitted when stream is capturing") on another stage's concurrent start-up work, such
# as a cuDNN algorithm search or a copy on the legacy default stream.
_BUILD_LOCK = threading.Lock()


def build_worker(stage: Any, profile: Any) -> Worker:
    """Build the stage's scheduler and runner (inside the actor, on its loop's thread)."""
    _load_family(stage.model)
    builder = _builders.get(stage.model)
    if builder is None:
        known = sorted(k for k in _builders if k.startswith(family_of(stage.model) + "."))
        raise KeyError(f"stage {stage.name!r}: no model registered as {stage.model!r} (known: {known})")
    with _BUILD_LOCK:
        if stage.device != "cpu":
            from omniloop.gpu.backends import configure_cuda_stage  # torch only for a GPU stage

            configure_cuda_stage()
        return builder(stage, profile)


def validator_for(key: str) -> Validator | None:
    return _validators.get(_load_family(key))


def info_for(key: str, profile: Any) -> ModelInfo:
    fn = _infos.get(_load_family(key))
    return fn(profile) if fn is not None else ModelInfo(name=profile.name)
