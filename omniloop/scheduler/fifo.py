"""A first-come-first-served batching scheduler: the bookkeeping every simple stage needs.

It owns the request table, seats (``max_num_seqs``, parked requests included), the waiting queue,
fencing of requests in flight, abort and failure. What a step *does* for a request is left to a
subclass through four hooks: ``on_add`` (set up ``seq.state``), ``is_runnable`` (has work now),
``prepare`` (the step's payload for one request) and ``on_output`` (turn one result into emits,
calling ``self.finish(seq)`` when the request is done here). The fake stages use it; real AR and
codec stages have their own schedulers.

A request is in at most one step at a time. Results are matched to requests by identity, so a
request aborted (or aborted and re-submitted under the same id) while its step ran is ignored.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from omniloop.scheduler.interface import Emit
from omniloop.transport.messages import Finish, Reason


@dataclass(eq=False, slots=True)
class Seq:
    req_id: str
    submit: Any
    arrays: dict[str, Any]
    inputs: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)  # upstream chunks not consumed
    num_upstream_chunks: int = 0
    is_upstream_done: bool = False
    upstream_reason: str | None = None
    num_steps: int = 0
    num_out: int = 0  # chunks emitted; the next chunk's seq
    is_in_flight: bool = False
    is_done: bool = False
    state: Any = None


class StepItem(NamedTuple):
    req_id: str
    payload: Any


class FifoPlan(NamedTuple):
    step_id: int
    items: tuple[StepItem, ...]


class FifoScheduler:
    def __init__(self, stage: str, *, max_num_seqs: int, has_upstream: bool, has_downstream: bool) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"stage {stage!r}: max_num_seqs must be >= 1, got {max_num_seqs}")
        self.stage = stage
        self.max_num_seqs = max_num_seqs
        self.has_upstream = has_upstream
        self.has_downstream = has_downstream
        self._seqs: dict[str, Seq] = {}  # admitted (holding a seat), in arrival order
        self._waiting: collections.OrderedDict[str, Seq] = collections.OrderedDict()
        self._plans: dict[int, list[Seq]] = {}
        self._step_ids = itertools.count()
        self.num_steps = 0

    # ---- counters
    @property
    def num_requests(self) -> int:
        return len(self._seqs) + len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._seqs)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ---- the stage loop's calls
    def add(self, req_id: str, submit: Any, arrays: dict[str, Any]) -> list[Emit]:
        if req_id in self._seqs or req_id in self._waiting:
            return [self._error(req_id, f"duplicate request id {req_id!r}: already in stage {self.stage!r}")]
        seq = Seq(req_id, submit, arrays, is_upstream_done=not self.has_upstream)
        (self._seqs if len(self._seqs) < self.max_num_seqs else self._waiting)[req_id] = seq
        emits = [Emit("next", submit, arrays)] if self.has_downstream else []
        return emits + self.on_add(seq)

    def extend(self, req_id: str, chunk: Any, arrays: dict[str, Any]) -> list[Emit]:
        seq = self._seqs.get(req_id) or self._waiting.get(req_id)
        if seq is None:  # aborted or failed here already; upstream has not heard yet
            return []
        seq.inputs.append((chunk, arrays))
        seq.num_upstream_chunks += 1
        if chunk.final:
            seq.is_upstream_done, seq.upstream_reason = True, chunk.reason
        return []

    def finish_upstream(self, req_id: str, finish: Any) -> list[Emit]:
        """Upstream ended the request without a final chunk (an error): drop it and pass it on."""
        if self._drop(req_id) is None:
            return []
        return [Emit("next", finish)]

    def abort(self, req_id: str) -> None:
        self._drop(req_id)

    def schedule(self) -> FifoPlan | None:
        self._admit()
        batch = [s for s in self._seqs.values() if not s.is_in_flight and self.is_runnable(s)]
        if not batch:
            return None
        step_id = next(self._step_ids)
        items = []
        for seq in batch:
            seq.is_in_flight = True
            items.append(StepItem(seq.req_id, self.prepare(seq)))
        self._plans[step_id] = batch
        return FifoPlan(step_id, tuple(items))

    def update(self, plan: FifoPlan, result: Any) -> list[Emit]:
        """``result``: one output per plan item, in order."""
        seqs = self._plans.pop(plan.step_id)
        if len(result) != len(seqs):
            raise ValueError(f"stage {self.stage!r}: step {plan.step_id} has {len(seqs)} items, {len(result)} outputs")
        self.num_steps += 1
        emits: list[Emit] = []
        for seq, out in zip(seqs, result):
            seq.is_in_flight = False
            if self._seqs.get(seq.req_id) is not seq:
                continue
            seq.num_steps += 1
            emits += self.on_output(seq, out)
        return emits

    def fail(self, plan: FifoPlan, error: BaseException) -> list[Emit]:
        seqs = self._plans.pop(plan.step_id, [])
        message = f"stage {self.stage!r} step failed: {type(error).__name__}: {error}"
        emits = []
        for seq in seqs:
            seq.is_in_flight = False
            if self._seqs.get(seq.req_id) is seq:
                self.finish(seq)
                emits.append(self._error(seq.req_id, message))
        return emits

    # ---- for subclasses
    def finish(self, seq: Seq) -> None:
        """The request is done at this stage: free its seat."""
        seq.is_done = True
        if self._seqs.get(seq.req_id) is seq:
            del self._seqs[seq.req_id]

    def next_seq(self, seq: Seq) -> int:
        seq.num_out += 1
        return seq.num_out - 1

    def on_add(self, seq: Seq) -> list[Emit]:
        return []

    def is_runnable(self, seq: Seq) -> bool:
        raise NotImplementedError

    def prepare(self, seq: Seq) -> Any:
        raise NotImplementedError

    def on_output(self, seq: Seq, out: Any) -> list[Emit]:
        raise NotImplementedError

    # ---- internals
    def _admit(self) -> None:
        while self._waiting and len(self._seqs) < self.max_num_seqs:
            req_id, seq = self._waiting.popitem(last=False)
            self._seqs[req_id] = seq

    def _drop(self, req_id: str) -> Seq | None:
        seq = self._seqs.pop(req_id, None) or self._waiting.pop(req_id, None)
        if seq is not None:
            seq.is_done = True
        return seq

    def _error(self, req_id: str, message: str) -> Emit:
        return Emit("frontend", Finish(req_id, Reason.ERROR.value, error=message, stage=self.stage))
