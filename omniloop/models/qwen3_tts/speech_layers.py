"""Small building blocks of the codec decoder, each able to run on a chunk with carried state.

Every stateful layer takes ``tail`` (what it needs from before the chunk, ``[B, C, P]``) and ``lens``
(valid input length per row at this layer's rate) and returns its output plus the new tail. Rows are
right-padded to the longest chunk; because everything is causal, padding only affects outputs past
``lens``, and the new tail is gathered from each row's own valid end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

try:  # the fused SnakeBeta kernel on CUDA; elsewhere (and without Triton) the plain torch ops
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def _snake_kernel(x_ptr, out_ptr, alpha_ptr, inv_beta_ptr, num_ch, length, sxb, sxc, sob, soc,
                      BLOCK: tl.constexpr):
        row = tl.program_id(0)
        b, c = (row // num_ch).to(tl.int64), (row % num_ch).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < length
        x = tl.load(x_ptr + b * sxb + c * sxc + offs, mask=mask).to(tl.float32)
        s = tl.sin(x * tl.load(alpha_ptr + c))
        y = x + tl.load(inv_beta_ptr + c) * s * s
        tl.store(out_ptr + b * sob + c * soc + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def gather_tail(full: Tensor, lens: Tensor, size: int) -> Tensor:
    """``full[b, :, lens[b] : lens[b] + size]`` for every row (``full`` = old tail + chunk)."""
    idx = lens[:, None] + torch.arange(size, device=full.device)
    return full.gather(-1, idx[:, None, :].expand(-1, full.shape[1], -1))


def with_tail(tail: Tensor, x: Tensor, act: SnakeBeta | None) -> Tensor:
    """``cat([tail, act(x)], -1)``, with the activation written straight into the result."""
    if act is None:
        return torch.cat([tail, x], dim=-1)
    p = tail.shape[-1]
    full = x.new_empty((*x.shape[:-1], p + x.shape[-1]))
    full[..., :p] = tail
    act(x, out=full[..., p:])
    return full


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin ``[B, L, head_dim]`` for absolute positions ``[B, L]`` (half-split layout), in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                                / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x [B, H, L, D]``; cos/sin ``[B, L, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class SnakeBeta(nn.Module):
    """x + sin²(x·e^α) / e^β, per channel (``[B, C, T]``); stateless."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(dim))
        self.beta = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """``out``: where to write (e.g. the chunk part of a conv's ``[tail, chunk]`` buffer)."""
        if triton is not None and x.is_cuda and x.stride(-1) == 1:
            return self._fused(x, x.new_empty(x.shape) if out is None else out)
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        y = x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)
        return y if out is None else out.copy_(y)

    def _fused(self, x: Tensor, out: Tensor) -> Tensor:
        """One pass over ``x`` instead of five, with float32 math inside (the result is stored in x's dtype)."""
        alpha = self.alpha.float().exp()
        inv_beta = 1.0 / (self.beta.float().exp() + 1e-9)
        b, c, n = x.shape
        block = min(1024, max(16, triton.next_power_of_2(n)))
        _snake_kernel[(b * c, triton.cdiv(n, block))](x, out, alpha, inv_beta, c, n, x.stride(0), x.stride(1),
                                                      out.stride(0), out.stride(1), BLOCK=block)
        return out


class CausalConv(nn.Module):
    """Stride-1 conv that sees only the past: the tail holds the last ``(k-1)·dilation`` inputs."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.context = (kernel - 1) * dilation

    def tail_shape(self) -> tuple[int, ...]:
        return (self.conv.in_channels, self.context)

    def forward(self, x: Tensor, tail: Tensor | None, lens: Tensor,
                act: SnakeBeta | None = None) -> tuple[Tensor, Tensor | None]:
        """``act``: an activation applied to ``x`` first (fused into building ``[tail, chunk]``)."""
        if self.context == 0:
            return self.conv(x if act is None else act(x)), None
        full = with_tail(tail, x, act)
        return self.conv(full), gather_tail(full, lens, self.context)


class CausalTransConv(nn.Module):
    """Transposed conv (kernel k, stride s) cut to exactly ``s`` outputs per input.

    With k = 2s each output block depends on its own input and the previous one, so the tail is the
    last input frame; a zero tail reproduces the start of a one-shot decode exactly (zero input adds
    nothing, the bias is added once either way). With k = s there is no overlap and no tail.
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        if kernel not in (stride, 2 * stride):
            raise ValueError(f"transposed conv kernel {kernel} must be stride {stride} or twice it")
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.stride = stride
        self.context = (kernel - stride) // stride

    def tail_shape(self) -> tuple[int, ...]:
        return (self.conv.in_channels, self.context)

    def forward(self, x: Tensor, tail: Tensor | None, lens: Tensor,
                act: SnakeBeta | None = None) -> tuple[Tensor, Tensor | None]:
        if self.context == 0:
            return self.conv(x if act is None else act(x)), None
        s, num = self.stride, x.shape[-1]
        full = with_tail(tail, x, act)
        y = self.conv(full)
        # y[:, :, :s] belongs to the tail frame (already emitted); the last s are the right trim.
        return y[..., s:(num + 1) * s], gather_tail(full, lens, 1)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor, tail: Tensor, lens: Tensor) -> tuple[Tensor, Tensor | None]:
        h, tail = self.dwconv(x, tail, lens)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h.transpose(1, 2)))))
        return x + (self.gamma * h).transpose(1, 2), tail


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: Tensor, tail: Tensor, lens: Tensor) -> tuple[Tensor, Tensor | None]:
        h, tail = self.conv1(x, tail, lens, act=self.act1)
        h, _ = self.conv2(h, None, lens, act=self.act2)
        return x + h, tail
