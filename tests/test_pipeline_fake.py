"""The fake pipelines end to end: exact output, abort, step failure, stage death, clean shutdown."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import zlib

import numpy as np
import psutil
import pytest

from omniloop.actors.engine import Engine
from omniloop.errors import RequestError, StageStartupError
from omniloop.profile import load_profile
from omniloop.transport.channel import Outbox, context_users
from omniloop.transport.frames import encode
from omniloop.transport.messages import ChatRequest, Chunk, SpeechRequest


def expected_pcm(text: str, max_frames: int | None = None) -> np.ndarray:
    """The fake talker + codec, written out independently of omniloop.models.fake."""
    num_frames = len(text) if max_frames is None else min(len(text), max_frames)
    base = zlib.crc32(text.encode()) % 2048
    out = []
    for f in range(num_frames):
        codes = [(base + 16 * f + j) % 2048 for j in range(16)]
        out += [((codes[k % 16] * 7 + k) % 1000) / 1000.0 - 0.5 for k in range(1920)]
    return np.asarray(out, dtype=np.float64).astype(np.float32)


def profile(name: str = "fake", threads: bool = True, *overrides: str):
    stages = ["thinker", "talker", "codec"] if name == "fake3" else ["talker", "codec"]
    sets = [f"stages.{s}.placement=thread" for s in stages] + ["transport=inproc"] if threads else []
    return load_profile(name, [*sets, *overrides], platform="cpu")


async def collect(engine: Engine, request, req_id: str | None = None):
    pcm, text, outs = [], [], []
    async for out in engine.generate(request, req_id):
        outs.append(out)
        if out.pcm is not None:
            pcm.append(out.pcm)
        if out.text:
            text.append(out.text)
    assert sum(o.finish is not None for o in outs) == 1 and outs[-1].finish is not None
    return (np.concatenate(pcm) if pcm else np.zeros(0, np.float32)), "".join(text), outs[-1].finish


async def wait_until_empty(engine: Engine) -> dict[str, int]:
    """Stages free aborted requests as the Abort reaches them; give the messages a moment to arrive."""
    for _ in range(100):
        stats = await engine.refresh_stats()
        counts = {n: int(s["extra"]["num_requests"]) for n, s in stats["stages"].items()}
        if not any(counts.values()):
            return counts
        await asyncio.sleep(0.01)
    return counts


def no_leftovers(threads_before: set[threading.Thread]) -> None:
    leftover = [t.name for t in threading.enumerate() if t not in threads_before]
    assert leftover == [], f"threads left behind: {leftover}"
    # multiprocessing's resource tracker is one per Python process, shared by every spawn user, and
    # ends with the process; it is not an actor.
    children = [p for p in psutil.Process().children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())]
    assert children == [], f"child processes left behind: {children}"
    assert context_users() == 0, "a ZMQ socket (and so the shared context) is still open"


async def test_threads_inproc_exact_pcm_for_concurrent_requests():
    before = set(threading.enumerate())
    engine = await Engine.start(profile("fake", True))
    # what start-up built is out of the cyclic collector while serving (its full passes stalled every thread)
    assert gc.get_freeze_count() > 0
    texts = ["hello world", "a", "the quick brown fox"]
    results = await asyncio.gather(
        *(collect(engine, SpeechRequest(t)) for t in texts), collect(engine, SpeechRequest("cut short", max_frames=3))
    )
    for text, (pcm, _, finish) in zip(texts, results):
        np.testing.assert_array_equal(pcm, expected_pcm(text))
        assert (finish.reason, finish.stage, finish.num_frames) == ("stop", "codec", len(text))
    pcm, _, finish = results[-1]
    np.testing.assert_array_equal(pcm, expected_pcm("cut short", 3))
    assert finish.reason == "length"
    await engine.shutdown()
    assert gc.get_freeze_count() == 0  # collectable again: a stopped engine's cycles must not leak
    no_leftovers(before)


async def test_processes_ipc_fake3_streams_text_and_exact_pcm_and_cleans_up():
    before = set(threading.enumerate())
    engine = await Engine.start(profile("fake3", False))
    run_dir = engine.supervisor.addresses.run_dir
    assert engine.is_ready and os.path.isdir(run_dir)
    request = ChatRequest(messages=[{"role": "user", "content": "streaming speech now"}])
    (pcm, text, finish), (pcm2, _, _) = await asyncio.gather(
        collect(engine, request), collect(engine, SpeechRequest("second one"))
    )
    assert text == "streaming speech now"
    np.testing.assert_array_equal(pcm, expected_pcm("streaming speech now"))
    np.testing.assert_array_equal(pcm2, expected_pcm("second one"))
    assert finish.reason == "stop"
    await engine.shutdown()
    assert not os.path.exists(run_dir), "ipc socket files must be removed on shutdown"
    no_leftovers(before)


async def test_abort_anywhere_is_idempotent_and_frees_the_request_in_every_stage():
    engine = await Engine.start(profile("fake3", True, "stages.talker.options.step_ms=10"))
    text = "abort me somewhere along the way please"

    # 1) aborted before its Submit was even handled
    gen = engine.generate(SpeechRequest(text), "early")
    first = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0)
    engine.abort("early")
    engine.abort("early")
    assert (await first).finish.reason == "abort"
    # 2) aborted once audio flows (the request is in thinker, talker and codec)
    gen = engine.generate(SpeechRequest(text), "mid")
    async for out in gen:
        if out.pcm is not None:
            engine.abort("mid")
        if out.finish is not None:
            assert out.finish.reason == "abort"
    # 3) the consumer walks away: closing the iterator aborts
    gen = engine.generate(SpeechRequest(text), "walked")
    async for out in gen:
        if out.text:
            break
    await gen.aclose()
    # 4) abort after a normal finish, and of an unknown id: no effect
    pcm, _, finish = await collect(engine, SpeechRequest("fine"), "done")
    engine.abort("done")
    engine.abort("never-existed")
    assert finish.reason == "stop"
    np.testing.assert_array_equal(pcm, expected_pcm("fine"))

    assert await wait_until_empty(engine) == {"thinker": 0, "talker": 0, "codec": 0}
    for handle in engine.supervisor.handles.values():
        assert handle.actor.scheduler.num_requests == 0, handle.name
    assert engine.stats()["num_finished"] == {"abort": 3, "stop": 1}
    await engine.shutdown()


@pytest.mark.parametrize("stage", ["talker", "codec"])
async def test_a_step_that_raises_fails_only_that_steps_requests(stage):
    engine = await Engine.start(
        profile("fake", True, f"stages.{stage}.options.raise_marker=RAISE", f"stages.{stage}.max_num_seqs=1")
    )
    texts = ["good one", "please RAISE here", "good two"]
    results = await asyncio.gather(*(collect(engine, SpeechRequest(t)) for t in texts))
    for text, (pcm, _, finish) in zip(texts, results):
        if "RAISE" in text:
            assert finish.reason == "error" and finish.stage == stage
            assert "fake failure" in finish.error and stage in finish.error
        else:
            assert finish.reason == "stop"
            np.testing.assert_array_equal(pcm, expected_pcm(text))
    assert await wait_until_empty(engine) == {"talker": 0, "codec": 0}
    await engine.shutdown()


async def test_garbage_and_truncated_frames_do_not_kill_a_stage():
    engine = await Engine.start(profile("fake", True, "stages.talker.options.step_ms=10"))
    intruder = Outbox(engine.supervisor.address_of("codec"), name="intruder")
    intruder.send_raw = intruder._sock.send_multipart
    intruder.send_raw([b"\x99", b"junk"])
    intruder.send_raw([b"\x02", b"\xc1 not msgpack"])
    gen = engine.generate(SpeechRequest("a fairly long sentence to speak"), "victim")
    async for out in gen:
        if out.pcm is not None:
            victim_id = engine._requests["victim"].wire_id  # the request's id inside the pipeline
            break_frames = encode(Chunk(victim_id, 99), {"codes": np.zeros((1, 16), np.int64)})
            intruder.send_raw(break_frames[:-1])  # the codes buffer is missing
        if out.finish is not None:
            finish = out.finish
    assert finish.reason == "error" and finish.stage == "codec" and "truncated" in finish.error
    pcm, _, finish = await collect(engine, SpeechRequest("still alive"))
    assert finish.reason == "stop"
    np.testing.assert_array_equal(pcm, expected_pcm("still alive"))
    assert await wait_until_empty(engine) == {"talker": 0, "codec": 0}
    intruder.close()
    await engine.shutdown()


async def test_killed_stage_process_fails_its_requests_naming_the_stage():
    before = set(threading.enumerate())
    engine = await Engine.start(profile("fake", False, "stages.talker.options.step_ms=20"))
    gens = [engine.generate(SpeechRequest("long enough to be in flight for a while"), f"r{i}") for i in range(3)]
    firsts = [await g.__anext__() for g in gens]
    assert all(o.finish is None for o in firsts)
    os.kill(engine.supervisor.handles["codec"].pid, signal.SIGKILL)
    for gen in gens:
        finishes = [o.finish async for o in gen if o.finish is not None]
        assert len(finishes) == 1
        assert finishes[0].reason == "stage_died"
        assert "'codec'" in finishes[0].error and "SIGKILL" in finishes[0].error
    assert not engine.is_ready
    assert "codec" in engine.stats()["error"]
    with pytest.raises(RequestError) as info:
        engine.generate(SpeechRequest("after death"))
    assert info.value.status == 503
    await engine.shutdown(timeout_s=1)
    no_leftovers(before)


@pytest.mark.parametrize("threads", [True, False], ids=["threads", "processes"])
async def test_shutdown_with_requests_in_flight_leaves_nothing_behind(threads):
    before = set(threading.enumerate())
    engine = await Engine.start(profile("fake", threads, "stages.talker.options.step_ms=20"))
    tasks = [asyncio.ensure_future(collect(engine, SpeechRequest("this will not finish in time"))) for _ in range(4)]
    await asyncio.sleep(0.1)
    await engine.shutdown(timeout_s=0.1)
    for pcm, _, finish in await asyncio.gather(*tasks):
        assert finish.reason == "shutdown"
    no_leftovers(before)


async def test_admission_and_validation_errors():
    engine = await Engine.start(profile("fake", True, "max_pending=2", "stages.talker.options.step_ms=20"))
    with pytest.raises(RequestError) as info:
        engine.generate(SpeechRequest("   "))
    assert info.value.status == 400
    with pytest.raises(RequestError, match="at most 512"):
        engine.generate(SpeechRequest("x" * 513))
    gens = [engine.generate(SpeechRequest("hold a seat for a while")) for _ in range(2)]
    firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
    await asyncio.sleep(0)
    with pytest.raises(RequestError) as info:
        engine.generate(SpeechRequest("one too many"))
    assert info.value.status == 429
    await asyncio.gather(*firsts)
    for gen in gens:
        await gen.aclose()
    assert engine.stats()["num_pending"] == 0
    assert engine.info.sample_rate == 24000
    await engine.shutdown()


@pytest.mark.parametrize("threads", [True, False], ids=["threads", "processes"])
async def test_a_stage_that_cannot_start_is_named_with_its_error(threads):
    before = set(threading.enumerate())
    with pytest.raises(StageStartupError, match=r"stage 'codec'.*unknown options \['bogus'\]"):
        await Engine.start(profile("fake", threads, "stages.codec.options.bogus=1"))
    no_leftovers(before)
