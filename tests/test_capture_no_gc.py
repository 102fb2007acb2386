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
    assert "with no_gc(), torch.cuda.graph(" in inspect.getsource(cuda_graphs.capture)
    # the codec's step graphs go through that one capture, not a torch.cuda.graph of their own
    codec = inspect.getsource(speech_stream._StepGraphs._capture)
    assert "capture(" in codec and "torch.cuda.graph(" not in codec



def test_dropped_codec_streams_free_their_graphs_without_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams and their step graphs form no reference cycle: dropping the streams frees both at once, so a
    dead graph never waits for a collection (which could come inside another capture). The real constructor
    runs; only its CUDA pool handle and side stream are stood in for on CPU."""
    import weakref

    import torch

    from omniloop.gpu.cuda_graphs import batch_buckets
    from omniloop.models.qwen3_tts.speech_tokenizer import SpeechTokenizer
    from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 0))
    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: object())
    dec = SpeechTokenizer.load(ensure_tiny_checkpoint("custom_voice"), device="cpu", dtype=torch.float32,
                               load_format="dummy", with_encoder=False, seed=3).decoder
    streams = speech_stream.CodecStreams(dec, max_streams=4, initial_slots=4, graphs=False)
    streams._graphs = speech_stream._StepGraphs(streams, batch_buckets(4))
    alive_streams, alive_graphs = weakref.ref(streams), weakref.ref(streams._graphs)
    gc.collect()
    gc.disable()
    try:
        del streams
        assert alive_streams() is None and alive_graphs() is None
    finally:
        gc.enable()
