"""Frame codec: every message type round-trips, arrays ride out of band zero-copy, bad input is a FrameError."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniloop.errors import FrameError
from omniloop.transport.frames import ALLOWED_DTYPES, decode, encode, peek_kind
from omniloop.transport.messages import (
    Abort,
    ChatRequest,
    Chunk,
    Credit,
    Finish,
    Kind,
    Ready,
    Sampling,
    Shutdown,
    SpeechRequest,
    Stats,
    Submit,
    TensorMeta,
)

MESSAGES = [
    Submit("r1", SpeechRequest("hi", speaker="vivian", sampling=Sampling(seed=7, top_k=50)), arrival=1.5),
    Submit("r2", ChatRequest(messages=[{"role": "user", "content": "hey"}], max_tokens=8)),
    Chunk("r1", 3, final=True, reason="stop", text="delta", stage="talker"),
    Abort("r1"),
    Finish("r1", "error", error="boom", stage="codec", num_frames=4),
    Ready("codec", 123, ok=False, error="no weights", info={"model": "fake.codec"}),
    Stats("talker", num_running=2, num_waiting=1, num_steps=9, step_ms=1.25, extra={"x": 1.0}),
    Shutdown(),
    Credit("r1", 4096),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_type_round_trips(msg):
    frames = encode(msg)
    assert peek_kind(frames) == Kind(frames[0][0])
    decoded, arrays = decode([bytes(f) for f in frames])
    assert decoded == msg
    assert arrays == {}


def test_arrays_of_several_dtypes_round_trip_including_empty_and_scalar():
    arrays = {
        "codes": np.arange(32, dtype=np.int64).reshape(2, 16),
        "pcm": np.linspace(-1, 1, 1920, dtype=np.float32),
        "empty_codes": np.zeros((0, 16), dtype=np.int64),
        "half": np.ones((3, 2), dtype=np.float16),
        "mask": np.array([True, False, True]),
        "scalar": np.array(5, dtype=np.int32),
        "bytes": np.frombuffer(b"abc", dtype=np.uint8),
    }
    msg, got = decode([bytes(f) for f in encode(Chunk("r9", 0), arrays)])
    assert msg.req_id == "r9"
    assert set(got) == set(arrays)
    for name, array in arrays.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        np.testing.assert_array_equal(got[name], array)
    assert msg.arrays["codes"] == TensorMeta("int64", (2, 16), 0)


def test_encode_is_zero_copy_and_noncontiguous_input_is_made_contiguous():
    pcm = np.arange(1000, dtype=np.float32)
    frames = encode(Chunk("r", 0), {"pcm": pcm, "strided": pcm[::2]})
    assert np.shares_memory(np.frombuffer(frames[2], dtype=np.float32), pcm)
    _, got = decode(frames)
    np.testing.assert_array_equal(got["strided"], pcm[::2])


def test_encode_refuses_what_cannot_travel():
    with pytest.raises(TypeError, match="dtype object"):
        encode(Chunk("r", 0), {"x": np.array([object()])})
    with pytest.raises(ValueError, match="no 'arrays' field"):
        encode(Abort("r"), {"x": np.zeros(2)})
    with pytest.raises(TypeError, match="not a transport message"):
        encode(SpeechRequest("x"))


def test_truncated_message_names_its_request():
    frames = encode(Chunk("req-7", 1), {"codes": np.zeros((2, 16), np.int64), "pcm": np.zeros(4, np.float32)})
    with pytest.raises(FrameError, match="truncated") as info:
        decode(frames[:-1])
    assert info.value.req_id == "req-7"
    short = [*frames[:3], bytes(frames[3])[:-1]]
    with pytest.raises(FrameError, match="needs 16 bytes") as info:
        decode(short)
    assert info.value.req_id == "req-7"


def test_header_with_forbidden_dtype_or_wrong_kind_is_rejected_with_req_id():
    header = msgspec.msgpack.encode({"type": "chunk", "req_id": "r5", "seq": 0, "arrays": {"x": ["object", [1], 0]}})
    with pytest.raises(FrameError, match="allowlist") as info:
        decode([bytes([Kind.CHUNK]), header, b"\0" * 8])
    assert info.value.req_id == "r5"
    with pytest.raises(FrameError, match="kind byte says ABORT") as info:
        decode([bytes([Kind.ABORT]), encode(Finish("r6", "stop"))[1]])
    assert info.value.req_id == "r6"


@pytest.mark.parametrize(
    "frames",
    [[], [b"\x02"], [b"\x63", b"x"], [b"\x02\x02", b"x"], [b"\x02", b"\xc1garbage"], [b"\x04", b"\x92\x01\x02"]],
)
def test_garbage_is_a_frame_error_without_req_id(frames):
    with pytest.raises(FrameError) as info:
        decode(frames)
    assert info.value.req_id is None


def test_partly_valid_header_still_names_the_request():
    header = msgspec.msgpack.encode({"type": "chunk", "req_id": "r8", "seq": "not-an-int"})
    with pytest.raises(FrameError) as info:
        decode([bytes([Kind.CHUNK]), header])
    assert info.value.req_id == "r8"


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(sorted(ALLOWED_DTYPES)),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_any_allowed_array_round_trips(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    array = (rng.integers(0, 2, size=shape) if dtype == "bool" else rng.integers(0, 100, size=shape)).astype(dtype)
    _, got = decode([bytes(f) for f in encode(Submit("r", SpeechRequest("x")), {"ref_pcm": array})])
    assert got["ref_pcm"].dtype == array.dtype and got["ref_pcm"].shape == array.shape
    np.testing.assert_array_equal(got["ref_pcm"], array)
