"""Review: the stage's deadline timer (``next_wakeup``) neither spins nor loses a deadline.

Two ways a held-back request was left with no wake-up at all (neither decoded nor waited for, with no input
and no step in flight: the client runs dry with frames in hand):

* an event loop's timers may fire a little before their time: uvloop's clock counts whole milliseconds, so a
  timer fires up to ~1.5 ms early. The stage then launched at once, ``schedule()`` still held the request
  back, the deadline (still future) was armed again for "now", and the loop spun launch after launch
  until the clock passed the deadline; when the deadline passed between ``schedule()`` (held: not yet)
  and ``next_wakeup()`` (only future moments: not any more), no timer was armed and the request was lost;
* a launch for any other reason (input, a drained outbox, a step) just before the deadline, with the
  deadline passing while the scheduler ran, cancelled the armed timer and armed nothing.

A scheduler's ``next_wakeup`` may well read the clock milliseconds after ``schedule()`` did: stages placed
as threads share the GIL, which another stage holds for up to its switch interval (5 ms)."""

from __future__ import annotations

import asyncio
import threading
import time
import types

from omniloop.actors.engine import Engine
from omniloop.models import fake
from omniloop.models.registry import Worker, register
from omniloop.profile import load_profile
from omniloop.transport.messages import SpeechRequest
from tests.holding_codec import HoldingCodec

EARLY_S = 0.0015


class _LaggingHoldingCodec(HoldingCodec):
    """``HoldingCodec``, except that the next ``next_wakeup`` reads the clock ``lag_once_s`` after it is called
    (a GIL switch) when that is set."""

    hold_s = 0.05
    lag_once_s = 0.0

    def next_wakeup(self) -> float | None:
        lag, type(self).lag_once_s = type(self).lag_once_s, 0.0
        if lag:
            time.sleep(lag)
        return super().next_wakeup()


@register("fake.lagging_holding_codec")
def _build(stage, profile) -> Worker:
    return fake._worker(_LaggingHoldingCodec, lambda p: fake.decode_codes(p[1]), stage, profile)


async def _start(monkeypatch, *, hold_s: float = 0.05):
    monkeypatch.setattr(_LaggingHoldingCodec, "hold_s", hold_s)
    sets = ["stages.talker.placement=thread", "stages.codec.placement=thread", "transport=inproc",
            "stages.codec.model=fake.lagging_holding_codec"]
    engine = await Engine.start(load_profile("fake", sets, platform="cpu"))
    codec = engine.supervisor.handles["codec"].actor
    return engine, codec


async def _speak(engine: Engine, text: str) -> int:
    outs = [out async for out in engine.generate(SpeechRequest(text=text))]
    assert outs[-1].finish is not None and outs[-1].finish.reason == "stop"
    return sum(len(o.pcm) for o in outs if o.pcm is not None)


class _Timer:
    def __init__(self, due: float, callback) -> None:
        self.due, self.callback, self.cancelled = due, callback, False

    def cancel(self) -> None:
        self.cancelled = True

    def when(self) -> float:
        return self.due


class _Loop:
    """Just what the stage's timer uses of its loop, on the monotonic clock; ``run`` fires the timers as a
    loop whose timers may go up to ``early`` seconds before their time (uvloop: ~1.5 ms)."""

    def __init__(self) -> None:
        self.timers: list[_Timer] = []

    def time(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, callback, *args, context=None) -> _Timer:
        self.timers.append(timer := _Timer(when, lambda: callback(*args)))
        return timer

    def call_later(self, delay: float, callback, *args, context=None) -> _Timer:
        return self.call_at(self.time() + delay, callback, *args)

    def run(self, until: float, early: float) -> int:
        fired = 0
        while time.monotonic() < until:
            live = [t for t in self.timers if not t.cancelled]
            if not live:
                break
            timer = min(live, key=lambda t: t.due)
            if timer.due - early <= time.monotonic():
                timer.cancelled = True
                fired += 1
                timer.callback()
        return fired


class _Held:
    """One request held back until ``deadline``; ``next_wakeup`` names only future moments, reading the
    clock ``lag`` seconds after it is called."""

    def __init__(self, deadline: float) -> None:
        self.deadline, self.lag, self.taken_at, self.num_schedules = deadline, 0.0, None, 0

    def schedule(self):
        self.num_schedules += 1
        if self.taken_at is None and time.monotonic() >= self.deadline:
            self.taken_at = time.monotonic()
            return "plan"
        return None

    def next_wakeup(self) -> float | None:
        if self.lag:
            time.sleep(self.lag)
        return self.deadline if self.taken_at is None and self.deadline > time.monotonic() else None


class _Future:
    def add_done_callback(self, fn) -> None:
        pass


def _actor(monkeypatch, deadline: float):
    from omniloop.actors import stage as stage_mod
    from omniloop.actors.actor import ActorSpec

    loop = _Loop()
    monkeypatch.setattr(stage_mod, "asyncio", types.SimpleNamespace(get_running_loop=lambda: loop))
    profile = load_profile("fake", [], platform="cpu")
    actor = stage_mod.StageActor(ActorSpec("codec", profile, "inproc://x", "inproc://y", "inproc://y"))
    actor.scheduler = _Held(deadline)
    actor.runner = types.SimpleNamespace(submit=lambda plan: _Future())
    actor._stopped = types.SimpleNamespace(done=lambda: False)
    return actor, loop


def test_a_timer_that_fires_early_neither_spins_nor_launches_before_its_deadline(monkeypatch) -> None:
    deadline = time.monotonic() + 0.02
    actor, loop = _actor(monkeypatch, deadline)
    actor._launch()  # held back: the timer is armed for the deadline
    fired = loop.run(until=deadline + 0.05, early=EARLY_S)
    sched = actor.scheduler
    assert sched.taken_at is not None and sched.taken_at >= deadline
    assert fired <= 2 and sched.num_schedules <= 3, (fired, sched.num_schedules)


def test_a_deadline_that_passes_while_the_scheduler_runs_is_not_lost_after_an_early_timer(monkeypatch) -> None:
    deadline = time.monotonic() + 0.02
    actor, loop = _actor(monkeypatch, deadline)
    actor._launch()
    actor.scheduler.lag = 0.003  # schedule(): not yet; next_wakeup() 3 ms later: already passed
    loop.run(until=deadline + 0.05, early=EARLY_S)
    assert actor.scheduler.taken_at is not None, "the request was neither scheduled nor waited for"


def test_a_launch_just_before_the_deadline_keeps_the_timer(monkeypatch) -> None:
    deadline = time.monotonic() + 0.05
    actor, loop = _actor(monkeypatch, deadline)
    actor._launch()
    time.sleep(max(0.0, deadline - 0.01 - time.monotonic()))
    actor.scheduler.lag = 0.02
    actor._launch()  # another wake-up (input, a step, a drained outbox) 10 ms before the deadline
    actor.scheduler.lag = 0.0
    loop.run(until=deadline + 0.05, early=0.0)
    assert actor.scheduler.taken_at is not None, "the request was neither scheduled nor waited for"


def test_a_congested_stage_wakes_once_for_a_deadline_and_resumes_on_drain(monkeypatch) -> None:
    """Not a change: while congested a passed deadline is not re-armed (no busy loop); the drain launches."""
    deadline = time.monotonic() + 0.01
    actor, loop = _actor(monkeypatch, deadline)
    actor._to_next = types.SimpleNamespace(is_congested=True)
    actor._launch()
    assert loop.run(until=deadline + 0.05, early=0.0) <= 1
    assert actor.scheduler.taken_at is None
    actor._to_next.is_congested = False
    actor._on_drain()
    assert actor.scheduler.taken_at is not None


async def test_engine_a_launch_just_before_the_deadline_keeps_its_timer(monkeypatch) -> None:
    engine, codec = await _start(monkeypatch, hold_s=0.3)
    try:
        task = asyncio.ensure_future(_speak(engine, "ef"))
        while not getattr(codec.scheduler, "hold_until", None):
            await asyncio.sleep(0.001)
        deadline = next(iter(codec.scheduler.hold_until.values()))
        await asyncio.sleep(max(0.0, deadline - 0.02 - time.monotonic()))
        # a wake-up for another reason 20 ms before the deadline, while the scheduler takes 40 ms to name its
        # next one: schedule() holds the request back (not yet), next_wakeup() no longer names it (passed)
        ran = threading.Event()
        _LaggingHoldingCodec.lag_once_s = 0.04
        codec._doorway.post(lambda: (codec._launch(), ran.set()))
        assert await asyncio.wait_for(task, 5) == 2 * 1920
        assert ran.is_set()
    finally:
        _LaggingHoldingCodec.lag_once_s = 0.0
        await asyncio.wait_for(engine.shutdown(), 30)
