"""Exceptions that cross package boundaries. Each names what is wrong, never just "failed"."""

from __future__ import annotations


class OmniloopError(Exception):
    """Base of every omniloop error."""


class RequestError(OmniloopError):
    """A request the engine refuses or cannot serve; ``status`` is the HTTP status the server returns
    (400 bad input, 429 too many pending requests, 503 engine not ready)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def __repr__(self) -> str:
        return f"RequestError({self.status}, {self.message!r})"


class StageError(OmniloopError):
    """A stage actor failed as a whole (start-up, death); ``stage`` names it."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(f"stage {stage!r}: {message}")
        self.stage = stage


class StageStartupError(StageError):
    """A stage did not report ready: its own error, its exit code, or a timeout."""


class FrameError(OmniloopError, ValueError):
    """A malformed or truncated multipart message. ``req_id`` is set when the header was readable far
    enough to tell which request it belonged to, so that request (and only it) can be failed; ``req_ids``
    names every request the message carried (one, or each of a ``Chunks`` batch's)."""

    def __init__(self, message: str, req_id: str | None = None, req_ids: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__(message if req_id is None else f"{message} (req_id={req_id!r})")
        self.req_id = req_id
        self.req_ids = tuple(req_ids) if req_ids else (() if req_id is None else (req_id,))


class ObserverClosed(OmniloopError):
    """A step was still pending when its runner/observer was closed."""
