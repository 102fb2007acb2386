"""One message per upstream step: plain chunks to a next stage are coalesced into ``Chunks`` and split again
on arrival, in order, with every malformed batch failing the requests it names."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from omniloop.actors.stage import StageActor
from omniloop.errors import FrameError
from omniloop.scheduler.interface import Emit
from omniloop.transport import batching
from omniloop.transport.frames import decode, encode
from omniloop.transport.messages import Abort, Chunk, Chunks, Finish


def codes(value: int, rows: int = 1) -> dict[str, np.ndarray]:
    return {"codes": np.full((rows, 16), value, dtype=np.int64)}


def test_pack_and_unpack_through_the_wire_keep_every_chunk():
    chunks = [(Chunk(f"r{i}", seq=i + 3, stage="talker"), codes(i, rows=1 + i % 2)) for i in range(5)]
    msg, arrays = batching.pack(chunks)
    assert isinstance(msg, Chunks) and arrays["codes"].shape == (7, 16)
    got_msg, got_arrays = decode(encode(msg, arrays))
    out = list(batching.unpack(got_msg, got_arrays))
    assert [(c.req_id, c.seq, c.stage, c.final) for c, _ in out] == [(f"r{i}", i + 3, "talker", False) for i in range(5)]
    for (_, want), (_, got) in zip(chunks, out):
        np.testing.assert_array_equal(got["codes"], want["codes"])


@pytest.mark.parametrize("msg, arrays", [
    (Chunk("r", 0, final=True, reason="stop"), codes(1)),  # a final chunk ends its request: alone
    (Chunk("r", 0, text="hi"), codes(1)),  # text deltas are not batched
    (Chunk("r", 0), None),
    (Chunk("r", 0), {"codes": np.zeros((1, 16), np.int64), "hidden": np.zeros((2, 4), np.float32)}),  # rows differ
    (Chunk("r", 0), {"x": np.float32(1.0).reshape(())}),  # 0-d
    (Finish("r", "stop"), None),
])
def test_what_travels_alone(msg, arrays):
    assert batching.layout(msg, arrays) is None


def test_layouts_differ_by_names_dtypes_and_trailing_shapes():
    base = batching.layout(Chunk("a", 0), codes(1))
    assert base == batching.layout(Chunk("b", 5), codes(2, rows=3))  # rows may differ
    assert base != batching.layout(Chunk("a", 0), {"codes": np.zeros((1, 8), np.int64)})
    assert base != batching.layout(Chunk("a", 0), {"codes": np.zeros((1, 16), np.int32)})
    assert base != batching.layout(Chunk("a", 0), {"other": np.zeros((1, 16), np.int64)})


@pytest.mark.parametrize("msg, arrays, error", [
    (Chunks(["a", "b"], [0], [1, 1]), codes(0, rows=2), "2 request ids, 1 seqs"),
    (Chunks(["a", "b"], [0, 0], [1, 2]), codes(0, rows=2), "add up to 3"),
    (Chunks(["a"], [0], [-1]), codes(0, rows=0), "negative"),
    (Chunks(["a"], [0], [1]), {}, "without arrays"),
])
def test_malformed_batches_are_frame_errors(msg, arrays, error):
    with pytest.raises(FrameError, match=error) as raised:
        batching.unpack(msg, arrays)
    assert raised.value.req_ids == tuple(msg.req_ids)  # every request of the batch is failed


class Recorder:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg, arrays=None) -> None:
        self.sent.append((msg, arrays))


class Scheduler:
    def __init__(self) -> None:
        self.extended: list = []
        self.aborted: list = []

    def extend(self, req_id, chunk, arrays):
        self.extended.append((req_id, chunk.seq, int(arrays["codes"][0, 0])))
        return []

    def abort(self, req_id):
        self.aborted.append(req_id)


def bare_stage(has_next_stage: bool = True) -> StageActor:
    """A StageActor's sending and receiving paths without a loop, sockets or a model."""
    stage = StageActor.__new__(StageActor)
    stage.has_next_stage = has_next_stage
    stage._to_next, stage._to_frontend = Recorder(), Recorder()
    stage.scheduler = Scheduler()
    stage.stage = type("S", (), {"name": "talker"})()
    return stage


def test_stage_coalesces_runs_and_keeps_order_on_the_socket():
    stage = bare_stage()
    plain = [Emit("next", Chunk(f"r{i}", 4, stage="talker"), codes(i)) for i in range(3)]
    final = Emit("next", Chunk("r1", 5, final=True, reason="stop", stage="talker"), codes(9))
    error = Emit("frontend", Finish("r2", "error", error="boom", stage="talker"))
    stage._send([*plain, final, plain[0], error, *plain[1:]])
    kinds = [(type(m).__name__, getattr(m, "req_ids", None) or m.req_id) for m, _ in stage._to_next.sent]
    # the run of three is one message; the final chunk follows it; one plain chunk alone is sent as a Chunk;
    # the error's Abort goes out before the chunks emitted after it
    assert kinds == [("Chunks", ["r0", "r1", "r2"]), ("Chunk", "r1"), ("Chunk", "r0"), ("Abort", "r2"),
                     ("Chunks", ["r1", "r2"])]
    assert isinstance(stage._to_next.sent[3][0], Abort)
    np.testing.assert_array_equal(stage._to_next.sent[0][1]["codes"][:, 0], [0, 1, 2])


def test_last_stage_batches_its_chunks_to_the_frontend():
    """A codec step's PCM for many requests: one Chunks message to the frontend (3.5 -> 0.6 ms of loop-thread time
    for 64 chunks of 8 frames on CPU, tools/bench_transport.py --payload pcm); final chunks and Finishes alone."""
    stage = bare_stage(has_next_stage=False)
    stage._to_next = stage._to_frontend  # as StageActor wires a last stage
    pcm = [Emit("next", Chunk(f"r{i}", 0, stage="codec"), {"pcm": np.full(4 + i, i, np.float32)}) for i in range(3)]
    last = Emit("next", Chunk("r0", 1, final=True, reason="stop", stage="codec"), {"pcm": np.ones(2, np.float32)})
    done = Emit("frontend", Finish("r0", "stop", stage="codec"))
    stage._send([*pcm, last, done, *pcm[1:]])
    sent = stage._to_frontend.sent
    assert [(type(m).__name__, getattr(m, "req_ids", None) or m.req_id) for m, _ in sent] == [
        ("Chunks", ["r0", "r1", "r2"]), ("Chunk", "r0"), ("Finish", "r0"), ("Chunks", ["r1", "r2"])]
    assert sent[0][0].rows == [4, 5, 6] and sent[0][1]["pcm"].tolist() == [0] * 4 + [1] * 5 + [2] * 6


def _frontend(*req_ids: str):
    from omniloop.actors.collector import Collector
    from omniloop.actors.engine import Engine
    from omniloop.profile import load_profile

    engine = Engine(load_profile("fake"))
    engine._idle = asyncio.Event()
    for req_id in req_ids:
        engine._requests[req_id] = Collector(req_id, wire_id=f"w-{req_id}")
        engine._req_id_of[f"w-{req_id}"] = req_id
    return engine


def test_the_frontend_splits_a_batch_into_each_request_and_fails_all_of_a_bad_one():
    engine = _frontend("a", "b", "c", "x", "y")
    msg, arrays = batching.pack([(Chunk(f"w-{r}", 0, stage="codec"), {"pcm": np.full(3, k, np.float32)})
                                 for k, r in enumerate("abc")])
    engine._on_inbox([decode(encode(msg, arrays))])
    for k, r in enumerate("abc"):
        assert engine._requests[r].num_samples == 3 and engine._requests[r]._pcm[0].tolist() == [k] * 3
    engine._on_inbox([(Chunks(["w-x", "w-y"], [0, 0], [2, 2]), {"pcm": np.zeros(3, np.float32)})])  # rows say 4
    assert "x" not in engine._requests and "y" not in engine._requests  # both ended, with an error
    assert engine._num_finished["error"] == 2 and set(engine._requests) == {"a", "b", "c"}


def test_a_damaged_batch_frame_at_the_frontend_fails_every_request_it_names():
    engine = _frontend("a", "b")
    batch, arrays = batching.pack([(Chunk(f"w-{r}", 0, stage="codec"), {"pcm": np.ones(3, np.float32)}) for r in "ab"])
    frames = encode(batch, arrays)
    engine._on_inbox(list(_delivered([*frames[:2], bytes(frames[2])[:-8]])))
    assert not engine._requests and engine._num_finished["error"] == 2


def _delivered(frames):
    """What an Inbox hands its callback for ``frames``: the decoded message, or the FrameError."""
    try:
        yield decode(frames)
    except FrameError as exc:
        yield exc


def test_receiving_stage_extends_each_request_and_fails_all_of_a_bad_batch():
    stage = bare_stage()
    msg, arrays = batching.pack([(Chunk(f"r{i}", 7, stage="talker"), codes(i)) for i in range(3)])
    stage._handle(*decode(encode(msg, arrays)))
    assert stage.scheduler.extended == [("r0", 7, 0), ("r1", 7, 1), ("r2", 7, 2)]
    bad = Chunks(["x", "y"], [0, 0], [1, 1])
    stage._handle(bad, codes(0, rows=3))
    assert stage.scheduler.aborted == ["x", "y"] and len(stage.scheduler.extended) == 3
    failed = [(m.req_id, m.reason) for m, _ in stage._to_frontend.sent]
    assert failed == [("x", "error"), ("y", "error")]


def test_a_damaged_batch_frame_fails_every_request_it_names():
    """Damage on the wire (a truncated buffer, a header that does not validate): no chunk of a batch may vanish
    silently, each named request ends with an error."""
    batch, arrays = batching.pack([(Chunk(f"r{i}", 0, stage="talker"), codes(i)) for i in range(3)])
    frames = encode(batch, arrays)
    with pytest.raises(FrameError) as info:
        decode([*frames[:2], bytes(frames[2])[:-8]])  # the codes buffer cut short
    assert info.value.req_ids == ("r0", "r1", "r2")
    stage = bare_stage()
    stage._on_bad_frame(info.value)  # what StageActor._on_inbox does with an inbox FrameError
    assert stage.scheduler.aborted == ["r0", "r1", "r2"]
    assert [(m.req_id, m.reason) for m, _ in stage._to_frontend.sent] == [(f"r{i}", "error") for i in range(3)]
    header = msgspec.msgpack.encode({"type": "chunks", "req_ids": ["r0", "r1"], "seqs": [0, 0], "rows": "two"})
    with pytest.raises(FrameError) as info:
        decode([frames[0], header, frames[2]])
    assert info.value.req_ids == ("r0", "r1")
