"""Process-wide torch backend choices for a stage on CUDA (``registry.build_worker`` applies them before any
GPU stage is built).

cuDNN's fused attention builds an execution plan the first time it sees a shape, which took ~0.8-1 s per
new prefill shape on the H200 (benchmarks/pipeline.md): every admission with an unseen prompt length
stalled the whole batch that long. Prefill lengths vary per request, so the stages use the
flash / memory-efficient kernels, which need no per-shape plan.
"""

from __future__ import annotations

import torch


def configure_cuda_stage() -> None:
    torch.backends.cuda.enable_cudnn_sdp(False)
