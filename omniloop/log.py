"""Logging through structlog: readable on a terminal, JSON lines with ``--log-format json``.

Configured once per process (the CLI calls ``setup_logging``; spawned actor processes call it again
with the same settings, carried in the environment so children log like their parent).
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_ENV_FORMAT = "OMNILOOP_LOG_FORMAT"
_ENV_LEVEL = "OMNILOOP_LOG_LEVEL"


def setup_logging(fmt: str | None = None, level: str | None = None) -> None:
    """``fmt``: "console" | "json" (default: console on a TTY, else console too); ``level``: INFO..."""
    fmt = fmt or os.environ.get(_ENV_FORMAT, "console")
    level = (level or os.environ.get(_ENV_LEVEL, "INFO")).upper()
    if fmt not in ("console", "json"):
        raise ValueError(f"log format must be console or json, got {fmt!r}")
    os.environ[_ENV_FORMAT] = fmt
    os.environ[_ENV_LEVEL] = level
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=False,
    )


class _Stderr:
    """Whatever ``sys.stderr`` is at the time of each write (it is replaced by test runners and daemons;
    holding the object seen at setup time would write into a closed stream later)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)
