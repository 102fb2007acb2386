"""Graph captures run with the cyclic collector held off (``no_gc``): a collection inside a capture may destroy
a dead CUDA graph, and releasing its memory pool mid-capture invalidates the capture (seen on the H200). The
helper must switch the collector off inside and restore exactly what was there, also on an exception; the
capture code must use it (CPU: the source is inspected, the capture itself needs CUDA)."""

import gc
import inspect

import pytest

from omniloop.gpu import cuda_graphs
from omniloop.gpu.cuda_graphs import no_gc
from omniloop.models.qwen3_tts import speech_stream


def test_no_gc_disables_inside_and_restores() -> None:
    assert gc.isenabled()
    with no_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with no_gc():
            raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # was off before: stays off
    finally:
        gc.enable()


def test_every_capture_site_holds_the_collector_off() -> None:
    for fn in (cuda_graphs.capture, speech_stream._StepGraphs._capture):
        src = inspect.getsource(fn)
        assert "torch.cuda.graph(" in src and "with no_gc(), torch.cuda.graph(" in src, fn.__qualname__
