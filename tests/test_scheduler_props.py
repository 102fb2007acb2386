"""Random interleavings of add / extend / abort / schedule / update with up to two steps in flight:
every request ends exactly once, nothing leaks, nothing is emitted after a stop, and the emitted
frames (talker) and samples (codec) are exactly the expected ones, in order."""

from __future__ import annotations

from collections import defaultdict, deque

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from omniloop.scheduler.ar import ArConfig, ArScheduler
from omniloop.scheduler.codec import CodecConfig, CodecScheduler
from omniloop.scheduler.plan import ArStepResult, CodecStepResult
from omniloop.scheduler.request import ArPrompt
from omniloop.transport.messages import Chunk, Finish

MAX_IN_FLIGHT = 2


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def is_terminal(emit) -> bool:
    return isinstance(emit.msg, Finish) or emit.msg.final


ar_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 12), st.integers(1, 8), st.none() | st.integers(0, 8),
                  st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 20)),
        st.tuples(st.just("schedule")),
        st.tuples(st.just("update")),
        st.tuples(st.just("fail")),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ar_ops, max_num_tokens=st.integers(1, 16), max_num_seqs=st.integers(1, 4))
def test_talker_random_interleavings(ops, max_num_tokens, max_num_seqs):
    config = ArConfig(max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens, num_kv_blocks=8, block_size=4,
                      max_codec_frames=6)
    clock = Clock()
    sched = ArScheduler(config, clock=clock)
    uid_of: dict[str, int] = {}  # req_id -> the uid of its live (or latest) request
    spec: dict[int, tuple[int, int | None]] = {}  # uid -> (max_frames, stop_at)
    num_samples: defaultdict[int, int] = defaultdict(int)  # samples scheduled per uid
    next_pos: dict[int, int] = defaultdict(int)
    frames: defaultdict[int, list[int]] = defaultdict(list)  # emitted sample indices per uid
    ends: defaultdict[int, list[str]] = defaultdict(list)  # terminal reasons per uid
    aborted: set[int] = set()
    in_flight: deque = deque()

    def schedule() -> None:
        plan = sched.schedule()
        if plan is None:
            return
        assert 0 < plan.num_tokens <= max_num_tokens and len(plan.seqs) <= max_num_seqs
        assert len({seq.slot for seq in plan.seqs}) == len(plan.seqs)
        meta = []
        for seq in plan.seqs:
            uid = uid_of[seq.req_id]
            assert seq.start == next_pos[uid] and 0 <= seq.slot < max_num_seqs  # positions contiguous
            next_pos[uid] += seq.num_tokens
            meta.append((uid, num_samples[uid]))
            num_samples[uid] += seq.is_sample
        in_flight.append((plan, meta))

    def collect(emits) -> None:
        for emit in emits:
            uid = uid_of[emit.msg.req_id]
            assert not ends[uid] and uid not in aborted  # nothing after the end
            if emit.arrays:
                row = emit.arrays["codes"][0]
                assert row[0] == uid  # a stale step never leaks into a reused id
                frames[uid].append(int(row[1]))
            if is_terminal(emit):
                ends[uid].append(emit.msg.reason)

    def update(fail: bool = False) -> None:
        plan, meta = in_flight.popleft()
        if fail:
            collect(sched.fail(plan, RuntimeError("step failed")))
            return
        codes = np.array([[uid, idx] + [0] * 14 for uid, idx in meta], dtype=np.int64)
        is_stop = [idx == spec[uid][1] for uid, idx in meta]
        collect(sched.update(plan, ArStepResult(codes=codes, is_stop=is_stop)))

    for op in ops:
        clock.now += 0.03
        if op[0] == "add":
            _, num_prompt, max_frames, stop_at, reuse = op
            ended = [rid for rid, uid in uid_of.items() if ends[uid] or uid in aborted]
            req_id = ended[0] if reuse and ended else f"r{len(spec)}"
            uid = len(spec)
            uid_of[req_id], spec[uid] = uid, (max_frames, stop_at)
            collect(sched.add(req_id, ArPrompt(num_prompt_tokens=num_prompt, max_frames=max_frames,
                                               arrival=clock.now)))
        elif op[0] == "abort":
            uid = op[1]
            req_id = next((rid for rid, u in uid_of.items() if u == uid), None)  # None: id reused since
            if req_id is not None:
                sched.abort(req_id)
                if not ends[uid]:
                    aborted.add(uid)
        elif op[0] == "schedule" and len(in_flight) < MAX_IN_FLIGHT:
            schedule()
        elif op[0] in ("update", "fail") and in_flight:
            update(fail=op[0] == "fail")
    while True:  # drain, keeping two steps in flight as the actor loop does
        while len(in_flight) < MAX_IN_FLIGHT:
            num_before = len(in_flight)
            schedule()
            if len(in_flight) == num_before:
                break
        if not in_flight:
            break  # a request still held here now is stuck: the leak checks below catch it
        update()

    for uid, (max_frames, stop_at) in spec.items():
        if uid in aborted:
            assert not ends[uid] and frames[uid] == list(range(len(frames[uid])))
            continue
        assert len(ends[uid]) == 1, (uid, ends[uid])  # exactly one end
        if ends[uid] == ["error"]:
            continue  # a failed step or a request too large for the KV pool
        limit = min(max_frames, 6)
        expected = min(stop_at, limit) if stop_at is not None else limit
        assert frames[uid] == list(range(expected))
        if stop_at is not None and stop_at < limit:
            assert ends[uid] == ["stop"]
        else:
            assert ends[uid] == (["length"] if max_frames <= 6 else ["codec_limit"])
    assert sched.num_requests == 0 and sched.num_in_flight == 0
    assert sched.num_free_blocks == 8 and sched.num_free_slots == max_num_seqs


codec_ops = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.integers(0, 3), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 3)),
        st.tuples(st.just("error"), st.integers(0, 3)),
        st.tuples(st.just("schedule")),
        st.tuples(st.just("update")),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=codec_ops, budget=st.integers(4, 12), max_num_seqs=st.integers(1, 3))
def test_codec_random_interleavings(ops, budget, max_num_seqs):
    config = CodecConfig(max_num_seqs=max_num_seqs, max_frames_per_step=budget, initial_frames=1, frames=4)
    clock = Clock()
    sched = CodecScheduler(config, clock=clock)
    num_sent: defaultdict[int, int] = defaultdict(int)
    is_closed: set[int] = set()  # upstream sent final, aborted or errored: nothing more is sent
    pcm: defaultdict[int, list[np.ndarray]] = defaultdict(list)
    ends: defaultdict[int, list[str]] = defaultdict(list)
    finals: defaultdict[int, int] = defaultdict(int)
    aborted: set[int] = set()
    in_flight: deque = deque()

    def collect(emits) -> None:
        for emit in emits:
            r = int(emit.msg.req_id)
            assert not ends[r] and r not in aborted
            if emit.arrays:
                pcm[r].append(emit.arrays["pcm"])
            if isinstance(emit.msg, Finish):  # the codec's one terminal message
                ends[r].append(emit.msg.reason)
            elif emit.msg.final:
                finals[r] += 1

    def schedule() -> bool:
        plan = sched.schedule()
        if plan is not None:
            assert 0 < plan.num_frames <= budget and len({s.slot for s in plan.seqs}) == len(plan.seqs)
            in_flight.append(plan)
        return plan is not None

    def update() -> None:
        plan = in_flight.popleft()
        collect(sched.update(plan, CodecStepResult([seq.codes[:, 0].astype(np.float32) for seq in plan.seqs])))

    for op in ops:
        clock.now += 0.03
        if op[0] == "send" and op[1] not in is_closed:
            _, r, n, final = op
            codes = np.repeat(np.arange(num_sent[r], num_sent[r] + n, dtype=np.int64)[:, None], 16, axis=1)
            num_sent[r] += n
            chunk = Chunk(req_id=str(r), seq=0, final=final, reason="stop" if final else None)
            collect(sched.extend(str(r), chunk, {"codes": codes}))
            if final:
                is_closed.add(r)
        elif op[0] == "abort" and not ends[op[1]]:
            sched.abort(str(op[1]))
            aborted.add(op[1])
            is_closed.add(op[1])
        elif op[0] == "error" and op[1] not in is_closed:
            collect(sched.finish_upstream(str(op[1]), Finish(req_id=str(op[1]), reason="error", error="x")))
            is_closed.add(op[1])
        elif op[0] == "schedule" and len(in_flight) < MAX_IN_FLIGHT:
            schedule()
        elif op[0] == "update" and in_flight:
            update()
    for r in set(num_sent) - is_closed:  # upstream finishes everything still open
        collect(sched.extend(str(r), Chunk(req_id=str(r), seq=0, final=True, reason="stop"), {}))
    while (len(in_flight) < MAX_IN_FLIGHT and schedule()) or in_flight:
        if in_flight:
            update()

    for r in num_sent:
        got = np.concatenate(pcm[r]) if pcm[r] else np.zeros(0, np.float32)
        assert np.array_equal(got, np.arange(len(got), dtype=np.float32))  # in order, no gaps or repeats
        if r in aborted:
            assert not ends[r]
        elif ends[r] == ["error"]:
            assert len(got) <= num_sent[r]
        else:
            assert ends[r] == ["stop"] and finals[r] == 1
            assert len(got) == num_sent[r]  # everything sent was decoded once
    assert sched.num_requests == 0 and sched.num_in_flight == 0 and sched.num_free_slots == max_num_seqs


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_num_tokens=st.integers(1, 24), max_num_seqs=st.integers(1, 6))
def test_talker_streaming_prompts_always_finish(seed, max_num_tokens, max_num_seqs):
    """Prompts that grow after admission (streamed input) on a small block pool: once every input is complete
    and the steps drain, every request has ended (no deadlock of grown prompts holding all blocks)."""
    rng = np.random.default_rng(seed)
    clock = Clock()
    sched = ArScheduler(ArConfig(max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens, num_kv_blocks=16,
                                 block_size=4), clock=clock)
    ended: set[str] = set()
    open_inputs: dict[str, int] = {}  # streaming request -> chunks still to come
    in_flight: deque = deque()
    names: list[str] = []

    def collect(emits) -> None:
        ended.update(e.msg.req_id for e in emits if is_terminal(e))

    def step() -> None:
        plan = in_flight.popleft()
        codes = np.zeros((len(plan.seqs), 16), dtype=np.int64)
        collect(sched.update(plan, ArStepResult(codes=codes, is_stop=[False] * len(plan.seqs))))

    for _ in range(150):
        clock.now += 0.01
        r = rng.random()
        if r < 0.1 and len(names) < 20:
            name = f"r{len(names)}"
            names.append(name)
            streaming = rng.random() < 0.5
            collect(sched.add(name, ArPrompt(num_prompt_tokens=int(rng.integers(1, 20)), max_frames=int(rng.integers(1, 6)),
                                             arrival=clock.now, is_input_complete=not streaming)))
            if streaming:
                open_inputs[name] = int(rng.integers(1, 4))
        elif r < 0.25 and open_inputs:
            name = list(open_inputs)[int(rng.integers(len(open_inputs)))]
            open_inputs[name] -= 1
            final = open_inputs[name] == 0
            collect(sched.extend(name, Chunk(name, 0, final=final), {"x": np.zeros((int(rng.integers(0, 12)), 1))}))
            if final:
                del open_inputs[name]
        elif len(in_flight) < MAX_IN_FLIGHT and (plan := sched.schedule()) is not None:
            assert plan.num_tokens <= max_num_tokens
            in_flight.append(plan)
        elif in_flight:
            step()
    for name in list(open_inputs):
        collect(sched.extend(name, Chunk(name, 0, final=True), {"x": np.zeros((1, 1))}))
    for _ in range(10_000):
        while len(in_flight) < MAX_IN_FLIGHT and (plan := sched.schedule()) is not None:
            in_flight.append(plan)
        if not in_flight:
            break
        step()
    assert set(names) <= ended and sched.num_requests == 0 and sched.num_free_blocks == 16
