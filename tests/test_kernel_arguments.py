"""The new decode and prefill kernels refuse malformed arguments before any launch, naming what is wrong (the
checks run on the host, so this needs neither a GPU nor Triton's interpreter)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_packed_attention_refuses_mismatched_shapes() -> None:
    from omniloop.gpu.kernels.packed_attention import packed_attention, packed_attention_reference

    q, kv = torch.zeros(6, 4, 16), torch.zeros(6, 2, 16)
    with pytest.raises(ValueError, match="seq_start"):
        packed_attention(q, kv, kv, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple"):
        packed_attention_reference(torch.zeros(6, 3, 16), kv, kv, torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="same tokens"):
        packed_attention(q, torch.zeros(5, 2, 16), torch.zeros(5, 2, 16), torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="power of two"):
        packed_attention(torch.zeros(6, 4, 24), torch.zeros(6, 2, 24), torch.zeros(6, 2, 24),
                         torch.zeros(6, dtype=torch.long))


def test_fresh_decode_attention_refuses_bad_caches_and_positions() -> None:
    from omniloop.gpu.kernels.decode_attention import decode_attention_fresh

    b, hq, hkv, d = 2, 4, 2, 16
    qkv = torch.zeros(b, 1, (hq + 2 * hkv) * d)
    w, rows = torch.ones(d), torch.zeros(b, d)
    cache = torch.zeros(3, hkv, 9, d)
    args = (w, w, 1e-6, rows, rows)
    with pytest.raises(ValueError, match="heads of 16"):
        decode_attention_fresh(torch.zeros(b, 1, 100), hq, hkv, *args, cache, cache.clone(), 0, 1)
    with pytest.raises(ValueError, match="kv heads"):
        decode_attention_fresh(qkv, hq, hkv, *args, torch.zeros(3, 4, 9, d), torch.zeros(3, 4, 9, d), 0, 1)
    with pytest.raises(ValueError, match="outside the cache"):
        decode_attention_fresh(qkv, hq, hkv, *args, cache, cache.clone(), 9, 9)
    with pytest.raises(ValueError, match="cache positions"):
        decode_attention_fresh(qkv, hq, hkv, *args, cache, cache.clone(), torch.zeros(3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="slots for 2 rows"):
        decode_attention_fresh(qkv, hq, hkv, *args, cache, cache.clone(), 0, 1, None, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="dtype"):
        decode_attention_fresh(qkv, hq, hkv, *args, cache.half(), cache.half(), 0, 1)


def test_packed_layout_refuses_what_does_not_fit() -> None:
    import numpy as np

    from omniloop.gpu.prefill_graphs import packed_layout

    with pytest.raises(ValueError, match="do not fit"):
        packed_layout(np.array([3, 0]), np.array([0, 1]), 8, max_len=16)  # an empty prompt


def test_decode_attention_reads_smaller_key_blocks_only_where_programs_fill_the_device(monkeypatch) -> None:
    """32 keys a loop step where a launch has at least two programs a SM (the talker at 64 rows: faster on the
    H200), 64 where it has fewer (1 and 8 rows: faster there); never more than the bucket needs."""
    from omniloop.gpu.kernels import decode_attention as da

    monkeypatch.setitem(da._SM_COUNT, 0, 132)  # an H200's count, so no device is asked
    gpu = torch.device("cuda", 0)
    assert da._block_n(320, 64 * 8, gpu) == 32
    assert da._block_n(320, 8 * 8, gpu) == 64
    assert da._block_n(320, 263, gpu) == 64 and da._block_n(320, 264, gpu) == 32
    assert da._block_n(17, 8, gpu) == 32 and da._block_n(9, 512, gpu) == 16  # the code predictor's short caches
    assert da._block_n(320, 8, torch.device("cpu")) == da.BLOCK_N_MAX
