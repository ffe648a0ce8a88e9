"""Triton paged prologue: QK-norm + rotary of Q and the new K, and the append of the new K/V into
the paged caches, one pass (the GQA prologue's pieces, addressed through the block table).

Grid: (tokens, cdiv(N, BLOCK_H) + cdiv(KV, BLOCK_H)). Token ``t`` belongs to the sequence ``b``
with ``cu[b] <= t < cu[b + 1]`` (found in-kernel), at position ``pos = past[b] + t - cu[b]``. A
program of the first kind writes BLOCK_H rotated query heads to the Q scratch ``[tokens, N, H]``
(dot dtype; with an int8 K cache ``k_scale`` is folded into Q before its one rounding, as in the
GQA tier). A program of the second kind writes BLOCK_H key heads and the matching value heads to
block ``block_table[b, pos // BLOCK_SIZE]``, row ``pos % BLOCK_SIZE``, converted or quantized
once; only that slot is written, and only when the table entry is a block in ``[0, num_blocks)``.

int8 K cache with 16-bit activations (``Q_POW2``): the Q scratch is fp16 and each (token, head)
row of the folded Q is multiplied by the power of two that puts its largest magnitude in
``[2**14, 2**15)`` before its one rounding (``pow2_rows``: 11 significant bits, no overflow, and
no fp16 subnormals from a small ``q * k_scale``); the inverse factors go to ``qs [tokens, N]``
fp32, which the attention kernel applies to the rows' fp32 dot products (exact).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..._triton_prologue import norm_rope_heads, pow2_rows, store_cache_rows
from ..._triton_utils import wait_prior_grids
from ._schedule import pick, sequence_of_token


@triton.jit
def paged_prologue_kernel(
    q_ptr,  # [tokens, N*HEAD] (rows strided: a packed query's Q part)
    k_ptr,  # [tokens, KV*HEAD]
    v_ptr,
    qn_w_ptr,
    kn_w_ptr,
    cos_ptr,  # [max_pos, ROT_DIM / 2]
    sin_ptr,
    cu_ptr,  # [B + 1] int32
    past_ptr,  # [B] int32
    table_ptr,  # [B, max_blocks] int32
    qout_ptr,  # [tokens, N, HEAD] dot dtype
    kc_ptr,  # [num_blocks, BLOCK_SIZE, KV, HEAD] cache
    vc_ptr,
    ks_ptr,  # fp32 k_scale [1] or [KV, 1, HEAD]
    vs_ptr,
    qs_ptr,  # [tokens, N] fp32 out (Q_POW2): the inverse power of two of each Q row
    batch,
    max_blocks,
    num_blocks,
    max_pos,
    stride_q,
    stride_k,
    stride_v,
    stride_table,
    stride_ks_h,
    stride_ks_d,
    stride_vs_h,
    stride_vs_d,
    stride_cos,
    stride_sin,
    eps,
    NUM_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    B_PAD: tl.constexpr,
    ROT_DIM: tl.constexpr,
    HAS_ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_QNORM: tl.constexpr,
    HAS_KNORM: tl.constexpr,
    K_QUANT: tl.constexpr,
    V_QUANT: tl.constexpr,
    Q_POW2: tl.constexpr,  # scale each Q row by a power of two (fp16 Q for an int8 K cache)
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    wait_prior_grids(PDL)  # first: the previous grid's writes are visible
    t = tl.program_id(0).to(tl.int64)
    offs_b = tl.arange(0, B_PAD)  # [B_PAD]
    b = sequence_of_token(cu_ptr, t, batch, B_PAD)
    in_batch = b < batch
    b = tl.minimum(b, batch - 1)
    cu0 = pick(tl.load(cu_ptr + offs_b, mask=offs_b < batch, other=0), offs_b, b)
    past = tl.load(past_ptr + b)
    pos = (past + t - cu0).to(tl.int64)  # the token's position in its sequence
    # Bad data is rejected on the host in eager mode; clamp so nothing reads outside cos/sin.
    rot_pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)

    offs_d = tl.arange(0, HEAD_PAD)  # [HEAD_PAD]
    mask_d = offs_d < HEAD
    nqb = tl.cdiv(NUM_HEADS, BLOCK_H)
    pid_h = tl.program_id(1)
    if pid_h < nqb:
        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] query heads
        mask = (offs_h < NUM_HEADS)[:, None] & mask_d[None, :]  # [BLOCK_H, HEAD_PAD]
        x = norm_rope_heads(
            q_ptr + t * stride_q, offs_h, NUM_HEADS, qn_w_ptr, cos_ptr, sin_ptr, rot_pos,
            stride_cos, stride_sin, eps, HEAD=HEAD, HEAD_PAD=HEAD_PAD, ROT_DIM=ROT_DIM,
            HAS_NORM=HAS_QNORM, HAS_ROTARY=HAS_ROTARY, INTERLEAVED=INTERLEAVED,
        )  # fmt: skip
        if K_QUANT:
            ks = tl.load(
                ks_ptr + (offs_h // GROUP)[:, None] * stride_ks_h + offs_d[None, :] * stride_ks_d,
                mask=mask,
                other=0.0,
            )  # [BLOCK_H, HEAD_PAD]
            x = x * ks
        if Q_POW2:
            x, unscale = pow2_rows(x)  # [BLOCK_H, HEAD_PAD], [BLOCK_H]
            qs_dst = qs_ptr + t * NUM_HEADS + offs_h  # [BLOCK_H]
            tl.store(qs_dst, unscale, mask=offs_h < NUM_HEADS)
        dst = qout_ptr + (t * NUM_HEADS + offs_h.to(tl.int64))[:, None] * HEAD + offs_d[None, :]
        tl.store(dst, x.to(qout_ptr.dtype.element_ty), mask=mask)
    else:
        offs_h = (pid_h - nqb) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] kv heads
        col = pos // BLOCK_SIZE
        col_ok = in_batch & (pos >= 0) & (col < max_blocks)
        blk = tl.load(table_ptr + b.to(tl.int64) * stride_table + col, mask=col_ok, other=-1)
        write = col_ok & (blk >= 0) & (blk < num_blocks)
        slot = tl.where(write, blk, 0).to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        mask = (offs_h < KV_HEADS)[:, None] & mask_d[None, :] & write  # [BLOCK_H, HEAD_PAD]
        row = slot * (KV_HEADS * HEAD) + offs_h.to(tl.int64)[:, None] * HEAD  # [BLOCK_H, 1]
        k = norm_rope_heads(
            k_ptr + t * stride_k, offs_h, KV_HEADS, kn_w_ptr, cos_ptr, sin_ptr, rot_pos,
            stride_cos, stride_sin, eps, HEAD=HEAD, HEAD_PAD=HEAD_PAD, ROT_DIM=ROT_DIM,
            HAS_NORM=HAS_KNORM, HAS_ROTARY=HAS_ROTARY, INTERLEAVED=INTERLEAVED,
        )  # fmt: skip
        store_cache_rows(
            kc_ptr + row + offs_d[None, :], k, ks_ptr, offs_h, offs_d, stride_ks_h, stride_ks_d,
            mask, QUANT=K_QUANT,
        )  # fmt: skip
        v_src = v_ptr + t * stride_v + offs_h.to(tl.int64)[:, None] * HEAD + offs_d[None, :]
        v = tl.load(v_src, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, HEAD_PAD]
        store_cache_rows(
            vc_ptr + row + offs_d[None, :], v, vs_ptr, offs_h, offs_d, stride_vs_h, stride_vs_d,
            mask, QUANT=V_QUANT,
        )  # fmt: skip
