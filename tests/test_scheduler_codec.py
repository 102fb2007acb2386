"""Codec-stage scheduler on CPU with hand-made PCM results."""

from __future__ import annotations

import numpy as np

from omniloop.scheduler.codec import CodecConfig, CodecScheduler
from omniloop.scheduler.plan import CodecStepPlan, CodecStepResult
from omniloop.scheduler.policy import SAMPLES_PER_FRAME
from omniloop.transport.messages import Chunk, Finish, SpeechRequest, Submit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock | None = None, **config) -> CodecScheduler:
    return CodecScheduler(CodecConfig(**config), clock=clock or Clock())


def codes(start: int, n: int) -> dict:
    """Frames numbered start..start+n-1 (the number sits in every codebook)."""
    return {"codes": np.repeat(np.arange(start, start + n, dtype=np.int64)[:, None], 16, axis=1)}


def send(sched, req_id: str, start: int, n: int, final: bool = False, reason: str = "stop"):
    chunk = Chunk(req_id=req_id, seq=start, final=final, reason=reason if final else None)
    return sched.extend(req_id, chunk, codes(start, n))


def decode(plan: CodecStepPlan) -> CodecStepResult:
    """A fake decoder: each frame becomes 1920 samples holding its frame number."""
    return CodecStepResult([np.repeat(seq.codes[:, 0].astype(np.float32), SAMPLES_PER_FRAME) for seq in plan.seqs])


def pcm_of(emits, req_id: str) -> np.ndarray:
    parts = [e.arrays["pcm"] for e in emits if e.msg.req_id == req_id and e.arrays]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def sizes(plan: CodecStepPlan) -> list[tuple[str, int]]:
    return [(seq.req_id, seq.end - seq.start) for seq in plan.seqs]


def test_dry_clients_go_with_what_there_is_and_buffered_ones_wait_for_a_full_chunk():
    clock = Clock()
    sched = make(clock, initial_frames=2, urgent_s=0.4)
    send(sched, "a", 0, 1)
    first = sched.schedule()
    assert sizes(first) == [("a", 1)] and first.seqs[0].is_first  # no audio yet: dry, go at once
    sched.update(first, decode(first))
    send(sched, "a", 1, 5)
    assert sizes(sched.schedule()) == [("a", 4)]  # 80 ms buffered < 0.4 s: urgent, up to its next chunk size (4)
    sched = make(clock, initial_frames=2, frames=8, urgent_s=0.4)
    send(sched, "b", 0, 8)
    plan = sched.schedule()
    assert sizes(plan) == [("b", 2)]
    sched.update(plan, decode(plan))
    plan = sched.schedule()
    assert sizes(plan) == [("b", 4)]
    sched.update(plan, decode(plan))  # 6 frames = 0.48 s buffered at the same instant: not urgent
    assert sched.schedule() is None  # 2 frames wait for a full chunk of 8
    clock.now += 0.1  # 0.38 s left in the client's buffer: urgent again
    assert sizes(sched.schedule()) == [("b", 2)]



def test_chunks_ramp_up_then_flush_everything_once():
    sched = make(initial_frames=2, frames=25)
    sched.add("a", Submit(req_id="a", request=SpeechRequest(text="hi", initial_chunk_frames=3)))
    send(sched, "a", 0, 100, final=True, reason="length")
    emits, steps = [], []
    while plan := sched.schedule():
        steps.append(plan.seqs[0].end - plan.seqs[0].start)
        emits += sched.update(plan, decode(plan))
    assert steps == [3, 6, 12, 24, 25, 25, 5]
    expected = np.repeat(np.arange(100, dtype=np.float32), SAMPLES_PER_FRAME)
    assert np.array_equal(pcm_of(emits, "a"), expected)  # nothing lost, duplicated or reordered
    assert [e.msg.seq for e in emits if isinstance(e.msg, Chunk)] == list(range(7))
    final, finish = emits[-2].msg, emits[-1].msg
    assert final.final and final.reason == "length" and emits[-2].arrays is not None
    assert isinstance(finish, Finish) and finish.reason == "length" and finish.num_frames == 100
    assert sched.num_requests == 0 and sched.num_free_slots == 64


def test_final_while_in_flight_rides_on_the_last_pcm():
    sched = make(initial_frames=4)
    send(sched, "a", 0, 4)
    plan = sched.schedule()
    assert not plan.seqs[0].is_last  # upstream has not finished yet
    assert send(sched, "a", 4, 0, final=True) == []  # the pcm of frames 0..3 is still in flight
    emits = sched.update(plan, decode(plan))
    assert [(type(e.msg), getattr(e.msg, "final", None)) for e in emits] == [(Chunk, True), (Finish, None)]
    assert len(pcm_of(emits, "a")) == 4 * SAMPLES_PER_FRAME


def test_final_after_everything_decoded_finishes_at_once():
    sched = make()
    send(sched, "a", 0, 2)
    plan = sched.schedule()
    sched.update(plan, decode(plan))
    emits = send(sched, "a", 2, 0, final=True)
    assert [type(e.msg) for e in emits] == [Chunk, Finish] and emits[0].msg.final and emits[0].arrays is None
    assert emits[1].msg.num_frames == 2 and sched.num_requests == 0


def test_codec_limit_drains_audio_then_finishes_with_the_error():
    sched = make()
    send(sched, "a", 0, 3)
    emits = sched.finish_upstream("a", Finish(req_id="a", reason="codec_limit", error="limit of 3 frames"))
    assert emits == []
    while plan := sched.schedule():
        emits += sched.update(plan, decode(plan))
    assert len(pcm_of(emits, "a")) == 3 * SAMPLES_PER_FRAME
    assert (emits[-1].msg.reason, emits[-1].msg.error) == ("codec_limit", "limit of 3 frames")


def test_upstream_error_drops_frames_and_forwards_the_finish():
    sched = make()
    send(sched, "a", 0, 5)
    plan = sched.schedule()
    emits = sched.finish_upstream("a", Finish(req_id="a", reason="error", error="talker failed"))
    assert [(e.msg.reason, e.msg.error) for e in emits] == [("error", "talker failed")]
    assert sched.update(plan, decode(plan)) == []  # in-flight pcm of a failed request is dropped
    assert send(sched, "a", 5, 3) == [] and sched.schedule() is None  # a late chunk does not revive it
    assert sched.num_requests == 0 and sched.num_free_slots == 64


def test_abort_in_flight_frees_the_slot_and_ignores_late_results():
    sched = make(max_num_seqs=1)
    send(sched, "a", 0, 2)
    send(sched, "b", 0, 2)
    plan = sched.schedule()
    assert sizes(plan) == [("a", 2)]  # one decoder slot: b waits for it
    sched.abort("a")
    sched.abort("a")
    assert sched.num_free_slots == 1 and sched.update(plan, decode(plan)) == []
    plan = sched.schedule()
    assert sizes(plan) == [("b", 2)] and plan.seqs[0].is_first


def test_fail_finishes_the_plans_requests_with_error():
    sched = make()
    send(sched, "a", 0, 3)
    send(sched, "b", 0, 3)
    plan = sched.schedule()
    emits = sched.fail(plan, RuntimeError("decoder exploded"))
    assert sorted((e.msg.req_id, e.msg.reason) for e in emits) == [("a", "error"), ("b", "error")]
    assert sched.num_requests == 0 and sched.num_free_slots == 64


def test_step_budget_and_deadline_order():
    clock = Clock()
    sched = make(clock, max_frames_per_step=4, initial_frames=2, frames=4)
    send(sched, "a", 0, 2)
    clock.now = 0.1
    send(sched, "b", 0, 2)
    plan = sched.schedule()
    assert sizes(plan) == [("a", 2), ("b", 2)]  # both dry, a waited longer
    sched.update(plan, decode(plan))
    send(sched, "a", 2, 4)
    send(sched, "b", 2, 4)
    clock.now = 0.1 + 0.12  # both played 120 of 160 ms; sent at the same time, equal slack
    plan = sched.schedule()
    assert plan.num_frames == 4 and sizes(plan) == [("a", 4)]  # the budget caps the step
    sched.update(plan, decode(plan))
    clock.now += 0.01
    send(sched, "a", 6, 4)
    assert sizes(sched.schedule()) == [("b", 4)]  # b is now the one closest to running dry


def test_out_of_range_codes_fail_only_their_request() -> None:
    sched = CodecScheduler(CodecConfig(max_num_seqs=4, codebook_size=2048))
    good = np.zeros((2, 16), dtype=np.int64)
    bad = np.full((1, 16), 2477, dtype=np.int64)
    assert sched.extend("ok", Chunk("ok", 0), {"codes": good}) == []
    emits = sched.extend("bad", Chunk("bad", 0), {"codes": bad})
    assert len(emits) == 1 and isinstance(emits[0].msg, Finish) and emits[0].msg.reason == "error"
    assert "2477" in emits[0].msg.error
    negative = sched.extend("neg", Chunk("neg", 0), {"codes": np.full((1, 16), -1, dtype=np.int64)})
    assert len(negative) == 1 and negative[0].msg.reason == "error" and "-1" in negative[0].msg.error
    assert sched.num_requests == 1  # the good request is untouched


def test_codes_of_the_wrong_width_fail_only_their_request() -> None:
    sched = CodecScheduler(CodecConfig(max_num_seqs=4))
    assert sched.extend("ok", Chunk("ok", 0), {"codes": np.zeros((2, 16), dtype=np.int64)}) == []
    for name in ("codes", "context_codes"):
        emits = sched.extend(name, Chunk(name, 0), {name: np.zeros((1, 8), dtype=np.int64)})
        assert len(emits) == 1 and emits[0].msg.reason == "error" and "[1, 8]" in emits[0].msg.error
    assert sched.num_requests == 1 and sched.schedule() is not None  # the good request still batches


def test_next_wakeup_is_when_a_held_back_chunk_becomes_urgent():
    clock = Clock()
    sched = make(clock, initial_frames=2, frames=8, urgent_s=0.4)
    assert sched.next_wakeup() is None
    send(sched, "a", 0, 6)
    assert sched.next_wakeup() is None  # no audio yet: urgent already, nothing to wait for
    for _ in range(2):
        plan = sched.schedule()
        sched.update(plan, decode(plan))  # 2 + 4 frames out at t=0: 0.48 s buffered
    send(sched, "a", 6, 3)
    assert sched.schedule() is None  # 3 < 8 frames and not urgent
    wake = sched.next_wakeup()
    assert abs(wake - (6 * 0.08 - 0.4)) < 1e-9  # the buffer reaches 0.4 s at t = 0.08
    clock.now = wake + 1e-6
    assert sizes(sched.schedule()) == [("a", 3)]  # and then the held frames go
    assert sched.next_wakeup() is None  # nothing held back any more


def _buffered_stream(clock: Clock):
    """A scheduler with stream "b" playing 0.48 s of audio at ``clock.now`` and a full 8-frame chunk waiting."""
    sched = make(clock, initial_frames=2, frames=8, urgent_s=0.4)
    send(sched, "b", 0, 6)
    for want in ([("b", 2)], [("b", 4)]):
        plan = sched.schedule()
        assert sizes(plan) == want
        sched.update(plan, decode(plan))  # 6 frames played by now: 0.48 s buffered, more than urgent_s
    send(sched, "b", 6, 8)
    return sched


def test_a_first_chunk_does_not_wait_for_full_chunks_of_buffered_streams():
    clock = Clock()
    alone = _buffered_stream(clock)
    assert sizes(alone.schedule()) == [("b", 8)]  # nothing new: the full chunk goes as always
    sched = _buffered_stream(clock)
    send(sched, "a", 0, 1)  # a new request's first frame
    first = sched.schedule()
    assert sizes(first) == [("a", 1)] and first.seqs[0].is_first  # its own step: its PCM leaves at once
    assert sizes(sched.schedule()) == [("b", 8)]  # the buffered stream's chunk goes in the next step
    # a stream that is itself urgent rides along with the first chunk
    sched = _buffered_stream(clock)
    clock.now += 0.1  # b holds 0.38 s now: urgent
    send(sched, "a", 0, 1)
    assert sorted(sizes(sched.schedule())) == [("a", 1), ("b", 8)]


def _two_playing_streams(join_fraction: float) -> CodecScheduler:
    """Streams "a" and "b", 8 frames each played out at t=0 (0.64 s buffered, not urgent), nothing pending."""
    sched = make(initial_frames=8, frames=8, urgent_s=0.4, join_fraction=join_fraction)
    for req_id in ("a", "b"):
        send(sched, req_id, 0, 8)
        plan = sched.schedule()
        assert sizes(plan) == [(req_id, 8)]
        sched.update(plan, decode(plan))
    return sched


def test_a_stream_with_half_a_chunk_rides_along_in_a_step_that_goes_anyway():
    sched = _two_playing_streams(0.5)
    send(sched, "b", 8, 3)
    assert sched.schedule() is None  # 3 < 8 frames, nobody urgent: no step at all
    send(sched, "a", 8, 8)
    assert sizes(sched.schedule()) == [("a", 8)]  # b holds 3 < half of 8: it waits
    send(sched, "b", 11, 1)
    send(sched, "a", 16, 8)
    assert sizes(sched.schedule()) == [("a", 8), ("b", 4)]  # now b holds half a chunk: it joins
    alone = _two_playing_streams(1.0)  # join_fraction 1: only full chunks go
    send(alone, "a", 8, 8)
    send(alone, "b", 8, 7)
    assert sizes(alone.schedule()) == [("a", 8)]


def test_staggered_streams_line_up_and_take_fewer_steps_with_nothing_lost():
    """Two streams fed one frame per tick (a talker step), b starting 3 ticks after a; a step completes before
    the next tick. Without joining, their chunks stay 3 ticks apart for ever: one step each."""
    def run(join_fraction: float) -> tuple[int, list]:
        clock = Clock()
        sched = make(clock, initial_frames=8, frames=8, urgent_s=0.0, join_fraction=join_fraction)
        emits, steps = [], 0
        for tick in range(51):
            clock.now = tick * 0.01  # far faster than real time: nobody runs dry
            for req_id, start in (("a", 0), ("b", 3)):
                frame = tick - start
                if 0 <= frame < 48:
                    send(sched, req_id, frame, 1, final=frame == 47, reason="stop")
            while plan := sched.schedule():
                steps += 1
                emits += sched.update(plan, decode(plan))
        return steps, emits

    (steps_alone, emits_alone), (steps_joined, emits_joined) = run(1.0), run(0.5)
    assert steps_alone == 14 and steps_joined <= 9, (steps_alone, steps_joined)  # 1 + 5 + 1 each; then together
    expected = np.repeat(np.arange(48, dtype=np.float32), SAMPLES_PER_FRAME)
    for emits in (emits_alone, emits_joined):
        for req_id in ("a", "b"):
            assert np.array_equal(pcm_of(emits, req_id), expected)  # every frame once, in order
            assert sum(isinstance(e.msg, Finish) and e.msg.req_id == req_id for e in emits) == 1


def test_join_fraction_must_be_a_fraction():
    for bad in (0.0, 1.5, float("nan")):
        try:
            CodecConfig(join_fraction=bad)
        except ValueError as e:
            assert "join_fraction" in str(e)
        else:
            raise AssertionError(f"join_fraction={bad} was accepted")
