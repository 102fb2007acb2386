"""A fake codec stage that holds each request's frames back for a while and names that moment through
``next_wakeup``: what the stage loop's deadline timer must wake for. Registered as ``fake.holding_codec``
(one module, imported by the tests that use it, so the key is registered once)."""

from __future__ import annotations

import time

from omniloop.models import fake
from omniloop.models.registry import Worker, register

HOLD_S = 0.3


class HoldingCodec(fake.CodecScheduler):
    """The fake codec, except that a request's frames wait ``hold_s`` after it arrived."""

    hold_s = HOLD_S

    def on_add(self, seq):
        self.hold_until = getattr(self, "hold_until", {})
        self.hold_until[seq.req_id] = time.monotonic() + self.hold_s
        return super().on_add(seq)

    def is_runnable(self, seq) -> bool:
        return time.monotonic() >= self.hold_until[seq.req_id] and super().is_runnable(seq)

    def next_wakeup(self) -> float | None:
        now = time.monotonic()
        held = [self.hold_until[s.req_id] for s in self._seqs.values()
                if self.hold_until[s.req_id] > now and fake.CodecScheduler.is_runnable(self, s)]
        return min(held, default=None)


@register("fake.holding_codec")
def _build(stage, profile) -> Worker:
    return fake._worker(HoldingCodec, lambda p: fake.decode_codes(p[1]), stage, profile)
