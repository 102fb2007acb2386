"""Review: the engine's shutdown timeout is the grace a stage gets to exit on its own; once that has passed
and the stage has been terminated, the supervisor escalates to kill on its own short schedule.

``_stop_one`` used the caller's timeout for every wait (before terminate, after terminate, after kill), so a
hung stage under the server's 30 s shutdown timeout took ~60 s to be killed instead of ~35 s, the
escalation stretched along with the grace the change meant to give."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from omniloop.actors import engine as engine_mod
from omniloop.actors import supervisor as supervisor_mod
from omniloop.actors.engine import Engine
from omniloop.profile import load_profile

DEFAULT_S = 0.5  # the supervisor's own exit wait, shortened for the test
GRACE_S = 3.0  # the caller's shutdown timeout


async def test_a_hung_stage_is_killed_soon_after_terminate(monkeypatch) -> None:
    monkeypatch.setattr(supervisor_mod, "STAGE_EXIT_TIMEOUT_S", DEFAULT_S)
    monkeypatch.setattr(engine_mod, "STAGE_EXIT_TIMEOUT_S", DEFAULT_S)
    engine = await Engine.start(load_profile("fake", [], platform="cpu"))  # stage processes
    supervisor = engine.supervisor
    handle = supervisor.handles["codec"]
    os.kill(handle.pid, signal.SIGSTOP)  # hung: reads nothing, ignores SIGTERM until continued
    times: dict[str, float] = {}
    for name in ("terminate", "kill"):
        action = getattr(handle, name)
        setattr(handle, name, lambda action=action, name=name: (times.setdefault(name, time.monotonic()), action()))
    start = time.monotonic()
    await asyncio.wait_for(engine.shutdown(timeout_s=GRACE_S), 60)
    assert set(times) == {"terminate", "kill"}  # the escalation still happens
    assert times["terminate"] - start >= GRACE_S - 0.1  # the caller's grace before terminate
    assert times["kill"] - times["terminate"] < DEFAULT_S + 1.0, times  # then the supervisor's own wait
    assert supervisor._exits["codec"].result() == -signal.SIGKILL
    assert supervisor._exits["talker"].result() == 0
