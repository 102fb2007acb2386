"""``omniloop bench --repeat``: each level run N times on one engine, with median, min and max per metric."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniloop.profile import load_profile
from omniloop.serve.bench import gpu_state, run_bench, summarize_runs


def test_summary_of_runs_is_median_min_max():
    runs = [{"concurrency": 8, "num_requests": 16, "audio_s_per_s": v, "errors": 0, "run": i}
            for i, v in enumerate((3.0, 1.0, 2.0))]
    assert summarize_runs(runs) == {"concurrency": 8, "runs": 3, "runs_with_errors": 0, "errors": 0,
                                    "audio_s_per_s": {"median": 2.0, "min": 1.0, "max": 3.0}}


def test_summary_counts_errors_and_leaves_failed_runs_out_of_the_latencies():
    runs = [{"concurrency": 2, "num_requests": 4, "first_audio_p95_s": p95, "errors": errors, "run": i}
            for i, (p95, errors) in enumerate(((0.5, 1), (0.0, 4), (0.7, 0)))]
    summary = summarize_runs(runs)
    assert (summary["errors"], summary["runs_with_errors"]) == (5, 2)
    assert summary["first_audio_p95_s"] == {"median": 0.6, "min": 0.5, "max": 0.7}  # the all-failed run's 0 is out
    all_failed = summarize_runs([{**runs[1], "run": 0}])
    assert "first_audio_p95_s" not in all_failed and all_failed["errors"] == 4


async def test_bench_repeats_each_level_on_one_engine():
    profile = load_profile("fake", ["stages.talker.placement=thread", "stages.codec.placement=thread",
                                    "transport=inproc"], platform="cpu")
    result = await run_bench(profile, [2, 3], num_requests=3, num_words=2, max_frames=4, repeat=2)
    assert [(r["concurrency"], r["run"]) for r in result["levels"]] == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert all(r["errors"] == 0 and r["audio_s_per_s"] > 0 and "gpu" in r for r in result["levels"])
    # the first wave: each client's first request; at 3 clients for 3 requests it is every request
    assert all(r["first_audio_p95_first_wave_s"] > 0 for r in result["levels"])
    assert all(r["first_audio_p95_first_wave_s"] == r["first_audio_p95_s"] for r in result["levels"][2:])
    assert [s["concurrency"] for s in result["summary"]] == [2, 3]
    for summary in result["summary"]:
        spread = summary["audio_s_per_s"]
        assert summary["runs"] == 2 and spread["min"] <= spread["median"] <= spread["max"]


async def test_repeat_must_be_positive():
    with pytest.raises(ValueError, match="repeat"):
        await run_bench(load_profile("fake", [], platform="cpu"), [1], None, 2, 4, repeat=0)


def _fake_nvidia_smi(tmp_path, monkeypatch, out: str, rc: int = 0) -> None:
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nprintf '{out}'\nexit {rc}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))


def test_gpu_state_parses_each_gpu(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, "0, 1980, 3201, 450.50, 55, 0x0000000000000000\\n"
                                            "1, 1755, 3201, [N/A], 61, 0x0000000000000004\\n")
    assert gpu_state() == [
        {"index": 0, "sm_mhz": 1980.0, "mem_mhz": 3201.0, "power_w": 450.5, "temp_c": 55.0,
         "clock_limits": "0x0000000000000000"},
        {"index": 1, "sm_mhz": 1755.0, "mem_mhz": 3201.0, "power_w": None, "temp_c": 61.0,
         "clock_limits": "0x0000000000000004"}]


def test_gpu_state_is_none_without_a_usable_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert gpu_state() is None
    _fake_nvidia_smi(tmp_path, monkeypatch, "No devices were found\\n", rc=6)
    assert gpu_state() is None
    _fake_nvidia_smi(tmp_path, monkeypatch, "1980, 3201\\n")  # fields missing: not guessed at
    assert gpu_state() is None


def test_tree_digest_follows_the_code_and_nothing_else(tmp_path):
    import shutil

    from omniloop.serve.bench import tree_digest

    repo = Path(__file__).resolve().parents[1]
    for part in ("omniloop", "profiles"):
        shutil.copytree(repo / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    here = tree_digest(repo)
    assert tree_digest(tmp_path) == here and len(here) == 12  # a copy of the tree: the same digest
    (tmp_path / "omniloop" / "notes.txt").write_text("not code")
    assert tree_digest(tmp_path) == here
    layers = tmp_path / "omniloop" / "models" / "qwen3_tts" / "layers.py"
    layers.write_text(layers.read_text() + "\n# changed\n")
    assert tree_digest(tmp_path) != here
