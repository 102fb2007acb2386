"""A stage that needs longer than the supervisor's default exit wait to release its resources (a GPU stage
freeing graphs and caches) gets the engine's shutdown timeout, and exits on its own instead of being
terminated."""

from __future__ import annotations

from omniloop.actors.engine import Engine
from omniloop.actors.supervisor import STAGE_EXIT_TIMEOUT_S
from omniloop.profile import load_profile


async def test_shutdown_timeout_reaches_the_stage_exit_wait() -> None:
    close_ms = int((STAGE_EXIT_TIMEOUT_S + 1.0) * 1000)
    profile = load_profile("fake", [f"stages.codec.options.close_ms={close_ms}"], platform="cpu")
    engine = await Engine.start(profile)
    supervisor = engine.supervisor
    handle = supervisor.handles["codec"]
    forced = []
    terminate = handle.terminate
    handle.terminate = lambda: (forced.append("terminate"), terminate())[1]
    await engine.shutdown(timeout_s=STAGE_EXIT_TIMEOUT_S + 4.0)
    assert forced == []  # not terminated after the supervisor's default 5 s
    assert supervisor._exits["codec"].result() == 0
