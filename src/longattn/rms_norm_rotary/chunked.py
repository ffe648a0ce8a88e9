"""Pure-PyTorch RMSNormRotary: fp32 math, processed in token chunks to bound temporaries."""

from __future__ import annotations

import torch

from .._rotary import apply_rotary, rms_norm

_CHUNK_ELEMS = 1 << 22  # fp32 temporaries per chunk stay around 16 MiB each


def rms_norm_rotary_chunked(
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
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x [B, S, N*H] -> [B, S, N*H] in out_dtype; positions [B, S] int64."""
    b, s, d = x.shape
    xt = x.reshape(b * s, num_heads, d // num_heads)
    pos = positions.reshape(b * s)
    out = torch.empty(xt.shape, dtype=out_dtype, device=x.device)
    step = max(1, _CHUNK_ELEMS // max(d, 1))
    for t0 in range(0, b * s, step):
        y = rms_norm(xt[t0 : t0 + step].to(torch.float32), weight, epsilon)
        if not exact:
            y = y.to(x.dtype).to(torch.float32)
        p = pos[t0 : t0 + step]
        cos = cos_cache[p].to(torch.float32)[:, None, :]  # [chunk, 1, rotary_dim/2]
        sin = sin_cache[p].to(torch.float32)[:, None, :]
        y = apply_rotary(y, cos, sin, interleaved=interleaved, rotary_offset=rotary_offset)
        out[t0 : t0 + step] = y.to(out_dtype)
    return out.reshape(b, s, d)
