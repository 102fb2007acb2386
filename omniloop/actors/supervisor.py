"""Supervisor: starts a profile's actors, waits for each to report Ready, watches them, stops them.

It lives in the frontend's loop. Ready messages arrive on the frontend inbox and are handed to
``on_ready``. Process deaths are seen by one watcher thread blocked in
``multiprocessing.connection.wait`` on the process sentinels (no polling interval) and posted into
the loop through the doorway; thread actors post their own exit. A death after start-up is reported
to the engine through ``on_death(stage, exitcode)``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable
from multiprocessing.connection import wait as wait_sentinels

from omniloop.actors.actor import EXIT_START_FAILED, ActorHandle, ActorSpec, ProcessHandle, start_actor
from omniloop.actors.doorway import Doorway
from omniloop.errors import StageStartupError
from omniloop.log import get_logger
from omniloop.profile import Profile
from omniloop.transport.messages import Ready

log = get_logger(__name__)

STAGE_EXIT_TIMEOUT_S = 5.0
READY_GRACE_S = 1.0


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class Addresses:
    """Where each inbox binds, for one run. ipc socket files live in ``run_dir`` (removed at close).

    ``auto``: an inbox whose owner and every sender live in the frontend's process (the frontend, stages
    placed as threads) is inproc — no socket file, no kernel round trip: on CPU a 64-chunk step crossed in
    85 us instead of 173 us over ipc (``tools/bench_transport.py``) — and any other is ipc."""

    def __init__(self, profile: Profile) -> None:
        self.run_dir: str | None = None
        names = [s.name for s in profile.stages] + ["frontend"]
        if profile.transport == "auto":
            local = _local_inboxes(profile)
            run = uuid.uuid4().hex[:12]
            if len(local) < len(names):
                self.run_dir = tempfile.mkdtemp(prefix="omniloop-")
            self.of = {n: f"inproc://omniloop-{run}-{n}" if n in local else f"ipc://{self.run_dir}/{n}.sock"
                       for n in names}
        elif profile.transport == "inproc":
            threads_only = all(s.placement == "thread" for s in profile.stages)
            if not threads_only:
                raise ValueError(f"profile {profile.name!r}: transport inproc needs placement 'thread' for every stage")
            run = uuid.uuid4().hex[:12]
            self.of = {n: f"inproc://omniloop-{run}-{n}" for n in names}
        elif profile.transport == "ipc":
            self.run_dir = tempfile.mkdtemp(prefix="omniloop-")
            self.of = {n: f"ipc://{self.run_dir}/{n}.sock" for n in names}
        elif profile.transport == "tcp":
            self.of = {n: f"tcp://127.0.0.1:{_free_port()}" for n in names}
        else:
            raise ValueError(f"profile {profile.name!r}: unknown transport {profile.transport!r} (inproc, ipc, tcp)")

    def remove(self) -> None:
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None


def _local_inboxes(profile: Profile) -> set[str]:
    """Inboxes (stage names, "frontend") bound and fed only by the frontend's process: the frontend sends to
    every stage, every stage to the frontend and to its next stage."""
    in_frontend = {s.name for s in profile.stages if s.placement == "thread"}
    local = {"frontend"} if len(in_frontend) == len(profile.stages) else set()
    for stage in profile.stages:
        previous = [src for src, dst in profile.edges if dst == stage.name]
        if stage.name in in_frontend and all(p in in_frontend for p in previous):
            local.add(stage.name)
    return local


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Supervisor:
    def __init__(self, profile: Profile, doorway: Doorway, on_death: Callable[[str, int | None], None]) -> None:
        self.profile = profile
        self.addresses = Addresses(profile)
        self.handles: dict[str, ActorHandle] = {}
        self._doorway = doorway
        self._on_death = on_death
        self._ready: dict[str, asyncio.Future] = {}
        self._exits: dict[str, asyncio.Future] = {}
        self._is_stopping = False
        self._watch_lock = threading.Lock()
        self._watched: dict[int, ProcessHandle] = {}
        self._wake_r, self._wake_w = os.pipe()
        self._watcher = threading.Thread(target=self._watch, name="omniloop-supervisor-watch", daemon=True)
        self._watcher.start()

    @property
    def frontend_address(self) -> str:
        return self.addresses.of["frontend"]

    def address_of(self, stage: str) -> str:
        return self.addresses.of[stage]

    def is_alive(self, stage: str) -> bool:
        future = self._exits.get(stage)
        return future is not None and not future.done()

    async def start(self) -> None:
        """Spawn every stage (first to last), then wait for each Ready in that order."""
        loop = self._doorway.loop
        stages = self.profile.ordered_stages()
        for stage in stages:
            nxt = self.profile.next_of(stage.name)
            spec = ActorSpec(
                stage=stage.name,
                profile=self.profile,
                inbox=self.address_of(stage.name),
                next=self.address_of(nxt) if nxt is not None else self.frontend_address,
                frontend=self.frontend_address,
            )
            self._ready[stage.name] = loop.create_future()
            self._exits[stage.name] = loop.create_future()
            on_thread_exit = _poster(self._doorway, self._on_exit, stage.name)
            handle = start_actor(spec, stage.placement, on_thread_exit)
            self.handles[stage.name] = handle
            if isinstance(handle, ProcessHandle):
                with self._watch_lock:
                    self._watched[handle.sentinel] = handle
                os.write(self._wake_w, b"w")
            log.info("stage_spawned", stage=stage.name, placement=stage.placement, pid=getattr(handle, "pid", None))
        for stage in stages:
            try:
                await asyncio.wait_for(asyncio.shield(self._ready[stage.name]), self.profile.startup_timeout_s)
            except TimeoutError:
                raise StageStartupError(
                    stage.name, f"did not report ready within startup_timeout_s={self.profile.startup_timeout_s}"
                ) from None

    def on_ready(self, ready: Ready) -> None:
        future = self._ready.get(ready.stage)
        if future is None or future.done():
            log.warning("unexpected_ready", stage=ready.stage, ok=ready.ok)
            return
        if ready.ok:
            log.info("stage_reported_ready", stage=ready.stage, pid=ready.pid)
            future.set_result(ready)
        else:
            future.set_exception(StageStartupError(ready.stage, f"failed to start: {ready.error}"))

    def _on_exit(self, stage: str, thread_exitcode: int | None = None) -> None:
        handle = self.handles[stage]
        exitcode = handle.exitcode if thread_exitcode is None else thread_exitcode
        exit_future = self._exits[stage]
        if not exit_future.done():
            exit_future.set_result(exitcode)
        ready = self._ready[stage]
        if not ready.done():
            start_error = getattr(getattr(handle, "actor", None), "start_error", None)
            if start_error is not None:
                self._fail_ready(stage, f"failed to start: {start_error}")
            elif exitcode == EXIT_START_FAILED:
                # Its Ready(ok=False) travels through ZMQ and may lose the race with the sentinel;
                # give it a moment so the user sees the stage's own error, not just an exit code.
                self._doorway.loop.call_later(
                    READY_GRACE_S, self._fail_ready, stage, f"exited before reporting ready ({describe_exit(exitcode)})"
                )
            else:
                self._fail_ready(stage, f"exited before reporting ready ({describe_exit(exitcode)})")
        elif not self._is_stopping:
            log.error("stage_died", stage=stage, exit=describe_exit(exitcode))
            self._on_death(stage, exitcode)

    def _fail_ready(self, stage: str, message: str) -> None:
        ready = self._ready[stage]
        if not ready.done():
            ready.set_exception(StageStartupError(stage, message))

    def _watch(self) -> None:
        """Watcher thread: sleeps until a watched process ends or the supervisor wakes it."""
        while True:
            with self._watch_lock:
                watched = dict(self._watched)
            ready = wait_sentinels([self._wake_r, *watched])
            for sentinel in ready:
                if sentinel == self._wake_r:
                    if os.read(self._wake_r, 64).endswith(b"q"):
                        return
                    continue
                with self._watch_lock:
                    handle = self._watched.pop(sentinel, None)
                if handle is not None:
                    # The sentinel can fire a moment before the child is reapable; join does the
                    # blocking waitpid here, off the loop, so exitcode is set when the loop reads it.
                    handle.join(STAGE_EXIT_TIMEOUT_S)
                    self._doorway.post(self._on_exit, handle.name)

    async def shutdown(self, send_shutdown: Callable[[str], None], timeout_s: float = STAGE_EXIT_TIMEOUT_S) -> None:
        """First to last: ask each live stage to stop, wait, then terminate, then kill. Always cleans up."""
        self._is_stopping = True
        try:
            for stage in self.profile.ordered_stages():
                if stage.name in self.handles:
                    await self._stop_one(stage.name, send_shutdown, timeout_s)
        finally:
            self.close()

    async def _stop_one(self, stage: str, send_shutdown: Callable[[str], None], timeout_s: float) -> None:
        handle, exit_future = self.handles[stage], self._exits[stage]
        if not exit_future.done():
            send_shutdown(stage)
        for action in (None, handle.terminate, handle.kill):
            if exit_future.done():
                break
            if action is not None:
                log.warning("stage_force_stop", stage=stage, action=action.__name__)
                action()
            # ``timeout_s`` is the grace to exit on its own; after terminate / kill, the supervisor's own wait
            wait_s = timeout_s if action is None else min(timeout_s, STAGE_EXIT_TIMEOUT_S)
            try:
                await asyncio.wait_for(asyncio.shield(exit_future), wait_s)
            except TimeoutError:
                continue
        if not exit_future.done():
            log.error("stage_did_not_stop", stage=stage)
            return
        handle.join(timeout_s)
        log.info("stage_exited", stage=stage, exit=describe_exit(exit_future.result()))

    def close(self) -> None:
        """Stop the watcher, reap processes, remove socket files. Idempotent."""
        self._is_stopping = True
        if self._watcher.is_alive():
            os.write(self._wake_w, b"q")
            self._watcher.join()
        if self._wake_r >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
        for handle in self.handles.values():
            if isinstance(handle, ProcessHandle) and handle.exitcode is None:
                handle.kill()
                handle.join(STAGE_EXIT_TIMEOUT_S)
            if isinstance(handle, ProcessHandle):
                handle.release()
        for future in (*self._ready.values(), *self._exits.values()):
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()  # already reported (or superseded by the first failure)
        self.addresses.remove()


def _poster(doorway: Doorway, fn: Callable[..., None], *args: object) -> Callable[[int], None]:
    def post(exitcode: int) -> None:
        doorway.post(fn, *args, exitcode)

    return post
