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

import json
import os
import time
from pathlib import Path
from typing import Any

ENV_DIR = "OMNILOOP_TRACE_DIR"
MAX_EVENTS = 500_000  # a bound, so a forgotten setting cannot grow without limit


def now_us() -> float:
    return time.monotonic_ns() / 1000.0


class Tracer:
    def __init__(self, name: str, directory: str | None = None) -> None:
        self.name = name
        self.directory = directory if directory is not None else os.environ.get(ENV_DIR)
        self.events: list[dict[str, Any]] = []
        self.num_dropped = 0

    @property
    def enabled(self) -> bool:
        return bool(self.directory)

    def _add(self, event: dict[str, Any]) -> None:
        if len(self.events) < MAX_EVENTS:
            event["pid"] = os.getpid()
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
        path = Path(self.directory) / f"{self.name}-{os.getpid()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"ph": "M", "name": "process_name", "pid": os.getpid(), "tid": 0, "args": {"name": self.name}}
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


def summarize(trace: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per actor: number of steps, mean step time and how much of the traced time a step was in flight."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M"}
    spans: dict[int, list[tuple[float, float]]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("name") == "step":
            spans.setdefault(e["pid"], []).append((e["ts"], e["ts"] + e["dur"]))
    out = {}
    for pid, items in spans.items():
        items.sort()
        busy, cursor = 0.0, float("-inf")
        for start, end in items:  # union of overlapping spans: time with at least one step in flight
            if end > cursor:
                busy += end - max(start, cursor)
                cursor = end
        total = items[-1][1] - items[0][0]
        out[names.get(pid, str(pid))] = {
            "num_steps": float(len(items)),
            "mean_step_ms": sum(e - s for s, e in items) / len(items) / 1000.0,
            "busy_fraction": busy / total if total > 0 else 0.0,
        }
    return out
