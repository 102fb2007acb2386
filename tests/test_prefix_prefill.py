"""``DecoderStack.forward(..., prefix=True)``: whole prompts from position 0, right-padded, attend their own
keys causally instead of the cache through a mask (the CUDA prefill graphs' path, flash attention there). On
the CPU reference path it must give the masked forward's hidden states for every real token, write the same
cache, and refuse calls that cannot be a prefix."""

import numpy as np
import pytest
import torch

from omniloop.gpu.prefill_graphs import packed_layout
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


def test_packed_layout_of_the_prefill_graphs() -> None:
    host, last = packed_layout(np.array([2, 3, 1]), np.array([5, 0, 7]), 8, max_len=16)
    assert host.tolist() == [[0, 1, 0, 1, 2, 0, 16, 16],  # positions: each prompt from 0, padding scratch
                             [5, 5, 0, 0, 0, 7, 0, 0],  # slots: the prompt's, padding slot 0
                             [0, 0, 2, 2, 2, 5, 6, 7]]  # prompt starts: padding tokens are their own
    assert last.tolist() == [1, 4, 5]
    with pytest.raises(ValueError, match="do not fit"):
        packed_layout(np.array([5, 4]), np.array([0, 1]), 8, max_len=16)


def test_packed_prompts_equal_each_prompt_alone() -> None:
    """Packed prompts (``seq_start``: one token a row, each its own slot and position) give every real token
    the hidden state it has when its prompt runs alone, and write the same cache; padding writes only the
    scratch position."""
    torch.manual_seed(1)
    stack = DecoderStack(CFG)
    max_len, lens, pad, prompt_slots = 16, [5, 9, 1, 7], 10, [3, 0, 2, 1]
    total = sum(lens)
    host, _ = packed_layout(np.array(lens), np.array(prompt_slots), total + pad, max_len)
    positions, slots, seq_start = (torch.from_numpy(row) for row in host)
    positions = positions[:, None]
    x = torch.randn(total + pad, 1, CFG.hidden_size)
    cache = torch.randn(2, CFG.num_layers, 4, CFG.num_kv_heads, max_len + 1, CFG.head_dim)
    k, v = cache.clone()
    with torch.no_grad():
        got = stack(x, positions, k, v, slots, 1, prefix=True, seq_start=seq_start)
    want_k, want_v = cache.clone()
    offset = 0
    for n, slot in zip(lens, prompt_slots):
        with torch.no_grad():
            alone = stack(x[offset:offset + n, 0][None], torch.arange(n)[None], want_k, want_v,
                          torch.tensor([slot]), n)
        torch.testing.assert_close(got[offset:offset + n, 0], alone[0], rtol=1e-5, atol=1e-5)
        offset += n
    torch.testing.assert_close(k[..., :max_len, :], want_k[..., :max_len, :], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v[..., :max_len, :], want_v[..., :max_len, :], rtol=1e-5, atol=1e-5)
    assert not torch.equal(k[..., :max_len, :], cache[0][..., :max_len, :])


def test_packed_call_is_refused_unless_one_token_a_row() -> None:
    stack = DecoderStack(CFG)
    cache = torch.zeros(CFG.num_layers, 2, CFG.num_kv_heads, 9, CFG.head_dim)
    x = torch.randn(4, 2, CFG.hidden_size)
    with pytest.raises(ValueError, match="packed"):
        stack(x, torch.zeros(4, 2, dtype=torch.long), cache, cache.clone(), torch.zeros(4, dtype=torch.long), 2,
              prefix=True, seq_start=torch.zeros(4, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packed_prompts_of_a_head_dim_the_kernel_cannot_take_run_on_cuda() -> None:
    """Head dim 8 (not a tile the packed-attention kernel takes): the packed call on CUDA uses torch's form of
    the same math instead of failing, and gives the CPU's hidden states."""
    import dataclasses

    cfg = dataclasses.replace(CFG, hidden_size=32, head_dim=8)
    torch.manual_seed(2)
    stack = DecoderStack(cfg)
    lens, max_len = [3, 4], 8
    host, _ = packed_layout(np.array(lens), np.array([1, 0]), 8, max_len)
    positions, slots, seq_start = (torch.from_numpy(row) for row in host)
    x = torch.randn(8, 1, cfg.hidden_size)
    cache = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, max_len + 1, cfg.head_dim)
    out = {}
    for dev in ("cpu", "cuda"):
        s = stack.to(dev)
        with torch.no_grad():
            out[dev] = s(x.to(dev), positions[:, None].to(dev), cache.clone().to(dev), cache.clone().to(dev),
                         slots.to(dev), 1, prefix=True, seq_start=seq_start.to(dev)).cpu()
    torch.testing.assert_close(out["cuda"][:sum(lens)], out["cpu"][:sum(lens)], rtol=1e-4, atol=1e-4)
