"""What a person at the terminal sees while the engine starts: a spinner naming the stages, then one
line saying where the server listens. Written to stderr so stdout stays free for tools."""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from rich.console import Console

_console = Console(stderr=True)


@contextlib.contextmanager
def starting(profile_name: str, stage_names: list[str]) -> Iterator[None]:
    status = f"starting [bold]{profile_name}[/]: stages {', '.join(stage_names)} (loading weights, warming up)"
    if not _console.is_terminal:
        yield  # no spinner in logs; the 'listening' line is enough
        return
    with _console.status(status, spinner="dots"):
        yield


def listening(profile_name: str, http_url: str, zmq_addr: str | None, startup_s: float) -> None:
    zmq_part = f", zmq {zmq_addr}" if zmq_addr else ""
    print(f"omniloop: serving {profile_name} on {http_url}{zmq_part} (ready in {startup_s:.1f} s)",
          file=sys.stderr, flush=True)
