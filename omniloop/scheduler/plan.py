"""Step plans and step results: the only things that cross from a scheduler to its runner and back.

Plain data (ints, lists, small numpy arrays), so logical state (scheduler) and physical state
(runner) meet here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class ArSeq:
    """One request's piece of an autoregressive step: feed ``num_tokens`` positions from ``start``.

    ``is_decode``: the single input is the frame this request sampled in its previous step, which the
    runner keeps on the device per slot (that step may still be running: async overlap).
    Otherwise the inputs are prompt positions ``[start, start + num_tokens)``.
    ``is_sample``: sample a frame after this piece (a decode, or the piece that completes the prompt).
    ``block_ids``: the request's whole block table when it changed since the last plan that held
    this slot (first schedule, prompt growth), else None: keep the table you have.
    """

    req_id: str
    slot: int
    start: int
    num_tokens: int
    is_sample: bool
    is_decode: bool
    block_ids: tuple[int, ...] | None = None


@dataclass(slots=True)
class ArNew:
    """A request scheduled for the first time: its slot starts over with this prepared payload."""

    req_id: str
    slot: int
    payload: Any


@dataclass(slots=True)
class ArStepPlan:
    """One talker step. ``new``: requests seated in this step (their slot starts over). A request preempted
    while prefilling (``ArScheduler``: grown prompts holding every block) is seated again later as a new one,
    from position 0, and every input it had been given comes again in ``inputs``."""

    step_id: int
    seqs: list[ArSeq]
    new: list[ArNew] = field(default_factory=list)
    inputs: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (slot, upstream arrays), in order

    @property
    def num_tokens(self) -> int:
        return sum(seq.num_tokens for seq in self.seqs)


@dataclass(slots=True)
class ArStepResult:
    """Aligned with ``plan.seqs``; rows of seqs that did not sample are ignored.

    ``codes``: int64 [len(seqs), 16], the sampled frame. ``is_stop``: the sample was EOS, so that
    row is not a frame and the request ends with reason "stop".
    """

    codes: np.ndarray
    is_stop: Sequence[bool]
    # arrays the runner attaches to a row's chunk (e.g. a voice clone's ``context_codes`` on its first
    # frame, so the codec primes its state with the reference frames); keyed by row index
    extras: dict[int, dict[str, np.ndarray]] | None = None
    # rows whose request failed in the runner (e.g. its slot could not be set up): that request alone
    # ends with reason "error" and this message; keyed by row index
    errors: dict[int, str] | None = None


@dataclass(slots=True)
class CodecSeq:
    """Decode frames ``[start, end)`` of one request, continuing the streaming state held in ``slot``.

    ``is_first``: reset the slot's state before decoding. ``is_last``: no frame follows (known at
    schedule time only when upstream had already finished), the runner may release the state.
    ``num_context``: the first rows of ``codes`` are context (a voice clone's reference frames): decode
    them to prime the state, but return only the samples of the rows after them.
    """

    req_id: str
    slot: int
    start: int
    end: int
    codes: np.ndarray  # int64 [end - start, 16]
    is_first: bool
    is_last: bool
    num_context: int = 0


@dataclass(slots=True)
class CodecStepPlan:
    step_id: int
    seqs: list[CodecSeq]

    @property
    def num_frames(self) -> int:
        return sum(seq.end - seq.start for seq in self.seqs)


@dataclass(slots=True)
class CodecStepResult:
    pcm: list[np.ndarray]  # float32 [1920 * (end - start)] per seq (context excluded), aligned with ``plan.seqs``
