"""Review: a request id may be used again once its request ended (docs/zmq-protocol.md: unique among a
client's *live* requests). The codec stage must not mistake the new request for the ended one."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from omniloop.actors.engine import Engine
from omniloop.profile import load_profile
from omniloop.scheduler.codec import CodecConfig, CodecScheduler
from omniloop.scheduler.plan import CodecStepResult
from omniloop.transport.messages import Chunk, Sampling, SpeechRequest, Submit


def _frames(n: int) -> dict:
    return {"codes": np.zeros((n, 16), dtype=np.int64)}


def _run_to_end(sched: CodecScheduler, req_id: str) -> list:
    emits = list(sched.add(req_id, Submit(req_id, SpeechRequest("hi"))))
    emits += sched.extend(req_id, Chunk(req_id, 0), _frames(2))
    emits += sched.extend(req_id, Chunk(req_id, 1, final=True, reason="stop"), {})
    while (plan := sched.schedule()) is not None:
        emits += sched.update(plan, CodecStepResult([np.zeros(1920 * (s.end - s.start), np.float32)
                                                     for s in plan.seqs]))
    return [e.msg for e in emits if type(e.msg).__name__ == "Finish"]


def test_codec_takes_a_request_id_again_after_it_finished():
    sched = CodecScheduler(CodecConfig())
    assert [f.reason for f in _run_to_end(sched, "x")] == ["stop"]
    assert [f.reason for f in _run_to_end(sched, "x")] == ["stop"]  # hung before: the id was "ended"


def test_codec_takes_a_request_id_again_after_an_abort():
    sched = CodecScheduler(CodecConfig())
    sched.add("x", Submit("x", SpeechRequest("hi")))
    sched.extend("x", Chunk("x", 0), _frames(2))
    assert sched.schedule() is not None
    sched.abort("x")
    assert [f.reason for f in _run_to_end(sched, "x")] == ["stop"]


async def test_engine_serves_a_reused_request_id(tts_fixtures):
    overrides = [f"model_dir={tts_fixtures.ckpt('a', 'custom_voice')}", "transport=inproc",
                 "stages.talker.placement=thread", "stages.codec.placement=thread"]
    engine = await Engine.start(load_profile("qwen3_tts", overrides, platform="cpu"))
    try:
        for _ in range(2):
            request = SpeechRequest(text="Hi.", speaker="ryan", sampling=Sampling(seed=1), max_frames=3)
            outs = await asyncio.wait_for(_collect(engine, request, "same-id"), 60)
            assert outs[-1].finish is not None and outs[-1].finish.reason in ("stop", "length")
    finally:
        await engine.shutdown(timeout_s=5)


async def _collect(engine, request, req_id):
    return [out async for out in engine.generate(request, req_id)]


class _Streams:
    """CodecStreams' bookkeeping (open raises on an open id, close ignores unknown ids), decoding zeros."""

    def __init__(self) -> None:
        self.open_ids: set[str] = set()
        self.device = torch.device("cpu")

    def open(self, req_id: str) -> None:
        if req_id in self.open_ids:
            raise KeyError(f"codec stream {req_id!r} is already open")
        self.open_ids.add(req_id)

    def close(self, req_id: str) -> None:
        self.open_ids.discard(req_id)

    def decode_host(self, chunks):
        assert all(req_id in self.open_ids for req_id, _ in chunks)
        return [np.zeros(1920 * len(codes), np.float32) for _, codes in chunks]


async def test_codec_runner_reopens_a_reused_id_in_another_slot():
    from omniloop.models.qwen3_tts.stage_codec import CodecRunner
    from omniloop.scheduler.plan import CodecSeq, CodecStepPlan

    def seq(req_id, slot, first, last):
        return CodecSeq(req_id, slot, 0, 1, np.zeros((1, 16), np.int64), first, last, 0)

    streams = _Streams()
    runner = CodecRunner(streams)
    try:
        # "x" is aborted mid-stream in slot 3 (its stream stays open until the slot is reused); "b" in
        # slot 1 ends, so a new "x" gets slot 1, and later a request "y" reuses slot 3
        runner.step(CodecStepPlan(0, [seq("b", 1, True, True), seq("x", 3, True, False)]))
        runner.step(CodecStepPlan(1, [seq("x", 1, True, False)]))
        runner.step(CodecStepPlan(2, [seq("y", 3, True, False)]))
        runner.step(CodecStepPlan(3, [seq("x", 1, False, True)]))  # the new x's stream is still open
    finally:
        runner.close()
    assert streams.open_ids == set()


async def test_late_output_of_an_aborted_request_does_not_reach_a_new_request_with_its_id():
    """After an abort the frontend forgets the id at once, but the last stage may still have output of
    the aborted request on its way (sent before the Abort reached it). A client that reuses the id
    right away must not get that output, nor its Finish."""
    from omniloop.transport.channel import Outbox
    from omniloop.transport.messages import Finish
    from tests.serve_util import expected_pcm

    profile = load_profile("fake", ["stages.talker.placement=thread", "stages.codec.placement=thread",
                                    "transport=inproc", "stages.talker.options.step_ms=5"], platform="cpu")
    engine = await Engine.start(profile)
    old_codec = Outbox(engine.supervisor.frontend_address, name="old-codec")  # the aborted request's tail
    try:
        first = engine.generate(SpeechRequest("a long sentence that is aborted early"), "x")
        async for out in first:
            if out.finish is None:
                old_id = getattr(engine._requests["x"], "wire_id", "x")  # the id the stages know it by
                engine.abort("x")
        pcm, finish = [], None
        async for out in engine.generate(SpeechRequest("hello"), "x"):
            if not pcm and finish is None:  # the old request's chunk and Finish were still in flight
                old_codec.send(Chunk(old_id, 7, stage="codec"), {"pcm": np.ones(1920, np.float32)})
                old_codec.send(Finish(old_id, "stop", stage="codec", num_frames=8))
            if out.pcm is not None:
                pcm.append(out.pcm)
            finish = out.finish or finish
        assert finish.reason == "stop" and finish.num_frames == len("hello")
        np.testing.assert_array_equal(np.concatenate(pcm), expected_pcm("hello"))
    finally:
        old_codec.close()
        await engine.shutdown(timeout_s=5)
