"""Review: the moment ``CodecScheduler.next_wakeup`` names is a moment at which the held-back request is urgent.

The stage arms its timer for ``next_wakeup()`` and, when it fires, calls ``schedule()`` once for that moment.
If ``schedule`` at that moment still holds the request back (the urgency test and the
deadline were two differently rounded forms of one inequality, one of them strict), the request is neither
decoded nor waited for: nothing wakes the stage until other input arrives, and the client runs dry with frames
in hand."""

from __future__ import annotations

from tests.test_scheduler_codec import Clock, decode, make, send, sizes


def test_a_held_back_request_is_urgent_at_the_moment_next_wakeup_named() -> None:
    stuck = []
    for i in range(200):
        clock = Clock()
        clock.now = 100.0 + 1234.5678 * i  # monotonic clocks of many magnitudes
        sched = make(clock, initial_frames=2, frames=8, urgent_s=0.4)
        send(sched, "a", 0, 6)
        for _ in range(2):
            plan = sched.schedule()
            sched.update(plan, decode(plan))  # 2 + 4 frames out: 0.48 s buffered
        clock.now += 0.0003 * (i % 50)
        send(sched, "a", 6, 3)
        assert sched.schedule() is None  # 3 < 8 frames, 0.48 s buffered: held back
        wake = sched.next_wakeup()
        assert wake is not None and wake > clock.now
        clock.now = wake  # the stage's timer fires exactly then
        plan = sched.schedule()
        if plan is None:
            stuck.append((i, sched.next_wakeup()))
        else:
            assert sizes(plan) == [("a", 3)]
    assert not stuck, f"{len(stuck)} of 200 requests neither decoded nor waited for at their deadline: {stuck[:3]}"


def test_before_its_first_audio_a_request_goes_at_once_even_with_urgent_s_zero() -> None:
    """Every request before its first audio is urgent (module doc); with ``urgent_s = 0`` the strict test made it
    wait for a full first chunk at the instant it arrived, and ``next_wakeup`` does not cover requests without
    audio, so no timer would ever start it."""
    clock = Clock()
    sched = make(clock, initial_frames=2, frames=8, urgent_s=0.0)
    send(sched, "a", 0, 1)
    plan = sched.schedule()
    assert plan is not None and sizes(plan) == [("a", 1)]
