"""The talker scheduler: continuous batching with chunked prefill, KV block accounting, parking,
deadline ordering, and async overlap (``schedule`` runs again before the previous step's ``update``).

Async overlap works by advancing counters at schedule time: a request's next decode is planned while
its previous step is still on the GPU, which feeds the sampled frame from device memory. A stop is
therefore learned one step late; the request finishes in that ``update`` and every later in-flight
step's output for it is dropped (fenced: nothing after a stop is ever emitted).

Admission grows the request's block table to its worst case (prompt + max_frames), so a decode never
runs out of blocks. A TTS request's worst case is known up front and bounded by the codec frame limit,
so this costs capacity but never a recompute. A prompt that grows (``extend``) is covered again before
its next piece is scheduled; if blocks are short it waits for finishing requests to return theirs.
No new request is seated while a seated one's grown prompt waits for blocks. Growing prompts can
still hold every block between them with none able to go on (nothing decoding, nothing in flight):
then the seated request that has not sampled yet and comes last in deadline order is preempted — its
seat and blocks freed, back to waiting, prefilled again from position 0 with its inputs sent again —
until a plan can be made. The most urgent seated request is never the victim while another exists, so
it finishes; the victim loses no output (it has emitted nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from omniloop.scheduler.interface import Emit
from omniloop.scheduler.kv_blocks import BlockPool
from omniloop.scheduler.plan import ArNew, ArSeq, ArStepPlan, ArStepResult
from omniloop.scheduler.policy import Playback, by_deadline
from omniloop.scheduler.request import ArPrompt, ArRequest, ArState, fail_requests
from omniloop.scheduler.slots import SlotPool
from omniloop.transport.messages import Chunk, Finish, Reason, Submit

Prepare = Callable[[str, Any, dict[str, Any]], ArPrompt]
CountTokens = Callable[[Any, dict[str, Any]], int]
_NORMAL_END = (Reason.STOP.value, Reason.LENGTH.value)


@dataclass(frozen=True, slots=True)
class ArConfig:
    stage: str = "talker"
    max_num_seqs: int = 64
    max_num_tokens: int = 8192  # positions fed per step, all requests together
    num_kv_blocks: int = 4096
    block_size: int = 16
    max_codec_frames: int | None = None  # hard limit: reaching it ends with codec_limit


def _count_first_array(chunk: Any, arrays: dict[str, Any]) -> int:
    """Default for ``extend``: one prompt token per row of the chunk's first array."""
    return len(next(iter(arrays.values()))) if arrays else 0


class ArScheduler:
    def __init__(
        self,
        config: ArConfig,
        prepare: Prepare | None = None,
        count_tokens: CountTokens = _count_first_array,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._prepare = prepare
        self._count_tokens = count_tokens
        self._clock = clock
        self._blocks = BlockPool(config.num_kv_blocks, config.block_size)
        self._slots = SlotPool(config.max_num_seqs)
        self._reqs: dict[str, ArRequest] = {}  # every request not finished
        self._waiting: dict[str, ArRequest] = {}
        self._seated: dict[str, ArRequest] = {}
        # step_id -> the request objects of that plan, aligned with plan.seqs. Identity, not ids,
        # decides whether a result still belongs to a live request (ids may be reused after an abort).
        self._in_flight: dict[int, list[ArRequest]] = {}
        self._next_step_id = 0

    # -- inputs ---------------------------------------------------------------------------------

    def prefetch(self, submits: list[Any]) -> None:
        """Many arrivals are about to be ``add``-ed: the prepare function's ``prefetch`` (if it has one) may do
        their common work at once. An error here is no request's: each still gets ``add``, which reports its own."""
        prefetch = getattr(self._prepare, "prefetch", None)
        if prefetch is not None:
            prefetch(submits)

    def add(self, req_id: str, submit: Any, arrays: dict[str, Any] | None = None) -> list[Emit]:
        if req_id in self._reqs:  # not raise: an exception here would take the whole actor down
            error = f"duplicate request id {req_id!r}: already in stage {self.config.stage!r}"
            return [Emit("frontend", Finish(req_id, Reason.ERROR.value, error=error, stage=self.config.stage))]
        try:
            prompt = self._prepare(req_id, submit, arrays or {}) if self._prepare else submit
        except Exception as exc:  # bad input (unknown speaker, text too long...) ends this request only
            error = f"{type(exc).__name__}: {exc}"
            return [Emit("frontend", Finish(req_id, Reason.ERROR.value, error=error, stage=self.config.stage))]
        if not isinstance(prompt, ArPrompt):  # a wiring bug, not a request's fault
            raise TypeError(f"add() needs an ArPrompt (or a prepare function), got {type(prompt).__name__}")
        limit = self.config.max_codec_frames
        is_codec_limited = limit is not None and limit < prompt.max_frames
        req = ArRequest(
            req_id=req_id,
            num_prompt_tokens=prompt.num_prompt_tokens,
            max_frames=limit if is_codec_limited else prompt.max_frames,
            is_codec_limited=is_codec_limited,
            is_input_complete=prompt.is_input_complete,
            priority=prompt.priority,
            playback=Playback(arrival=self._clock() if prompt.arrival is None else prompt.arrival),
            payload=prompt.payload,
        )
        if error := self._check(req):
            return [self._finish(req, Reason.ERROR.value, error)]
        self._reqs[req_id] = req
        self._waiting[req_id] = req
        # The codec stage learns of the request (and its first-chunk size) from the Submit itself;
        # its arrays (reference audio) stay here.
        return [Emit("next", submit)] if isinstance(submit, Submit) else []

    def extend(self, req_id: str, chunk: Any, arrays: dict[str, Any] | None = None) -> list[Emit]:
        req = self._reqs.get(req_id)
        if req is None or req.is_input_complete:
            return []  # aborted, or a late chunk after the prompt was closed
        req.num_prompt_tokens += self._count_tokens(chunk, arrays or {})
        if arrays:
            req.pending_inputs.append(arrays)
        return self._on_input(req, is_complete=bool(getattr(chunk, "final", False)))

    def finish_upstream(self, req_id: str, finish: Finish) -> list[Emit]:
        req = self._reqs.get(req_id)
        if req is None:
            return []
        if finish.reason in _NORMAL_END:
            return self._on_input(req, is_complete=True) if not req.is_input_complete else []
        self._release(req)
        return [Emit("next", finish)]

    def abort(self, req_id: str) -> None:
        req = self._reqs.get(req_id)
        if req is not None:
            self._release(req)

    # -- steps ----------------------------------------------------------------------------------

    def schedule(self) -> ArStepPlan | None:
        now = self._clock()
        plan = ArStepPlan(step_id=self._next_step_id, seqs=[])
        reqs: list[ArRequest] = []
        is_growth_blocked = self._fill(plan, reqs, now)
        # deadlock: grown prompts hold the blocks, and no step in flight will return any
        while not plan.seqs and is_growth_blocked and not self._in_flight and self._preempt(now):
            is_growth_blocked = self._fill(plan, reqs, now)
        if not plan.seqs:
            return None
        self._next_step_id += 1
        self._in_flight[plan.step_id] = reqs
        return plan

    def _fill(self, plan: ArStepPlan, reqs: list[ArRequest], now: float) -> bool:
        """Put this step's pieces into ``plan``; True if a seated request's grown prompt found no blocks."""
        budget = self.config.max_num_tokens
        # decided before the loop: a waiting request ahead in deadline order must not take the blocks first
        is_growth_blocked = any(req.num_prefill_ready and not self._blocks.can_grow(req.block_table, req.num_tokens_max)
                                for req in self._seated.values())
        # Seated and waiting requests compete by deadline alike (a waiting one is dry since arrival),
        # except that prefill never takes the positions of the seated streams' decodes while the budget
        # holds them all: a decode costs one position, a prompt hundreds, and deferring the decodes
        # behind a wave of admissions would stall every playing stream for each prefill step (the frame
        # step runs anyway when a prompt ends). A budget too small for the decodes alone falls back to
        # the deadline order. The first waiting request short of blocks stops admission, so a large
        # request is not starved by smaller ones behind it.
        num_decodes = sum(req.can_decode for req in self._seated.values())
        reserved = num_decodes if num_decodes < budget else 0
        # A prompt's first piece is as large as an otherwise empty step allows: the whole prompt, or all of
        # that room for a longer one. One cut shorter waits for a later step (smaller prompts behind it may
        # use the room meanwhile): only first pieces replay a captured prefill graph, and every further
        # piece runs eagerly (~700 kernel launches from the loop thread).
        whole_room = budget - reserved
        is_admission_blocked = False
        for req in by_deadline([*self._seated.values(), *self._waiting.values()], now):
            if budget == 0:
                break
            is_decode = req.can_decode  # (its prompt is all fed: it has no prefill piece)
            if is_decode and reserved:
                reserved -= 1
            room = budget if is_decode else budget - reserved
            if room == 0 or req.num_computed == 0 and room < min(req.num_prefill_ready, whole_room):
                continue
            num_tokens, is_sample = self._next_piece(req, room)
            if num_tokens == 0:
                if req.state is not ArState.WAITING and not req.is_input_complete:
                    req.state = ArState.PARKED
                continue  # a waiting request with nothing to feed would only sit on a seat
            if req.state is ArState.WAITING:
                # a seated request's grown prompt waiting for blocks goes first: admitting past it would
                # take the blocks it waits for
                if is_admission_blocked or is_growth_blocked or self._slots.num_free == 0:
                    continue
                if not self._blocks.grow(req.block_table, req.num_tokens_max):
                    is_admission_blocked = True
                    continue
                self._seat(plan, req)
            elif not self._blocks.grow(req.block_table, req.num_tokens_max):
                is_growth_blocked = True
                continue  # a grown prompt waits for blocks that finishing requests return
            budget -= self._push(plan, reqs, req, num_tokens, is_sample)
        return is_growth_blocked

    def _preempt(self, now: float) -> bool:
        """Send the seated request that has not sampled and comes last in deadline order back to waiting (see
        the module doc); False if there is none. Only with nothing in flight: no step still reads its slot or
        blocks. It is admitted again only when no seated prompt waits for blocks."""
        candidates = [req for req in self._seated.values() if req.num_scheduled_frames == 0]
        if not candidates:
            return False
        victim = by_deadline(candidates, now)[-1]
        self._unseat(victim)
        victim.num_blocks_sent = 0
        victim.num_computed = 0
        victim.pending_inputs[:0] = victim.sent_inputs
        victim.sent_inputs = []
        victim.state = ArState.WAITING
        self._waiting[victim.req_id] = victim
        return True

    def update(self, plan: ArStepPlan, result: ArStepResult) -> list[Emit]:
        emits: list[Emit] = []
        now = self._clock()
        for i, (seq, req) in enumerate(zip(plan.seqs, self._in_flight.pop(plan.step_id, ()))):
            if req.is_finished:
                continue  # a finished request's later output is fenced off here
            if result.errors and i in result.errors:
                message = f"stage {self.config.stage!r} could not run this request: {result.errors[i]}"
                emits.append(self._finish(req, Reason.ERROR.value, message))
                continue
            if not seq.is_sample:
                continue
            if result.is_stop[i]:
                emits.append(self._chunk(req, None, Reason.STOP.value))
                self._release(req)
                continue
            codes = np.array(result.codes[i : i + 1], dtype=np.int64)  # a copy: the result's buffer gets recycled
            extra = result.extras.get(i) if result.extras else None
            req.num_frames += 1
            req.playback.on_audio(1, now)
            if req.num_frames < req.max_frames:
                emits.append(self._chunk(req, codes, None, extra))
            elif req.is_codec_limited:
                emits.append(self._chunk(req, codes, None, extra))
                error = f"reached the codec frame limit of {req.max_frames} frames"
                emits.append(self._finish(req, Reason.CODEC_LIMIT.value, error))
            else:
                emits.append(self._chunk(req, codes, Reason.LENGTH.value, extra))
                self._release(req)
        return emits

    def fail(self, plan: ArStepPlan, error: BaseException) -> list[Emit]:
        return fail_requests(self._in_flight.pop(plan.step_id, ()), self.config.stage, error, self._finish)

    # -- introspection --------------------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests holding a seat, parked ones included."""
        return len(self._seated)

    @property
    def num_parked(self) -> int:
        return sum(req.state is ArState.PARKED for req in self._seated.values())

    @property
    def num_free_blocks(self) -> int:
        return self._blocks.num_free

    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def state_of(self, req_id: str) -> ArState | None:
        req = self._reqs.get(req_id)
        return req.state if req else None

    # -- internals ------------------------------------------------------------------------------

    def _next_piece(self, req: ArRequest, budget: int) -> tuple[int, bool]:
        """(positions to feed, whether to sample after them) for this request's next step."""
        if ready := req.num_prefill_ready:
            num_tokens = min(ready, budget)
            is_last_piece = req.is_input_complete and req.num_computed + num_tokens == req.num_prompt_tokens
            return num_tokens, is_last_piece
        if req.can_decode:
            return 1, True
        return 0, False

    def _seat(self, plan: ArStepPlan, req: ArRequest) -> None:
        req.slot = self._slots.acquire()
        del self._waiting[req.req_id]
        self._seated[req.req_id] = req
        plan.new.append(ArNew(req.req_id, req.slot, req.payload))

    def _push(self, plan: ArStepPlan, reqs: list[ArRequest], req: ArRequest, num_tokens: int, is_sample: bool) -> int:
        is_decode = req.num_computed >= req.num_prompt_tokens
        block_ids = None
        if len(req.block_table) != req.num_blocks_sent:
            block_ids = tuple(req.block_table)
            req.num_blocks_sent = len(req.block_table)
        plan.seqs.append(ArSeq(req.req_id, req.slot, req.num_computed, num_tokens, is_sample, is_decode, block_ids))
        plan.inputs.extend((req.slot, arrays) for arrays in req.pending_inputs)
        if is_sample:  # the prompt is all fed: it can no longer be preempted, its inputs are not needed again
            req.sent_inputs.clear()
        else:
            req.sent_inputs.extend(req.pending_inputs)
        req.pending_inputs.clear()
        reqs.append(req)
        req.num_computed += num_tokens
        req.num_scheduled_frames += is_sample
        req.state = ArState.RUNNING if req.num_computed >= req.num_prompt_tokens else ArState.PREFILLING
        return num_tokens

    def _on_input(self, req: ArRequest, is_complete: bool) -> list[Emit]:
        req.is_input_complete = is_complete
        if req.state is ArState.PARKED:
            req.state = ArState.PREFILLING
        if error := self._check(req):
            return [self._finish(req, Reason.ERROR.value, error)]
        return []

    def _check(self, req: ArRequest) -> str | None:
        """A request-scoped error, or None. Runs at add and whenever the prompt grows."""
        if req.max_frames < 1:
            return f"max_frames must be >= 1, got {req.max_frames}"
        if req.is_input_complete and req.num_prompt_tokens < 1:
            return "empty prompt"
        num_blocks = self._blocks.blocks_for(req.num_tokens_max)
        if num_blocks > self._blocks.num_blocks:
            return (
                f"needs {num_blocks} KV blocks ({req.num_tokens_max} positions), "
                f"stage {self.config.stage!r} has {self._blocks.num_blocks}"
            )
        return None

    def _chunk(self, req: ArRequest, codes: np.ndarray | None, reason: str | None,
               extra: dict[str, np.ndarray] | None = None) -> Emit:
        chunk = Chunk(req_id=req.req_id, seq=req.num_chunks, final=reason is not None, reason=reason,
                      stage=self.config.stage)
        req.num_chunks += 1
        arrays = dict(extra) if extra else {}
        if codes is not None:
            arrays["codes"] = codes
        return Emit("next", chunk, arrays or None)

    def _finish(self, req: ArRequest, reason: str, error: str | None) -> Emit:
        """Errors skip the rest of the pipeline (the actor aborts the request downstream); a codec
        limit travels on, behind the frames already sent, so the audio so far still plays."""
        self._release(req)
        finish = Finish(req_id=req.req_id, reason=reason, error=error, stage=self.config.stage,
                        num_frames=req.num_frames)
        return Emit("frontend" if reason == Reason.ERROR.value else "next", finish)

    def _release(self, req: ArRequest) -> None:
        """Free seat, slot and blocks at once. Safe with the request still in an in-flight step:
        steps run in stream order, so that step is done with them before a later step reuses them."""
        if req.is_finished:
            return
        req.state = ArState.FINISHED
        self._unseat(req)
        self._waiting.pop(req.req_id, None)
        if self._reqs.get(req.req_id) is req:
            del self._reqs[req.req_id]

    def _unseat(self, req: ArRequest) -> None:
        """Give back the request's blocks and slot and take it off the seats (finished, or preempted)."""
        self._blocks.free(req.block_table)
        if req.slot >= 0:
            self._slots.release(req.slot)
            req.slot = -1
        self._seated.pop(req.req_id, None)
