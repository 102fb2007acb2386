"""The contract between a stage actor and its scheduler (pure Python, no torch).

The actor loop calls, and only calls:

    scheduler.add(req_id, submit)          a new request (from the frontend or the upstream stage)
    scheduler.extend(req_id, chunk, arrays) an upstream chunk for a request it holds
    scheduler.abort(req_id)                 idempotent; frees seats/KV at once; returns nothing to emit
    scheduler.schedule() -> plan | None     the next step to run, or None if nothing can run now
    scheduler.update(plan, result) -> list[Emit]   the only place results are learned
    scheduler.fail(plan, error) -> list[Emit]      a step raised: fail exactly that step's requests

Optionally ``scheduler.next_wakeup() -> float | None``: a future ``time.monotonic()`` moment at which
``schedule()`` may return a plan without new input; the stage arms one timer for it.

``Emit.dest`` is ``"next"`` (the downstream stage; the frontend for the last stage) or
``"frontend"`` (text deltas and errors that skip the rest of the pipeline).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol


class Emit(NamedTuple):
    dest: str  # "next" | "frontend"
    msg: Any  # a transport message (Chunk, Finish)
    arrays: dict[str, Any] | None = None  # numpy arrays travelling out of band


class Scheduler(Protocol):
    def add(self, req_id: str, submit: Any, arrays: dict[str, Any]) -> list[Emit]: ...

    def extend(self, req_id: str, chunk: Any, arrays: dict[str, Any]) -> list[Emit]: ...

    def finish_upstream(self, req_id: str, finish: Any) -> list[Emit]: ...

    def abort(self, req_id: str) -> None: ...

    def schedule(self) -> Any | None: ...

    def update(self, plan: Any, result: Any) -> list[Emit]: ...

    def fail(self, plan: Any, error: BaseException) -> list[Emit]: ...

    @property
    def num_requests(self) -> int: ...
