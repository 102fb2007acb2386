"""Where a burst of requests waits for its first audio: the steps of every stage from the burst's first arrival
until its last first audio, from an ``omniloop trace`` file.

    python tools/wave_timeline.py trace.json [--min-burst 16] [--burst N]

A burst is a run of request arrivals (the frontend's ``request`` begin events) with under 50 ms between
neighbours and at least ``--min-burst`` requests (the bench's waves; its one-stream warm-up is not one).
Prints, in ms from the burst's first arrival: each step (stage, start, duration, requests, new admissions,
tokens or frames, the loop thread's planning and submit time, and what the submit was made of where the runner
says: ``TalkerSteps.phases_ms``), each stage's inbox drains that took in the burst's
requests (when, how many, the loop time to take them in), then the first audios as a histogram by 10 ms.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from typing import Any

GAP_US = 50_000


def load(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        return json.load(fh)["traceEvents"]


def bursts(events: list[dict[str, Any]], min_size: int) -> list[list[float]]:
    """Arrival times (us) of each burst, in order."""
    arrivals = sorted(e["ts"] for e in events if e.get("ph") == "b" and e.get("name") == "request")
    groups: list[list[float]] = []
    for ts in arrivals:
        if groups and ts - groups[-1][-1] < GAP_US:
            groups[-1].append(ts)
        else:
            groups.append([ts])
    return [g for g in groups if len(g) >= min_size]


def timeline(events: list[dict[str, Any]], arrivals: list[float]) -> dict[str, Any]:
    """The steps and first audios of the requests that arrived at ``arrivals``."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    ids = {e["id"] for e in events if e.get("ph") == "b" and e["ts"] in set(arrivals)}
    first = sorted(e["ts"] for e in events if e.get("name") == "first_audio" and e.get("id") in ids)
    t0, end = arrivals[0], (first[-1] if first else arrivals[-1])
    steps = []
    for e in sorted((e for e in events if e.get("ph") == "X" and e.get("name") == "step"), key=lambda e: e["ts"]):
        if t0 <= e["ts"] <= end:
            a = e.get("args", {})
            steps.append({"stage": names.get(e["pid"], e["pid"]), "start_ms": round((e["ts"] - t0) / 1e3, 1),
                          "ms": round(e["dur"] / 1e3, 1), "seqs": a.get("seqs"), "new": a.get("new"),
                          "size": a.get("num_tokens", a.get("num_frames")), "schedule_ms": a.get("schedule_ms"),
                          "submit_ms": a.get("submit_ms"), "parts": a.get("submit_phases_ms")})
    inboxes = []  # the drains that took in new requests (stage traces from this session on have them)
    for e in sorted((e for e in events if e.get("ph") == "X" and e.get("name") == "inbox"), key=lambda e: e["ts"]):
        a = e.get("args", {})
        if t0 <= e["ts"] <= end and a.get("submits"):
            inboxes.append({"stage": names.get(e["pid"], e["pid"]), "start_ms": round((e["ts"] - t0) / 1e3, 2),
                            "submits": a["submits"], "handle_ms": a.get("handle_ms", 0.0),
                            "ms": round(e["dur"] / 1e3, 2)})
    first_ms = [(ts - t0) / 1e3 for ts in first]
    return {"requests": len(arrivals), "arrivals_ms": round((arrivals[-1] - t0) / 1e3, 1), "steps": steps,
            "inboxes": inboxes, "first_audio_ms": first_ms, "missing_first_audio": len(ids) - len(first)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--min-burst", type=int, default=16)
    parser.add_argument("--burst", type=int, default=None, help="only this burst (0-based); default all")
    args = parser.parse_args()
    events = load(args.trace)
    found = bursts(events, args.min_burst)
    if not found:
        raise SystemExit(f"{args.trace}: no burst of {args.min_burst} or more requests")
    for k, arrivals in enumerate(found):
        if args.burst is not None and k != args.burst:
            continue
        t = timeline(events, arrivals)
        fa = t["first_audio_ms"]
        p95 = sorted(fa)[max(0, int(round(0.95 * len(fa))) - 1)] if fa else None
        print(f"burst {k}: {t['requests']} requests arriving over {t['arrivals_ms']} ms; first audio "
              f"{min(fa):.1f}-{max(fa):.1f} ms (p95 {p95:.1f}), {t['missing_first_audio']} without" if fa else
              f"burst {k}: {t['requests']} requests, no first audio")
        print(f"  {'stage':8} {'start':>7} {'ms':>6} {'seqs':>5} {'new':>4} {'size':>6} {'plan':>6} {'submit':>7}")
        for s in t["steps"]:
            parts = "  " + " ".join(f"{k} {v:.2f}" for k, v in s["parts"].items()) if s.get("parts") else ""
            print(f"  {s['stage'][:8]:8} {s['start_ms']:7.1f} {s['ms']:6.1f} {s['seqs'] or 0:5d} {s['new'] or 0:4d} "
                  f"{s['size'] or 0:6d} {s['schedule_ms'] or 0:6.2f} {s['submit_ms'] or 0:7.2f}{parts}")
        by_stage: dict[str, list[dict[str, Any]]] = {}
        for d in t["inboxes"]:
            by_stage.setdefault(d["stage"], []).append(d)
        for stage, drains in by_stage.items():  # where the arrivals waited before the first plan
            print(f"  {stage} inbox: {sum(d['submits'] for d in drains)} arrivals in {len(drains)} drains "
                  f"({drains[0]['start_ms']:.1f}-{drains[-1]['start_ms']:.1f} ms), taking them in "
                  f"{sum(d['handle_ms'] for d in drains):.2f} ms, with launches {sum(d['ms'] for d in drains):.2f} ms; "
                  "drains (start ms:arrivals:handle ms): "
                  + " ".join(f"{d['start_ms']:.1f}:{d['submits']}:{d['handle_ms']:.2f}" for d in drains[:24]))
        hist = Counter(int(x // 10) * 10 for x in fa)
        print("  first audio by 10 ms: " + ", ".join(f"{b}: {n}" for b, n in sorted(hist.items())))


if __name__ == "__main__":
    main()
