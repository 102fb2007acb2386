"""The codec-stage scheduler: batches streaming decode steps of code frames into PCM.

Chunk sizes ramp: a request's first chunk is small (``initial_frames``) so first audio leaves early, then each
chunk doubles up to ``frames``, so the client's buffer grows faster than it plays. A request whose client has
less than ``urgent_s`` of audio buffered (every request before its first audio) is decoded with whatever frames
it has (at least 1); the others wait for a full chunk, because a step's cost grows far slower than its frames
(64 streams x 1 frame costs a third of 64 x 8 on an H200) and the codec shares the GPU with the talker. Once a
step goes, every other request holding at least ``join_fraction`` of its chunk rides along: streams admitted a
few talker steps apart would otherwise reach their full chunks at different moments forever, and the codec
would run many part-filled steps (an H200 trace at 64 streams had 47-, 17- and 1-row steps where one 64-row
step would do). Under contention requests nearest to running dry go first, and ``max_frames_per_step`` caps a
step. A step that carries a first chunk carries only urgent requests: a step's PCM leaves when its last row is
decoded, so first audio must not wait for full chunks of streams that still have more than ``urgent_s``
buffered (they go in the next step, which may be in flight at the same time).

Decoder state (sliding-window cache, conv tails) lives in the runner per slot and steps run in
stream order, so a request may be scheduled again while its previous step is still in flight.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from omniloop.scheduler.interface import Emit
from omniloop.scheduler.plan import CodecSeq, CodecStepPlan, CodecStepResult
from omniloop.scheduler.policy import FRAME_S, Playback, by_deadline
from omniloop.scheduler.request import CodecRequest, fail_requests
from omniloop.scheduler.slots import SlotPool
from omniloop.transport.messages import Chunk, Finish, Reason

# Upstream ends after which the audio so far is still worth playing: drain it, then finish.
_DRAIN_REASONS = (Reason.STOP.value, Reason.LENGTH.value, Reason.CODEC_LIMIT.value)
_NUM_ENDED_REMEMBERED = 4096  # late chunks of ended requests must not bring them back


@dataclass(frozen=True, slots=True)
class CodecConfig:
    stage: str = "codec"
    max_num_seqs: int = 64  # decoder state slots
    max_frames_per_step: int = 512
    initial_frames: int = 2  # first chunk (per-request override: SpeechRequest.initial_chunk_frames)
    frames: int = 25  # largest chunk
    codebook_size: int = 2048
    num_codebooks: int = 16
    urgent_s: float = 0.4  # less buffered than this: decode what is there (see the module doc)
    join_fraction: float = 0.5  # in a step that goes anyway, a request with this much of its chunk rides along

    def __post_init__(self) -> None:
        if not self.urgent_s >= 0:
            raise ValueError(f"urgent_s must be >= 0, got {self.urgent_s}")
        if not 0 < self.join_fraction <= 1:
            raise ValueError(f"join_fraction must be in (0, 1], got {self.join_fraction}")
        if not 1 <= self.initial_frames <= self.frames <= self.max_frames_per_step:
            raise ValueError(
                "need 1 <= initial_frames <= frames <= max_frames_per_step, got "
                f"{self.initial_frames}, {self.frames}, {self.max_frames_per_step}"
            )


class CodecScheduler:
    def __init__(self, config: CodecConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._slots = SlotPool(config.max_num_seqs)
        self._reqs: dict[str, CodecRequest] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._in_flight: dict[int, list[CodecRequest]] = {}  # step_id -> requests aligned with plan.seqs
        self._next_step_id = 0

    # -- inputs ---------------------------------------------------------------------------------

    def add(self, req_id: str, submit: Any = None, arrays: dict[str, Any] | None = None) -> list[Emit]:
        # A Submit starts a new request: an id may be used again once its earlier request ended. Every
        # message of the earlier one (chunks, its Abort) came before this Submit on the same socket.
        self._ended.pop(req_id, None)
        req = self._get(req_id)
        request = getattr(submit, "request", None)
        frames = getattr(request, "initial_chunk_frames", None)
        if req is not None and frames:
            req.initial_frames = max(1, min(int(frames), self.config.frames))
        if req is not None:
            req.return_codes = bool(getattr(request, "return_codes", False))
        return []

    def extend(self, req_id: str, chunk: Any, arrays: dict[str, Any] | None = None) -> list[Emit]:
        """Upstream frames arrive; a request seen for the first time here is created."""
        req = self._get(req_id)
        if req is None:
            return []
        context = (arrays or {}).get("context_codes")
        if context is not None and len(context) and req.num_scheduled == 0:
            context = np.asarray(context, dtype=np.int64)
            if error := self._bad_codes("context_codes", context):
                return [self._finish(req, Reason.ERROR.value, error)]
            req.context = context
        codes = (arrays or {}).get("codes")
        if codes is not None and len(codes):
            codes = np.asarray(codes, dtype=np.int64)
            if error := self._bad_codes("codes", codes):
                return [self._finish(req, Reason.ERROR.value, error)]
            req.pending.append(codes)
            req.num_received += len(codes)
        if getattr(chunk, "final", False):
            req.final_reason = chunk.reason or Reason.STOP.value
        return self._maybe_finish(req)

    def finish_upstream(self, req_id: str, finish: Finish) -> list[Emit]:
        if finish.reason in _DRAIN_REASONS:
            req = self._get(req_id)
            if req is None:
                return []
            req.final_reason, req.final_error = finish.reason, finish.error
            return self._maybe_finish(req)
        req = self._reqs.get(req_id)
        if req is not None:
            self._release(req)
        elif req_id in self._ended:
            return []
        self._remember_ended(req_id)
        return [Emit("next", finish)]

    def abort(self, req_id: str) -> None:
        req = self._reqs.get(req_id)
        if req is not None:
            self._release(req)
        self._remember_ended(req_id)

    # -- steps ----------------------------------------------------------------------------------

    def schedule(self) -> CodecStepPlan | None:
        now = self._clock()
        budget = self.config.max_frames_per_step
        plan = CodecStepPlan(step_id=self._next_step_id, seqs=[])
        reqs: list[CodecRequest] = []
        ready = by_deadline([req for req in self._reqs.values() if req.num_available], now)
        # a step goes when some request has a full chunk, is urgent or is draining; then the others that hold
        # at least join_fraction of their chunk ride along (their phases line up with it: fewer, fuller steps)
        if not any(req.final_reason is not None or req.num_available >= self._min_frames(req, now)
                   for req in ready):
            return None
        first_audio = False  # the step carries a chunk of a request that has played nothing yet
        for req in ready:
            if budget == 0:
                break
            size = self._chunk_size(req)
            if req.final_reason is None and req.num_available < self._join_frames(req, size, now):
                continue
            waits_for_first = req.playback.first_audio_at is None
            if first_audio and not waits_for_first and now < self._urgent_at(req):
                continue  # well buffered: next step, so this step's first audio leaves without waiting for it
            if req.slot < 0:
                slot = self._slots.acquire()
                if slot is None:
                    continue  # a request that already holds a slot may still go
                req.slot = slot
            num_frames = min(req.num_available, size, budget)
            start = req.num_scheduled
            codes = req.take(num_frames)
            is_last = req.final_reason is not None and req.num_available == 0
            num_context = 0
            if start == 0 and req.context is not None:
                num_context, codes = len(req.context), np.concatenate((req.context, codes))
                req.context = None
            plan.seqs.append(CodecSeq(req.req_id, req.slot, start, start + num_frames, codes, start == 0, is_last,
                                      num_context))
            reqs.append(req)
            req.num_steps += 1
            budget -= num_frames
            first_audio |= waits_for_first
        if not plan.seqs:
            return None
        self._next_step_id += 1
        self._in_flight[plan.step_id] = reqs
        return plan

    def update(self, plan: CodecStepPlan, result: CodecStepResult | Sequence[np.ndarray]) -> list[Emit]:
        pcms = result.pcm if isinstance(result, CodecStepResult) else result
        emits: list[Emit] = []
        now = self._clock()
        for seq, req, pcm in zip(plan.seqs, self._in_flight.pop(plan.step_id, ()), pcms):
            if req.is_finished:
                continue
            req.num_done = seq.end
            req.playback.on_audio(seq.end - seq.start, now)
            is_final = req.final_reason is not None and req.num_done == req.num_received
            codes = seq.codes[seq.num_context:] if req.return_codes else None
            emits.append(self._chunk(req, pcm, req.final_reason if is_final else None, codes))
            if is_final:
                emits.append(self._finish(req, req.final_reason, req.final_error))
        return emits

    def next_wakeup(self) -> float | None:
        """When a held-back chunk becomes urgent (its client's buffer falls to ``urgent_s``), on the scheduler's
        clock; None if no request waits for that. The stage arms a timer for it: with no new frames and no
        step in flight nothing else would wake the loop, and the client would run dry with frames in hand.
        A moment already past is returned too (a deadline can pass between ``schedule`` and this call); the
        stage launches once for a given moment, so a request held for another reason (no free decoder slot,
        steps in flight) does not make it spin."""
        times = [self._urgent_at(req) for req in self._reqs.values()
                 if req.num_available and req.final_reason is None and req.playback.first_audio_at is not None]
        return min(times, default=None)

    def fail(self, plan: CodecStepPlan, error: BaseException) -> list[Emit]:
        return fail_requests(self._in_flight.pop(plan.step_id, ()), self.config.stage, error, self._finish)

    # -- introspection --------------------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    @property
    def num_running(self) -> int:
        """Requests holding a decoder state slot."""
        return self.config.max_num_seqs - self._slots.num_free

    @property
    def num_waiting(self) -> int:
        return len(self._reqs) - self.num_running

    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    # -- internals ------------------------------------------------------------------------------

    def _bad_codes(self, name: str, codes: np.ndarray) -> str | None:
        """Checked here, per request: a malformed chunk inside a batched step would fail every request in it
        (or, with the wrong width, the stage's batching itself)."""
        groups = self.config.num_codebooks
        if codes.ndim != 2 or codes.shape[1] != groups:
            return f"{name} must be [n, {groups}], got {list(codes.shape)}"
        # one pass (a negative code reads as a huge unsigned one): this runs for every chunk of every request
        if codes.size and codes.view(np.uint64).max() >= self.config.codebook_size:
            return f"{name} must be in [0, {self.config.codebook_size}), got [{codes.min()}, {codes.max()}]"
        return None

    def _chunk_size(self, req: CodecRequest) -> int:
        """The ramp: initial_frames, doubling each step, up to ``frames``."""
        return min(self.config.frames, req.initial_frames << min(req.num_steps, 16))

    def _min_frames(self, req: CodecRequest, now: float) -> int:
        """Frames this request should have before its next chunk is worth a step of its own."""
        if now >= self._urgent_at(req):
            return 1  # the client is (nearly) dry: go with what there is
        return self._chunk_size(req)

    def _join_frames(self, req: CodecRequest, size: int, now: float) -> int:
        """Frames this request should have to ride along in a step that goes anyway."""
        return min(self._min_frames(req, now), max(1, math.ceil(size * self.config.join_fraction)))

    def _urgent_at(self, req: CodecRequest) -> float:
        """When the client's buffer falls to ``urgent_s`` (slack = urgent_s); -inf before its first audio (it
        has been dry since it arrived). ``_min_frames`` and ``next_wakeup`` share this one expression, so a
        request is urgent at the very moment ``next_wakeup`` named: two differently rounded forms (one of
        them strict) left it neither decoded nor waited for there."""
        playback = req.playback
        if playback.first_audio_at is None:
            return -math.inf
        return playback.first_audio_at + playback.num_frames * FRAME_S - self.config.urgent_s

    def _get(self, req_id: str) -> CodecRequest | None:
        """The live request, created on first sight; None if it already ended here."""
        req = self._reqs.get(req_id)
        if req is None and req_id not in self._ended:
            req = CodecRequest(req_id, self.config.initial_frames, Playback(arrival=self._clock()))
            self._reqs[req_id] = req
        return req

    def _maybe_finish(self, req: CodecRequest) -> list[Emit]:
        """Upstream ended and every frame's pcm is out (nothing pending or in flight): finish now."""
        if req.final_reason is None or req.num_done != req.num_received:
            return []
        return [self._chunk(req, None, req.final_reason), self._finish(req, req.final_reason, req.final_error)]

    def _chunk(self, req: CodecRequest, pcm: np.ndarray | None, reason: str | None,
               codes: np.ndarray | None = None) -> Emit:
        chunk = Chunk(req_id=req.req_id, seq=req.num_chunks, final=reason is not None, reason=reason,
                      stage=self.config.stage)
        req.num_chunks += 1
        arrays = {"pcm": pcm} if pcm is not None else {}
        if codes is not None:
            arrays["codes"] = codes
        return Emit("next", chunk, arrays or None)

    def _finish(self, req: CodecRequest, reason: str, error: str | None) -> Emit:
        self._release(req)
        finish = Finish(req_id=req.req_id, reason=reason, error=error, stage=self.config.stage,
                        num_frames=req.num_done)
        return Emit("frontend" if reason == Reason.ERROR.value else "next", finish)

    def _release(self, req: CodecRequest) -> None:
        if req.is_finished:
            return
        req.is_finished = True
        req.pending.clear()
        if req.slot >= 0:
            self._slots.release(req.slot)
            req.slot = -1
        if self._reqs.get(req.req_id) is req:
            del self._reqs[req.req_id]
        self._remember_ended(req.req_id)

    def _remember_ended(self, req_id: str) -> None:
        self._ended[req_id] = None
        self._ended.move_to_end(req_id)
        if len(self._ended) > _NUM_ENDED_REMEMBERED:
            self._ended.popitem(last=False)
