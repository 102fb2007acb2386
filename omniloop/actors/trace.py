"""Chrome / Perfetto trace events from every actor, to explain a benchmark's numbers.

Off unless ``OMNILOOP_TRACE_DIR`` is set (the environment reaches spawned stage processes, so one setting
traces the whole engine). Each actor keeps a bounded list of events on its own loop thread — nothing is
shared, nothing is locked — and writes ``<dir>/<name>-<pid>.json`` when it closes. ``merge_traces`` joins
them into one file that chrome://tracing or ui.perfetto.dev opens. Timestamps are CLOCK_MONOTONIC
microseconds, the same clock in every process of the host, so the stages line up.

What is recorded: each stage step as a span from submit to the moment the loop learns it finished (lane =
which of the ``max_in_flight`` slots it used, since steps overlap), with the plan's size; each request as
an async span on the frontend from submit to finish, with its first audio as an instant.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from pathlib import Path
from typing import Any

ENV_DIR = "OMNILOOP_TRACE_DIR"
MAX_EVENTS = 500_000  # a bound, so a forgotten setting cannot grow without limit


def now_us() -> float:
    return time.monotonic_ns() / 1000.0


_TRACERS = itertools.count()  # per process: actors placed as threads share a pid but not a trace track


class Tracer:
    def __init__(self, name: str, directory: str | None = None) -> None:
        self.name = name
        # the trace's "process" id: the OS pid alone would merge thread-placed stages into one track
        self.pid = os.getpid() * 1000 + next(_TRACERS) % 1000
        self.directory = directory if directory is not None else os.environ.get(ENV_DIR)
        self.events: list[dict[str, Any]] = []
        self.num_dropped = 0

    @property
    def enabled(self) -> bool:
        return bool(self.directory)

    def _add(self, event: dict[str, Any]) -> None:
        if len(self.events) < MAX_EVENTS:
            event["pid"] = self.pid
            self.events.append(event)
        else:
            self.num_dropped += 1

    def span(self, name: str, start_us: float, end_us: float, lane: int = 0, **args: Any) -> None:
        if self.enabled:
            self._add({"ph": "X", "name": name, "ts": start_us, "dur": max(0.0, end_us - start_us), "tid": lane,
                       "args": args})

    def begin(self, name: str, key: str, **args: Any) -> None:
        if self.enabled:
            self._add({"ph": "b", "cat": "request", "name": name, "id": key, "ts": now_us(), "tid": 0, "args": args})

    def end(self, name: str, key: str, **args: Any) -> None:
        if self.enabled:
            self._add({"ph": "e", "cat": "request", "name": name, "id": key, "ts": now_us(), "tid": 0, "args": args})

    def instant(self, name: str, key: str | None = None, **args: Any) -> None:
        if self.enabled:
            event = {"ph": "n" if key else "i", "name": name, "ts": now_us(), "tid": 0, "args": args, "s": "t"}
            if key:
                event.update(cat="request", id=key)
            self._add(event)

    def flush(self) -> Path | None:
        """Write this actor's events (once, at close); returns the file, or None when tracing is off."""
        if not self.enabled:
            return None
        path = Path(self.directory) / f"{self.name}-{self.pid}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"ph": "M", "name": "process_name", "pid": self.pid, "tid": 0, "args": {"name": self.name}}
        with open(path, "w") as f:
            json.dump({"traceEvents": [meta, *self.events], "dropped": self.num_dropped}, f)
        self.events = []
        return path


def merge_traces(directory: str | Path, out: str | Path) -> dict[str, Any]:
    """Join every actor's file in ``directory`` into ``out``; returns the merged trace."""
    events: list[dict[str, Any]] = []
    for path in sorted(Path(directory).glob("*.json")):
        events += json.loads(path.read_text())["traceEvents"]
    merged = {"traceEvents": events, "displayTimeUnit": "ms"}
    Path(out).write_text(json.dumps(merged))
    return merged


def summarize(trace: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per actor: number of steps, mean and p95 step time (submit to completion), the median time between
    step starts (the pace the stage actually ran at: with steps overlapping, shorter than a step), how much
    of the traced time a step was in flight, the loop thread's host time per step (planning + submitting: time
    in which the stage could launch nothing else), and its three longest steps with their plan sizes (stalls)."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M"}
    steps: dict[int, list[dict[str, Any]]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("name") == "step":
            steps.setdefault(e["pid"], []).append(e)
    out = {}
    for pid, events in steps.items():
        events.sort(key=lambda e: e["ts"])
        items = [(e["ts"], e["ts"] + e["dur"]) for e in events]
        busy, cursor = 0.0, float("-inf")
        for start, end in items:  # union of overlapping spans: time with at least one step in flight
            if end > cursor:
                busy += end - max(start, cursor)
                cursor = end
        total = max(end for _, end in items) - items[0][0]
        durations = sorted(e - s for s, e in items)
        spacing = sorted(b[0] - a[0] for a, b in zip(items, items[1:]))
        longest = sorted(events, key=lambda e: -e["dur"])[:3]
        host = sorted(e.get("args", {}).get("schedule_ms", 0.0) + e.get("args", {}).get("submit_ms", 0.0)
                      for e in events)
        out[names.get(pid, str(pid))] = {
            "num_steps": float(len(items)),
            "mean_step_ms": sum(durations) / len(durations) / 1000.0,
            "p95_step_ms": durations[min(len(durations) - 1, int(0.95 * len(durations)))] / 1000.0,
            "median_spacing_ms": spacing[len(spacing) // 2] / 1000.0 if spacing else 0.0,
            "busy_fraction": busy / total if total > 0 else 0.0,
            "host_ms_total": round(math.fsum(host), 1),  # exact: no summation-order rounding
            "host_ms_max": round(host[-1], 2),
            "longest_steps": [{"ms": round(e["dur"] / 1000.0, 2), "at_ms": round((e["ts"] - items[0][0]) / 1000.0, 1),
                               **e.get("args", {})} for e in longest],
        }
    return out
