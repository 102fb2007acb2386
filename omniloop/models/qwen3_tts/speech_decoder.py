"""Qwen3-TTS 12 Hz codec decoder: codes ``[B, T, 16]`` -> 24 kHz PCM, exactly 1920 samples per frame.

Split RVQ lookup -> causal pre-conv -> sliding-window transformer -> 2x(transposed conv, ConvNeXt) ->
causal conv -> 4 upsampling blocks (SnakeBeta, transposed conv, dilated residual units) -> SnakeBeta ->
causal conv -> clamp. Every op is causal (the transposed convs are trimmed on the right only), so there is
no lookahead: a frame's 1920 samples are final as soon as the frame is decoded.

``step`` decodes a chunk per row given the carried state (a flat list of per-row tensors, see
``state_specs``) and returns the new state, so a stream decodes each frame exactly once. ``decode`` is
the one-shot path: the same ``step`` from a zero state, in bounded internal chunks.

Layout (``set_channels_last``; on by default for CUDA, see ``SpeechTokenizer.build``): the conv stack's
activations and conv tails are stored time-major, ``[B, T, C]``, so cuDNN's NHWC conv kernels read and write
them without layout transposes (``speech_layers``); off, everything is ``[B, C, T]`` as in the reference.

Module names follow the checkpoint keys (``decoder.*`` in ``speech_tokenizer/model.safetensors``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omniloop.models.qwen3_tts.rope import fold_sin
from omniloop.models.qwen3_tts.speech_config import DecoderConfig
from omniloop.models.qwen3_tts.speech_layers import (
    CausalConv, CausalTransConv, ConvNeXtBlock, LayerScale, ResidualUnit, RMSNorm, SnakeBeta, apply_rope,
    channels_last_copy, rope_cos_sin,
)

StateSpec = tuple[tuple[int, ...], torch.dtype | None]  # per-row shape; dtype None = the model's dtype


class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def table(self) -> Tensor:
        return self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class _VQ(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = _Codebook(size, dim)


class _VQList(nn.Module):
    def __init__(self, num: int, size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_VQ(size, dim) for _ in range(num))


class _RVQ(nn.Module):
    """One half of the split RVQ: summed codebook vectors, then a 1x1 output projection."""

    def __init__(self, num: int, size: int, dim: int, out_dim: int) -> None:
        super().__init__()
        self.input_proj = nn.Conv1d(out_dim, dim, 1, bias=False)  # encode side; kept so the keys load
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)
        self.vq = _VQList(num, size, dim)
        self.size = size
        self.register_buffer("tables", torch.zeros(num * size, dim), persistent=False)
        self.channels_last = False

    def refresh(self) -> None:
        self.tables = torch.cat([vq._codebook.table() for vq in self.vq.layers]).detach()

    def forward(self, codes: Tensor) -> Tensor:
        """codes ``[B, L, n]`` -> ``[B, out_dim, L]``."""
        offsets = torch.arange(codes.shape[-1], device=codes.device) * self.size
        summed = F.embedding(codes + offsets, self.tables).sum(dim=2)
        if self.channels_last:  # the 1x1 conv as the Linear over channels it is: [B, L, out] rows
            return F.linear(summed, self.output_proj.weight[:, :, 0]).transpose(1, 2)
        return F.conv1d(summed.transpose(1, 2), self.output_proj.weight)


class _SplitRVQ(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.rvq_first = _RVQ(cfg.num_semantic_quantizers, cfg.codebook_size, dim, cfg.codebook_dim)
        self.rvq_rest = _RVQ(cfg.num_quantizers - cfg.num_semantic_quantizers, cfg.codebook_size, dim,
                             cfg.codebook_dim)
        self.num_semantic = cfg.num_semantic_quantizers

    def refresh(self) -> None:
        self.rvq_first.refresh()
        self.rvq_rest.refresh()

    def forward(self, codes: Tensor) -> Tensor:
        return self.rvq_first(codes[..., :self.num_semantic]) + self.rvq_rest(codes[..., self.num_semantic:])


# the transformer's norms, layer-scaled residual adds and RoPE through Triton kernels on CUDA in half precision
# (``_Transformer._forward_fused``); a switch so benchmarks can measure the torch path
FUSED_TRANSFORMER = True


class _Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.attn_head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(self, x: Tensor, rotate: Callable[[Tensor], Tensor], mask: Tensor, k_cache: Tensor,
                v_cache: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``rotate``: RoPE of heads ``[B, L, heads, D]`` (contiguous, as the projections give them), returned
        as ``[B, heads, L, D]``. The values are made contiguous in that order, like the fused path's keys: the
        cache concatenation below then takes torch's vectorized copy (an H200 profile of a 64 x 8-frame codec
        step: 32 us a layer with strided inputs)."""
        b, n, _ = x.shape
        q = rotate(self.q_proj(x).view(b, n, self.num_heads, self.head_dim))
        k = rotate(self.k_proj(x).view(b, n, self.num_kv, self.head_dim))
        v = self.v_proj(x).view(b, n, self.num_kv, self.head_dim).transpose(1, 2).contiguous()
        k_all, v_all = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
        idx = keep[:, None, :, None].expand(-1, self.num_kv, -1, self.head_dim)
        new_k, new_v = k_all.gather(2, idx), v_all.gather(2, idx)
        rep = self.num_heads // self.num_kv
        if rep > 1:
            k_all, v_all = k_all.repeat_interleave(rep, dim=1), v_all.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1)), new_k, new_v


class _Mlp(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _Mlp(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)


class _Transformer(nn.Module):
    """Sliding-window causal transformer; the cache keeps each row's last ``window - 1`` keys/values
    (post-RoPE), which is all a query at the next position can see."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        self.window, self.theta, self.head_dim = cfg.sliding_window, cfg.rope_theta, cfg.attn_head_dim
        self.cache_len = cfg.sliding_window - 1

    def forward(self, x: Tensor, pos: Tensor, lens: Tensor, caches: list[Tensor],
                fused: bool | None = None) -> tuple[Tensor, list[Tensor]]:
        """x ``[B, L, latent]``; pos ``[B]`` frames already decoded; caches ``[k0, v0, k1, v1, ...]``.
        ``fused``: through ``_forward_fused`` (None: where ``FUSED_TRANSFORMER`` and CUDA in half precision;
        True elsewhere only where Triton runs, e.g. its CPU interpreter in the tests)."""
        num, w = x.shape[1], self.cache_len
        steps = torch.arange(num, device=x.device)
        qpos = pos[:, None] + steps
        kpos = torch.cat([pos[:, None] - w + torch.arange(w, device=x.device), qpos], dim=1)
        q_, k_ = qpos[:, :, None], kpos[:, None, :]
        # Padded rows past lens only ever see themselves and earlier keys, so valid rows never read them.
        mask = ((k_ >= 0) & (k_ <= q_) & (k_ > q_ - self.window))[:, None]
        keep = lens[:, None] + torch.arange(w, device=x.device)
        cos, sin = rope_cos_sin(qpos, self.head_dim, self.theta)
        h = self.input_proj(x)
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        if fused is None:
            fused = FUSED_TRANSFORMER and h.is_cuda and h.dtype in (torch.float16, torch.bfloat16)
        if fused:
            return self._forward_fused(h, cos, sin, mask, keep, caches)
        new_caches: list[Tensor] = []

        def rotate(t: Tensor) -> Tensor:
            return apply_rope(t.transpose(1, 2), cos, sin)

        for i, layer in enumerate(self.layers):
            a, k_new, v_new = layer.self_attn(layer.input_layernorm(h), rotate, mask, caches[2 * i],
                                              caches[2 * i + 1], keep)
            h = h + layer.self_attn_layer_scale(a)
            h = h + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(h)))
            new_caches += [k_new, v_new]
        return self.output_proj(self.norm(h)), new_caches

    def _forward_fused(self, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, keep: Tensor,
                       caches: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """``forward``'s layers with the talker's Triton kernels (CUDA, half precision): each layer-scaled
        residual add runs in the kernel of the norm after it (``add_rms_norm``: one launch for ~8 torch ops) and
        q/k RoPE in one launch each (``rope``: for ~5), in float32 rounded once. The same values as the torch
        path up to that rounding; float32 and CPU come here only when asked (their parity is bit for bit)."""
        from omniloop.gpu.kernels.add_rms_norm import add_rms_norm
        from omniloop.gpu.kernels.qk_norm_rope import rope

        b, n, d = cos.shape
        cos_rows, sin_rows = cos.reshape(b * n, d), fold_sin(sin).reshape(b * n, d)

        def rotate(t: Tensor) -> Tensor:
            return rope(t, cos_rows, sin_rows)

        new_caches: list[Tensor] = []
        normed = self.layers[0].input_layernorm(h)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for i, (layer, next_norm) in enumerate(zip(self.layers, next_norms)):
            a, k_new, v_new = layer.self_attn(normed, rotate, mask, caches[2 * i], caches[2 * i + 1], keep)
            post = layer.post_attention_layernorm
            normed, h = add_rms_norm(a, h, post.weight, post.eps, scale=layer.self_attn_layer_scale.scale)
            normed, h = add_rms_norm(layer.mlp(normed), h, next_norm.weight, next_norm.eps,
                                     scale=layer.mlp_layer_scale.scale)
            new_caches += [k_new, v_new]
        return self.output_proj(normed), new_caches


class _DecoderBlock(nn.Module):
    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(cin), CausalTransConv(cin, cout, 2 * rate, rate),
                                    *(ResidualUnit(cout, d) for d in (1, 3, 9))])


class SpeechDecoder(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.quantizer = _SplitRVQ(cfg)
        self.pre_conv = CausalConv(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = _Transformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv(cfg.latent_dim, cfg.latent_dim, r, r), ConvNeXtBlock(cfg.latent_dim)])
            for r in cfg.upsampling_ratios)
        dims = [cfg.decoder_dim // 2 ** i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList([
            CausalConv(cfg.latent_dim, cfg.decoder_dim, 7),
            *(_DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)),
            SnakeBeta(dims[-1]),
            CausalConv(dims[-1], 1, 7),
        ])
        self.samples_per_frame = cfg.samples_per_frame
        self.channels_last = False

    def set_channels_last(self, on: bool) -> None:
        """Store the conv stack's activations, tails and conv weights channels-last (the weights are
        re-laid in place: no extra memory). Set it before building ``CodecStreams``: its pool packs tails in
        the layout the decoder had then (the other layout still decodes the same, through transposing copies)."""
        self.channels_last = on
        for m in self.modules():
            if isinstance(m, (CausalConv, CausalTransConv)):
                m.set_channels_last(on)
            elif isinstance(m, _RVQ):
                m.channels_last = on

    def refresh(self) -> None:
        """Recompute derived tables after the weights change (load, dummy init, dtype move)."""
        self.quantizer.refresh()

    def _conv_layers(self) -> list[nn.Module]:
        """Layers with a conv tail, in the order ``step`` consumes them."""
        out: list[nn.Module] = [self.pre_conv]
        for trans, convnext in self.upsample:
            out += [trans, convnext.dwconv]
        out.append(self.decoder[0])
        for blk in self.decoder[1:-2]:
            out.append(blk.block[1])
            out += [unit.conv1 for unit in blk.block[2:]]
        out.append(self.decoder[-1])
        return [m for m in out if m.context > 0]

    def state_specs(self) -> list[StateSpec]:
        """Per-row shapes of the stream state: positions, then (k, v) per layer, then conv tails."""
        cfg, tr = self.cfg, self.pre_transformer
        kv = ((cfg.num_key_value_heads, tr.cache_len, cfg.attn_head_dim), None)
        return [((), torch.int64), *([kv] * (2 * cfg.num_hidden_layers)),
                *((m.tail_shape(), None) for m in self._conv_layers())]

    def init_state(self, batch: int) -> list[Tensor]:
        p = self.pre_conv.conv.weight
        state = [torch.zeros((batch, *shape), dtype=dtype or p.dtype, device=p.device)
                 for shape, dtype in self.state_specs()]
        if self.channels_last:  # conv tails [B, C, P] stored [B, P, C], as the layers produce them
            first = len(state) - len(self._conv_layers())
            state[first:] = [channels_last_copy(t) for t in state[first:]]
        return state

    def step(self, codes: Tensor, lens: Tensor, state: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """Decode one chunk per row. codes ``[B, L, Q]`` (rows right-padded past ``lens``), lens ``[B]``
        int64 on the model's device. Returns pcm ``[B, L * 1920]`` (valid up to ``lens * 1920``) and the
        new state. A row with ``lens == 0`` keeps its state unchanged."""
        cfg = self.cfg
        num_layers = 2 * cfg.num_hidden_layers
        pos, caches, tails = state[0], state[1:1 + num_layers], iter(state[1 + num_layers:])
        new_tails: list[Tensor] = []

        def run(layer: nn.Module, x: Tensor, rate_lens: Tensor, **kw: Any) -> Tensor:
            tail = next(tails) if layer_has_tail(layer) else None
            y, t = layer(x, tail, rate_lens, **kw)
            if t is not None:
                new_tails.append(t)
            return y

        codes = codes.clamp(0, cfg.codebook_size - 1)
        x = self.quantizer(codes).to(self.pre_conv.conv.weight.dtype)
        x = run(self.pre_conv, x, lens)
        # channels-last: both transposes are views (the transformer reads and writes [B, T, C])
        h, new_caches = self.pre_transformer(x.transpose(1, 2), pos, lens, caches)
        x, cur = h.transpose(1, 2), lens
        for trans, convnext in self.upsample:
            x = run(trans, x, cur)
            cur = cur * trans.stride
            x = run(convnext, x, cur)
        x = run(self.decoder[0], x, cur)
        owed = None  # where the residual units fold conv biases: the per-channel bias x still lacks
        for blk in self.decoder[1:-2]:
            trans, units = blk.block[1], blk.block[2:]
            # the block's SnakeBeta adds what the last block left owed; where the units fold biases, the
            # transposed conv's is owed in turn, and each unit owes its conv2's on top (ResidualUnit.owed_bias).
            # Those units update x in place: the transposed conv's output is read by nothing else.
            fold = units[0].folds_bias()
            x = run(trans, x, cur, act=blk.block[0], with_bias=not fold, act_bias=owed)
            owed = trans.conv.bias if fold else None
            cur = cur * trans.stride
            for unit in units:
                x = run(unit, x, cur, x_bias=owed)
                owed = unit.owed_bias(owed)
        x = run(self.decoder[-1], x, cur, act=self.decoder[-2], act_bias=owed)
        return x.clamp(-1.0, 1.0)[:, 0], [pos + lens, *new_caches, *new_tails]

    @torch.inference_mode()
    def decode(self, codes: Tensor, lens: Tensor | None = None, chunk_frames: int = 300) -> Tensor:
        """One-shot decode of ``[B, T, Q]`` codes -> ``[B, T * 1920]`` float PCM (rows past ``lens`` hold
        padding output). Exact for any length: internal chunks carry the full state."""
        if codes.ndim != 3 or codes.shape[-1] != self.cfg.num_quantizers:
            raise ValueError(f"codes must be [B, T, {self.cfg.num_quantizers}], got {list(codes.shape)}")
        b, t, _ = codes.shape
        dev = self.pre_conv.conv.weight.device
        codes = codes.to(dev)
        lens = torch.full((b,), t, device=dev) if lens is None else lens.to(dev)
        state = self.init_state(b)
        pieces = []
        for start in range(0, t, chunk_frames):
            num = min(chunk_frames, t - start)
            chunk_lens = (lens - start).clamp(0, num)
            pcm, state = self.step(codes[:, start:start + num], chunk_lens, state)
            pieces.append(pcm)
        if not pieces:
            return torch.zeros((b, 0), device=dev)
        pcm = torch.cat(pieces, dim=1)
        return pcm if pcm.dtype == torch.float64 else pcm.float()


def layer_has_tail(layer: nn.Module) -> bool:
    if isinstance(layer, (ConvNeXtBlock, ResidualUnit)):
        return True
    return getattr(layer, "context", 0) > 0
