"""The K/V cache writes that ``qk_norm_rope_cache`` replaces (``Attention.forward`` before it), shared by the
interpreter check and the GPU tests: ``qk_norm_rope``, then torch's slice copy (shared start) or ``index_put_``
(per-row positions) of k and v."""

from __future__ import annotations

import torch


def separate_writes(qkv: torch.Tensor, nq: int, nk: int, wq: torch.Tensor, wk: torch.Tensor, cos: torch.Tensor,
                    folded: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    positions: torch.Tensor | int, slots: torch.Tensor | None) -> torch.Tensor:
    """Writes k and v into the caches the old way; returns q."""
    from omniloop.gpu.kernels.qk_norm_rope import qk_norm_rope  # Triton: imported only when used

    b, n, _ = qkv.shape
    d = wq.shape[0]
    q, k = qk_norm_rope(qkv, nq, nk, wq, wk, 1e-6, cos, folded)
    k, v = k.transpose(1, 2), qkv[..., (nq + nk) * d:].view(b, n, nk, d).transpose(1, 2)
    if isinstance(positions, int):
        k_cache[:b, :, positions:positions + n] = k
        v_cache[:b, :, positions:positions + n] = v
    else:
        rows = torch.arange(b, device=qkv.device) if slots is None else slots
        index = (rows[:, None, None], torch.arange(nk, device=qkv.device)[None, :, None], positions[:, None, :])
        k_cache.index_put_(index, k)
        v_cache.index_put_(index, v)
    return q
