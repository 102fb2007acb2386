"""Tracing: with OMNILOOP_TRACE_DIR set, every actor writes its steps and requests, and the merged file is
a Chrome/Perfetto trace in which each stage's steps and each request's lifetime can be read."""

from __future__ import annotations

import json
import math

import pytest

from omniloop.actors.engine import Engine
from omniloop.actors.trace import ENV_DIR, merge_traces, summarize
from omniloop.profile import load_profile
from omniloop.transport.messages import SpeechRequest


@pytest.mark.parametrize("threads", [False, True])
async def test_trace_records_every_stage_step_and_request(tmp_path, monkeypatch, threads: bool) -> None:
    """Stage processes, or stages as threads of this process (one OS pid, still one track per stage)."""
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "parts"))
    sets = ["stages.talker.options.step_ms=5"]
    if threads:
        sets += ["stages.talker.placement=thread", "stages.codec.placement=thread", "transport=inproc"]
    profile = load_profile("fake", sets, platform="cpu")
    engine = await Engine.start(profile)
    try:
        for i in range(3):
            async for _ in engine.generate(SpeechRequest(text=f"trace me {i}", max_frames=6), req_id=f"r{i}"):
                pass
    finally:
        await engine.shutdown(timeout_s=5)
    trace = merge_traces(tmp_path / "parts", tmp_path / "trace.json")
    assert json.loads((tmp_path / "trace.json").read_text()) == trace
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"frontend", "talker", "codec"}
    for key in ("r0", "r1", "r2"):  # each request: begin, first audio, end with its reason
        phases = [e["ph"] for e in events if e.get("id") == key]
        assert phases == ["b", "n", "e"], (key, phases)
    assert all(e["args"]["reason"] == "length" for e in events if e["ph"] == "e")
    steps = [e for e in events if e["ph"] == "X" and e["name"] == "step"]
    assert steps and all(e["args"]["seqs"] >= 1 for e in steps)
    # each stage's inbox drains: each stage took in the three submits (the talker forwards them), the codec its
    # chunks besides
    inboxes = [e for e in events if e["ph"] == "X" and e["name"] == "inbox"]
    by_name = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert sum(e["args"]["submits"] for e in inboxes if by_name[e["pid"]] == "talker") == 3
    assert sum(e["args"]["submits"] for e in inboxes if by_name[e["pid"]] == "codec") == 3
    assert sum(e["args"]["messages"] for e in inboxes if by_name[e["pid"]] == "codec") > 3
    assert all(0.0 <= e["args"]["handle_ms"] <= e["dur"] / 1e3 + 1e-3 for e in inboxes)
    summary = summarize(trace)
    assert set(summary) == {"talker", "codec"}
    assert summary["talker"]["mean_step_ms"] >= 5.0  # each fake talker step sleeps 5 ms
    assert 0.0 < summary["talker"]["busy_fraction"] <= 1.0
    talker = summary["talker"]
    assert talker["p95_step_ms"] >= talker["mean_step_ms"] * 0.5 and talker["median_spacing_ms"] > 0.0
    longest = [s["ms"] for s in talker["longest_steps"]]
    assert longest == sorted(longest, reverse=True) and longest[0] >= talker["p95_step_ms"] - 0.01
    assert all("seqs" in s for s in talker["longest_steps"])  # with the plan's size: what the stall was
    # every step records the loop thread's host time: planning it and submitting it
    assert all(e["args"]["schedule_ms"] >= 0.0 and e["args"]["submit_ms"] >= 0.0 for e in steps)
    talker_steps = [e for e in steps if e["pid"] == next(e2["pid"] for e2 in events
                                                          if e2["ph"] == "M" and e2["args"]["name"] == "talker")]
    host = [e["args"]["schedule_ms"] + e["args"]["submit_ms"] for e in talker_steps]
    assert talker["host_ms_total"] == round(math.fsum(host), 1) and talker["host_ms_max"] == round(max(host), 2)


def test_tracing_is_off_by_default(tmp_path, monkeypatch) -> None:
    from omniloop.actors.trace import Tracer

    monkeypatch.delenv(ENV_DIR, raising=False)
    tracer = Tracer("x")
    tracer.span("step", 0.0, 1.0)
    tracer.begin("request", "r")
    assert not tracer.enabled and tracer.events == [] and tracer.flush() is None


async def test_a_runner_that_times_its_submit_parts_has_them_in_its_step_spans(tmp_path, monkeypatch) -> None:
    """``phases_ms`` (the CUDA talker runner's: admit, reset, prefill, frame, gather, out) rides on each traced step
    as ``submit_phases_ms``; a runner without it leaves the key out."""
    from omniloop.models import fake

    monkeypatch.setenv(ENV_DIR, str(tmp_path / "parts"))
    calls = []

    def phases_ms(self):  # noqa: ANN001, ANN202
        calls.append(self.stage)
        return {"admit": 0.5, "frame": float(len(calls))} if self.stage == "talker" else None

    monkeypatch.setattr(fake.FakeRunner, "phases_ms", property(phases_ms), raising=False)
    sets = ["stages.talker.placement=thread", "stages.codec.placement=thread", "transport=inproc"]
    engine = await Engine.start(load_profile("fake", sets, platform="cpu"))
    try:
        async for _ in engine.generate(SpeechRequest(text="parts", max_frames=4), req_id="p0"):
            pass
    finally:
        await engine.shutdown(timeout_s=5)
    events = merge_traces(tmp_path / "parts", tmp_path / "trace.json")["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    steps = [e for e in events if e["ph"] == "X" and e["name"] == "step"]
    talker = [e["args"]["submit_phases_ms"] for e in steps if names[e["pid"]] == "talker"]
    assert talker and all(p["admit"] == 0.5 for p in talker)
    assert sorted(p["frame"] for p in talker) == sorted({p["frame"] for p in talker})  # one read per step
    assert all("submit_phases_ms" not in e["args"] for e in steps if names[e["pid"]] == "codec")
