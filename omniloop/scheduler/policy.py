"""Playback-deadline ordering: the stream closest to running dry goes first.

Each streaming request has a playback clock: the client started playing at its first audio and has
been playing in real time since, so ``slack = audio_sent - elapsed_since_first_audio`` is how much
audio it still has buffered. Under contention the smallest slack wins. A request with no audio yet
has an empty buffer that has been "dry" since it arrived, so its slack is ``-(now - arrival)``:
among themselves such requests go by arrival (first-audio latency), and against playing streams they
win exactly when they have waited longer than the stream's buffer lasts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920
FRAME_S = SAMPLES_PER_FRAME / SAMPLE_RATE  # 80 ms of audio per codec frame (12.5 frames/s)


@dataclass(slots=True)
class Playback:
    """A request's playback clock, as seen from one stage (frames this stage has sent on)."""

    arrival: float
    first_audio_at: float | None = None
    num_frames: int = 0

    def slack(self, now: float) -> float:
        """Seconds of audio the client still has buffered; negative: it has been dry that long."""
        if self.first_audio_at is None:
            return self.arrival - now
        return self.num_frames * FRAME_S - (now - self.first_audio_at)

    def on_audio(self, num_frames: int, now: float) -> None:
        if self.first_audio_at is None:
            self.first_audio_at = now
        else:
            # A player that ran dry pauses until more audio comes; shifting the clock by the stall
            # keeps one early gap from making this stream look urgent forever after.
            self.first_audio_at += max(0.0, -self.slack(now))
        self.num_frames += num_frames


class HasDeadline(Protocol):
    priority: int
    playback: Playback


R = TypeVar("R", bound=HasDeadline)


def by_deadline(reqs: Iterable[R], now: float) -> list[R]:
    """Lower ``priority`` values first, then smallest slack (stable: ties keep their order)."""
    return sorted(reqs, key=lambda req: (req.priority, req.playback.slack(now)))
