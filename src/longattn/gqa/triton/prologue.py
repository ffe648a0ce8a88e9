"""Triton GQA prologue: QK-norm + rotary of Q and the new K, and the K/V cache append, one pass.

Grid: (B * S, cdiv(N, BLOCK_H) + cdiv(KV, BLOCK_H)). A program of the first kind normalizes and
rotates BLOCK_H query heads of one token and writes them to the Q scratch buffer
``[B, S, N, HEAD]`` in the dot dtype; a program of the second kind does the same for BLOCK_H key
heads, writing them (and the matching value heads) into the caches at row ``qpos``, converted or
quantized to the cache dtype. All math is fp32 from the input values and fp32-read cos/sin; each
stored value is rounded exactly once.

int8 K caches: the K scale is folded into Q here (``q * k_scale[kv(head), d]`` before Q's one
rounding), so the attention kernels multiply Q by the stored integers, which the dot dtype
represents exactly: no dequantization rounding of K at all. With 16-bit activations
(``Q_POW2``) that dot dtype is fp16 whatever the activation dtype: each (token, head) row of Q
is multiplied by a power of two that puts its largest magnitude in ``[2**14, 2**15)`` before
its one rounding to fp16 (11 significant bits, never overflowing, and no underflow of a small
``q * k_scale``), and the inverse power of two goes to ``qs [B, S, N]`` fp32, which the
attention kernels apply to the row's fp32 dot products (exact). The int8 keys then reach the
fp16 tensor cores through an xor and one fp16 subtract (``_triton_utils.int8_to_fp16``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..._triton_prologue import norm_rope_heads, pow2_rows, store_cache_rows
from ..._triton_utils import next_pow2, wait_prior_grids


@triton.jit
def prologue_program(
    tok,  # token index b * S + s
    pid_h,  # head block: < cdiv(N, BLOCK_H) query heads, then key/value heads
    q_ptr,  # [B, S, N*HEAD] (or the Q part of packed QKV)
    k_ptr,  # [B, S, KV*HEAD] (strided view)
    v_ptr,
    qn_w_ptr,
    kn_w_ptr,
    cos_ptr,  # [max_pos, ROT_DIM / 2], last dim contiguous
    sin_ptr,
    pos_ptr,  # [B, S] int64
    seqlens_ptr,  # [B] int32
    qout_ptr,  # [B, S, N, HEAD] dot dtype
    kc_ptr,  # [B, KV, C, HEAD] cache
    vc_ptr,
    ks_ptr,  # fp32 k_scale, [1] or [KV, 1, HEAD]
    vs_ptr,
    qs_ptr,  # [B, S, N] fp32 out (Q_POW2): 2**-p of each row scaled by 2**p
    seq_len,
    max_pos,
    cache_len,
    stride_qb,
    stride_qs,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    stride_qob,
    stride_qos,
    stride_kcb,
    stride_kch,
    stride_kcc,
    stride_vcb,
    stride_vch,
    stride_vcc,
    stride_ks_h,
    stride_ks_d,
    stride_vs_h,
    stride_vs_d,
    stride_pb,
    stride_ps,
    stride_cos,
    stride_sin,
    eps,
    NUM_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROT_DIM: tl.constexpr,
    HAS_ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_QNORM: tl.constexpr,
    HAS_KNORM: tl.constexpr,
    IS_FIRST_PROMPT: tl.constexpr,
    K_QUANT: tl.constexpr,
    V_QUANT: tl.constexpr,
    Q_POW2: tl.constexpr,  # scale each Q row by a power of two (fp16 Q for an int8 K cache)
):
    """One program of the prologue grid (see the module docstring): token ``tok``, head block
    ``pid_h``. ``gqa_prologue_kernel`` runs its grid; the sparse layer's select kernel hosts
    the same programs beside its own (``sparse.triton.layer``)."""
    b = (tok // seq_len).to(tl.int64)
    s = (tok % seq_len).to(tl.int64)
    total_len = tl.load(seqlens_ptr + b).to(tl.int64) + 1
    if IS_FIRST_PROMPT:
        qpos = s
    else:
        qpos = total_len - seq_len + s
    if HAS_POS:
        pos = tl.load(pos_ptr + b * stride_pb + s * stride_ps).to(tl.int64)
    else:
        pos = qpos
    # Out-of-range positions are rejected on the host in eager mode; clamp so a bad id can never
    # read outside the rotary cache (e.g. under CUDA-graph capture).
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)

    offs_d = tl.arange(0, HEAD_PAD)  # [HEAD_PAD]
    mask_d = offs_d < HEAD
    nqb = tl.cdiv(NUM_HEADS, BLOCK_H)
    if pid_h < nqb:
        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] query heads
        mask = (offs_h < NUM_HEADS)[:, None] & mask_d[None, :]  # [BLOCK_H, HEAD_PAD]
        x = norm_rope_heads(
            q_ptr + b * stride_qb + s * stride_qs, offs_h, NUM_HEADS, qn_w_ptr, cos_ptr,
            sin_ptr, pos, stride_cos, stride_sin, eps, HEAD=HEAD, HEAD_PAD=HEAD_PAD, ROT_DIM=ROT_DIM,
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
            x, unscale = pow2_rows(x)
            qs_dst = qs_ptr + (b * seq_len + s) * NUM_HEADS + offs_h  # [BLOCK_H]
            tl.store(qs_dst, unscale, mask=offs_h < NUM_HEADS)
        dst = qout_ptr + b * stride_qob + s * stride_qos + offs_h[:, None] * HEAD + offs_d[None, :]
        tl.store(dst, x.to(qout_ptr.dtype.element_ty), mask=mask)
    else:
        offs_h = (pid_h - nqb) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] kv heads
        write = (qpos >= 0) & (qpos < cache_len)
        if IS_FIRST_PROMPT:
            write = write & (s < total_len)  # right padding is not written
        mask = (offs_h < KV_HEADS)[:, None] & mask_d[None, :] & write  # [BLOCK_H, HEAD_PAD]
        row = offs_h.to(tl.int64)[:, None]
        k = norm_rope_heads(
            k_ptr + b * stride_kb + s * stride_ks, offs_h, KV_HEADS, kn_w_ptr, cos_ptr,
            sin_ptr, pos, stride_cos, stride_sin, eps, HEAD=HEAD, HEAD_PAD=HEAD_PAD, ROT_DIM=ROT_DIM,
            HAS_NORM=HAS_KNORM, HAS_ROTARY=HAS_ROTARY, INTERLEAVED=INTERLEAVED,
        )  # fmt: skip
        k_dst = kc_ptr + b * stride_kcb + row * stride_kch + qpos * stride_kcc + offs_d[None, :]
        store_cache_rows(
            k_dst, k, ks_ptr, offs_h, offs_d, stride_ks_h, stride_ks_d, mask, QUANT=K_QUANT
        )
        v_src = v_ptr + b * stride_vb + s * stride_vs + row * HEAD + offs_d[None, :]
        v = tl.load(v_src, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, HEAD_PAD]
        v_dst = vc_ptr + b * stride_vcb + row * stride_vch + qpos * stride_vcc + offs_d[None, :]
        store_cache_rows(
            v_dst, v, vs_ptr, offs_h, offs_d, stride_vs_h, stride_vs_d, mask, QUANT=V_QUANT
        )


@triton.jit
def gqa_prologue_kernel(
    q_ptr, k_ptr, v_ptr, qn_w_ptr, kn_w_ptr, cos_ptr, sin_ptr, pos_ptr, seqlens_ptr, qout_ptr,
    kc_ptr, vc_ptr, ks_ptr, vs_ptr, qs_ptr, seq_len, max_pos, cache_len, stride_qb, stride_qs,
    stride_kb, stride_ks, stride_vb, stride_vs, stride_qob, stride_qos, stride_kcb, stride_kch,
    stride_kcc, stride_vcb, stride_vch, stride_vcc, stride_ks_h, stride_ks_d, stride_vs_h,
    stride_vs_d, stride_pb, stride_ps, stride_cos, stride_sin, eps,
    NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr, BLOCK_H: tl.constexpr, ROT_DIM: tl.constexpr,
    HAS_ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_QNORM: tl.constexpr, HAS_KNORM: tl.constexpr, IS_FIRST_PROMPT: tl.constexpr,
    K_QUANT: tl.constexpr, V_QUANT: tl.constexpr, Q_POW2: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):  # fmt: skip
    """Grid ``(B * S, cdiv(N, BLOCK_H) + cdiv(KV, BLOCK_H))`` of ``prologue_program`` (its
    arguments, documented there)."""
    wait_prior_grids(PDL)  # first: the previous grid's writes are visible
    prologue_program(
        tl.program_id(0), tl.program_id(1), q_ptr, k_ptr, v_ptr, qn_w_ptr, kn_w_ptr, cos_ptr,
        sin_ptr, pos_ptr, seqlens_ptr, qout_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, qs_ptr, seq_len,
        max_pos, cache_len, stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs,
        stride_qob, stride_qos, stride_kcb, stride_kch, stride_kcc, stride_vcb, stride_vch,
        stride_vcc, stride_ks_h, stride_ks_d, stride_vs_h, stride_vs_d, stride_pb, stride_ps,
        stride_cos, stride_sin, eps, NUM_HEADS, KV_HEADS, GROUP, HEAD, HEAD_PAD, BLOCK_H,
        ROT_DIM, HAS_ROTARY, INTERLEAVED, HAS_POS, HAS_QNORM, HAS_KNORM, IS_FIRST_PROMPT,
        K_QUANT, V_QUANT, Q_POW2,
    )  # fmt: skip


def prologue_block_heads(num_heads: int, kv_heads: int, head: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps): about 2K elements per program."""
    head_pad = next_pow2(head)
    block_h = max(1, min(next_pow2(max(num_heads, kv_heads)), 2048 // head_pad))
    return block_h, 4 if block_h * head_pad <= 2048 else 8
