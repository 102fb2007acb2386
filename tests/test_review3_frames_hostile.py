"""Hostile shapes in a frame header must raise FrameError (what Inbox catches), never a bare
ValueError that escapes the inbox callback and loses the rest of the received batch."""

import msgspec
import numpy as np
import pytest

from omniloop.transport import frames
from omniloop.transport.messages import Chunk, TensorMeta


def _frames(shape, buf=b"", dtype="float32"):
    msg = Chunk("r1", 0, arrays={"pcm": TensorMeta(dtype, shape, 0)})
    return [bytes([2]), msgspec.msgpack.encode(msg), buf]


@pytest.mark.parametrize(
    "shape,buf",
    [
        ((2**32, 2**32), b""),  # int64 product wraps to 0 and matched the empty frame
        ((2**62, 4), b""),
        ((2**33, 2**31), b""),
        ((1,) * 65, b"\0" * 4),  # more dims than numpy supports
        ((0, 2**64 - 1), b""),  # zero-size but a dim numpy cannot represent
        ((2**64 - 1,), b""),
    ],
)
def test_hostile_shape_is_frame_error(shape, buf):
    with pytest.raises(frames.FrameError) as info:
        frames.decode(_frames(shape, buf))
    assert info.value.req_id == "r1"


def test_zero_size_and_normal_still_decode():
    msg, arrays = frames.decode(frames.encode(Chunk("r", 0), {"a": np.zeros((0, 16), np.int64), "b": np.arange(3.0)}))
    assert arrays["a"].shape == (0, 16) and arrays["b"].tolist() == [0.0, 1.0, 2.0]
