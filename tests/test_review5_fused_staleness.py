"""Review: fused projection staleness is caught for every part, in both decoder stacks.

``check_fused`` compared only the first projection (q / gate) with the fused tensor, so a replaced k, v or up
weight left the fused matmul on stale values without a word; and ``fuse_projections`` looked only at the
talker's first MLP to decide whether to re-fuse, so parameters replaced in the code predictor (or in a later
talker layer) stayed stale while the error told the caller to call ``fuse_projections()`` again, which then
did nothing."""

from __future__ import annotations

import types

import pytest
import torch

from omniloop.gpu.kernels import qk_norm_rope as kernels
from omniloop.models.qwen3_tts.checkpoint import build_model
from omniloop.models.qwen3_tts.config import load_tts_config
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint


class _KernelReached(Exception):
    pass


def _model():
    return build_model(cfg=load_tts_config(ensure_tiny_checkpoint("custom_voice")), load_format="dummy", seed=1)[0]


def _assert_current(model) -> None:
    """Every fused tensor equals its parts as they are now, and every part is still a view of it."""
    for stack in (model.talker.model, model.code_predictor.model):
        for layer in stack.layers:
            for fused, parts in ((layer.self_attn.qkv_weight, [layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                               layer.self_attn.v_proj]),
                                 (layer.mlp.gate_up_weight, [layer.mlp.gate_proj, layer.mlp.up_proj])):
                weights = [p.weight for p in parts]
                assert torch.equal(fused, torch.cat(weights))
                assert weights[0].data_ptr() == fused.data_ptr()
                assert weights[-1].data_ptr() == fused[-weights[-1].shape[0]:].data_ptr()


def test_the_fused_attention_path_refuses_a_stale_k_or_v(monkeypatch) -> None:
    """The fused QKV path (CUDA, ``s.rows`` set) raises before its kernel when k or v was replaced."""
    def kernel(*args, **kwargs):
        raise _KernelReached

    monkeypatch.setattr(kernels, "qk_norm_rope", kernel)
    model = _model()
    model.fuse_projections()
    attn = model.talker.model.layers[0].self_attn
    x = torch.zeros(1, 1, attn.q_proj.weight.shape[1], dtype=attn.q_proj.weight.dtype)
    step = types.SimpleNamespace(rows=(None,))
    with pytest.raises(_KernelReached):  # current weights: on to the kernel
        attn._qkv(x, step)
    for proj in (attn.k_proj, attn.v_proj):
        proj.weight.data = proj.weight.data * 2  # a new tensor: the fused rows keep the old values
        with pytest.raises(RuntimeError, match="stale"):
            attn._qkv(x, step)
        model.fuse_projections()  # the remedy the error names works
        with pytest.raises(_KernelReached):
            attn._qkv(x, step)
    _assert_current(model)


def test_fuse_projections_refuses_a_replaced_code_predictor_or_later_layer() -> None:
    model = _model()
    model.fuse_projections()
    model.code_predictor.double()  # only the code predictor moved: the talker's first layer is still current
    last = model.talker.model.layers[-1].mlp
    last.up_proj.weight.data = last.up_proj.weight.data + 1
    model.fuse_projections()
    _assert_current(model)
    assert model.code_predictor.model.layers[0].self_attn.qkv_weight.dtype == torch.float64
    # still idempotent: nothing replaced, nothing re-fused
    before = model.talker.model.layers[0].self_attn.qkv_weight.data_ptr()
    model.fuse_projections()
    assert model.talker.model.layers[0].self_attn.qkv_weight.data_ptr() == before
