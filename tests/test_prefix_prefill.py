"""``DecoderStack.forward(..., prefix=True)``: whole prompts from position 0, right-padded, attend their own
keys causally instead of the cache through a mask (the CUDA prefill graphs' path, flash attention there). On
the CPU reference path it must give the masked forward's hidden states for every real token, write the same
cache, and refuse calls that cannot be a prefix."""

import pytest
import torch

from omniloop.models.qwen3_tts.config import DecoderConfig
from omniloop.models.qwen3_tts.layers import DecoderStack

CFG = DecoderConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, mrope_section=None,
                    mrope_interleaved=False, max_position_embeddings=64, attention_bias=False)


def test_prefix_forward_equals_the_masked_forward() -> None:
    torch.manual_seed(0)
    stack = DecoderStack(CFG)
    max_len, n, lens = 16, 7, [7, 3, 5]
    positions = torch.tensor([[i if i < m else max_len for i in range(n)] for m in lens])
    slots = torch.tensor([1, 3, 0])
    x = torch.randn(3, n, CFG.hidden_size)
    cache = torch.randn(2, CFG.num_layers, 4, CFG.num_kv_heads, max_len + 1, CFG.head_dim)
    out = {}
    for prefix in (True, False):
        k, v = cache.clone()
        with torch.no_grad():
            out[prefix] = (stack(x, positions, k, v, slots, n, prefix=prefix), k, v)
    for row, m in enumerate(lens):
        torch.testing.assert_close(out[True][0][row, :m], out[False][0][row, :m], rtol=1e-5, atol=1e-5)
    # the second layer sees the first layer's output: a wrong (e.g. non-causal) prefix attention changes it
    assert not torch.equal(out[True][1][:, :, :max_len], cache[0][:, :, :, :max_len])
    assert torch.equal(out[True][1][..., :max_len, :], out[False][1][..., :max_len, :])
    assert torch.equal(out[True][2][..., :max_len, :], out[False][2][..., :max_len, :])


def test_prefix_refuses_shared_positions_and_a_longer_kv_len() -> None:
    stack = DecoderStack(CFG)
    x = torch.randn(1, 3, CFG.hidden_size)
    cache = torch.zeros(CFG.num_layers, 1, CFG.num_kv_heads, 9, CFG.head_dim)
    with pytest.raises(ValueError, match="prefix"):
        stack(x, 0, cache, cache.clone(), None, 3, prefix=True)
    with pytest.raises(ValueError, match="prefix"):
        stack(x, torch.arange(3)[None], cache, cache.clone(), None, 5, prefix=True)
