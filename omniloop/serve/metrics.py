"""Prometheus text exposition (format 0.0.4), written by hand: prometheus_client is not a dependency.

Names follow vLLM's style with an ``omniloop:`` prefix. Everything here is touched only from the
server's event loop, so plain ints and lists need no locks.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from typing import Any, Callable

import msgspec

SAMPLE_RATE = 24000

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # last slot: +Inf only
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{self.name}_sum {self.sum}", f"{self.name}_count {self.count}"]
        return lines


class Counter:
    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text
        self.values: dict[tuple[tuple[str, str], ...], float] = defaultdict(float)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] += amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        if not self.values:
            lines.append(f"{self.name} 0")
        lines += [f"{self.name}{_labels(dict(k))} {v}" for k, v in self.values.items()]
        return lines


class ServeMetrics:
    """Server-side request metrics plus the engine's own stats at scrape time."""

    def __init__(self) -> None:
        p = "omniloop:"
        self.num_running = 0
        self.ttfa = Histogram(p + "time_to_first_audio_seconds", "Time from arrival to the first audio sample sent.", _LATENCY_BUCKETS)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Time from arrival to the end of the request.", _E2E_BUCKETS)
        self.rtf = Histogram(p + "real_time_factor", "Generation time divided by audio duration, per finished request.", _RTF_BUCKETS)
        self.audio_seconds = Counter(p + "audio_seconds_total", "Seconds of audio produced.")
        self.underruns = Counter(p + "stream_underruns_total", "Requests whose audio arrived slower than playback after first audio.")
        self.underrun_gap = Counter(p + "stream_underrun_seconds_total", "Total playback gap a real-time player would have heard.")
        self.requests = Counter(p + "requests_total", "Finished requests by API and finish reason.")
        self.errors = Counter(p + "request_errors_total", "Failed requests by reason.")

    def track(self, api: str) -> RequestTracker:
        return RequestTracker(self, api)

    def render(self, engine_stats: dict[str, Any] | None, is_ready: bool, is_draining: bool) -> str:
        g = "omniloop:"
        lines = [
            f"# HELP {g}num_requests_running Requests being served by this frontend (HTTP and ZMQ).",
            f"# TYPE {g}num_requests_running gauge",
            f"{g}num_requests_running {self.num_running}",
            f"# TYPE {g}engine_ready gauge",
            f"{g}engine_ready {int(is_ready)}",
            f"# TYPE {g}server_draining gauge",
            f"{g}server_draining {int(is_draining)}",
        ]
        lines += _render_engine_stats(engine_stats or {})
        for metric in (self.ttfa, self.e2e, self.rtf, self.audio_seconds, self.underruns, self.underrun_gap,
                       self.requests, self.errors):
            lines += metric.render()
        return "\n".join(lines) + "\n"


def _render_engine_stats(stats: dict[str, Any]) -> list[str]:
    """``engine.stats()`` as gauges: top-level numbers -> ``omniloop:engine_<key>``, ``num_finished``
    -> ``omniloop:engine_num_finished{reason}``, each stage's Stats -> ``omniloop:stage_<field>{stage}``
    (its ``extra`` numbers included); anything non-numeric is skipped."""
    samples: dict[str, list[str]] = defaultdict(list)
    for key, value in stats.items():
        if _is_number(value):
            samples[f"omniloop:engine_{_metric_safe(key)}"].append(f"{float(value)}")
    for reason, n in (stats.get("num_finished") or {}).items():
        samples["omniloop:engine_num_finished"].append(f'{{reason="{_escape(reason)}"}} {float(n)}')
    for stage, record in (stats.get("stages") or {}).items():
        record = _as_dict(record) or {}
        fields = {k: v for k, v in record.items() if _is_number(v)}
        fields.update({k: v for k, v in (record.get("extra") or {}).items() if _is_number(v)})
        for field, v in fields.items():
            samples[f"omniloop:stage_{_metric_safe(field)}"].append(f'{{stage="{_escape(stage)}"}} {float(v)}')
    lines: list[str] = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines += [f"{name}{v}" if v.startswith("{") else f"{name} {v}" for v in values]
    return lines


def _as_dict(value: Any) -> dict | None:
    if isinstance(value, msgspec.Struct):
        return msgspec.structs.asdict(value)
    return value if isinstance(value, dict) else None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _metric_safe(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in str(name))


class RequestTracker:
    """One request's timeline: first audio, playback deadline (for underruns), totals at the end."""

    def __init__(self, metrics: ServeMetrics, api: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics, self.api, self.clock = metrics, api, clock
        self.arrival = clock()
        self.first_audio: float | None = None
        self.num_samples = 0
        self.has_underrun = False
        self.stalled = 0.0  # seconds the player has been dry so far: it resumes when audio arrives
        self.done = False
        metrics.num_running += 1

    def on_audio(self, num_samples: int) -> None:
        if num_samples <= 0:
            return
        now = self.clock()
        if self.first_audio is None:
            self.first_audio = now
            self.metrics.ttfa.observe(now - self.arrival)
        else:
            # A real-time player that started at first audio and paused while dry has played
            # (now - first_audio - stalled) seconds; if that exceeds what it was given, it ran dry
            # before this chunk arrived, and resumes with it.
            gap = (now - self.first_audio - self.stalled) - self.num_samples / SAMPLE_RATE
            if gap > 0:
                self.stalled += gap
                self.metrics.underrun_gap.inc(gap)
                if not self.has_underrun:
                    self.has_underrun = True
                    self.metrics.underruns.inc()
        self.num_samples += num_samples

    def finish(self, reason: str, error_label: str | None = None) -> None:
        """Record the end once; later calls (cleanup paths) do nothing."""
        if self.done:
            return
        self.done = True
        self.metrics.num_running -= 1
        elapsed = self.clock() - self.arrival
        audio_s = self.num_samples / SAMPLE_RATE
        self.metrics.e2e.observe(elapsed)
        self.metrics.audio_seconds.inc(audio_s)
        if audio_s > 0:
            self.metrics.rtf.observe(elapsed / audio_s)
        self.metrics.requests.inc(api=self.api, reason=reason)
        if error_label is not None:
            self.metrics.errors.inc(reason=error_label)
