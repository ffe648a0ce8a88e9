"""Rotary-embedding math shared by the pure-torch tiers of every op (any float dtype)."""

from __future__ import annotations

import torch


def rotate(
    y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate the last dim of ``y`` [..., rotary_dim] by cos/sin [..., rotary_dim / 2].

    Half (split) layout pairs channel i with i + d/2; interleaved pairs (2i, 2i + 1).
    """
    if interleaved:
        x1, x2 = y[..., 0::2], y[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    half = y.shape[-1] // 2
    x1, x2 = y[..., :half], y[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary(
    y: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool,
    rotary_offset: int = 0,
) -> torch.Tensor:
    """Out-of-place rotary on channels ``rotary_offset .. rotary_offset + 2 * cos.shape[-1]``.

    y: [..., H]; cos/sin broadcastable to [..., rotary_dim / 2] in y's dtype.
    """
    lo, hi = rotary_offset, rotary_offset + 2 * cos.shape[-1]
    if lo == 0 and hi == y.shape[-1]:
        return rotate(y, cos, sin, interleaved)
    return torch.cat((y[..., :lo], rotate(y[..., lo:hi], cos, sin, interleaved), y[..., hi:]), -1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, in x's dtype."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.to(x.dtype)


def rope_cache(
    max_pos: int,
    rotary_dim: int,
    *,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard RoPE cos/sin caches ``[max_pos, rotary_dim / 2]``, computed in fp64.

    Angles ``pos * base^(-2i/rotary_dim)`` are formed in fp64 and rounded once to ``dtype``:
    an fp32 angle at position 256K would already be off by ~0.02 rad.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim}")
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
