"""Per-request output slot between the frontend's inbox and the request's consumer.

One slot, not a queue: when the consumer lags, new PCM and text are merged into what is already
waiting, so a slow client costs memory equal to the audio it has not taken yet and nothing more.
The consumer sleeps on an ``asyncio.Event`` that the inbox sets; everything runs on one loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from omniloop.transport.messages import Finish


@dataclass(slots=True)
class Output:
    """What ``Engine.generate`` yields: new PCM (float32, 24 kHz) and/or a text delta since the last
    item; the last item of every request carries ``finish``."""

    pcm: np.ndarray | None = None
    text: str | None = None
    finish: Finish | None = None
    codes: np.ndarray | None = None  # int64 [n, 16], only when the request asked (return_codes)


class Collector:
    def __init__(self, req_id: str, wire_id: str | None = None) -> None:
        self.req_id = req_id
        self.wire_id = wire_id or req_id  # the request's id inside the pipeline (see Engine._stream)
        self._pcm: list[np.ndarray] = []
        self._text: list[str] = []
        self._codes: list[np.ndarray] = []
        self._finish: Finish | None = None
        self._event = asyncio.Event()
        self.is_taken_finish = False  # the consumer has received the Finish
        self.num_samples = 0

    @property
    def is_finished(self) -> bool:
        return self._finish is not None

    def put_pcm(self, pcm: np.ndarray) -> None:
        if self._finish is None and pcm.size:
            self._pcm.append(pcm)
            self.num_samples += pcm.size
            self._event.set()

    def put_codes(self, codes: np.ndarray) -> None:
        if self._finish is None and len(codes):
            self._codes.append(codes)
            self._event.set()

    def put_text(self, text: str) -> None:
        if self._finish is None and text:
            self._text.append(text)
            self._event.set()

    def put_finish(self, finish: Finish) -> bool:
        """The first Finish wins; later ones (an abort racing a stop) are ignored. True if taken."""
        if self._finish is not None:
            return False
        self._finish = finish
        self._event.set()
        return True

    async def get(self) -> Output:
        """Everything that arrived since the last call, merged; waits if nothing has."""
        await self._event.wait()
        self._event.clear()
        pcm = None
        if self._pcm:
            pcm = self._pcm[0] if len(self._pcm) == 1 else np.concatenate(self._pcm)
            self._pcm = []
        text = "".join(self._text) if self._text else None
        self._text = []
        codes = np.concatenate(self._codes) if self._codes else None
        self._codes = []
        if self._finish is not None:
            self.is_taken_finish = True
        return Output(pcm, text, self._finish, codes)
