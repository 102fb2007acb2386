"""``run_server``: the engine, the HTTP app and the ZMQ front end in one uvloop event loop.

Order of life: bind the HTTP port first (a port in use fails in a second, before weights load), serve
/health at once and /ready when the engine is up; on SIGTERM/SIGINT stop admitting (503), let in-flight
requests finish for up to ``shutdown_timeout_s``, abort the rest with a clear error, stop uvicorn,
stop the engine (every actor), return 0. A second SIGINT skips the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import time
from typing import Any, Iterator

import uvicorn
import uvloop

from omniloop.log import get_logger
from omniloop.serve.context import ServeContext
from omniloop.serve.http import DEFAULT_MAX_BODY_BYTES, build_app
from omniloop.serve.metrics import ServeMetrics
from omniloop.serve.progress import listening, starting
from omniloop.serve.ref_audio import RefAudioResolver

log = get_logger(__name__)

ENGINE_SHUTDOWN_TIMEOUT_S = 30.0


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: ours drains first, and uvicorn's re-raises the
    signal after serving, which would turn a clean shutdown into a death by SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def run_server(
    profile: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    zmq_addr: str | None = None,
    api_key: str | None = None,
    ref_audio_dirs: list[str] = [],  # noqa: B006 - never mutated; the signature the CLI calls
    shutdown_timeout_s: float = 30.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> int:
    """Serve until SIGTERM/SIGINT; the process exit code."""
    try:
        sock = _bind(host, port)
    except OSError as exc:
        print(f"omniloop serve: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return uvloop.run(_serve(profile, sock, zmq_addr, api_key, list(ref_audio_dirs), shutdown_timeout_s, max_body_bytes))


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def _serve(profile: Any, sock: socket.socket, zmq_addr: str | None, api_key: str | None,
                 ref_audio_dirs: list[str], shutdown_timeout_s: float, max_body_bytes: int) -> int:
    from omniloop.actors.engine import Engine  # heavy (spawns actors); keep module import cheap

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    num_signals = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal num_signals
        num_signals += 1
        log.info("shutdown requested", signal=sig.name, drain_timeout_s=0 if num_signals > 1 else shutdown_timeout_s)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    ctx = ServeContext(model_name=profile.name, max_text_chars=profile.max_text_chars,
                       metrics=ServeMetrics(), ref_audio=RefAudioResolver(ref_audio_dirs))
    app = build_app(ctx, api_key, max_body_bytes)
    server = _Uvicorn(uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                                     timeout_graceful_shutdown=5, server_header=False))
    http_task = asyncio.create_task(server.serve(sockets=[sock]))
    t0 = time.monotonic()
    engine: Any = None
    zmq_front: Any = None
    exit_code = 0
    try:
        engine = await _start_engine(Engine, profile, stop)
        if engine is not None:
            ctx.engine = engine
            if zmq_addr:
                from omniloop.serve.zmq_api import ZmqFrontend

                zmq_front = ZmqFrontend(ctx, zmq_addr)
                zmq_front.start()
            host, port = sock.getsockname()[:2]
            listening(profile.name, f"http://{host}:{port}", zmq_addr, time.monotonic() - t0)
            await _first_of(stop.wait(), http_task)
    except Exception as exc:  # engine start-up failure: say why, still stop everything cleanly
        print(f"omniloop serve: the engine failed to start: {exc}", file=sys.stderr)
        exit_code = 1
    finally:
        drain_s = 0.0 if num_signals > 1 else shutdown_timeout_s
        num_aborted = await ctx.drain(drain_s)
        if num_aborted:
            log.warning("aborted requests still running after the drain timeout", num_aborted=num_aborted)
        if zmq_front is not None:
            await zmq_front.close()
        server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await http_task
        if engine is not None:
            await engine.shutdown(ENGINE_SHUTDOWN_TIMEOUT_S)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return exit_code


async def _start_engine(engine_cls: Any, profile: Any, stop: asyncio.Event) -> Any:
    """The started engine, or None when a signal arrived first (the start is then cancelled; the
    Engine's own cancellation path stops whatever actors it had spawned)."""
    with starting(profile.name, [s.name for s in profile.stages]):
        start = asyncio.create_task(engine_cls.start(profile))
        await _first_of(stop.wait(), start)
        if start.done():
            return start.result()
        start.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await start
        return None


async def _first_of(*aws: Any) -> None:
    tasks = [a if isinstance(a, asyncio.Task) else asyncio.ensure_future(a) for a in aws]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task, original in zip(tasks, aws):
        if task is not original and not task.done():
            task.cancel()
