"""``fuse_projections`` also joins the 16 codec embedding tables into one (a frame's input is one gather, not
sixteen) and projects the code predictor's input table once (each step's input is one row gather, not a gather
and a matmul). Same values as the separate path; a changed parameter is never used stale."""

from __future__ import annotations

import pytest
import torch

from omniloop.models.qwen3_tts.checkpoint import build_model
from omniloop.models.qwen3_tts.config import load_tts_config
from omniloop.models.qwen3_tts.generate import GREEDY
from omniloop.models.qwen3_tts.sampling import SamplingParams
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint


def _model():
    return build_model(cfg=load_tts_config(ensure_tiny_checkpoint("base")), load_format="dummy", seed=3)[0]


def _codes(model, rows: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    code0 = torch.randint(0, model.cfg.talker.decoder.vocab_size, (rows, 1), generator=g)
    rest = torch.randint(0, model.code_predictor.cfg.vocab_size, (rows, 15), generator=g)
    return torch.cat((code0, rest), 1)


@torch.no_grad()
def test_fused_tables_give_the_same_frame_input_and_codes() -> None:
    model = _model()
    codes = _codes(model)
    frame = model.frame_embed(codes)
    hidden = torch.randn(5, model.cfg.talker.decoder.hidden_size, generator=torch.Generator().manual_seed(1))
    params = SamplingParams.stack([dict(GREEDY, seed=0)] * 5)
    step = torch.zeros(5, dtype=torch.long)

    def predict() -> torch.Tensor:
        return model.code_predictor.predict(hidden, model.codec_embed(codes[:, 0]), params, step)

    before = predict()
    rows = [model.code_predictor.step_input(codes[:, g + 1], g) for g in range(15)]
    model.fuse_projections()
    assert model._frame_table is not None and model.code_predictor.inputs_fused()
    assert torch.equal(model.frame_embed(codes), frame)  # the same rows summed the same way
    for g in range(15):
        torch.testing.assert_close(model.code_predictor.step_input(codes[:, g + 1], g), rows[g], rtol=1e-6,
                                   atol=1e-6)
    assert torch.equal(predict(), before)  # greedy codes of all 15 steps


@torch.no_grad()
def test_changed_parameters_are_never_used_stale() -> None:
    model = _model()
    model.fuse_projections()
    cp = model.code_predictor
    code = torch.tensor([3, 7])
    proj = cp.small_to_mtp_projection.weight
    proj.data = proj.data * 2  # replaced: the projected table no longer matches
    with pytest.raises(RuntimeError, match="stale"):
        cp.step_input(code, 0)
    model.fuse_projections()  # the remedy the error names
    torch.testing.assert_close(cp.step_input(code, 0), cp.small_to_mtp_projection(cp.codec_embedding[0](code)))
    cp.codec_embedding[4].weight.add_(1.0)  # in place: the frame table (views) follows, the projection does not
    with pytest.raises(RuntimeError, match="stale"):
        cp.step_input(code, 4)
    codes = _codes(model, 2)
    want = torch.cat((model.codec_embed(codes[:, :1]), cp.embed_codes(codes[:, 1:])), -2).sum(-2)
    assert torch.equal(model.frame_embed(codes), want)


def test_tables_of_mixed_dtypes_are_left_apart() -> None:
    model = _model()
    model.code_predictor.double()
    model.fuse_projections()
    assert model._frame_table is None  # one table would have cast the talker's embedding to float64
    assert model.talker.codec_embedding.weight.dtype == torch.float32
    assert model.code_predictor.inputs_fused()


def test_no_projection_no_table() -> None:
    """Equal widths (the 0.6B models): the projection is the identity, so no table is built (it would copy
    the embeddings) and each step's input is its embedding row."""
    model = _model()
    cp = model.code_predictor
    cp.small_to_mtp_projection = torch.nn.Identity()
    model.fuse_projections()
    assert cp.inputs_fused() and cp._inputs is None
    code = torch.tensor([1, 5])
    assert torch.equal(cp.step_input(code, 2), cp.codec_embedding[2](code))
