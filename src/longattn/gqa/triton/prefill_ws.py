"""Warp-specialized Triton prefill kernel of GQA (sm_90, prototype; not measured yet).

Same math as ``prefill.gqa_prefill_kernel`` for the plain case (16-bit cache in the dot dtype,
no bias, no int8), shaped the way triton 3.6's Hopper warp specialization accepts a loop
(``benchmarks/probe_hopper_ws.py``): ONE tile loop, 4 warps (one consumer warpgroup; the
compiler adds the TMA producer), ``BLOCK_M`` 64, every operand through TMA:

- Q rows ``[BLOCK_M, HEAD]`` and the output through host descriptors (rows past S: zero-filled
  on load, clipped on store);
- K/V tiles through device-side descriptors built per program with the sequence's valid length
  as their row count, so TMA zero-fills the cache rows past it (they may hold NaN garbage): no
  tile needs masked pointer loads, and the causal / window mask is applied on every tile (a
  runtime ``if`` inside the loop stops the specialization).

Grid: (cdiv(S, BLOCK_M), B * N), longest causal tiles first.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._core import load_total_len, normalize, softcap_log2


@triton.jit
def _ws_tile(acc, m_i, l_i, q, k_desc, v_desc, start_n, qpos, window, qk_scale, softcap_mult,
             BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):  # fmt: skip
    """One K/V tile (TMA) with the causal / window mask applied (every tile: no branch)."""
    k = k_desc.load([start_n, 0])  # [BLOCK_N, HEAD]
    v = v_desc.load([start_n, 0])  # [BLOCK_N, HEAD]
    qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] fp32
    offs_n = start_n + tl.arange(0, BLOCK_N)
    mask = offs_n[None, :] <= qpos[:, None]  # causal; rows past total_len: zeroed by row_ok
    if HAS_WINDOW:
        mask = mask & (offs_n[None, :] > qpos[:, None] - window)
    if HAS_SOFTCAP:
        s = tl.where(mask, softcap_log2(qk, qk_scale, softcap_mult), float("-inf"))
        unit = 1.0
    else:
        s = tl.where(mask, qk, float("-inf"))
        unit = qk_scale
    m_new = tl.maximum(m_i, tl.max(s, 1) * unit)  # [BLOCK_M]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s * unit - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def gqa_prefill_ws_kernel(
    q_desc,  # [B, S, N, HEAD] rotated Q (dot dtype), block [1, BLOCK_M, 1, HEAD]
    k_ptr,  # [B, KV, C, HEAD] cache (dot dtype)
    v_ptr,
    o_desc,  # [B, S, N * HEAD] output, block [1, BLOCK_M, HEAD]
    seqlens_ptr,  # [B] int32, total_len - 1
    sink_ptr,  # [N]
    max_total,
    seq_len,
    window,
    stride_kb,
    stride_kh,
    stride_kc,
    stride_vb,
    stride_vh,
    stride_vc,
    qk_scale,  # scale * log2(e), or scale / softcap with softcap
    softcap_mult,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FIRST_PROMPT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINK: tl.constexpr,
    SINK_FROM_PTR: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bn = tl.program_id(1)
    b = pid_bn // NUM_HEADS
    n = pid_bn % NUM_HEADS
    kvh = n // GROUP
    b64 = b.to(tl.int64)
    total_len = load_total_len(seqlens_ptr, b, max_total)
    if IS_FIRST_PROMPT:
        offset = 0
        rows_valid = tl.minimum(seq_len, total_len)
    else:
        offset = total_len - seq_len
        rows_valid = seq_len
    m0 = pid_m * BLOCK_M
    offs_s = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_ok = offs_s < rows_valid
    qpos = offs_s + offset  # [BLOCK_M]
    live = m0 < rows_valid
    q_lo = offset + m0
    q_hi = offset + tl.minimum(m0 + BLOCK_M, rows_valid) - 1
    kv_hi = tl.where(live, tl.minimum(q_hi + 1, total_len), 0)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.minimum(tl.maximum(q_lo - window + 1, 0), kv_hi)

    # per-program descriptors: rows >= total_len read as zeros (no cache garbage enters)
    k_desc = tl.make_tensor_descriptor(
        k_ptr + b64 * stride_kb + kvh.to(tl.int64) * stride_kh,
        shape=[total_len, HEAD], strides=[stride_kc, 1], block_shape=[BLOCK_N, HEAD],
    )  # fmt: skip
    v_desc = tl.make_tensor_descriptor(
        v_ptr + b64 * stride_vb + kvh.to(tl.int64) * stride_vh,
        shape=[total_len, HEAD], strides=[stride_vc, 1], block_shape=[BLOCK_N, HEAD],
    )  # fmt: skip
    q = q_desc.load([b, m0, n, 0]).reshape(BLOCK_M, HEAD)  # [BLOCK_M, HEAD]

    acc = tl.zeros([BLOCK_M, HEAD], dtype=tl.float32)  # [BLOCK_M, HEAD]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if INTERPRET:  # numpy-2 interpreter: no tensor bounds in range()
        start_n = kv_lo
        while start_n < kv_hi:
            acc, m_i, l_i = _ws_tile(acc, m_i, l_i, q, k_desc, v_desc, start_n, qpos, window,
                                     qk_scale, softcap_mult, BLOCK_N, HAS_WINDOW, HAS_SOFTCAP)  # fmt: skip
            start_n += BLOCK_N
    else:
        for start_n in tl.range(kv_lo, kv_hi, BLOCK_N, warp_specialize=WARP_SPEC):
            acc, m_i, l_i = _ws_tile(acc, m_i, l_i, q, k_desc, v_desc, start_n, qpos, window,
                                     qk_scale, softcap_mult, BLOCK_N, HAS_WINDOW, HAS_SOFTCAP)  # fmt: skip
    if HAS_SINK:
        if SINK_FROM_PTR:
            sink2 = tl.load(sink_ptr + n).to(tl.float32) * 1.4426950408889634
        else:
            sink2 = 0.0
        m_f = tl.maximum(m_i, sink2)
        alpha = tl.exp2(m_i - m_f)
        l_i = l_i * alpha + tl.exp2(sink2 - m_f)
        acc = acc * alpha[:, None]
    acc = normalize(acc, l_i)
    acc = tl.where(row_ok[:, None], acc, 0.0)  # padding rows -> zeros
    o_desc.store([b, m0, n * HEAD], acc.to(o_desc.dtype).reshape(1, BLOCK_M, HEAD))
