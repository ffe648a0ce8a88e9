"""Triton prefill flash-attention kernel of GQA (S > 1, first or subsequent prompt).

Grid: (cdiv(S, BLOCK_M), B * N). One program owns BLOCK_M query rows of one head; K/V come from
the cache (past rows plus the new rows the prologue just wrote), read tile by tile. The key range
of a tile is computed from its first/last query position, so fully masked KV blocks are never
loaded; the range splits into a masked lead-in (window edge), an unmasked middle and a masked
tail (diagonal / sequence end), each one call of ``_attend_range``.

On sm_90+ with 16-bit caches (``USE_DESC``, chosen by ``launch.prefill_use_tma``) the unmasked
middle reads K/V through TMA tensor descriptors (one bulk copy per tile instead of per-thread
cp.async copies and their address math); the masked ranges keep masked pointer loads, because a
TMA tile would also read cache rows past the sequence (up to the capacity), which may hold NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._core import (
    causal_window_mask,
    load_kv_tile,
    load_row_scale,
    load_total_len,
    new_row_span,
    normalize,
    online_softmax_step,
    prefill_key_range,
    scores,
)


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    q,  # [BLOCK_M, HEAD] dot dtype
    qpos,  # [BLOCK_M] int32
    k_base,
    v_base,
    bias_base,  # this (b, n)'s bias origin; element (s, j) at s * stride_s + j * stride_t
    in_s,  # [BLOCK_M] bool: rows inside S
    offs_s,  # [BLOCK_M] int32 new-token index of each row (bias row)
    start_n,
    kv_hi,
    window,
    stride_kc,
    stride_vc,
    stride_bias_s,
    stride_bias_t,
    qk_scale,
    row_scale,  # [BLOCK_M, 1] fp32 (power-of-two Q scale) or 1.0
    softcap_mult,
    HEAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    USE_DESC: tl.constexpr,
    k_desc,
    v_desc,
    kv_b,
    kv_h,
):
    """One KV tile [start_n, start_n + BLOCK_N) folded into the running softmax state.

    ``USE_DESC``: unmasked tiles are read by TMA through ``k_desc`` / ``v_desc`` (descriptors of
    the ``[B, KV, C, HEAD]`` caches; (kv_b, kv_h) = the tile's sequence and KV head); masked
    tiles keep the masked pointer loads (TMA would read the rows >= kv_hi, which may hold NaN
    garbage, up to the capacity)."""
    offs_d = tl.arange(0, HEAD)  # [HEAD]
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    if USE_DESC and not MASKED:
        k = k_desc.load([kv_b, kv_h, start_n, 0]).reshape(BLOCK_N, HEAD)  # [BLOCK_N, HEAD]
    else:
        k = load_kv_tile(
            k_base, start_n, offs_d, stride_kc, kv_hi, BLOCK_N, DOT_DTYPE, MASKED, True
        )
    bias = 0.0
    if HAS_BIAS:
        b_ptrs = (
            bias_base
            + offs_s.to(tl.int64)[:, None] * stride_bias_s
            + offs_n.to(tl.int64)[None, :] * stride_bias_t
        )
        b_mask = in_s[:, None] & (offs_n < kv_hi)[None, :]
        bias = tl.load(b_ptrs, mask=b_mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_N]
    s, unit = scores(q, k, qk_scale, row_scale, softcap_mult, bias, HAS_SOFTCAP, HAS_BIAS, DOT_PREC)
    if MASKED:
        mask = causal_window_mask(qpos, offs_n, kv_hi, window, HAS_WINDOW)
        s = tl.where(mask, s, float("-inf"))  # [BLOCK_M, BLOCK_N]
    if USE_DESC and not MASKED:
        v = v_desc.load([kv_b, kv_h, start_n, 0]).reshape(BLOCK_N, HEAD)  # [BLOCK_N, HEAD]
    else:
        v = load_kv_tile(
            v_base, start_n, offs_d, stride_vc, kv_hi, BLOCK_N, DOT_DTYPE, MASKED, False
        )
    return online_softmax_step(acc, m_i, l_i, s, unit, v, DOT_PREC)


@triton.jit
def _attend_range(
    acc, m_i, l_i, q, qpos, k_base, v_base, bias_base, in_s, offs_s, start, end, kv_hi, window,
    stride_kc, stride_vc, stride_bias_s, stride_bias_t, qk_scale, row_scale, softcap_mult,
    HEAD: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr, USE_DESC: tl.constexpr, k_desc, v_desc,
    kv_b, kv_h,
):  # fmt: skip
    """KV tiles start, start + BLOCK_N, ... < end. The interpreter (numpy 2) cannot take tensor
    bounds in ``range``, so it runs the same body in a while loop; compiled code keeps the
    pipelined for loop."""
    if INTERPRET:
        start_n = start
        while start_n < end:
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, q, qpos, k_base, v_base, bias_base, in_s, offs_s, start_n, kv_hi,
                window, stride_kc, stride_vc, stride_bias_s, stride_bias_t, qk_scale,
                row_scale, softcap_mult, HEAD, BLOCK_N, MASKED, HAS_WINDOW, HAS_SOFTCAP,
                HAS_BIAS, DOT_DTYPE, DOT_PREC, USE_DESC, k_desc, v_desc, kv_b, kv_h,
            )  # fmt: skip
            start_n += BLOCK_N
    else:
        for start_n in range(start, end, BLOCK_N):
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, q, qpos, k_base, v_base, bias_base, in_s, offs_s, start_n, kv_hi,
                window, stride_kc, stride_vc, stride_bias_s, stride_bias_t, qk_scale,
                row_scale, softcap_mult, HEAD, BLOCK_N, MASKED, HAS_WINDOW, HAS_SOFTCAP,
                HAS_BIAS, DOT_DTYPE, DOT_PREC, USE_DESC, k_desc, v_desc, kv_b, kv_h,
            )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def gqa_prefill_kernel(
    q_ptr,  # [B, S, N, HEAD] rotated Q in the dot dtype
    k_ptr,  # [B, KV, C, HEAD] cache
    v_ptr,
    k_desc,  # TMA descriptors of the two caches (USE_DESC; else unused)
    v_desc,
    o_ptr,  # [B, S, N * HEAD] activation dtype
    seqlens_ptr,  # [B] int32, total_len - 1
    max_total,  # T: total lengths are clamped to it (the caches hold >= T rows)
    bias_ptr,  # [B|1, N|1, S, T] (strides 0 on broadcast dims)
    sink_ptr,  # [N]
    vs_ptr,  # v_scale: [1] or [KV, 1, HEAD] fp32
    qs_ptr,  # [B, S, N] fp32 power-of-two factor of each Q row (HAS_QSCALE)
    seq_len,
    window,
    stride_qb,
    stride_qs,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kc,
    stride_vb,
    stride_vh,
    stride_vc,
    stride_ob,
    stride_os,
    stride_bias_b,
    stride_bias_n,
    stride_bias_s,
    stride_bias_t,
    stride_vs_h,
    stride_vs_d,
    qk_scale,
    softcap_mult,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FIRST_PROMPT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SINK: tl.constexpr,  # a sink logit joins the denominator
    SINK_FROM_PTR: tl.constexpr,  # head_sink[n]; else 0 (smooth_softmax)
    HAS_VSCALE: tl.constexpr,
    HAS_QSCALE: tl.constexpr,  # Q rows carry a power-of-two scale (qs_ptr): int8 K in fp16
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    INTERPRET: tl.constexpr,  # run loops as while loops (see _attend_range)
    USE_DESC: tl.constexpr,  # unmasked K/V tiles by TMA (k_desc / v_desc)
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest causal tiles first
    pid_bn = tl.program_id(1)
    b = pid_bn // NUM_HEADS
    n = pid_bn % NUM_HEADS
    kvh = n // GROUP
    b64 = b.to(tl.int64)
    total_len = load_total_len(seqlens_ptr, b, max_total)
    offset, rows_valid = new_row_span(total_len, seq_len, IS_FIRST_PROMPT)

    m0 = pid_m * BLOCK_M
    offs_s = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] new-token index
    offs_d = tl.arange(0, HEAD)  # [HEAD]
    in_s = offs_s < seq_len
    row_ok = offs_s < rows_valid
    qpos = offs_s + offset  # [BLOCK_M]
    o_ptrs = (
        o_ptr
        + b64 * stride_ob
        + offs_s.to(tl.int64)[:, None] * stride_os
        + n * HEAD
        + offs_d[None, :]
    )

    acc = tl.zeros([BLOCK_M, HEAD], dtype=tl.float32)  # [BLOCK_M, HEAD]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    if m0 < rows_valid:
        q_ptrs = (
            q_ptr
            + b64 * stride_qb
            + offs_s.to(tl.int64)[:, None] * stride_qs
            + n * stride_qn
            + offs_d[None, :]
        )
        q = tl.load(q_ptrs, mask=in_s[:, None], other=0.0)  # [BLOCK_M, HEAD]
        row_scale = load_row_scale(qs_ptr, b64, seq_len, offs_s, n, in_s, NUM_HEADS, HAS_QSCALE)
        q_lo, q_hi, kv_lo, kv_hi = prefill_key_range(offset, rows_valid, total_len, m0, window,
                                                     BLOCK_M, HAS_WINDOW)  # fmt: skip
        # Unmasked middle: blocks fully visible to every row of the tile.
        full_lo = kv_lo
        if HAS_WINDOW:
            lead = tl.maximum(q_hi - window + 1 - kv_lo, 0)
            full_lo = tl.minimum(kv_lo + tl.cdiv(lead, BLOCK_N) * BLOCK_N, kv_hi)
        full_end = tl.minimum(q_lo + 1, total_len)
        n_full = tl.maximum(full_end - full_lo, 0) // BLOCK_N
        full_hi = full_lo + n_full * BLOCK_N

        k_base = k_ptr + b64 * stride_kb + kvh.to(tl.int64) * stride_kh
        v_base = v_ptr + b64 * stride_vb + kvh.to(tl.int64) * stride_vh
        bias_base = bias_ptr
        if HAS_BIAS:
            bias_base = bias_ptr + b64 * stride_bias_b + n.to(tl.int64) * stride_bias_n
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, qpos, k_base, v_base, bias_base, in_s, offs_s, kv_lo, full_lo,
            kv_hi, window, stride_kc, stride_vc, stride_bias_s, stride_bias_t, qk_scale,
            row_scale, softcap_mult, HEAD=HEAD, BLOCK_N=BLOCK_N, MASKED=True, INTERPRET=INTERPRET,
            HAS_WINDOW=HAS_WINDOW, HAS_SOFTCAP=HAS_SOFTCAP, HAS_BIAS=HAS_BIAS, DOT_DTYPE=DOT_DTYPE, DOT_PREC=DOT_PREC,
            USE_DESC=USE_DESC, k_desc=k_desc, v_desc=v_desc, kv_b=b, kv_h=kvh,
        )  # fmt: skip
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, qpos, k_base, v_base, bias_base, in_s, offs_s, full_lo, full_hi,
            kv_hi, window, stride_kc, stride_vc, stride_bias_s, stride_bias_t, qk_scale,
            row_scale, softcap_mult, HEAD=HEAD, BLOCK_N=BLOCK_N, MASKED=False, INTERPRET=INTERPRET,
            HAS_WINDOW=HAS_WINDOW, HAS_SOFTCAP=HAS_SOFTCAP, HAS_BIAS=HAS_BIAS, DOT_DTYPE=DOT_DTYPE, DOT_PREC=DOT_PREC,
            USE_DESC=USE_DESC, k_desc=k_desc, v_desc=v_desc, kv_b=b, kv_h=kvh,
        )  # fmt: skip
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, qpos, k_base, v_base, bias_base, in_s, offs_s, full_hi, kv_hi,
            kv_hi, window, stride_kc, stride_vc, stride_bias_s, stride_bias_t, qk_scale,
            row_scale, softcap_mult, HEAD=HEAD, BLOCK_N=BLOCK_N, MASKED=True, INTERPRET=INTERPRET,
            HAS_WINDOW=HAS_WINDOW, HAS_SOFTCAP=HAS_SOFTCAP, HAS_BIAS=HAS_BIAS, DOT_DTYPE=DOT_DTYPE, DOT_PREC=DOT_PREC,
            USE_DESC=USE_DESC, k_desc=k_desc, v_desc=v_desc, kv_b=b, kv_h=kvh,
        )  # fmt: skip
        if HAS_SINK:
            if SINK_FROM_PTR:
                sink2 = tl.load(sink_ptr + n).to(tl.float32) * 1.4426950408889634
            else:
                sink2 = 0.0
            m_f = tl.maximum(m_i, sink2)  # [BLOCK_M], finite
            alpha = tl.exp2(m_i - m_f)
            l_i = l_i * alpha + tl.exp2(sink2 - m_f)
            acc = acc * alpha[:, None]
        acc = normalize(acc, l_i)
        if HAS_VSCALE:
            vs = tl.load(vs_ptr + kvh * stride_vs_h + offs_d * stride_vs_d)  # [HEAD] fp32
            acc = acc * vs[None, :]
        acc = tl.where(row_ok[:, None], acc, 0.0)  # padding rows -> zeros
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=in_s[:, None])


def prefill_config(head: int, dot_dtype, interpret: bool, extra_bytes_per_stage: int = 0) -> dict:
    """Launch parameters keyed on (head size, dot dtype); Hopper-tuned, tiny for the interpreter.

    Measured on the H200 (benchmarks/results/gqa.md, causal bf16 S = 8K): H=128 (128, 128, 8
    warps, 3 stages) 454 TFLOP/s, H=256 (128, 64, 8 warps, 2 stages) 474 TFLOP/s. The stage
    count is lowered while the pipelined tiles (K + V + ``extra_bytes_per_stage``, e.g. a bias
    tile) would not fit the 227 KiB of shared memory (Triton allocates Q + stages x tiles; 2 KiB
    stay free for the TMA path's barriers)."""
    if interpret:
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if dot_dtype.itemsize == 4:
        cfg = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    elif head <= 128:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
    q_bytes = cfg["BLOCK_M"] * head * dot_dtype.itemsize
    stage = 2 * cfg["BLOCK_N"] * head * dot_dtype.itemsize + extra_bytes_per_stage
    while cfg["num_stages"] > 1 and q_bytes + cfg["num_stages"] * stage > 232448 - 2048:
        cfg["num_stages"] -= 1
    return cfg
