"""``tools/sim_codec.py`` drives the real ``CodecScheduler`` through whole closed-loop benchmarks on a simulated clock:
every request must finish with every one of its frames decoded exactly once, whatever the chunking policy."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import sim_codec  # noqa: E402

from omniloop.scheduler.codec import CodecConfig  # noqa: E402
from omniloop.scheduler.policy import FRAME_S  # noqa: E402


@pytest.mark.parametrize("urgent_s, join_fraction", [(0.4, 0.5), (0.15, 0.5), (0.0, 1.0)])
def test_every_frame_of_every_request_is_played_once(urgent_s: float, join_fraction: float) -> None:
    cfg = CodecConfig(max_num_seqs=64, max_frames_per_step=512, initial_frames=2, frames=8, urgent_s=urgent_s,
                      join_fraction=join_fraction)
    out = sim_codec.simulate(cfg, sim_codec.Costs(), concurrency=12, num_requests=30, max_frames=37)
    assert out["num_finished"] == 30
    assert out["audio_s"] == pytest.approx(30 * 37 * FRAME_S)
    assert out["codec_steps"] >= 37 // 8  # at least the chunks of one request


def test_a_costlier_codec_step_is_slower_and_a_lower_urgency_takes_fewer_steps() -> None:
    cfg = CodecConfig(max_num_seqs=64, max_frames_per_step=512, initial_frames=2, frames=8)
    base = sim_codec.simulate(cfg, sim_codec.Costs(), 64, 128, 100)
    slow = sim_codec.simulate(cfg, replace(sim_codec.Costs(), replay_a=5.0), 64, 128, 100)
    assert slow["wall_s"] > base["wall_s"]
    relaxed = sim_codec.simulate(replace(cfg, urgent_s=0.15), sim_codec.Costs(), 64, 128, 100)
    assert relaxed["codec_steps"] < base["codec_steps"]


def test_the_talkers_submit_time_delays_a_bursts_first_audio() -> None:
    """An admission plan's GPU work starts only once the loop thread submitted it (``admit_host_ms`` a prompt,
    one loop thread): more of it puts the burst's first audio later, without changing the audio delivered."""
    cfg = CodecConfig(max_num_seqs=64, max_frames_per_step=512, initial_frames=2, frames=8, urgent_s=0.15)
    runs = [sim_codec.simulate(cfg, replace(sim_codec.Costs(), admit_host_ms=ms), 64, 64, 40) for ms in (0.0, 2.0)]
    assert runs[1]["first_audio_p95_s"] > runs[0]["first_audio_p95_s"] + 0.03  # 128 ms of submit, partly under GPU work
    assert runs[0]["audio_s"] == runs[1]["audio_s"] == pytest.approx(64 * 40 * FRAME_S)
