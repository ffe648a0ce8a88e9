"""Triton RMSNormRotary: one pass over x (read once, write once), fp32 math in registers.

Grid: (tokens, cdiv(num_heads, BLOCK_N)). Each program normalizes BLOCK_N heads of one token and
rotates them, working on rotary pairs (a_i, b_i): the two halves (split layout) or the even/odd
channels (interleaved), plus the pass-through channels of a partial rotary. Every element of x is
read once and written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_utils import cdiv, next_pow2, pdl_kwargs, wait_prior_grids


@triton.jit
def _table_row(ptrs, mask, BLOCK_N: tl.constexpr, HALF_PAD: tl.constexpr, TILE: tl.constexpr):
    """fp32 values of a [HALF_PAD] row of pointers: [BLOCK_N, HALF_PAD] (TILE) or [1, HALF_PAD]."""
    if TILE:  # the same row for every head
        p2 = tl.broadcast_to(ptrs[None, :], (BLOCK_N, HALF_PAD))
        r = tl.load(p2, mask=tl.broadcast_to(mask[None, :], (BLOCK_N, HALF_PAD)), other=0.0)
    else:
        r = tl.load(ptrs, mask=mask, other=0.0)[None, :]
    return r.to(tl.float32)


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
    HALF_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROT_OFF: tl.constexpr,
    ROT_DIM: tl.constexpr,
    IS_PARTIAL: tl.constexpr,
    HAS_POS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    EXACT: tl.constexpr,
    TILE_TABLES: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    wait_prior_grids(PDL)  # first: the previous grid's writes are visible
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
    mask_n = (offs_n < NUM_HEADS)[:, None]  # [BLOCK_N, 1]
    row = offs_n.to(tl.int64)[:, None] * HEAD  # [BLOCK_N, 1]
    x_row = x_ptr + b * stride_xb + s * stride_xs + row
    o_row = out_ptr + b * stride_ob + s * stride_os + row

    # Work in pair space: rotary pair i couples channels (a_i, b_i); the other channels
    # (partial rotary) pass through. Every channel of x is loaded exactly once.
    HALF: tl.constexpr = ROT_DIM // 2
    offs_i = tl.arange(0, HALF_PAD)  # [HALF_PAD]
    mask_i = offs_i < HALF
    if INTERLEAVED:
        ch_a = ROT_OFF + 2 * offs_i
        ch_b = ch_a + 1
    else:
        ch_a = ROT_OFF + offs_i
        ch_b = ch_a + HALF
    mask_p = mask_n & mask_i[None, :]  # [BLOCK_N, HALF_PAD]
    xa = tl.load(x_row + ch_a[None, :], mask=mask_p, other=0.0).to(tl.float32)
    xb = tl.load(x_row + ch_b[None, :], mask=mask_p, other=0.0).to(tl.float32)
    # Weight and cos/sin rows, issued before the x-dependent reduction. TILE_TABLES: read as full
    # [BLOCK_N, HALF_PAD] tiles (repeats hit L1) that share x's register layout; else as 1-D rows
    # (their own layout, moved into x's through shared memory).
    wa = _table_row(w_ptr + ch_a, mask_i, BLOCK_N, HALF_PAD, TILE_TABLES)  # [BLOCK_N | 1, HALF_PAD]
    wb = _table_row(w_ptr + ch_b, mask_i, BLOCK_N, HALF_PAD, TILE_TABLES)
    cos = _table_row(cos_ptr + pos * stride_cos + offs_i, mask_i, BLOCK_N, HALF_PAD, TILE_TABLES)
    sin = _table_row(sin_ptr + pos * stride_sin + offs_i, mask_i, BLOCK_N, HALF_PAD, TILE_TABLES)
    sumsq = tl.sum(xa * xa, axis=1) + tl.sum(xb * xb, axis=1)  # [BLOCK_N]
    if IS_PARTIAL:
        offs_h = tl.arange(0, HEAD_PAD)  # [HEAD_PAD]
        is_pass = (offs_h < ROT_OFF) | ((offs_h >= ROT_OFF + ROT_DIM) & (offs_h < HEAD))
        mask_h = mask_n & is_pass[None, :]  # [BLOCK_N, HEAD_PAD]
        xp = tl.load(x_row + offs_h[None, :], mask=mask_h, other=0.0).to(tl.float32)
        sumsq += tl.sum(xp * xp, axis=1)
    inv_rms = tl.rsqrt(sumsq / HEAD + eps)[:, None]  # [BLOCK_N, 1]

    ya = xa * inv_rms * wa  # [BLOCK_N, HALF_PAD]
    yb = xb * inv_rms * wb
    if not EXACT:  # legacy: the normalized value is rounded to x's dtype before the rotation
        ya = ya.to(x_ptr.dtype.element_ty).to(tl.float32)
        yb = yb.to(x_ptr.dtype.element_ty).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(o_row + ch_a[None, :], (ya * cos - yb * sin).to(out_ty), mask=mask_p)
    tl.store(o_row + ch_b[None, :], (yb * cos + ya * sin).to(out_ty), mask=mask_p)
    if IS_PARTIAL:
        wp = tl.load(w_ptr + offs_h, mask=is_pass, other=0.0).to(tl.float32)[None, :]
        tl.store(o_row + offs_h[None, :], (xp * inv_rms * wp).to(out_ty), mask=mask_h)


def _launch_config(num_heads: int, head: int) -> tuple[int, int, bool]:
    """(BLOCK_N, num_warps, TILE_TABLES) from the H200 sweeps (benchmarks/results/
    rms_norm_rotary.md, kernel launched directly, [1, 16384, N x H] bf16 -> fp16):

    - H <= 128: 1K-element tiles on 2 warps, 1-D table rows (32x128: BLOCK_N=8/2 warps 71.6 us
      = 90% of copy bandwidth; with tiled table rows 102.7 us);
    - H >= 256: 2K-element tiles on 2 warps, tiled table rows (16x256: 8/2 73.3 us = 91%; with
      1-D rows the best was 8/8 at 104.8 us).
    Run-to-run spread is up to ~20%: re-sweep when the kernel changes.
    """
    head_pad = next_pow2(head)
    heads_pad = next_pow2(num_heads)
    if head_pad <= 128:
        return max(1, min(heads_pad, 1024 // head_pad)), 2, False
    return max(1, min(heads_pad, 2048 // head_pad)), 2, True


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
    tile_tables: bool | None = None,
) -> torch.Tensor:
    """x [B, S, N*H] (last dim contiguous) -> new [B, S, N*H] tensor in out_dtype."""
    b, s, d = x.shape
    head = d // num_heads
    out = torch.empty((b, s, d), dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    cfg_n, cfg_w, cfg_t = _launch_config(num_heads, head)
    block_n = block_n or cfg_n
    num_warps = num_warps or cfg_w
    tile_tables = cfg_t if tile_tables is None else tile_tables
    pos = position_ids if position_ids is not None else x  # dummy pointer when HAS_POS is False
    grid = (b * s, cdiv(num_heads, block_n))
    _rms_norm_rotary_kernel[grid](
        **pdl_kwargs(x),
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
        HEAD_PAD=next_pow2(head),
        HALF_PAD=next_pow2(cos_cache.shape[1]),
        BLOCK_N=block_n,
        ROT_OFF=rotary_offset,
        ROT_DIM=2 * cos_cache.shape[1],
        IS_PARTIAL=rotary_offset != 0 or 2 * cos_cache.shape[1] != head,
        HAS_POS=position_ids is not None,
        INTERLEAVED=interleaved,
        EXACT=exact,
        TILE_TABLES=tile_tables,
        num_warps=num_warps,
    )
    return out
