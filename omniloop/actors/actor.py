"""Where an actor lives: its own process (multiprocessing 'spawn', the default) or its own thread.

Either way the actor gets a fresh uvloop loop and runs ``StageActor.run`` on it until Shutdown,
SIGTERM (processes) or a fatal error; the process/thread ends with the returned exit code
(0 clean, 1 fatal error after start, 2 failed to start). A process receives its ``ActorSpec`` as
msgpack bytes, so nothing but a bytes object crosses the spawn boundary.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import signal
import threading
from collections.abc import Callable

import msgspec
import uvloop

from omniloop.profile import Profile

EXIT_OK = 0
EXIT_FATAL = 1
EXIT_START_FAILED = 2


class ActorSpec(msgspec.Struct, frozen=True):
    """Everything an actor needs to start: its stage, the profile and the addresses it talks to."""

    stage: str
    profile: Profile
    inbox: str  # bound by the actor
    next: str  # downstream stage's inbox, or the frontend's for the last stage
    frontend: str  # the frontend's inbox: Ready, Stats, text deltas, request errors


class ActorHandle:
    """The supervisor's view of one actor. ``exitcode`` is None while it runs."""

    name: str

    @property
    def exitcode(self) -> int | None:
        raise NotImplementedError

    def terminate(self) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def join(self, timeout_s: float | None = None) -> None:
        raise NotImplementedError


class ProcessHandle(ActorHandle):
    def __init__(self, spec: ActorSpec) -> None:
        self.name = spec.stage
        ctx = multiprocessing.get_context("spawn")
        # daemon: if the frontend process dies without shutting down, its stages go with it.
        self.process = ctx.Process(
            target=process_main, args=(msgspec.msgpack.encode(spec),), name=f"omniloop-{spec.stage}", daemon=True
        )
        self.process.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def terminate(self) -> None:
        if self.process.exitcode is None:
            self.process.terminate()

    def kill(self) -> None:
        if self.process.exitcode is None:
            self.process.kill()

    def join(self, timeout_s: float | None = None) -> None:
        self.process.join(timeout_s)

    def release(self) -> None:
        if self.process.exitcode is not None:
            self.process.close()


class ThreadHandle(ActorHandle):
    """An actor on a thread of this process; ``on_exit(exitcode)`` runs on that thread as it ends."""

    def __init__(self, spec: ActorSpec, on_exit: Callable[[int], None]) -> None:
        from omniloop.actors.stage import StageActor  # stage imports this module

        self.name = spec.stage
        self.actor = StageActor(spec)
        self._exitcode: int | None = None
        self._on_exit = on_exit
        self.thread = threading.Thread(target=self._main, name=f"omniloop-{spec.stage}", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        code = EXIT_FATAL
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                code = runner.run(self.actor.run())
        finally:
            self._exitcode = code
            self._on_exit(code)

    @property
    def exitcode(self) -> int | None:
        return self._exitcode

    def terminate(self) -> None:
        self.actor.request_stop("terminate")

    kill = terminate  # a thread cannot be killed; asking it to stop is all there is

    def join(self, timeout_s: float | None = None) -> None:
        self.thread.join(timeout_s)


def freeze_startup_heap() -> None:
    """Everything start-up built (torch, the models, captured graphs) lives as long as the process serves: keep it
    out of the cyclic collector, whose full pass over it held the GIL ~60-100 ms, stalling every loop thread at
    once (a stream's whole buffer at first audio). Garbage first: what is frozen is never collected. The engine
    unfreezes at shutdown (``gc.unfreeze``); a stage process just exits."""
    gc.collect()
    gc.freeze()


def process_main(spec_bytes: bytes) -> None:
    """Entry point of an actor process."""
    from omniloop.actors.stage import StageActor
    from omniloop.log import setup_logging

    setup_logging()
    # Ctrl-C reaches the whole process group; the frontend shuts stages down in order instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = msgspec.msgpack.decode(spec_bytes, type=ActorSpec)
    actor = StageActor(spec)

    async def main() -> int:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, actor.request_stop, "SIGTERM")
        return await actor.run(freeze_heap=True)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        code = runner.run(main())
    raise SystemExit(code)  # multiprocessing turns this into the process's exit code


def start_actor(spec: ActorSpec, placement: str, on_thread_exit: Callable[[int], None]) -> ActorHandle:
    if placement == "process":
        return ProcessHandle(spec)
    if placement == "thread":
        return ThreadHandle(spec, on_thread_exit)
    raise ValueError(f"stage {spec.stage!r}: placement must be 'process' or 'thread', got {placement!r}")
