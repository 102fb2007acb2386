"""A decode-sized matmul ``a @ w.T`` with the elementwise work around it done in the same launch.

A decode frame at 64 rows is a chain of ~1,200 dependent kernels (``benchmarks/raw/talker-kernels-*.txt``):
each matmul reads a few MB of weights (1-3 us at the H200's bandwidth) and the norms, adds and SiLU around it
cost a launch each (~1.5-2.5 us in a graph) for a few hundred KB. Here one program owns ``BLOCK_M`` rows x
``BLOCK_N`` output columns and streams its weight columns over K once; around the product it can

- ``norm``: take ``a`` un-normalized and apply RMSNorm on the way in: the K loop multiplies each ``a`` tile
  by the norm's weight and sums the squares of the row it already reads, and the product is scaled by the
  row's ``rsqrt(mean(a^2) + eps)`` at the end (``rmsnorm(a) @ w.T = rstd * ((a * g) @ w.T)``);
- ``silu``: ``w`` is a fused ``[gate; up]`` weight ``[2N, K]``: two products per program (gate and up
  columns n and N + n), each rounded to the output dtype as the separate projection would store it, then
  ``silu(gate) * up`` in float32 rounded once (``silu_mul``'s arithmetic);
- ``residual``: store ``residual + product`` (the product rounded first, the add in float32 rounded once:
  what a bf16 projection followed by ``add_rms_norm``'s add stores).

So a pre-norm decoder layer runs as norm+QKV, attention, O+residual, norm+gate/up+SiLU, down+residual.

Tiles do not depend on M (``BLOCK_M`` is fixed; ``BLOCK_N``/``BLOCK_K`` follow N and K only), so a row's
result is the same whatever other rows share the call: batch composition cannot change a row's bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64
MAX_ROWS = 256  # decode-sized calls only: larger ones (prefill) go to cuBLAS
# (BLOCK_N, BLOCK_K, num_stages, num_warps) for every call when set: a knob for on-device tile sweeps
TILE_OVERRIDE: tuple[int, int, int, int] | None = None
# measured per shape, (N, K, silu) -> tiles, ahead of the rule in ``tiles`` (``tools/bench_gemm.py --fused``
# prints the best of its sweep per shape); None: cuBLAS and separate kernels were faster for that shape, so
# ``fused_linear`` runs those instead. From the H200 sweep at 4219e78 (benchmarks/talker-steps.md, M = 64 and
# 128, 1.7B): only the residual-epilogue shapes (O and down projections) and the code predictor's head beat
# cuBLAS; with RMSNorm in or SiLU*up out the Triton matmul was 1.3-3x slower. (1024, 2048) is both the code
# predictor's O projection (fused wins 6.3 vs 7.2 us, 75 calls a frame) and its input projection (loses
# 6.2 vs 5.8 us, one call): the O projection's tiles.
TILES: dict[tuple[int, int, bool], tuple[int, int, int, int] | None] = {
    (4096, 2048, False): None, (2048, 2048, False): (32, 128, 4, 4), (6144, 2048, True): None,
    (2048, 6144, False): None, (4096, 1024, False): None, (1024, 2048, False): (16, 256, 3, 4),
    (3072, 1024, True): None, (1024, 3072, False): (16, 256, 3, 4), (3072, 2048, False): None,
    (2048, 1024, False): (32, 128, 4, 4),
}


@triton.jit
def _fused_linear_kernel(a_ptr, w_ptr, out_ptr, g_ptr, res_ptr, M, N, K, a_stride, res_stride, eps,
                         NORM: tl.constexpr, SILU: tl.constexpr, RESIDUAL: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * a_stride
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sumsq = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            af = a.to(tl.float32)
            sumsq += tl.sum(af * af, axis=1)
            g = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            a = (af * g[None, :]).to(w_ptr.dtype.element_ty)
        w_mask = k_ok[:, None] & n_ok[None, :]
        w = tl.load(w_cols + k[:, None], mask=w_mask, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if SILU:
            w_up = tl.load(w_cols + N.to(tl.int64) * K + k[:, None], mask=w_mask, other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
    if NORM:
        rstd = tl.rsqrt(sumsq / K + eps)
        acc = acc * rstd[:, None]
        acc_up = acc_up * rstd[:, None]
    out_ty = out_ptr.dtype.element_ty
    y = acc.to(out_ty).to(tl.float32)  # the product as a separate projection would store it
    if SILU:
        up = acc_up.to(out_ty).to(tl.float32)
        y = y / (1.0 + tl.exp(-y)) * up
    if RESIDUAL:
        r = tl.load(res_ptr + rm.to(tl.int64)[:, None] * res_stride + rn[None, :],
                    mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        y = y + r.to(tl.float32)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], y.to(out_ty), mask=m_ok[:, None] & n_ok[None, :])


def tiles(n: int, k: int, silu: bool) -> tuple[int, int, int, int] | None:
    """(BLOCK_N, BLOCK_K, num_stages, num_warps) for ``n`` output columns: enough programs to keep the SMs
    streaming weights (>= 64 of them for the shapes of Qwen3-TTS), from n and k only (batch invariance).
    ``silu`` holds two accumulators: at most 32 columns (64 took all 255 registers in ptxas for sm_90a)."""
    if TILE_OVERRIDE is not None:
        return TILE_OVERRIDE
    if (n, k, silu) in TILES:
        return TILES[n, k, silu]
    block_n = 64 if n >= 64 * 96 else 32 if n >= 32 * 96 else 16
    return min(block_n, 32) if silu else block_n, 128, 4, 4


def fused_linear(a: torch.Tensor, weight: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None,
                 silu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ weight.T`` for ``a`` ``[..., K]`` (last dim contiguous) and ``weight`` ``[N, K]`` (``[2N, K]``
    ``[gate; up]`` with ``silu``), no bias. ``norm=(g, eps)``: ``a`` is RMS-normalized with weight ``g``
    ``[K]`` first. ``silu``: returns ``silu(a @ gate.T) * (a @ up.T)`` ``[..., N]``. ``residual`` ``[..., N]``:
    returns ``residual + a @ weight.T``. Output contiguous, in ``a``'s dtype."""
    k = a.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k or weight.dtype != a.dtype or not weight.is_contiguous():
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} is not a contiguous [N, {k}] {a.dtype} matrix")
    if silu and weight.shape[0] % 2:
        raise ValueError(f"silu needs a [gate; up] weight of even rows, got {weight.shape[0]}")
    n = weight.shape[0] // 2 if silu else weight.shape[0]
    a2 = a.reshape(-1, k)
    if a2.stride(-1) != 1:
        a2 = a2.contiguous()
    m = a2.shape[0]
    out = torch.empty((*a.shape[:-1], n), dtype=a.dtype, device=a.device)
    g, eps = norm if norm is not None else (None, 0.0)
    if g is not None and g.shape != (k,):
        raise ValueError(f"norm weight {tuple(g.shape)} is not [{k}]")
    r2 = None
    if residual is not None:
        if residual.shape != out.shape or residual.dtype != a.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} is not {tuple(out.shape)} {a.dtype}")
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    if m == 0:
        return out
    tile = tiles(n, k, silu)
    if tile is None:
        return _separate(a, weight, norm, silu, residual)
    block_n, block_k, stages, warps = tile
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # tf32 is ignored for half inputs
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, BLOCK_M))
    _fused_linear_kernel[grid](a2, weight, out, g, r2, m, n, k, a2.stride(0), r2.stride(0) if r2 is not None else 0,
                               eps, NORM=g is not None, SILU=silu, RESIDUAL=r2 is not None, BLOCK_M=BLOCK_M,
                               BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, num_stages=stages,
                               num_warps=warps)
    return out


def _separate(a: torch.Tensor, weight: torch.Tensor, norm: tuple[torch.Tensor, float] | None, silu: bool,
              residual: torch.Tensor | None) -> torch.Tensor:
    """``fused_linear``'s result from torch's RMSNorm and matmul (cuBLAS), the SiLU*up kernel and an add: for
    the shapes where that measured faster (``TILES[...] = None``)."""
    from omniloop.gpu.kernels.silu_mul import silu_mul

    x = torch.nn.functional.rms_norm(a, (a.shape[-1],), norm[0], norm[1]) if norm is not None else a
    y = torch.nn.functional.linear(x, weight)
    if silu:
        y = silu_mul(y.contiguous())
    return (residual + y) if residual is not None else y.contiguous()
