"""Per-request scheduler state: counters only, positions absolute from 0."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from omniloop.scheduler.policy import Playback
from omniloop.transport.messages import Reason


class ArState(enum.Enum):
    WAITING = "waiting"  # no seat yet
    PREFILLING = "prefilling"  # seated, prompt positions left to feed
    RUNNING = "running"  # seated, prompt fed, sampling a frame per step
    PARKED = "parked"  # seated, fed all input it has, waiting for more from upstream
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class ArPrompt:
    """What the talker scheduler needs to know about a new request, prepared by the model side.

    ``is_input_complete=False`` for stages fed in chunks (Omni talker): ``extend`` adds prompt
    tokens, a final chunk completes it. ``payload`` reaches the runner once, in the request's first plan.
    ``arrival`` is on the scheduler's clock (monotonic, not ``Submit.arrival``); None: now.
    """

    num_prompt_tokens: int
    max_frames: int
    arrival: float | None = None
    priority: int = 0
    is_input_complete: bool = True
    payload: Any = None


@dataclass(slots=True, eq=False)
class ArRequest:
    req_id: str
    num_prompt_tokens: int
    max_frames: int  # effective limit: the request's own, or the codec limit if smaller
    is_codec_limited: bool  # reaching max_frames means codec_limit, not length
    is_input_complete: bool
    priority: int
    playback: Playback
    payload: Any = None
    state: ArState = ArState.WAITING
    slot: int = -1
    block_table: list[int] = field(default_factory=list)
    num_blocks_sent: int = 0  # block table length the runner was last given
    num_computed: int = 0  # positions fed in scheduled steps (in flight or done)
    num_scheduled_frames: int = 0  # samples scheduled (in flight or done)
    num_frames: int = 0  # frames learned from results and emitted
    num_chunks: int = 0  # seq of the next Chunk this request emits
    pending_inputs: list[dict[str, Any]] = field(default_factory=list)
    # inputs already handed to the runner while the prompt is not yet all fed: sent again if the request is
    # preempted and prefilled from the start (see ``ArScheduler._preempt``)
    sent_inputs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def num_tokens_max(self) -> int:
        """Positions this request can ever write: the prompt, then one per frame except the last
        (the last sampled frame is never fed back)."""
        return self.num_prompt_tokens + self.max_frames - 1

    @property
    def num_prefill_ready(self) -> int:
        """Prompt positions that may be fed now. While input is incomplete the last known token is
        held back, so the piece that completes the prompt always has a token to sample after."""
        usable = self.num_prompt_tokens if self.is_input_complete else self.num_prompt_tokens - 1
        return max(0, usable - self.num_computed)

    @property
    def can_decode(self) -> bool:
        return (
            self.is_input_complete
            and self.num_computed >= self.num_prompt_tokens
            and 0 < self.num_scheduled_frames < self.max_frames
        )

    @property
    def is_finished(self) -> bool:
        return self.state is ArState.FINISHED


@dataclass(slots=True, eq=False)
class CodecRequest:
    req_id: str
    initial_frames: int
    playback: Playback
    priority: int = 0
    slot: int = -1
    pending: deque[np.ndarray] = field(default_factory=deque)  # received, not yet scheduled
    num_received: int = 0
    num_scheduled: int = 0  # frames handed to steps (in flight or done)
    num_done: int = 0  # frames whose pcm was emitted
    num_steps: int = 0  # decode steps scheduled: drives the chunk-size ramp
    num_chunks: int = 0
    final_reason: str | None = None  # set when upstream ended normally: drain, then finish with it
    final_error: str | None = None
    context: np.ndarray | None = None  # reference frames to decode before frame 0 (voice clone), not emitted
    return_codes: bool = False  # the client asked for the codes beside the PCM
    is_finished: bool = False

    @property
    def num_available(self) -> int:
        return self.num_received - self.num_scheduled

    def take(self, num_frames: int) -> np.ndarray:
        """Pop the next ``num_frames`` received frames as one [num_frames, 16] array."""
        parts: list[np.ndarray] = []
        need = num_frames
        while need:
            head = self.pending[0]
            if len(head) <= need:
                parts.append(self.pending.popleft())
                need -= len(head)
            else:
                parts.append(head[:need])
                self.pending[0] = head[need:]
                need = 0
        self.num_scheduled += num_frames
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def fail_requests(reqs: Iterable[ArRequest | CodecRequest], stage: str, error: BaseException,
                  finish: Callable[[Any, str, str | None], Any]) -> list[Any]:
    """A step raised: every request of it still alive ends with reason error and the step's error."""
    message = f"stage {stage!r} step failed: {type(error).__name__}: {error}"
    return [finish(req, Reason.ERROR.value, message) for req in reqs if not req.is_finished]
