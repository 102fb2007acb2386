"""The command line: every subcommand has --help; check-profile prints the resolved profile."""

from __future__ import annotations

import subprocess
import sys

import pytest

from omniloop.serve.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_for_every_subcommand(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert "usage: omniloop " + command in capsys.readouterr().out


def test_check_profile_prints_resolved(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-profile", "qwen3_tts", "--platform", "cuda", "--set", "stages.talker.max_num_seqs=7"]) == 0
    out = capsys.readouterr().out
    assert "max_num_seqs: 7" in out and "bfloat16" in out


def test_check_profile_error_is_clear() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "omniloop", "check-profile", "qwen3_tts", "--set", "stages.talker.colour=red"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "colour" in proc.stderr and "qwen3_tts.yaml" in proc.stderr


def test_log_format_json_emits_json_lines(tmp_path) -> None:
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "omniloop", "speak", "--text", "Hi.", "--speaker", "ryan", "--max-frames", "2",
         "--platform", "cpu", "--log-format", "json", "--out", str(tmp_path / "a.wav")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    events = {r["event"] for r in records}
    assert {"engine_ready", "engine_stopped"} <= events and all("level" in r and "timestamp" in r for r in records)
