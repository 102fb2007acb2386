"""Fused QKV / gate-up weights (the CUDA path's one-matmul projections): the separate parameters become
views of one tensor, loading writes through them, and weights replaced after fusing are caught instead of
silently leaving the fused matmul on stale values. (The fused kernels themselves: test_kernels_interpret.py
on CPU, test_kernels_gpu.py on the GPU.)"""

from __future__ import annotations

import pytest
import torch

from omniloop.models.qwen3_tts.checkpoint import build_model
from omniloop.models.qwen3_tts.config import load_tts_config
from omniloop.models.qwen3_tts.layers import _check_fused
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
        _check_fused(attn.qkv_weight, attn.q_proj.weight)
    model.fuse_projections()  # re-fuses from the current parameters
    _check_fused(attn.qkv_weight, attn.q_proj.weight)
    _check_fused(mlp.gate_up_weight, mlp.gate_proj.weight)
    assert attn.qkv_weight.dtype == torch.float64
