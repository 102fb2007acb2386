"""The frontend: the Engine API (docs/contracts.md), living in the caller's event loop.

It owns one inbox that every stage sends to (Ready, Stats, text deltas, PCM, Finish), one outbox
per stage (Submit to the first, Abort broadcast, Stats queries, Shutdown), the supervisor, and
one ``Collector`` per request. Every request ends with exactly one Finish: the last stage's
stop/length, an error from any stage, abort (``abort()`` or the consumer leaving the iterator),
stage_died, or shutdown.
"""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import numpy as np

from omniloop.actors.actor import freeze_startup_heap
from omniloop.actors.collector import Collector, Output
from omniloop.actors.doorway import Doorway
from omniloop.actors.supervisor import STAGE_EXIT_TIMEOUT_S, Supervisor, describe_exit
from omniloop.actors.trace import Tracer
from omniloop.errors import FrameError, RequestError
from omniloop.log import get_logger
from omniloop.models.registry import ModelInfo, info_for, validator_for
from omniloop.profile import Profile
from omniloop.transport import batching
from omniloop.transport.channel import Delivery, Inbox, Outbox
from omniloop.transport.messages import (
    Abort,
    ChatRequest,
    Chunk,
    Chunks,
    Finish,
    Ready,
    Reason,
    Shutdown,
    SpeechRequest,
    Stats,
    Submit,
)

log = get_logger(__name__)

_NORMAL_END = (Reason.STOP.value, Reason.LENGTH.value)


class Engine:
    """Use ``await Engine.start(profile)``; the constructor alone starts nothing."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.supervisor: Supervisor | None = None
        self._info = info_for(profile.first_stage.model, profile)
        self._validator = validator_for(profile.first_stage.model)
        self._first = profile.first_stage.name
        self._last = profile.last_stage.name
        self._requests: dict[str, Collector] = {}  # by the caller's request id
        # The id a request has inside the pipeline, unique per submission: a caller may use an id again
        # as soon as its request ended, while the stages may still send output of the ended one.
        self._req_id_of: dict[str, str] = {}  # pipeline id -> caller's id
        self._outboxes: dict[str, Outbox] = {}
        self._inbox: Inbox | None = None
        self._doorway: Doorway | None = None
        self._stage_stats: dict[str, Stats] = {}
        self._stats_waiters: dict[str, asyncio.Future] = {}
        self._idle: asyncio.Event | None = None
        self._is_ready = False
        self._is_closed = False
        self._dead: str | None = None  # why the engine stopped serving, once a stage died
        self._num_submitted = 0
        self._num_finished: Counter[str] = Counter()
        self.tracer = Tracer("frontend")

    # ---- lifecycle
    @classmethod
    async def start(cls, profile: Profile) -> Engine:
        engine = cls(profile)
        await engine._start()
        return engine

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._doorway = Doorway(loop)  # the frontend's own: shutting it down must not touch others'
        self._idle = asyncio.Event()
        self._idle.set()
        try:
            self.supervisor = Supervisor(self.profile, self._doorway, self._on_stage_death)
            self._inbox = Inbox(self.supervisor.frontend_address, name="frontend-inbox")
            self._inbox.attach(loop, self._on_inbox)
            for stage in self.profile.stages:
                outbox = Outbox(self.supervisor.address_of(stage.name), name=f"frontend->{stage.name}")
                outbox.attach(loop)
                self._outboxes[stage.name] = outbox
            await self.supervisor.start()
        except BaseException:
            await self._stop_all(timeout_s=0.0)
            raise
        freeze_startup_heap()  # back to collectable at shutdown
        self._is_ready = True
        log.info("engine_ready", profile=self.profile.name, stages=self.profile.stage_names)

    @property
    def is_ready(self) -> bool:
        return self._is_ready

    @property
    def info(self) -> ModelInfo:
        return self._info

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop taking requests, give those in flight ``timeout_s`` to finish, end the rest with
        reason shutdown, then stop the stages in order and release every socket and thread."""
        if self._is_closed:
            return
        self._is_ready = False
        if self._requests and timeout_s > 0:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except TimeoutError:
                pass
        for req_id in list(self._requests):
            self._end(req_id, Finish(req_id, Reason.SHUTDOWN.value, error="server shut down before the request finished",
                                     stage="frontend"), broadcast=False)
        await self._stop_all(timeout_s=timeout_s)

    async def _stop_all(self, timeout_s: float) -> None:
        self._is_ready = False
        self._is_closed = True
        gc.unfreeze()
        try:
            if self.supervisor is not None:
                # each stage gets the caller's timeout to exit on its own (a GPU stage frees graphs and caches),
                # never less than the supervisor's default, before terminate and kill
                await self.supervisor.shutdown(self._send_shutdown, timeout_s=max(timeout_s, STAGE_EXIT_TIMEOUT_S))
        finally:
            for waiter in self._stats_waiters.values():
                if not waiter.done():
                    waiter.cancel()
            if self._inbox is not None:
                self._inbox.close()
            for outbox in self._outboxes.values():
                outbox.close()
            self._outboxes.clear()
            if self._doorway is not None:
                self._doorway.close()
            self.tracer.flush()
            log.info("engine_stopped", profile=self.profile.name)

    def _send_shutdown(self, stage: str) -> None:
        outbox = self._outboxes.get(stage)
        if outbox is not None:  # missing when start-up failed before the outboxes were open
            outbox.send(Shutdown())

    # ---- requests
    def validate(self, request: SpeechRequest | ChatRequest) -> None:
        """Raise RequestError(400, ...) if the model cannot take ``request``."""
        if self._validator is not None:
            self._validator(request, self.profile)

    def generate(self, request: SpeechRequest | ChatRequest, req_id: str | None = None) -> AsyncIterator[Output]:
        """Validate and admit now (raising RequestError), stream when iterated. The last Output has ``finish``."""
        self._check_admission()
        self.validate(request)
        req_id = req_id or uuid.uuid4().hex
        if req_id in self._requests:
            raise RequestError(400, f"request id {req_id!r} is already in flight")
        return self._stream(request, req_id)

    def _check_admission(self) -> None:
        if self._dead is not None:
            raise RequestError(503, f"engine is not serving: {self._dead}")
        if not self._is_ready:
            raise RequestError(503, "engine is not ready (starting or shutting down)")
        if len(self._requests) >= self.profile.max_pending:
            raise RequestError(429, f"too many requests in flight ({len(self._requests)} >= max_pending="
                                    f"{self.profile.max_pending}); retry later")

    async def _stream(self, request: SpeechRequest | ChatRequest, req_id: str) -> AsyncIterator[Output]:
        self._check_admission()  # again: the world may have changed since generate() was called
        if req_id in self._requests:
            raise RequestError(400, f"request id {req_id!r} is already in flight")
        self._num_submitted += 1
        collector = self._requests[req_id] = Collector(req_id, f"{req_id}#{self._num_submitted}")
        self._req_id_of[collector.wire_id] = req_id
        self._idle.clear()
        self.tracer.begin("request", req_id)
        try:
            self._outboxes[self._first].send(Submit(collector.wire_id, request, arrival=time.time()))
        except Exception as exc:  # noqa: BLE001 - e.g. a field msgspec cannot encode: end it with its one Finish
            self._end(req_id, Finish(req_id, Reason.ERROR.value, error=f"could not submit the request: {exc}",
                                     stage="frontend"), broadcast=False)
        try:
            while True:
                out = await collector.get()
                yield out
                if out.finish is not None:
                    return
        finally:
            if not collector.is_finished:  # the consumer left (break, cancel, disconnect)
                self.abort(req_id)

    def abort(self, req_id: str) -> None:
        """End ``req_id`` now with reason abort and free it in every stage. Idempotent."""
        if req_id in self._requests:
            self._end(req_id, Finish(req_id, Reason.ABORT.value, stage="frontend"), broadcast=True)

    def _end(self, req_id: str, finish: Finish, broadcast: bool) -> None:
        collector = self._requests.pop(req_id, None)
        if collector is None:
            return
        self._req_id_of.pop(collector.wire_id, None)
        collector.put_finish(finish)
        self._num_finished[finish.reason] += 1
        self.tracer.end("request", req_id, reason=finish.reason, samples=collector.num_samples)
        if broadcast and not self._is_closed:
            self._broadcast(Abort(collector.wire_id, finish.reason))
        if not self._requests:
            self._idle.set()

    def _broadcast(self, msg: Any) -> None:
        for name, outbox in self._outboxes.items():
            if self.supervisor is None or self.supervisor.is_alive(name):
                outbox.send(msg)

    # ---- inbox
    def _on_inbox(self, batch: list[Delivery]) -> None:
        for item in batch:
            if isinstance(item, FrameError):
                self._on_bad_frame(item)
                continue
            msg, arrays = item
            try:
                self._handle(msg, arrays)
            except Exception:  # one bad message must not stop the frontend
                log.exception("frontend_message_failed", type=type(msg).__name__)

    def _handle(self, msg: Any, arrays: dict[str, np.ndarray]) -> None:
        if isinstance(msg, Chunks):  # a last stage's step: its requests' chunks in one message
            try:
                chunks = list(batching.unpack(msg, arrays))
            except FrameError as exc:  # checked whole: no chunk of it was delivered, every request it names fails
                self._on_bad_frame(exc)
                return
            for chunk, chunk_arrays in chunks:
                self._handle(chunk, chunk_arrays)
        elif isinstance(msg, Chunk):
            req_id = self._req_id_of.get(msg.req_id)
            if req_id is None:  # late output of an aborted or failed request
                return
            collector = self._requests[req_id]
            if msg.text:
                collector.put_text(msg.text)
            pcm = arrays.get("pcm")
            if pcm is not None:
                if collector.num_samples == 0 and len(pcm):
                    self.tracer.instant("first_audio", req_id)
                collector.put_pcm(pcm)
            codes = arrays.get("codes")
            if codes is not None:
                collector.put_codes(codes)
        elif isinstance(msg, Finish):
            # An end anywhere but a normal stop at the last stage may leave the request in other stages.
            req_id = self._req_id_of.get(msg.req_id)
            if req_id is None:  # a request that already ended (or an earlier one with the same id)
                return
            is_normal = msg.stage == self._last and msg.reason in _NORMAL_END
            self._end(req_id, msgspec.structs.replace(msg, req_id=req_id), broadcast=not is_normal)
        elif isinstance(msg, Ready):
            if self.supervisor is not None:
                self.supervisor.on_ready(msg)
        elif isinstance(msg, Stats):
            self._stage_stats[msg.stage] = msg
            waiter = self._stats_waiters.pop(msg.stage, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
        else:
            log.warning("frontend_unexpected_message", type=type(msg).__name__)

    def _on_bad_frame(self, exc: FrameError) -> None:
        """Every request the damaged message named (one, or each of a ``Chunks`` batch's) ends with an error."""
        log.warning("frontend_bad_frame", error=str(exc), req_ids=exc.req_ids)
        for named in exc.req_ids:
            req_id = self._req_id_of.get(named)
            if req_id is not None:
                self._end(req_id, Finish(req_id, Reason.ERROR.value, error=f"undecodable output: {exc}",
                                         stage="frontend"), broadcast=True)

    def _on_stage_death(self, stage: str, exitcode: int | None) -> None:
        self._is_ready = False
        self._dead = f"stage {stage!r} died ({describe_exit(exitcode)})"
        log.error("engine_stage_died", stage=stage, exit=describe_exit(exitcode), num_failed=len(self._requests))
        for req_id in list(self._requests):
            error = f"stage {stage!r} died ({describe_exit(exitcode)}) while the request was in flight"
            self._end(req_id, Finish(req_id, Reason.STAGE_DIED.value, error=error, stage=stage), broadcast=True)

    # ---- stats
    def stats(self) -> dict[str, Any]:
        """Counters of the frontend and the last Stats each stage reported (see ``refresh_stats``)."""
        return {
            "profile": self.profile.name,
            "is_ready": self._is_ready,
            "error": self._dead,
            "num_pending": len(self._requests),
            "num_submitted": self._num_submitted,
            "num_finished": dict(self._num_finished),
            "stages": {name: msgspec.to_builtins(s) for name, s in self._stage_stats.items()},
        }

    async def refresh_stats(self, timeout_s: float = 2.0) -> dict[str, Any]:
        """Ask every live stage for fresh Stats (answered between steps), then return ``stats()``."""
        loop = asyncio.get_running_loop()
        waiters = []
        for name, outbox in self._outboxes.items():
            if self.supervisor is not None and self.supervisor.is_alive(name):
                waiter = self._stats_waiters.get(name) or loop.create_future()
                self._stats_waiters[name] = waiter
                outbox.send(Stats(name))
                waiters.append(waiter)
        if waiters:
            await asyncio.wait(waiters, timeout=timeout_s)
        return self.stats()
