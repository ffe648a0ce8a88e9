"""Triton RMSNormRotary: one pass over x (read once, write once), fp32 math in registers.

Grid: (tokens, cdiv(num_heads, BLOCK_N)). Each program normalizes BLOCK_N heads of one token and
rotates them. The rotary partner of each channel is read with a second, gathered load of the same
row (it hits L1; DRAM traffic stays one read of x).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_rotary_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    out_ptr,
    seq_len,
    max_pos,
    stride_xb,
    stride_xs,
    stride_ob,
    stride_os,
    stride_cos,
    stride_sin,
    stride_pb,
    stride_ps,
    eps,
    NUM_HEADS: tl.constexpr,
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROT_OFF: tl.constexpr,
    ROT_DIM: tl.constexpr,
    HAS_POS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    EXACT: tl.constexpr,
):
    tok = tl.program_id(0)
    b = (tok // seq_len).to(tl.int64)
    s = (tok % seq_len).to(tl.int64)
    if HAS_POS:
        pos = tl.load(pos_ptr + b * stride_pb + s * stride_ps).to(tl.int64)
    else:
        pos = s
    # Out-of-range positions are rejected on the host in eager mode; clamp so a bad id can never
    # read outside the cache (e.g. under CUDA-graph capture, where the host check is skipped).
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)

    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_h = tl.arange(0, HEAD_PAD)  # [HEAD_PAD]
    mask_h = offs_h < HEAD
    mask = (offs_n < NUM_HEADS)[:, None] & mask_h[None, :]  # [BLOCK_N, HEAD_PAD]
    row = offs_n.to(tl.int64)[:, None] * HEAD  # [BLOCK_N, 1]
    x_row = x_ptr + b * stride_xb + s * stride_xs

    x = tl.load(x_row + row + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD + eps)  # [BLOCK_N]
    w = tl.load(w_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)  # [HEAD_PAD]
    y = x * inv_rms[:, None] * w[None, :]  # [BLOCK_N, HEAD_PAD]
    if not EXACT:
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)

    # Rotary: channel j (relative to ROT_OFF) pairs with its partner; outside the rotary range
    # cos = 1 and sin = 0 make the formula a pass-through.
    HALF: tl.constexpr = ROT_DIM // 2
    j = offs_h - ROT_OFF  # [HEAD_PAD]
    in_rot = (j >= 0) & (j < ROT_DIM) & mask_h
    if INTERLEAVED:
        first = (j % 2) == 0
        partner = tl.where(first, j + 1, j - 1)
        c_idx = j // 2
    else:
        first = j < HALF
        partner = tl.where(first, j + HALF, j - HALF)
        c_idx = tl.where(first, j, j - HALF)
    partner_h = tl.where(in_rot, partner + ROT_OFF, offs_h)  # [HEAD_PAD]
    c_idx = tl.where(in_rot, c_idx, 0)
    xp = tl.load(x_row + row + partner_h[None, :], mask=mask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner_h, mask=mask_h, other=0.0).to(tl.float32)
    yp = xp * inv_rms[:, None] * wp[None, :]  # [BLOCK_N, HEAD_PAD]
    if not EXACT:
        yp = yp.to(x_ptr.dtype.element_ty).to(tl.float32)
    cos = tl.load(cos_ptr + pos * stride_cos + c_idx, mask=in_rot, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + c_idx, mask=in_rot, other=0.0).to(tl.float32)
    sin = tl.where(first, -sin, sin)  # [HEAD_PAD]
    out = y * cos[None, :] + yp * sin[None, :]  # [BLOCK_N, HEAD_PAD]

    o_row = out_ptr + b * stride_ob + s * stride_os
    tl.store(o_row + row + offs_h[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_config(num_heads: int, head: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps): about 2K elements per program, at least 4 warps' worth of work."""
    head_pad = triton.next_power_of_2(head)
    block_n = max(1, min(triton.next_power_of_2(num_heads), 2048 // head_pad))
    num_warps = 4 if block_n * head_pad <= 2048 else 8
    return block_n, num_warps


def rms_norm_rotary_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    position_ids: torch.Tensor | None,
    *,
    num_heads: int,
    epsilon: float,
    interleaved: bool,
    rotary_offset: int,
    exact: bool,
    out_dtype: torch.dtype,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """x [B, S, N*H] (last dim contiguous) -> new [B, S, N*H] tensor in out_dtype."""
    b, s, d = x.shape
    head = d // num_heads
    out = torch.empty((b, s, d), dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    cfg_n, cfg_w = _launch_config(num_heads, head)
    block_n = block_n or cfg_n
    num_warps = num_warps or cfg_w
    pos = position_ids if position_ids is not None else x  # dummy pointer when HAS_POS is False
    grid = (b * s, triton.cdiv(num_heads, block_n))
    _rms_norm_rotary_kernel[grid](
        x_ptr=x,
        w_ptr=weight,
        cos_ptr=cos_cache,
        sin_ptr=sin_cache,
        pos_ptr=pos,
        out_ptr=out,
        seq_len=s,
        max_pos=cos_cache.shape[0],
        stride_xb=x.stride(0),
        stride_xs=x.stride(1),
        stride_ob=out.stride(0),
        stride_os=out.stride(1),
        stride_cos=cos_cache.stride(0),
        stride_sin=sin_cache.stride(0),
        stride_pb=position_ids.stride(0) if position_ids is not None else 0,
        stride_ps=position_ids.stride(1) if position_ids is not None else 0,
        eps=epsilon,
        NUM_HEADS=num_heads,
        HEAD=head,
        HEAD_PAD=triton.next_power_of_2(head),
        BLOCK_N=block_n,
        ROT_OFF=rotary_offset,
        ROT_DIM=2 * cos_cache.shape[1],
        HAS_POS=position_ids is not None,
        INTERLEAVED=interleaved,
        EXACT=exact,
        num_warps=num_warps,
    )
    return out
