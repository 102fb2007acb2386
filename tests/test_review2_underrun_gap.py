"""Review 2: stream_underrun_seconds_total is the time a real-time player spends dry. A player that ran
dry waits for the next chunk and resumes from there, so one late chunk is one gap, not a deficit that
is counted again with every later chunk (bench.py's player model counts it once too)."""

from __future__ import annotations

from omniloop.serve.metrics import SAMPLE_RATE, RequestTracker, ServeMetrics


def test_one_late_chunk_is_counted_once() -> None:
    now = [0.0]
    metrics = ServeMetrics()
    tracker = RequestTracker(metrics, "speech", clock=lambda: now[0])
    second = SAMPLE_RATE
    for t in (0.0, 1.5, 2.5, 3.5, 4.5):  # 1 s of audio each; the second chunk is 0.5 s late
        now[0] = t
        tracker.on_audio(second)
    tracker.finish("stop")
    assert metrics.underruns.get() == 1
    assert abs(metrics.underrun_gap.get() - 0.5) < 1e-9, metrics.underrun_gap.get()
