"""Per-token prologue math shared by the Triton tiers (GQA's prologue kernel, the DSA split
kernel's fused decode prologue): RMSNorm + rotary of a token's heads in fp32, and the one
conversion (or int8 quantization) of a new K/V row to the cache dtype."""

from __future__ import annotations

import triton
import triton.language as tl

_RINT_MAGIC = tl.constexpr(
    12582912.0
)  # 1.5 * 2**23: (x + M) - M rounds |x| < 2**22 half-to-even in fp32


@triton.jit
def norm_rope_heads(
    row_ptr,  # token's first channel of head 0
    offs_h,  # [BLOCK_H] head indices
    num_heads,
    w_ptr,  # norm weight [HEAD]
    cos_ptr,
    sin_ptr,
    pos,  # rotary position (int64 scalar)
    stride_cos,
    stride_sin,
    eps,
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    ROT_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """``[BLOCK_H, HEAD_PAD]`` fp32: RMSNorm (optional) then rotary (optional) of the heads."""
    offs_d = tl.arange(0, HEAD_PAD)  # [HEAD_PAD]
    mask_d = offs_d < HEAD
    mask = (offs_h < num_heads)[:, None] & mask_d[None, :]  # [BLOCK_H, HEAD_PAD]
    base = row_ptr + offs_h.to(tl.int64)[:, None] * HEAD
    x = tl.load(base + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD + eps)  # [BLOCK_H]
        w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)  # [HEAD_PAD]
        x = x * inv_rms[:, None] * w[None, :]
    if HAS_ROTARY:
        # Channel j pairs with a partner; outside the rotary range cos = 1, sin = 0 pass through.
        HALF: tl.constexpr = ROT_DIM // 2
        in_rot = (offs_d < ROT_DIM) & mask_d
        if INTERLEAVED:
            first = (offs_d % 2) == 0
            partner = tl.where(first, offs_d + 1, offs_d - 1)
            c_idx = offs_d // 2
        else:
            first = offs_d < HALF
            partner = tl.where(first, offs_d + HALF, offs_d - HALF)
            c_idx = tl.where(first, offs_d, offs_d - HALF)
        partner = tl.where(in_rot, partner, offs_d)  # [HEAD_PAD]
        c_idx = tl.where(in_rot, c_idx, 0)
        xp = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            wp = tl.load(w_ptr + partner, mask=mask_d, other=0.0).to(tl.float32)
            xp = xp * inv_rms[:, None] * wp[None, :]
        cos = tl.load(cos_ptr + pos * stride_cos + c_idx, mask=in_rot, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * stride_sin + c_idx, mask=in_rot, other=0.0).to(tl.float32)
        sin = tl.where(first, -sin, sin)  # [HEAD_PAD]
        x = x * cos[None, :] + xp * sin[None, :]
    return x


@triton.jit
def to_cache(
    x,  # [BLOCK_H, HEAD_PAD] fp32
    scale_ptr,
    offs_h,  # [BLOCK_H] KV heads
    offs_d,  # [HEAD_PAD]
    stride_sc_h,
    stride_sc_d,
    mask,  # [BLOCK_H, HEAD_PAD]
    DTYPE: tl.constexpr,  # the cache's element type
    QUANT: tl.constexpr,
):
    """``x`` in the cache dtype: one rounding, or int8 quantization (``x / scale`` rounded to
    nearest-even, clamped to +-127)."""
    if QUANT:
        sc = tl.load(
            scale_ptr + offs_h[:, None] * stride_sc_h + offs_d[None, :] * stride_sc_d,
            mask=mask,
            other=1.0,
        )  # [BLOCK_H, HEAD_PAD] fp32
        y = tl.math.div_rn(x, sc)
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        y = ((y + _RINT_MAGIC) - _RINT_MAGIC).to(tl.int8)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def store_cache_rows(dst, x, scale_ptr, offs_h, offs_d, stride_sc_h, stride_sc_d, mask,
                     QUANT: tl.constexpr):  # fmt: skip
    """Store ``x [BLOCK_H, HEAD_PAD]`` fp32 at ``dst`` (pointers) converted by ``to_cache``."""
    y = to_cache(x, scale_ptr, offs_h, offs_d, stride_sc_h, stride_sc_d, mask,
                 dst.dtype.element_ty, QUANT)  # fmt: skip
    tl.store(dst, y, mask=mask)
