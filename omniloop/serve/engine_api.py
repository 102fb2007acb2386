"""What serve/ needs from the Engine (omniloop.actors.engine), as a Protocol.

Written down here so the HTTP and ZMQ front ends depend on the contract in docs/contracts.md and not
on the Engine class, and so the chat path can be exercised by any engine that speaks it.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Protocol

import numpy as np

from omniloop.transport.messages import ChatRequest, Finish, SpeechRequest


class Output(Protocol):
    pcm: np.ndarray | None  # float32 mono 24 kHz
    text: str | None
    finish: Finish | None  # set on the last item only


class EngineLike(Protocol):
    @property
    def info(self) -> Any: ...  # ModelInfo(name, task_types, speakers, languages, sample_rate)

    @property
    def is_ready(self) -> bool: ...

    def validate(self, request: SpeechRequest | ChatRequest) -> None: ...

    def generate(self, request: SpeechRequest | ChatRequest, req_id: str | None = None) -> AsyncIterator[Output]: ...

    def abort(self, req_id: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    async def shutdown(self, timeout_s: float = ...) -> None: ...


def supports_chat(info: Any) -> bool:
    """Whether the loaded model takes ChatRequest. ModelInfo may say so with ``supports_chat`` or by
    listing ``chat`` among its task types; anything else is a TTS-only model."""
    flag = getattr(info, "supports_chat", None)
    if flag is not None:
        return bool(flag)
    return "chat" in (getattr(info, "task_types", None) or ())


def is_success(reason: str) -> bool:
    return reason in ("stop", "length")
