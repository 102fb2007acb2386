"""tools/wave_timeline.py on a synthetic trace: bursts are found by arrival gaps, and a burst's timeline holds the
steps between its first arrival and its last first audio, and only its own requests' first audios."""

from __future__ import annotations

from tools.wave_timeline import bursts, timeline


def _trace() -> list[dict]:
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "talker"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "codec"}}]
    warm = [{"ph": "b", "name": "request", "id": "w", "ts": 0.0}, {"ph": "n", "name": "first_audio", "id": "w", "ts": 20e3}]
    burst = [{"ph": "b", "name": "request", "id": f"r{i}", "ts": 1e6 + i * 100.0} for i in range(20)]
    audio = [{"ph": "n", "name": "first_audio", "id": f"r{i}", "ts": 1e6 + 60e3 + i * 1e3} for i in range(19)]
    steps = [{"ph": "X", "name": "step", "pid": 1, "ts": 1e6 + 5e3, "dur": 30e3,
              "args": {"seqs": 20, "new": 20, "num_tokens": 4000, "schedule_ms": 0.2, "submit_ms": 9.5,
                       "submit_phases_ms": {"admit": 1.0, "prefill": 7.5, "frame": 1.0}}},
             {"ph": "X", "name": "step", "pid": 2, "ts": 1e6 + 40e3, "dur": 10e3, "args": {"seqs": 20, "num_frames": 20}},
             {"ph": "X", "name": "step", "pid": 1, "ts": 2e6, "dur": 5e3, "args": {}}]  # after the burst's last audio
    inboxes = [{"ph": "X", "name": "inbox", "pid": 1, "ts": 1e6 + 50.0, "dur": 400.0,
                "args": {"messages": 1, "submits": 1, "handle_ms": 0.35}},
               {"ph": "X", "name": "inbox", "pid": 1, "ts": 1e6 + 500.0, "dur": 900.0,
                "args": {"messages": 20, "submits": 19, "handle_ms": 0.8}},
               {"ph": "X", "name": "inbox", "pid": 2, "ts": 1e6 + 600.0, "dur": 10.0,
                "args": {"messages": 2, "submits": 0, "handle_ms": 0.01}}]  # no arrivals: not listed
    return meta + warm + burst + audio + steps + inboxes


def test_a_burst_and_its_steps_and_first_audios() -> None:
    events = _trace()
    found = bursts(events, min_size=16)
    assert len(found) == 1 and len(found[0]) == 20  # the lone warm-up request is no burst
    t = timeline(events, found[0])
    assert t["requests"] == 20 and t["missing_first_audio"] == 1 and len(t["first_audio_ms"]) == 19
    assert t["first_audio_ms"][0] == 60.0 and t["arrivals_ms"] == 1.9
    assert [(s["stage"], s["start_ms"], s["new"], s["size"], s["submit_ms"]) for s in t["steps"]] == [
        ("talker", 5.0, 20, 4000, 9.5), ("codec", 40.0, None, 20, None)]
    assert [s["parts"] for s in t["steps"]] == [{"admit": 1.0, "prefill": 7.5, "frame": 1.0}, None]
    assert [(d["stage"], d["start_ms"], d["submits"], d["handle_ms"], d["ms"]) for d in t["inboxes"]] == [
        ("talker", 0.05, 1, 0.35, 0.4), ("talker", 0.5, 19, 0.8, 0.9)]


def test_the_printout_names_the_submit_parts_and_the_drains(tmp_path, monkeypatch, capsys) -> None:
    import json
    import sys

    from tools import wave_timeline

    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": _trace()}))
    monkeypatch.setattr(sys, "argv", ["wave_timeline", str(path), "--burst", "0"])
    wave_timeline.main()
    out = capsys.readouterr().out
    talker_row = next(line for line in out.splitlines() if line.strip().startswith("talker") and "4000" in line)
    assert talker_row.endswith("admit 1.00 prefill 7.50 frame 1.00")
    assert "talker inbox: 20 arrivals in 2 drains" in out
