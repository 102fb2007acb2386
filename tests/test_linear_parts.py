"""``layers.linear_parts``: a projection as float32 partial sums over slices of K (what the add+RMSNorm kernel sums
in place of a split-K reduce kernel); on CPU the same views through a float32 batched matmul."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omniloop.models.qwen3_tts import layers


def test_partial_sums_add_up_to_the_product() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(2, 5, 48, dtype=torch.float64), torch.randn(24, 48, dtype=torch.float64)
    for parts in (2, 3, 4, 6):
        out = layers.linear_parts(x, w, parts)
        assert out.shape == (parts, 2, 5, 24) and out.dtype == torch.float32
        torch.testing.assert_close(out.double().sum(0), x @ w.T, rtol=1e-5, atol=1e-5)
        k = 48 // parts  # each part is its own slice of K, not a share of the whole
        torch.testing.assert_close(out[1].double(), x[..., k:2 * k] @ w[:, k:2 * k].T, rtol=1e-5, atol=1e-5)


def test_bad_splits_are_refused_and_biased_indivisible_or_long_calls_keep_the_plain_matmul() -> None:
    x, w = torch.randn(3, 48), torch.randn(24, 48)
    for parts in (1, 5):
        with pytest.raises(ValueError, match="parts"):
            layers.linear_parts(x, w, parts)
    with pytest.raises(ValueError, match="parts"):
        layers.linear_parts(x, torch.randn(24, 40), 2)
    most = layers.PARTS_MAX_TOKENS
    assert layers._parts_for(nn.Linear(48, 24, bias=False), 4, 64) == 4
    assert layers._parts_for(nn.Linear(48, 24, bias=False), 4, most) == 4
    assert layers._parts_for(nn.Linear(48, 24, bias=False), 4, most + 1) == 0  # a prefill: tiles enough
    assert layers._parts_for(nn.Linear(48, 24, bias=True), 4, 64) == 0
    assert layers._parts_for(nn.Linear(50, 24, bias=False), 4, 64) == 0
    assert layers._parts_for(nn.Linear(48, 24, bias=False), 0, 64) == 0
