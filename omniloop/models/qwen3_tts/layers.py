"""Qwen3 decoder building blocks shared by the talker and the code predictor.

Attention reads and writes a *slot* KV cache: ``k_cache``/``v_cache`` of one layer are
``[num_slots, kv_heads, max_len, head_dim]``; a batch row names its slot and the absolute cache
position of each of its tokens. Prefill (many tokens per row) and decode (one token per row) are the
same code path, so a prompt prefilled with others gives the same keys as one prefilled alone.

Two ways to give positions: a ``[B, L]`` tensor (each row its own, masked per row), or a Python int
``start`` shared by every row (the code predictor: all rows at the same step, every key valid, so
attention needs no mask and the cache write is a slice copy).

On CUDA the same math runs in fewer kernels (graph replay is bound by kernel count, not bytes):
``F.rms_norm``, a per-position rope table and one ``addcmul`` rotation, decode attention with GQA as
``[B, kv_heads, groups, D]`` queries and an additive bias; in bf16/fp16 the decode and code-predictor
attention is one Triton kernel that reads each row's cache up to its length (no mask). The CPU path keeps
the reference's exact float32 formulas.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.qwen3_tts import fused_weights
from omniloop.models.qwen3_tts.config import DecoderConfig
from omniloop.models.qwen3_tts.rope import Rope, fold_sin, rotate_half


# CUDA: per-head q/k RMSNorm + rope in one Triton kernel (``gpu/kernels/qk_norm_rope.py``); a switch so
# benchmarks can measure the torch path it replaces
FUSED_NORM_ROPE = True
# CUDA, with FUSED_NORM_ROPE: that kernel also writes the new keys and values into the KV cache (no separate
# copy / index_put_ kernels per layer); a switch so benchmarks and tests can compare with the separate writes
FUSED_KV_WRITE = True
# CUDA bf16/fp16: each residual add fused into the RMSNorm that follows it (``gpu/kernels/add_rms_norm.py``;
# ``DecoderStack._forward_fused``); a switch so benchmarks can measure the add + norm kernels it replaces
FUSED_ADD_NORM = True
# CUDA bf16/fp16: the talker's decode attention (one token per row) and the code predictor's steps (one or two
# tokens, shared positions) in one Triton kernel that reads each row's cache up to its own length
# (``gpu/kernels/decode_attention.py``): no SDPA, no per-step mask; a switch so benchmarks can measure SDPA
FUSED_DECODE_ATTENTION = True
# CUDA bf16/fp16, with FUSED_KV_WRITE and FUSED_DECODE_ATTENTION: the decode attention kernel also does the q/k
# norm+rope and the KV write of the new tokens (``decode_attention_fresh``): one launch a layer instead of two
# (H200, 1.7B, 64 rows: frame 5.47 -> 5.43 ms; benchmarks/talker-steps.md). Head dims it cannot take (a power of
# two >= 16) keep the two launches. A switch so benchmarks can compare; ``OMNILOOP_FUSED_QKV_ATTENTION=0`` turns
# it off for a whole run
FUSED_QKV_ATTENTION = os.environ.get("OMNILOOP_FUSED_QKV_ATTENTION") != "0"
# with FUSED_ADD_NORM: the MLP's down projection (DOWN_PARTS) and the attention's output projection (O_PARTS) as
# P float32 partial sums over slices of K (``linear_parts``: one batched matmul) that the add+RMSNorm kernel after
# them sums, instead of cuBLAS's split-K matmul and its reduce kernel (103 reduce launches in the 64-row frame,
# benchmarks/talker-steps.md). H200, 1.7B, 64 rows: frame 5.37 -> 4.98 ms with 4 and 4, pipeline at 64 streams
# 571-593 -> 627-642 audio-s/s (benchmarks/pipeline.md). Only for calls of at most PARTS_MAX_TOKENS tokens (the
# decode steps, where cuBLAS splits K for lack of output tiles); a prefill's matmuls have tiles enough and would
# only write P times the float32 output. 0: off; ``OMNILOOP_DOWN_PARTS=0`` etc. for a run
DOWN_PARTS = int(os.environ.get("OMNILOOP_DOWN_PARTS", "4"))
O_PARTS = int(os.environ.get("OMNILOOP_O_PARTS", "4"))
PARTS_MAX_TOKENS = 256


def linear_parts(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """``x @ weight.T`` (x ``[..., K]``, weight ``[N, K]``) as ``parts`` float32 partial sums over equal slices of K,
    ``[parts, ..., N]``, from one batched matmul (CUDA: bf16 inputs, float32 outputs)."""
    k, n = x.shape[-1], weight.shape[0]
    if parts < 2 or k % parts or weight.shape[1] != k:
        raise ValueError(f"{parts} parts of K = {k} (weight {tuple(weight.shape)})")
    a = x.reshape(-1, parts, k // parts).transpose(0, 1)  # [P, M, K/P]
    b = weight.view(n, parts, k // parts).permute(1, 2, 0)  # [P, K/P, N]
    out = torch.bmm(a, b, out_dtype=torch.float32) if x.is_cuda else torch.bmm(a.float(), b.float())
    return out.view(parts, *x.shape[:-1], n)


def _parts_for(linear: nn.Linear, parts: int, tokens: int) -> int:
    """``parts`` where the projection can be split that way (no bias, K divisible) and the call has at most
    PARTS_MAX_TOKENS tokens, else 0 (the plain matmul)."""
    split = parts > 1 and tokens <= PARTS_MAX_TOKENS and linear.bias is None and linear.in_features % parts == 0
    return parts if split else 0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            # one fused kernel; statistics in float32 as the reference, rounded once instead of twice
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # float32: the reference formula, bit for bit (parity is proven in float32)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


@dataclass
class StackStep:
    """What every layer of one stack call shares, built once per call (not once per layer)."""

    cos: torch.Tensor  # broadcastable to [B, L, heads, D]
    sin: torch.Tensor  # plain sin (reference path) or sign-folded sin (fast path)
    kv_len: int
    fast: bool  # CUDA: fewer kernels, same math up to rounding
    start: int | None  # shared positions start..start+L-1: no mask, slice writes
    index: tuple[torch.Tensor, ...] | None  # per-row cache write index (rows, heads, positions)
    slots: torch.Tensor | None
    mask: torch.Tensor | None  # bool [B, 1, L, kv_len] (True = may attend), or additive [B, 1, 1, kv_len]
    rows: tuple[torch.Tensor, torch.Tensor] | None = None  # CUDA: cos, folded sin [R, D] for the fused kernel
    # set when attention runs the fused decode kernel (then ``mask`` is None): the int kv_len shared by every
    # row, or each row's position + 1 ``[B]`` (the kernel clamps it to kv_len: scratch rows read the bucket)
    decode_lengths: torch.Tensor | int | None = None
    # every row's tokens sit at positions 0..L-1, right-padded (a prefill of whole prompts): each query attends
    # its own call's keys causally (flash attention), not the cache through a mask
    prefix: bool = False
    # with ``prefix``: the call is packed prompts ``[P, 1]`` (one token a row, each row its own slot and
    # position) and token t attends the call's keys ``seq_start[t]..t`` (``gpu/kernels/packed_attention.py``)
    seq_start: torch.Tensor | None = None

    @property
    def write_positions(self) -> torch.Tensor | int:
        """Where the call's keys go in the cache: the shared start, or the per-row write positions
        ``index[2]`` (already clamped to the scratch position)."""
        return self.start if self.start is not None else self.index[2]

    @property
    def row_lengths(self) -> torch.Tensor | None:
        """The fused decode kernel's per-row lengths ``[B]``, or None where every row reads ``kv_len``."""
        return None if isinstance(self.decode_lengths, int) else self.decode_lengths

    def norm_rope(self, x: torch.Tensor, norm: "RMSNorm") -> torch.Tensor:
        """RMSNorm over the last dim, then rope; x ``[B, L, heads, D]``."""
        if self.rows is not None and FUSED_NORM_ROPE:
            from omniloop.gpu.kernels.qk_norm_rope import norm_rope

            return norm_rope(x, norm.weight, norm.eps, *self.rows)
        return self.rope(norm(x))

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, L, heads, D]``."""
        if self.fast:
            half = x.shape[-1] // 2
            return torch.addcmul(x * self.cos, torch.cat((x[..., half:], x[..., :half]), -1), self.sin)
        return x * self.cos + rotate_half(x) * self.sin


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias, **kw)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias, **kw)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **kw)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **kw)
        self.qkv_weight: torch.Tensor | None = None  # set by ``fuse``
        self.qkv_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        """One ``[q; k; v]`` weight, with the three projections' weights turned into views of it (no copy
        kept): one matmul instead of three on the fast path, same values."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = fused_weights.fuse([p.weight for p in projs])
        if self.q_proj.bias is not None:
            self.qkv_bias = fused_weights.fuse([p.bias for p in projs])

    def _is_fused_path(self, s: StackStep) -> bool:
        """Fused QKV weights and the Triton q/k norm+rope kernel (CUDA: ``s.rows`` is set)."""
        return self.qkv_weight is not None and s.rows is not None and FUSED_NORM_ROPE

    def _fused_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L, (heads + 2 * kv_heads) * D]`` rows of the one fused matmul, on weights checked current."""
        fused_weights.check_fused(self.qkv_weight, self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        return F.linear(x, self.qkv_weight, self.qkv_bias)

    def _values(self, qkv: torch.Tensor) -> torch.Tensor:
        """The values ``[B, L, kv_heads, D]`` of the fused projection's rows (a view)."""
        b, n, _ = qkv.shape
        return qkv[..., (self.num_heads + self.num_kv_heads) * self.head_dim:].view(b, n, self.num_kv_heads,
                                                                                    self.head_dim)

    def _qkv(self, x: torch.Tensor, s: StackStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[B, L, heads, D]`` and k, v ``[B, L, kv_heads, D]``; q and k normalized and rotated."""
        b, n, _ = x.shape
        if self._is_fused_path(s):
            from omniloop.gpu.kernels.qk_norm_rope import qk_norm_rope

            qkv = self._fused_qkv(x)
            q, k = qk_norm_rope(qkv, self.num_heads, self.num_kv_heads, self.q_norm.weight, self.k_norm.weight,
                                self.q_norm.eps, *s.rows)
            return q, k, self._values(qkv)
        q = s.norm_rope(self.q_proj(x).view(b, n, self.num_heads, self.head_dim), self.q_norm)
        k = s.norm_rope(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim), self.k_norm)
        return q, k, self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim)

    def _q_writing_kv(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      s: StackStep) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The fused path's q ``[B, L, heads, D]`` from the fused projection's rows ``qkv``
        ``[B, L, (heads + 2 * kv_heads) * D]``; the same launch stores the keys (normalized, rotated) and
        values in the cache where ``forward``'s separate writes would: at ``s.start + l`` of slot ``b``, or at
        the per-row write positions ``s.index[2]`` (already clamped to the scratch position) of ``s.slots``.
        With ``s.prefix`` also the keys and values ``[B, L, kv_heads, D]`` (else None)."""
        from omniloop.gpu.kernels.qk_norm_rope import qk_norm_rope_cache

        out = qk_norm_rope_cache(qkv, self.num_heads, self.num_kv_heads, self.q_norm.weight, self.k_norm.weight,
                                 self.q_norm.eps, *s.rows, k_cache, v_cache, s.write_positions, s.slots,
                                 keep_keys=s.prefix)
        if not s.prefix:
            return out, None, None
        return out[:, :, :self.num_heads], out[:, :, self.num_heads:], self._values(qkv)

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, s: StackStep,
                parts: int = 0) -> torch.Tensor:
        """x ``[B, L, H]``. Writes x's keys at their positions, then attends over keys ``[0, kv_len)`` of each
        row's slot. ``s.slots=None``: row i is slot i, so the cache is read by slicing (a view) instead of
        gathering (a copy). ``parts`` > 1: ``o_proj``'s product as float32 partial sums (``linear_parts``)."""
        if self._is_fused_path(s) and FUSED_KV_WRITE:
            out = self.attend_qkv(self._fused_qkv(x), k_cache, v_cache, s)
        else:
            q, k, v = self._qkv(x, s)
            self._write_kv(k, v, k_cache, v_cache, s)
            out = self._attend(q, k, v, k_cache, v_cache, s)
        return linear_parts(out, self.o_proj.weight, parts) if parts > 1 else self.o_proj(out)

    def _fresh_attention(self, s: StackStep) -> bool:
        """Decode-kernel attention that also normalizes, rotates and stores the new keys (FUSED_QKV_ATTENTION)."""
        from omniloop.gpu.kernels.decode_attention import dot_head_dim_ok

        return (FUSED_QKV_ATTENTION and FUSED_KV_WRITE and s.decode_lengths is not None and not s.prefix
                and dot_head_dim_ok(self.head_dim) and self._is_fused_path(s))

    def attend_qkv(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   s: StackStep) -> torch.Tensor:
        """``forward`` from the fused projection's rows ``qkv`` ``[B, L, (heads + 2 * kv_heads) * D]`` (computed
        by the caller), up to but not including ``o_proj``: returns ``[B, L, heads * D]``."""
        b, n, _ = qkv.shape
        if self._fresh_attention(s):
            from omniloop.gpu.kernels.decode_attention import decode_attention_fresh

            out = decode_attention_fresh(qkv, self.num_heads, self.num_kv_heads, self.q_norm.weight,
                                         self.k_norm.weight, self.q_norm.eps, *s.rows, k_cache, v_cache,
                                         s.write_positions, s.kv_len, s.row_lengths, s.slots)
            return out.view(b, n, -1)
        if self._is_fused_path(s) and FUSED_KV_WRITE:
            q, k, v = self._q_writing_kv(qkv, k_cache, v_cache, s)
        else:
            hd, h, kv = self.head_dim, self.num_heads, self.num_kv_heads
            q = s.norm_rope(qkv[..., :h * hd].view(b, n, h, hd), self.q_norm)
            k = s.norm_rope(qkv[..., h * hd:(h + kv) * hd].view(b, n, kv, hd), self.k_norm)
            v = self._values(qkv)
            self._write_kv(k, v, k_cache, v_cache, s)
        return self._attend(q, k, v, k_cache, v_cache, s)

    @staticmethod
    def _write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  s: StackStep) -> None:
        b, n = k.shape[:2]
        if s.start is not None:
            k_cache[:b, :, s.start:s.start + n] = k.transpose(1, 2)
            v_cache[:b, :, s.start:s.start + n] = v.transpose(1, 2)
        else:
            k_cache.index_put_(s.index, k.transpose(1, 2))
            v_cache.index_put_(s.index, v.transpose(1, 2))

    def _attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, s: StackStep) -> torch.Tensor:
        """Attention of q ``[B, L, heads, D]`` (x's keys and values already in the cache; ``k``, ``v`` are x's
        own, needed only by a prefix call) -> ``[B, L, heads * D]``, before ``o_proj``."""
        b, n = q.shape[:2]
        gqa = self.num_heads != self.num_kv_heads
        if s.seq_start is not None:  # packed prompts: [P, 1, heads, D], one token a row
            from omniloop.gpu.kernels import packed_attention as packed
            from omniloop.gpu.kernels.decode_attention import dot_head_dim_ok

            # the kernel on CUDA where it takes the head dim; else torch's dense-mask form of the same math
            use_kernel = q.is_cuda and dot_head_dim_ok(self.head_dim)
            attend = packed.packed_attention if use_kernel else packed.packed_attention_reference
            return attend(q[:, 0], k[:, 0], v[:, 0], s.seq_start).reshape(b, n, -1)
        if s.prefix:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=gqa)
            return out.transpose(1, 2).reshape(b, n, -1)
        if s.decode_lengths is not None:
            from omniloop.gpu.kernels.decode_attention import decode_attention

            out = decode_attention(q, k_cache, v_cache, s.kv_len, s.row_lengths, s.slots)
            return out.view(b, n, -1)
        if s.slots is None:
            keys, values = k_cache[:b, :, :s.kv_len], v_cache[:b, :, :s.kv_len]
        else:
            keys, values = k_cache[s.slots, :, :s.kv_len], v_cache[s.slots, :, :s.kv_len]
        if s.start is not None:  # every key in [0, kv_len) is valid for every row; causal within x's tokens
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=n > 1, enable_gqa=gqa)
        elif s.fast and n == 1:
            # one query per row: the query heads of one kv head form the "query length" of that kv head,
            # so no key/value repeat and one additive bias row per batch row
            qg = q.view(b, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=s.mask)
            return out.reshape(b, 1, -1)
        elif s.fast and gqa:
            # prefill: keys repeated per query head (a small copy), so the masked call can take the memory-
            # efficient kernel; with enable_gqa it could only take cuDNN's (a plan per new shape, ~1 s) or math
            groups = self.num_heads // self.num_kv_heads
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.repeat_interleave(groups, 1),
                                                 values.repeat_interleave(groups, 1), attn_mask=s.mask)
        else:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=s.mask, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(b, n, -1)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, **kw)
        self.gate_up_weight: torch.Tensor | None = None  # set by ``fuse``

    def fuse(self) -> None:
        """One ``[gate; up]`` weight (the two become views of it): one matmul and one SiLU-multiply kernel."""
        self.gate_up_weight = fused_weights.fuse([self.gate_proj.weight, self.up_proj.weight])

    def forward(self, x: torch.Tensor, parts: int = 0) -> torch.Tensor:
        """``parts`` > 1: ``down_proj``'s product as float32 partial sums (``linear_parts``)."""
        if self.gate_up_weight is not None and x.is_cuda:
            from omniloop.gpu.kernels.silu_mul import silu_mul

            fused_weights.check_fused(self.gate_up_weight, self.gate_proj.weight, self.up_proj.weight)
            act = silu_mul(F.linear(x, self.gate_up_weight))
        else:
            act = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return linear_parts(act, self.down_proj.weight, parts) if parts > 1 else self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, device, dtype)
        self.mlp = MLP(cfg, device, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, s: StackStep) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), k_cache, v_cache, s)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, h: torch.Tensor, residual: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      s: StackStep, next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with each residual add fused into the norm after it: h is this layer's input already
        normalized by ``input_layernorm``, residual the un-normalized input; returns the output normalized
        by ``next_norm`` (the next layer's input norm, or the stack's final norm) and the output itself."""
        from omniloop.gpu.kernels.add_rms_norm import add_rms_norm

        post = self.post_attention_layernorm
        tokens = h.numel() // h.shape[-1]
        o_parts = _parts_for(self.self_attn.o_proj, O_PARTS, tokens)
        down_parts = _parts_for(self.mlp.down_proj, DOWN_PARTS, tokens)
        h, residual = add_rms_norm(self.self_attn(h, k_cache, v_cache, s, o_parts), residual, post.weight, post.eps)
        return add_rms_norm(self.mlp(h, down_parts), residual, next_norm.weight, next_norm.eps)


class DecoderStack(nn.Module):
    """Layers + final norm over a slot KV cache ``[layers, slots, kv_heads, max_len + 1, head_dim]``; the
    last position is scratch space that absorbs the writes of right-padding tokens in a batched prefill."""

    def __init__(self, cfg: DecoderConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg, device, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.rope = Rope(cfg, device)
        self.num_kv_heads = cfg.num_kv_heads

    def fuse(self) -> None:
        """Fused QKV and gate/up weights in every layer (for the CUDA path; the CPU path keeps the reference's
        separate matmuls, bit for bit)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def is_fused(self) -> bool:
        """Every layer's fused weights are current (no parameter replaced since ``fuse``)."""
        fused = fused_weights.is_fused
        return all(fused(a.qkv_weight, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
                   and (a.qkv_bias is None or fused(a.qkv_bias, a.q_proj.bias, a.k_proj.bias, a.v_proj.bias))
                   and fused(m.gate_up_weight, m.gate_proj.weight, m.up_proj.weight)
                   for a, m in ((layer.self_attn, layer.mlp) for layer in self.layers))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slots: torch.Tensor | None, kv_len: int, prefix: bool = False,
                seq_start: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[B, L, H]``; positions ``[B, L]`` absolute (also the cache positions written), or an int: every
        row at positions ``positions..positions+L-1`` with all keys below ``kv_len = positions + L`` valid.
        ``slots=None`` means row i uses slot i (see ``Attention``). ``prefix``: the caller promises every row's
        real tokens are at positions ``0..n_i-1`` (right padding after them, ``kv_len == L``), so attention is
        causal over the call's own keys; padding queries' outputs are then meaningless (the caller drops them).
        ``seq_start`` (with ``prefix``): packed prompts, x ``[P, 1, H]``, positions ``[P, 1]``, slots ``[P]`` (each
        token its own row), ``kv_len`` 1; token t attends the call's keys ``seq_start[t]..t`` (its prompt's)."""
        if prefix and (isinstance(positions, int) or kv_len != x.shape[1]):
            raise ValueError("a prefix call takes per-token positions and kv_len equal to its length")
        if seq_start is not None and (not prefix or x.shape[1] != 1 or seq_start.shape != (x.shape[0],)):
            raise ValueError("a packed call is a prefix call of one token a row with one seq_start a row")
        step = self._step(x, positions, k_cache, slots, kv_len, prefix, seq_start)
        if FUSED_ADD_NORM and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and len(self.layers):
            return self._forward_fused(x, k_cache, v_cache, step)
        for i, layer in enumerate(self.layers):
            x = layer(x, k_cache[i], v_cache[i], step)
        return self.norm(x)

    def _forward_fused(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       step: StackStep) -> torch.Tensor:
        """``forward``'s layers carrying (normalized hidden, residual), so every residual add runs in the
        kernel of the norm after it: two launches per layer instead of four. Same values as the unfused half-
        precision path up to the norms' reduction order; float32 never comes here (its parity with the
        reference is bit for bit, and the kernel's reduction order is not torch's). Any device the kernel
        runs on (CPU under ``TRITON_INTERPRET=1`` in the tests)."""
        h, residual = self.layers[0].input_layernorm(x), x
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for i, (layer, next_norm) in enumerate(zip(self.layers, next_norms)):
            h, residual = layer.forward_fused(h, residual, k_cache[i], v_cache[i], step, next_norm)
        return h

    def _step(self, x: torch.Tensor, positions: torch.Tensor | int, k_cache: torch.Tensor,
              slots: torch.Tensor | None, kv_len: int, prefix: bool = False,
              seq_start: torch.Tensor | None = None) -> StackStep:
        b, n, dev = x.shape[0], x.shape[1], x.device
        fast = x.is_cuda
        fused_attention = FUSED_DECODE_ATTENTION and fast and x.dtype in (torch.bfloat16, torch.float16)
        if isinstance(positions, int):
            if kv_len != positions + n or (n > 1 and positions != 0) or slots is not None:
                raise ValueError("shared positions need kv_len = start + L, start 0 when L > 1, and slots=None")
            cos, sin, sin_folded = self.rope.table(k_cache.shape[3], x.dtype)
            window = slice(positions, positions + n)
            rows = (cos[window], sin_folded[window]) if fast else None
            return StackStep(cos[window, None], (sin_folded if fast else sin)[window, None], kv_len, fast,
                             positions, None, None, None, rows, kv_len if fused_attention and n <= 2 else None)
        if positions.dim() == 2 and positions.shape[1] == 1 and fast:
            cos, _, sin_folded = self.rope.table(k_cache.shape[3], x.dtype)
            # positions >= the table (none in practice) would read out of bounds: clamp like the writes
            at = positions.clamp(max=k_cache.shape[3] - 1)
            cos, sin = cos[at], sin_folded[at]
        else:
            cos, sin = self.rope(positions, x.dtype)
            if fast:
                sin = fold_sin(sin)
        rows = (cos.reshape(b * n, -1).contiguous(), sin.reshape(b * n, -1).contiguous()) if fast else None
        cos, sin = cos[:, :, None], sin[:, :, None]
        # the caller marks padding tokens with a position >= max_len; they land on the scratch position
        write_pos = positions.clamp(max=k_cache.shape[3] - 1)
        heads = torch.arange(self.num_kv_heads, device=dev)
        batch_rows = torch.arange(b, device=dev) if slots is None else slots
        index = (batch_rows[:, None, None], heads[None, :, None], write_pos[:, None, :])
        if prefix:
            return StackStep(cos, sin, kv_len, fast, None, index, slots, None, rows, prefix=True, seq_start=seq_start)
        if fused_attention and n == 1:  # the kernel masks by length: no mask to build
            return StackStep(cos, sin, kv_len, fast, None, index, slots, None, rows, positions[:, 0] + 1)
        keys = torch.arange(kv_len, device=dev)
        mask = keys[None, None, None, :] <= positions[:, None, :, None]
        if fast and n == 1:
            mask = torch.zeros(mask.shape, dtype=x.dtype, device=dev).masked_fill_(~mask, float("-inf"))
        return StackStep(cos, sin, kv_len, fast, None, index, slots, mask, rows)
