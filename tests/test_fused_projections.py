"""Fused QKV / gate-up weights (the CUDA path's one-matmul projections): the separate parameters become
views of one tensor, loading writes through them, and weights replaced after fusing are caught instead of
silently leaving the fused matmul on stale values; none of the CUDA-only fusions changes the CPU float32 stack.
(The fused kernels themselves: test_kernels_interpret.py on CPU, test_kernels_gpu.py on the GPU.)"""

from __future__ import annotations

import pytest
import torch

from omniloop.models.qwen3_tts import layers
from omniloop.models.qwen3_tts.checkpoint import build_model
from omniloop.models.qwen3_tts.config import load_tts_config
from omniloop.models.qwen3_tts.fused_weights import check_fused
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint


def test_fused_weights_are_views_and_stale_ones_are_caught() -> None:
    model = build_model(cfg=load_tts_config(ensure_tiny_checkpoint("custom_voice")), load_format="dummy", seed=1)[0]
    attn, mlp = model.talker.model.layers[0].self_attn, model.code_predictor.model.layers[0].mlp
    before = [p.detach().clone() for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)]
    model.fuse_projections()
    assert torch.equal(attn.qkv_weight, torch.cat(before))
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert mlp.gate_proj.weight.data_ptr() == mlp.gate_up_weight.data_ptr()
    # loading (in place) writes through the views into the fused tensor
    state = model.state_dict()
    state["talker.model.layers.0.self_attn.k_proj.weight"] = torch.ones_like(attn.k_proj.weight)
    model.load_state_dict(state)
    nq = attn.q_proj.weight.shape[0]
    assert bool((attn.qkv_weight[nq:nq + attn.k_proj.weight.shape[0]] == 1).all())
    model.fuse_projections()  # idempotent: still the same fused tensor
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    model.double()  # replaces every parameter: the fused tensors are now stale
    with pytest.raises(RuntimeError, match="stale"):
        check_fused(attn.qkv_weight, attn.q_proj.weight)
    model.fuse_projections()  # re-fuses from the current parameters
    check_fused(attn.qkv_weight, attn.q_proj.weight)
    check_fused(mlp.gate_up_weight, mlp.gate_proj.weight)
    assert attn.qkv_weight.dtype == torch.float64


@torch.no_grad()
def test_cpu_stack_keeps_the_reference_formulas_with_every_fusion_switched_on() -> None:
    """The CUDA-only fusions (fused weights, residual add fused into the norm) leave the CPU float32 stack the
    reference's formulas bit for bit: pre-norm layers, each add separate, each norm its own weight."""
    model = build_model(cfg=load_tts_config(ensure_tiny_checkpoint("custom_voice")), load_format="dummy", seed=1)[0]
    model.fuse_projections()
    stack = model.talker.model
    assert layers.FUSED_ADD_NORM and layers.FUSED_NORM_ROPE
    torch.manual_seed(0)
    for module in stack.modules():
        if isinstance(module, layers.RMSNorm):
            module.weight.data = torch.rand_like(module.weight) + 0.5

    def norm(m: layers.RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return m.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.eps))

    b, n = 2, 5
    x = torch.randn(b, n, stack.norm.weight.shape[0])
    positions = torch.arange(n).repeat(b, 1)
    shape = (len(stack.layers), b, stack.num_kv_heads, n + 1, stack.layers[0].self_attn.head_dim)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    got = stack(x, positions, k_cache.clone(), v_cache.clone(), None, n)
    step = stack._step(x, positions, k_cache, None, n)
    h = x
    for i, layer in enumerate(stack.layers):
        h = h + layer.self_attn(norm(layer.input_layernorm, h), k_cache[i], v_cache[i], step)
        mlp, normed = layer.mlp, norm(layer.post_attention_layernorm, h)
        h = h + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed))
    assert torch.equal(got, norm(stack.norm, h))
