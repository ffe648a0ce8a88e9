"""Readable fp64 reference of RMSNormRotary (the oracle; unfused, no chunking)."""

from __future__ import annotations

import torch

from .._rotary import apply_rotary, rms_norm


def rms_norm_rotary_fp64(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    num_heads: int,
    epsilon: float,
    interleaved: bool,
    rotary_offset: int,
    exact: bool,
) -> torch.Tensor:
    """fp64 result before the final rounding; x [B, S, N*H], positions [B, S] int64.

    exact=False rounds the normalized value to x's dtype before the rotation (the legacy kernel).
    The cos/sin values are used as stored (an fp32 cache is exact in fp64).
    """
    b, s, d = x.shape
    y = rms_norm(x.reshape(b, s, num_heads, d // num_heads).to(torch.float64), weight, epsilon)
    if not exact:
        y = y.to(x.dtype).to(torch.float64)
    cos = cos_cache[positions].to(torch.float64)[:, :, None, :]  # [B, S, 1, rotary_dim/2]
    sin = sin_cache[positions].to(torch.float64)[:, :, None, :]
    out = apply_rotary(y, cos, sin, interleaved=interleaved, rotary_offset=rotary_offset)
    return out.reshape(b, s, d)


def rms_norm_rotary_reference(x, weight, cos_cache, sin_cache, positions, *, out_dtype, **kw):
    """The reference tier: the fp64 result rounded once to ``out_dtype``."""
    return rms_norm_rotary_fp64(x, weight, cos_cache, sin_cache, positions, **kw).to(out_dtype)
