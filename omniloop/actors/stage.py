"""The stage actor: one loop, one inbox, one scheduler, one runner.

The loop sleeps until something happens, and then runs the DESIGN.md routine:

    inbox input      -> drain inbox (add / extend / finish_upstream / abort / stop), then launch
    step completed   -> apply it (update or fail -> emits -> outboxes), then launch
    deadline / drain -> launch (see the two paragraphs below)
    launch: while in_flight < max_in_flight and (plan := scheduler.schedule()): runner.submit(plan)

A stage whose outbox holds a backlog (its peer stopped reading) launches nothing until the backlog
drains, which wakes the loop again: backpressure along the pipeline, memory bounded by the steps in flight.

A scheduler whose plans also depend on the clock (the codec's: a held-back chunk becomes urgent when its
client's buffer runs low) says when through ``next_wakeup()``; the loop then arms one timer for that
moment, so a deadline passing with no input and no step in flight still gets its launch.

A step's outputs are sent before the next step is launched. Nothing here waits on a result, polls,
or sleeps. When a stage ends a request itself (an error Finish to the frontend), it also sends
Abort downstream on the same socket that carried the request, so the abort cannot overtake it.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
import traceback
from typing import Any

from omniloop.actors.actor import EXIT_FATAL, EXIT_OK, EXIT_START_FAILED, ActorSpec, freeze_startup_heap
from omniloop.actors.doorway import Doorway, doorway_for
from omniloop.actors.trace import Tracer, now_us
from omniloop.errors import FrameError
from omniloop.log import get_logger
from omniloop.models.registry import build_worker
from omniloop.scheduler.interface import Emit
from omniloop.transport import batching
from omniloop.transport.channel import Delivery, Inbox, Outbox
from omniloop.transport.messages import Abort, Chunk, Chunks, Finish, Ready, Reason, Shutdown, Stats, Submit

log = get_logger(__name__)

TIMER_SLACK_S = 0.002  # a deadline timer is armed this much late: loops' timers may fire up to ~1.5 ms early


class StageActor:
    def __init__(self, spec: ActorSpec) -> None:
        self.spec = spec
        self.stage = spec.profile.stage(spec.stage)
        self.has_next_stage = spec.profile.next_of(spec.stage) is not None
        self.scheduler: Any = None
        self.runner: Any = None
        self.num_in_flight = 0
        self.num_steps = 0
        self._step_s_total = 0.0
        self.tracer = Tracer(spec.stage)
        self._free_lanes = list(range(self.stage.max_in_flight))  # trace lanes: in-flight steps overlap
        self._inbox: Inbox | None = None
        self._to_next: Outbox | None = None
        self._to_frontend: Outbox | None = None
        self._doorway: Doorway | None = None
        self._stopped: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None  # the scheduler's next deadline (see the module doc)
        self._timer_for = 0.0  # the deadline the timer is armed for (time.monotonic seconds)
        self._fired_for: float | None = None  # the deadline the timer last launched for
        self.start_error: str | None = None  # set when start-up failed; also sent in Ready(ok=False)

    # ---- lifecycle
    async def run(self, freeze_heap: bool = False) -> int:
        """Start, report Ready, serve until stopped; always closes what it opened. Returns the exit code.
        ``freeze_heap`` (a stage process): what start-up built is moved out of the cyclic collector
        (``freeze_startup_heap``, as the engine does for its process)."""
        loop = asyncio.get_running_loop()
        self._doorway = doorway_for(loop)
        self._stopped = loop.create_future()
        log_ = log.bind(stage=self.stage.name, pid=os.getpid())
        try:
            self._to_frontend = Outbox(self.spec.frontend, name=f"{self.stage.name}->frontend")
            self._to_frontend.attach(loop)
            try:
                self._open(loop)
            except Exception as exc:
                self.start_error = _summary(exc)
                log_.error("stage_start_failed", error=self.start_error)
                self._to_frontend.send(Ready(self.stage.name, os.getpid(), ok=False, error=self.start_error))
                return EXIT_START_FAILED
            if freeze_heap:
                freeze_startup_heap()
            self._to_frontend.send(Ready(self.stage.name, os.getpid(), info={"model": self.stage.model}))
            log_.info("stage_ready", model=self.stage.model, placement=self.stage.placement)
            reason = await self._stopped
            log_.info("stage_stopped", reason=reason)
            return EXIT_OK
        except Exception as exc:
            log_.error("stage_fatal", error=repr(exc), traceback=traceback.format_exc())
            return EXIT_FATAL
        finally:
            self._close()

    def request_stop(self, reason: str = "stop") -> None:
        """Ask the actor to stop; safe from any thread (and from a signal handler on the loop)."""
        if self._doorway is not None:
            self._doorway.post(self._stop, reason)

    def _open(self, loop: asyncio.AbstractEventLoop) -> None:
        self.scheduler, self.runner = build_worker(self.stage, self.spec.profile)
        if self.spec.next == self.spec.frontend:
            # Last stage: one socket for chunks and Finish so the Finish cannot overtake its chunks.
            self._to_next = self._to_frontend
        else:
            self._to_next = Outbox(self.spec.next, name=f"{self.stage.name}->next")
            self._to_next.attach(loop)
        self._inbox = Inbox(self.spec.inbox, name=f"{self.stage.name}-inbox")
        self._inbox.attach(loop, self._on_inbox)
        for outbox in {id(o): o for o in (self._to_next, self._to_frontend)}.values():
            outbox.on_drain = self._on_drain

    def _stop(self, reason: str) -> None:
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(reason)

    def _fatal(self, exc: BaseException) -> None:
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_exception(exc)

    @property
    def is_stopping(self) -> bool:
        return self._stopped is None or self._stopped.done()

    def _close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        steps = (
            ("inbox", self._inbox),
            ("runner", self.runner),
            ("next", self._to_next if self._to_next is not self._to_frontend else None),
            ("frontend", self._to_frontend),
            ("doorway", self._doorway),
        )
        for what, resource in steps:
            if resource is None:
                continue
            try:
                resource.close()
            except Exception as exc:  # keep closing the rest: a leak elsewhere is worse
                log.error("stage_close_failed", stage=self.stage.name, what=what, error=repr(exc))
        try:
            self.tracer.flush()
        except OSError as exc:
            log.error("stage_trace_write_failed", stage=self.stage.name, error=repr(exc))

    # ---- wake-up 1: inbox input
    def _on_inbox(self, batch: list[Delivery]) -> None:
        started = now_us() if self.tracer.enabled else 0.0
        try:
            self._prefetch(batch)
            for item in batch:
                if isinstance(item, FrameError):
                    self._on_bad_frame(item)
                else:
                    self._handle(*item)
            handled = now_us() if self.tracer.enabled else 0.0
            self._launch()
        except Exception as exc:
            self._fatal(exc)
            return
        if self.tracer.enabled:  # loop-thread time: taking the messages in, then the launches they made; on a
            # track of its own, after the step lanes 0..max_in_flight-1
            self.tracer.span("inbox", started, now_us(), self.stage.max_in_flight, messages=len(batch),
                             submits=len(_submits(batch)), handle_ms=round((handled - started) / 1e3, 3))

    def _prefetch(self, batch: list[Delivery]) -> None:
        """Several arrivals at once: the scheduler may do their common work together (the talker tokenizes
        their texts in one call) before they are added one by one. A failure costs only the speed-up."""
        prefetch = getattr(self.scheduler, "prefetch", None)
        submits = _submits(batch)
        if prefetch is None or len(submits) < 2:
            return
        try:
            prefetch(submits)
        except Exception as exc:  # noqa: BLE001 - each request is still added, and reports its own error
            log.warning("stage_prefetch_failed", stage=self.stage.name, error=repr(exc))

    def _handle(self, msg: Any, arrays: dict[str, Any]) -> None:
        if isinstance(msg, Submit):
            self._send(self.scheduler.add(msg.req_id, msg, arrays))
        elif isinstance(msg, Chunk):
            self._send(self.scheduler.extend(msg.req_id, msg, arrays))
        elif isinstance(msg, Chunks):
            self._extend_many(msg, arrays)
        elif isinstance(msg, Finish):
            self._send(self.scheduler.finish_upstream(msg.req_id, msg))
        elif isinstance(msg, Abort):
            self.scheduler.abort(msg.req_id)
            if self.has_next_stage:  # follows anything we already sent for it downstream
                self._to_next.send(msg)
        elif isinstance(msg, Stats):
            self._to_frontend.send(self.stats())
        elif isinstance(msg, Shutdown):
            self._stop(msg.reason)
        else:
            log.warning("stage_unexpected_message", stage=self.stage.name, type=type(msg).__name__)

    def _extend_many(self, batch: Chunks, arrays: dict[str, Any]) -> None:
        """An upstream step's chunks in one message: each goes to the scheduler as if it came alone. A
        malformed batch fails every request it names (none of its chunks is delivered)."""
        try:
            chunks = list(batching.unpack(batch, arrays))
        except FrameError as exc:  # names every request of the batch
            self._on_bad_frame(exc)
            return
        emits: list[Emit] = []
        for chunk, chunk_arrays in chunks:
            emits += self.scheduler.extend(chunk.req_id, chunk, chunk_arrays)
        self._send(emits)

    def _on_bad_frame(self, exc: FrameError) -> None:
        log.warning("stage_bad_frame", stage=self.stage.name, error=str(exc), req_ids=exc.req_ids)
        for req_id in exc.req_ids:  # none: nobody to tell (the frame named no request)
            self.scheduler.abort(req_id)
        self._send([Emit("frontend", Finish(req_id, Reason.ERROR.value, error=str(exc), stage=self.stage.name))
                    for req_id in exc.req_ids])

    # ---- wake-up 2: a step completed
    def _on_step_done(self, plan: Any, started: float, lane: int,
                      host_ms: tuple[float, float, dict[str, float] | None], future: asyncio.Future) -> None:
        self.num_in_flight -= 1
        self._free_lanes.append(lane)
        if self.tracer.enabled:
            # host time on the loop thread: planning it, and submitting it (the runner's launches; a runner
            # with ``phases_ms`` also says what the submit time was made of)
            phases = {"submit_phases_ms": host_ms[2]} if host_ms[2] else {}
            self.tracer.span("step", started * 1e6, now_us(), lane, **_plan_size(plan),
                             schedule_ms=round(host_ms[0], 3), submit_ms=round(host_ms[1], 3), **phases)
        if self.is_stopping:  # steps failed by the runner's close: nobody is waiting for them any more
            if not future.cancelled():
                future.exception()
            return
        try:
            error = future.exception() if not future.cancelled() else asyncio.CancelledError("step cancelled")
            if error is None:
                self.num_steps += 1
                self._step_s_total += time.monotonic() - started
                emits = self.scheduler.update(plan, future.result())
            else:
                log.warning("stage_step_failed", stage=self.stage.name, error=repr(error))
                emits = self.scheduler.fail(plan, error)
            self._send(emits)
            self._launch()
        except Exception as exc:
            self._fatal(exc)

    # ---- launch
    def _launch(self) -> None:
        while not self.is_stopping and self.num_in_flight < self.stage.max_in_flight and not self._is_congested():
            planning = time.monotonic()
            plan = self.scheduler.schedule()
            if plan is None:
                break
            self.num_in_flight += 1
            lane = self._free_lanes.pop()
            started = time.monotonic()  # the tracer's clock: one CLOCK_MONOTONIC for every process
            future = self.runner.submit(plan)
            host_ms = ((started - planning) * 1e3, (time.monotonic() - started) * 1e3,
                       getattr(self.runner, "phases_ms", None) if self.tracer.enabled else None)
            future.add_done_callback(functools.partial(self._on_step_done, plan, started, lane, host_ms))
        self._arm_timer()

    def _arm_timer(self) -> None:
        """One timer at the scheduler's next deadline (``next_wakeup``, time.monotonic seconds), if any."""
        next_wakeup = getattr(self.scheduler, "next_wakeup", None)
        when = next_wakeup() if next_wakeup is not None and not self.is_stopping else None
        if self.is_stopping or (when is not None and when == self._fired_for and when <= time.monotonic()):
            when = None  # already launched for it: the scheduler's to take on the next wake-up; never spin
        if self._timer is not None:
            if not self.is_stopping and (when is None or when >= self._timer_for):
                # armed for this moment or an earlier one: keep it. A deadline that passed while the scheduler
                # ran (schedule(): not yet; next_wakeup(): gone) would otherwise get no launch at all; a timer
                # with nothing left to do costs one launch
                return
            self._timer.cancel()
            self._timer = None
        if when is not None:
            self._set_timer(when)

    def _set_timer(self, when: float) -> None:
        # a loop's timers may fire a little early (uvloop's clock counts whole milliseconds): a little later
        # instead, so the launch it makes sees its deadline passed
        self._timer_for = when
        delay = max(0.0, when - time.monotonic()) + TIMER_SLACK_S
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _is_congested(self) -> bool:
        """A peer stopped keeping up (an outbox holds a backlog): launch nothing until it drains, so what
        waits in memory stays bounded by the steps already in flight."""
        return any(o is not None and o.is_congested for o in (self._to_next, self._to_frontend))

    # ---- wake-up 3: a scheduler deadline
    def _on_timer(self) -> None:
        self._timer = None
        if time.monotonic() < self._timer_for:  # fired early: wait on, without launching for nothing
            self._set_timer(self._timer_for)
            return
        self._fired_for = self._timer_for
        try:
            self._launch()
        except Exception as exc:
            self._fatal(exc)

    # ---- wake-up 4: a congested outbox drained
    def _on_drain(self) -> None:
        try:
            self._launch()
        except Exception as exc:
            self._fatal(exc)

    def _send(self, emits: list[Emit]) -> None:
        """Emits in order; runs of plain chunks of one layout to one peer (the next stage, or the frontend from
        the last stage) go as one ``Chunks`` message (``transport.batching``), each run sent before whatever
        follows it."""
        run: list[tuple[Any, dict[str, Any]]] = []
        run_key = None
        for emit in emits:
            key = self._run_key(emit)
            if key is None or key != run_key:  # the run ends here: it goes before this emit
                self._send_run(run_key, run)
                run, run_key = [], key
            if key is not None:
                run.append((emit.msg, emit.arrays))
                continue
            if emit.dest == "next":
                self._to_next.send(emit.msg, emit.arrays)
            elif emit.dest == "frontend":
                self._to_frontend.send(emit.msg, emit.arrays)
                if isinstance(emit.msg, Finish) and self.has_next_stage:
                    self._to_next.send(Abort(emit.msg.req_id, emit.msg.reason))
            else:
                raise ValueError(f"stage {self.stage.name!r}: emit to unknown destination {emit.dest!r}")
        self._send_run(run_key, run)

    def _run_key(self, emit: Emit) -> tuple | None:
        """(peer, layout) of a chunk that may ride in a ``Chunks`` run; None: it travels alone. A last stage's
        "next" means the frontend too (``Engine`` splits a ``Chunks`` as a stage does)."""
        dest = emit.dest
        if dest == "next" and not self.has_next_stage:
            dest = "frontend"
        if dest not in ("next", "frontend"):
            return None
        shape = batching.layout(emit.msg, emit.arrays)
        return None if shape is None else (dest, shape)

    def _send_run(self, key: tuple | None, run: list[tuple[Any, dict[str, Any]]]) -> None:
        if not run:
            return
        outbox = self._to_next if key[0] == "next" else self._to_frontend
        outbox.send(*(run[0] if len(run) == 1 else batching.pack(run)))

    def stats(self) -> Stats:
        sched = self.scheduler
        return Stats(
            self.stage.name,
            num_running=getattr(sched, "num_running", sched.num_requests),
            num_waiting=getattr(sched, "num_waiting", 0),
            num_steps=self.num_steps,
            step_ms=1000.0 * self._step_s_total / max(1, self.num_steps),
            extra={"num_requests": float(sched.num_requests), "num_in_flight": float(self.num_in_flight)},
        )


def _submits(batch: list[Delivery]) -> list[Submit]:
    """The new requests among an inbox batch's messages."""
    return [item[0] for item in batch if not isinstance(item, FrameError) and isinstance(item[0], Submit)]


def _plan_size(plan: Any) -> dict[str, int]:
    """What a step carried, for its trace span: requests, positions or frames, admissions, decodes."""
    seqs = getattr(plan, "seqs", None) or getattr(plan, "items", ())
    size = {"seqs": len(seqs), "new": len(getattr(plan, "new", ()))}
    for name in ("num_tokens", "num_frames"):
        if hasattr(plan, name):
            size[name] = int(getattr(plan, name))
    size["decodes"] = sum(1 for seq in seqs if getattr(seq, "is_decode", False))
    return size


def _summary(exc: BaseException) -> str:
    """The error and where it was raised, short enough for a log line and a Ready message."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in reversed(frames))
    return f"{type(exc).__name__}: {exc}" + (f" (at {where})" if where else "")
