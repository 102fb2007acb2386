"""Talker scheduler on CPU with hand-made step results."""

from __future__ import annotations

import numpy as np
from omniloop.scheduler.ar import ArConfig, ArScheduler
from omniloop.scheduler.plan import ArStepPlan, ArStepResult
from omniloop.scheduler.policy import FRAME_S
from omniloop.scheduler.request import ArPrompt, ArState
from omniloop.transport.messages import Chunk, Finish, SpeechRequest, Submit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock | None = None, **config) -> ArScheduler:
    config.setdefault("num_kv_blocks", 64)
    config.setdefault("block_size", 4)
    return ArScheduler(ArConfig(**config), clock=clock or Clock())


def result(plan: ArStepPlan, stops: tuple[str, ...] = (), value: int = 7) -> ArStepResult:
    codes = np.full((len(plan.seqs), 16), value, dtype=np.int64)
    return ArStepResult(codes=codes, is_stop=[seq.req_id in stops for seq in plan.seqs])


def seq_of(plan: ArStepPlan, req_id: str):
    return next(seq for seq in plan.seqs if seq.req_id == req_id)


def frames(emits) -> int:
    return sum(len(e.arrays["codes"]) for e in emits if e.arrays)


def test_chunked_prefill_splits_long_prompt_while_decodes_continue():
    sched = make(max_num_tokens=8)
    sched.add("a", ArPrompt(num_prompt_tokens=3, max_frames=50))
    sched.add("b", ArPrompt(num_prompt_tokens=20, max_frames=50, arrival=1.0))
    pieces, a_frames = [], 0
    while True:
        plan = sched.schedule()
        assert plan.num_tokens <= 8
        a = seq_of(plan, "a")
        assert a.is_sample  # a samples a frame every step, prefill or decode
        b = next((seq for seq in plan.seqs if seq.req_id == "b"), None)
        pieces.append(b and (b.start, b.num_tokens, b.is_sample))
        a_frames += frames(e for e in sched.update(plan, result(plan)) if e.msg.req_id == "a")
        if b and b.is_sample:
            break
    # b's first piece waits for a step with all the room a's decode leaves (7), not the 5 left beside a's prompt
    assert pieces == [None, (0, 7, False), (7, 7, False), (14, 6, True)]
    assert a_frames == 4
    # once prefilled, b decodes from its prompt end, one position per step
    plan = sched.schedule()
    assert seq_of(plan, "b").start == 20 and seq_of(plan, "b").is_decode
    assert seq_of(plan, "a").start == 3 + 4 - 1


def test_async_overlap_schedules_next_decode_before_update():
    sched = make()
    sched.add("a", ArPrompt(num_prompt_tokens=5, max_frames=10))
    p1 = sched.schedule()
    p2 = sched.schedule()  # p1 still in flight: a's input comes from p1's sample on the device
    assert (p1.seqs[0].start, p1.seqs[0].num_tokens, p1.seqs[0].is_decode) == (0, 5, False)
    assert (p2.seqs[0].start, p2.seqs[0].num_tokens, p2.seqs[0].is_decode) == (5, 1, True)
    assert p1.seqs[0].block_ids == (0, 1, 2, 3) and p2.seqs[0].block_ids is None  # table sent once
    assert [e.msg.seq for e in sched.update(p1, result(p1))] == [0]
    assert [e.msg.seq for e in sched.update(p2, result(p2))] == [1]


def test_fenced_stop_discards_the_extra_step():
    sched = make()
    sched.add("a", ArPrompt(num_prompt_tokens=2, max_frames=10))
    p1, p2 = sched.schedule(), sched.schedule()
    assert frames(sched.update(p1, result(p1))) == 1
    p3 = sched.schedule()  # planned before the stop in p2 is known
    emits = sched.update(p2, result(p2, stops=("a",)))
    assert len(emits) == 1 and emits[0].msg.final and emits[0].msg.reason == "stop" and emits[0].arrays is None
    assert sched.update(p3, result(p3)) == []  # after the stop: nothing
    assert sched.schedule() is None
    assert sched.num_requests == 0 and sched.num_free_blocks == 64 and sched.num_free_slots == 64


def test_length_finish_emits_exactly_max_frames():
    sched = make()
    sched.add("a", ArPrompt(num_prompt_tokens=2, max_frames=3))
    plans = [sched.schedule() for _ in range(3)]
    assert sched.schedule() is None  # never more samples than max_frames, even with steps in flight
    emits = [e for p in plans for e in sched.update(p, result(p))]
    assert frames(emits) == 3
    assert [e.msg.final for e in emits] == [False, False, True] and emits[-1].msg.reason == "length"
    assert sched.num_requests == 0 and sched.num_free_blocks == 64


def test_codec_limit_emits_frames_then_finish_with_error():
    sched = make(max_codec_frames=2)
    sched.add("a", ArPrompt(num_prompt_tokens=2, max_frames=100))
    emits = []
    while plan := sched.schedule():
        emits += sched.update(plan, result(plan))
    assert [type(e.msg) for e in emits] == [Chunk, Chunk, Finish]
    assert frames(emits) == 2 and not any(e.msg.final for e in emits[:2])
    assert emits[-1].msg.reason == "codec_limit" and "2 frames" in emits[-1].msg.error
    assert emits[-1].msg.num_frames == 2 and sched.num_requests == 0


def test_abort_while_in_flight_frees_at_once_and_is_idempotent():
    sched = make()
    sched.add("a", ArPrompt(num_prompt_tokens=4, max_frames=10))
    sched.add("b", ArPrompt(num_prompt_tokens=4, max_frames=10))
    p1 = sched.schedule()
    free_before = sched.num_free_blocks
    sched.abort("a")
    sched.abort("a")
    sched.abort("never-added")
    assert sched.num_free_blocks == free_before + 4 and sched.num_free_slots == 63 and sched.num_requests == 1
    emits = sched.update(p1, result(p1))
    assert [e.msg.req_id for e in emits] == ["b"]
    assert [s.req_id for s in sched.schedule().seqs] == ["b"]


def test_fail_finishes_exactly_the_plans_requests():
    sched = make()
    sched.add("a", ArPrompt(num_prompt_tokens=4, max_frames=10))
    sched.add("b", ArPrompt(num_prompt_tokens=4, max_frames=10))
    p1, p2 = sched.schedule(), sched.schedule()
    emits = sched.fail(p1, RuntimeError("boom"))
    assert {e.msg.req_id for e in emits} == {"a", "b"}
    assert all(e.dest == "frontend" and e.msg.reason == "error" and "boom" in e.msg.error for e in emits)
    assert sched.update(p2, result(p2)) == []
    assert sched.num_requests == 0 and sched.num_free_blocks == 64 and sched.num_free_slots == 64


def test_parked_requests_keep_seats_and_admission_never_overcommits():
    sched = make(max_num_seqs=2)
    for req_id in ("a", "b"):  # 4 + 9 - 1 positions: 3 blocks of 4
        sched.add(req_id, ArPrompt(num_prompt_tokens=4, max_frames=9, is_input_complete=False))
    sched.add("c", ArPrompt(num_prompt_tokens=4, max_frames=10, arrival=1.0))
    plan = sched.schedule()
    # the last known token is held back so the piece completing the prompt can sample
    assert [(s.req_id, s.start, s.num_tokens, s.is_sample) for s in plan.seqs] == [
        ("a", 0, 3, False), ("b", 0, 3, False)]
    sched.update(plan, result(plan))
    assert sched.schedule() is None  # a and b parked; c has no seat
    assert sched.num_parked == 2 and sched.state_of("c") is ArState.WAITING
    sched.extend("a", Chunk(req_id="a", seq=0, final=True), {"hidden": np.zeros((2, 8))})
    plan = sched.schedule()
    assert [(s.req_id, s.start, s.num_tokens, s.is_sample) for s in plan.seqs] == [("a", 3, 3, True)]
    assert [slot for slot, _ in plan.inputs] == [seq_of(plan, "a").slot]
    assert seq_of(plan, "a").block_ids is not None  # the prompt grew past its first table
    sched.update(plan, result(plan, stops=("a",)))
    assert [s.req_id for s in sched.schedule().seqs] == ["c"]  # a's seat went to c


def test_admission_waits_for_blocks_instead_of_preempting():
    sched = make(num_kv_blocks=4, block_size=4)  # 16 positions
    assert sched.add("huge", ArPrompt(num_prompt_tokens=10, max_frames=10))[0].msg.reason == "error"
    sched.add("a", ArPrompt(num_prompt_tokens=4, max_frames=9))  # 12 positions: 3 blocks
    sched.add("b", ArPrompt(num_prompt_tokens=4, max_frames=5, arrival=1.0))  # 8 positions: 2 blocks
    plan = sched.schedule()
    assert [s.req_id for s in plan.seqs] == ["a"] and sched.num_free_blocks == 1
    for _ in range(9):  # a decodes to its limit; it never needs a block it does not hold
        sched.update(plan, result(plan))
        plan = sched.schedule()
        assert [s.req_id for s in plan.seqs] == (["a"] if sched.num_requests == 2 else ["b"])
    assert sched.state_of("a") is None and sched.state_of("b") is ArState.RUNNING


def test_admission_is_first_come_when_blocks_are_short():
    sched = make(num_kv_blocks=6, block_size=4)
    sched.add("a", ArPrompt(num_prompt_tokens=4, max_frames=5))  # 2 blocks
    sched.schedule()
    sched.add("big", ArPrompt(num_prompt_tokens=12, max_frames=5, arrival=1.0))  # 4 blocks: 4 free, but...
    sched.add("small", ArPrompt(num_prompt_tokens=4, max_frames=1, arrival=2.0))  # 1 block
    sched.abort("a")
    sched.add("c", ArPrompt(num_prompt_tokens=8, max_frames=9, arrival=0.5))  # 4 blocks, earliest
    plan = sched.schedule()
    # c (earliest) takes 4 of the 6 blocks; big does not fit and small may not jump the queue
    assert [s.req_id for s in plan.seqs] == ["c"] and sched.num_waiting == 2


def test_deadline_order_under_a_contended_token_budget():
    clock = Clock()
    sched = make(clock, max_num_tokens=1, num_kv_blocks=128)
    sched.add("a", ArPrompt(num_prompt_tokens=1, max_frames=100, arrival=0.0))
    sched.add("b", ArPrompt(num_prompt_tokens=1, max_frames=100, arrival=0.5))
    clock.now = 1.0

    def step() -> str:
        plan = sched.schedule()
        sched.update(plan, result(plan))
        return plan.seqs[0].req_id

    assert step() == "a"  # no audio yet anywhere: first come, first served
    assert step() == "b"  # a now has 80 ms buffered, b is still dry
    for _ in range(3):
        assert step() == "a"  # a and b tie (ties keep order): a, then ...
        assert step() == "b"
    clock.now += 2 * FRAME_S  # both play on, 4 frames sent each
    sched.add("c", ArPrompt(num_prompt_tokens=1, max_frames=100, arrival=clock.now - 0.01))
    # a and b still hold 2 frames (160 ms) each, c has waited 10 ms: the seated streams are not
    # in danger, but c is (it has no audio at all) and goes first
    assert step() == "c"


def test_upstream_error_forwards_finish_and_frees():
    sched = make()
    sched.add("a", ArPrompt(num_prompt_tokens=4, max_frames=10, is_input_complete=False))
    plan = sched.schedule()
    emits = sched.finish_upstream("a", Finish(req_id="a", reason="error", error="thinker died"))
    assert [(e.dest, e.msg.reason, e.msg.error) for e in emits] == [("next", "error", "thinker died")]
    assert sched.update(plan, result(plan)) == [] and sched.num_free_blocks == 64


def test_duplicate_request_id_is_refused_without_touching_the_first():
    sched = make()
    sched.add("a", ArPrompt(num_prompt_tokens=4, max_frames=10))
    emits = sched.add("a", ArPrompt(num_prompt_tokens=4, max_frames=10))
    assert [(e.dest, e.msg.reason) for e in emits] == [("frontend", "error")]
    assert sched.num_requests == 1 and sched.schedule().seqs[0].req_id == "a"


def test_submit_is_forwarded_so_the_codec_learns_the_request():
    def prepare(req_id, submit, arrays) -> ArPrompt:
        if not submit.request.text:
            raise ValueError("empty text")
        return ArPrompt(num_prompt_tokens=len(submit.request.text), max_frames=4, payload=submit.request.text)

    sched = ArScheduler(ArConfig(num_kv_blocks=8, block_size=4), prepare=prepare, clock=Clock())
    submit = Submit(req_id="a", request=SpeechRequest(text="hello"))
    emits = sched.add("a", submit, {"ref_pcm": np.zeros(10, np.float32)})
    assert [(e.dest, e.msg, e.arrays) for e in emits] == [("next", submit, None)]  # reference audio stays
    plan = sched.schedule()
    assert [(n.req_id, n.payload) for n in plan.new] == [("a", "hello")] and plan.num_tokens == 5
    emits = sched.add("b", Submit(req_id="b", request=SpeechRequest(text="")), {})  # prepare raises below
    assert [(e.dest, e.msg.reason) for e in emits] == [("frontend", "error")] and sched.num_requests == 1


def test_admission_never_takes_the_playing_streams_decodes():
    """A wave of prompts is more urgent (dry since arrival) than streams with audio buffered, but it only
    gets the budget left after their decodes: the streams keep playing while the wave is prefilled."""
    clock = Clock()
    sched = make(clock, max_num_tokens=10, num_kv_blocks=128)
    for name in ("a", "b"):
        sched.add(name, ArPrompt(num_prompt_tokens=2, max_frames=100, arrival=0.0))
    plan = sched.schedule()
    sched.update(plan, result(plan))  # a and b prefilled, one frame each: now decoding
    clock.now = 0.05
    sched.add("c", ArPrompt(num_prompt_tokens=30, max_frames=100, arrival=0.0))
    plan = sched.schedule()
    assert {(s.req_id, s.num_tokens) for s in plan.seqs} == {("a", 1), ("b", 1), ("c", 8)}
    sched.update(plan, result(plan))
    # a budget too small for the decodes alone: the deadline order decides (c, dry since 0, goes first)
    small = make(clock, max_num_tokens=2, num_kv_blocks=128)
    for name in ("a", "b"):
        small.add(name, ArPrompt(num_prompt_tokens=1, max_frames=100, arrival=0.0))
    plan = small.schedule()
    small.update(plan, result(plan))
    small.add("c", ArPrompt(num_prompt_tokens=30, max_frames=100, arrival=0.0))
    assert [(s.req_id, s.num_tokens) for s in small.schedule().seqs] == [("c", 2)]


def test_a_prompt_that_fits_a_step_whole_is_not_split():
    """A first piece that would be cut short waits for a later step (only first pieces replay a prefill
    graph); a smaller prompt behind it uses the room meanwhile, and a prompt longer than any step starts
    with all of an otherwise empty step's room."""
    sched = make(max_num_tokens=10, num_kv_blocks=128)
    sched.add("a", ArPrompt(num_prompt_tokens=6, max_frames=10, arrival=0.0))
    sched.add("b", ArPrompt(num_prompt_tokens=6, max_frames=10, arrival=0.1))
    sched.add("c", ArPrompt(num_prompt_tokens=3, max_frames=10, arrival=0.2))
    sched.add("long", ArPrompt(num_prompt_tokens=25, max_frames=10, arrival=0.3))
    plan = sched.schedule()
    assert [(s.req_id, s.start, s.num_tokens) for s in plan.seqs] == [("a", 0, 6), ("c", 0, 3)]
    plan = sched.schedule()  # a and c decode (one position each), b whole
    assert [(s.req_id, s.start, s.num_tokens) for s in plan.seqs] == [("a", 6, 1), ("b", 0, 6), ("c", 3, 1)]
    plan = sched.schedule()  # "long" never fits whole: it starts when it gets a step's room (10 - 3 decodes)
    assert ("long", 0, 7) in [(s.req_id, s.start, s.num_tokens) for s in plan.seqs]


def test_grown_prompts_holding_every_block_preempt_the_least_urgent_and_resend_its_inputs():
    """Two streaming prompts grow until neither fits beside the other and nothing runs: the later one is sent
    back to waiting (its blocks and seat freed), the earlier goes on, and the victim is prefilled again from
    position 0 with every input it had been given, in order, once the earlier one is done."""
    sched = make(max_num_tokens=32, num_kv_blocks=6, block_size=4, max_num_seqs=2)
    for name, at in (("a", 0.0), ("b", 0.1)):
        sched.add(name, ArPrompt(num_prompt_tokens=4, max_frames=2, arrival=at, is_input_complete=False))
    plan = sched.schedule()  # both seated: 3 of 4 known tokens each (the last is held back), 2 blocks each
    assert [(s.req_id, s.start, s.num_tokens) for s in plan.seqs] == [("a", 0, 3), ("b", 0, 3)]
    sched.update(plan, result(plan))
    b_inputs = [np.full((12, 1), 1.0)]
    sched.extend("a", Chunk("a", 0), {"x": np.full((12, 1), 0.0)})
    sched.extend("b", Chunk("b", 0), {"x": b_inputs[0]})
    # each now needs 5 blocks (16 prompt positions + 1 frame), 2 are free: neither can go on
    plan = sched.schedule()
    assert [(s.req_id, s.start, s.num_tokens) for s in plan.seqs] == [("a", 3, 12)]
    assert sched.state_of("b") is ArState.WAITING and sched.num_free_blocks == 1
    sched.update(plan, result(plan))
    sched.extend("a", Chunk("a", 1, final=True), {"x": np.full((1, 1), 0.0)})
    b_inputs.append(np.full((2, 1), 2.0))
    sched.extend("b", Chunk("b", 1), {"x": b_inputs[1]})  # b grows while it waits: kept for its re-admission
    while sched.state_of("a") is not None:  # a finishes its prompt and its 2 frames
        plan = sched.schedule()
        assert "b" not in [s.req_id for s in plan.seqs]
        sched.update(plan, result(plan))
    plan = sched.schedule()  # b again, from position 0, with both inputs sent again in order
    assert [(s.req_id, s.start, s.num_tokens) for s in plan.seqs] == [("b", 0, 17)]
    assert [n.req_id for n in plan.new] == ["b"]
    sent = [x for _, arrays in plan.inputs for x in arrays.values()]
    assert len(sent) == 2 and all(x is y for x, y in zip(sent, b_inputs))


def test_no_request_is_seated_while_a_seated_prompt_waits_for_blocks():
    """Even one ahead in deadline order (it arrived first, but had nothing to feed when the other was seated):
    seating it would take the blocks the grown prompt waits for."""
    sched = make(max_num_tokens=32, num_kv_blocks=6, block_size=4, max_num_seqs=3)
    sched.add("w", ArPrompt(num_prompt_tokens=1, max_frames=1, arrival=0.0, is_input_complete=False))
    sched.add("s", ArPrompt(num_prompt_tokens=4, max_frames=1, arrival=0.1, is_input_complete=False))
    sched.add("p", ArPrompt(num_prompt_tokens=8, max_frames=5, arrival=0.2))
    plan = sched.schedule()
    assert [s.req_id for s in plan.seqs] == ["s", "p"] and sched.num_free_blocks == 2  # w: nothing to feed yet
    sched.update(plan, result(plan))
    sched.extend("s", Chunk("s", 0), {"x": np.zeros((12, 1))})  # s now needs 4 blocks, has 1; 2 are free
    sched.extend("w", Chunk("w", 0), {"x": np.zeros((4, 1))})
    plan = sched.schedule()
    assert plan.new == [] and sched.state_of("w") is ArState.WAITING and sched.num_free_blocks == 2
