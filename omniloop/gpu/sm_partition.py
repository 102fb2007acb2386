"""A CUDA stream whose kernels run on a fixed number of SMs only (a CUDA green context).

Where two stages share a GPU, the talker's short, launch-bound kernels wait behind the codec's long conv
kernels for SMs even on a higher-priority stream (a block already running is never preempted). Confining the
codec to part of the SMs leaves the rest free for the talker at every moment. Off unless a stage asks for it
(``options.sm_count`` of the codec stage); ``tools/bench_overlap.py`` measures whether it pays.
"""

from __future__ import annotations

import torch


def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_sm_count(stage: str, device: torch.device, value: object) -> int:
    """``value`` as a valid SM count for ``device``, or a ValueError naming the stage's option."""
    if device.type != "cuda":
        raise ValueError(f"stage {stage!r}: options.sm_count confines CUDA kernels; the stage runs on {device}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"stage {stage!r}: options.sm_count must be a positive integer, got {value!r}")
    total = sm_count(device)
    if value > total:
        raise ValueError(f"stage {stage!r}: options.sm_count {value} exceeds the {total} SMs of {device}")
    return value


class PartitionedStream:
    """A stream on ``num_sms`` SMs of ``device``; holds its green context, which must outlive the stream's
    work (``close`` drops both). torch's API moved between releases: newer ones hand out the context's own
    streams (``Stream()``); 2.10 makes the context current for the thread, and a stream created then is the
    context's."""

    def __init__(self, num_sms: int, device: torch.device) -> None:
        from torch.cuda.green_contexts import GreenContext

        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            ctx = GreenContext.create(num_sms=num_sms, device_id=index)
        except TypeError:  # 2.10 takes them positionally
            ctx = GreenContext.create(num_sms, index)
        self._context = ctx
        if hasattr(ctx, "Stream"):
            self.stream = ctx.Stream()
        else:
            ctx.set_context()
            try:
                self.stream = torch.cuda.Stream(device)
            finally:
                ctx.pop_context()
        self.num_sms = num_sms

    def close(self) -> None:
        if self._context is not None:
            self.stream.synchronize()
            self.stream, self._context = None, None
