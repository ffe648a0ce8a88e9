"""Warp-specialized GQA prefill for sm_90 in Gluon (triton.experimental.gluon), prototype.

Same math as ``prefill.gqa_prefill_kernel`` for the plain case (16-bit cache in the dot dtype,
no bias, no int8 / per-row Q scale), laid out the way FlashAttention-3 runs on Hopper:

- one CTA owns ``2 * 64`` query rows of one head; three partitions share it:
  two consumer warpgroups (64 rows each: QK^T wgmma, softmax, PV wgmma with P from registers)
  and one producer warp that issues every TMA load (Q once, then K and V tiles into a ring of
  ``STAGES`` shared-memory slots guarded by ready / empty mbarriers);
- K/V descriptors are built on the device per CTA with the sequence's valid length as their row
  count, so TMA zero-fills the cache rows past it (they may hold NaN garbage); the causal /
  window mask is applied only on tiles that need it (a runtime branch is fine here: nothing
  depends on the compiler's loop analysis);
- ``OVERLAP``: the softmax of tile j runs while the PV wgmma of tile j-1 is still in flight
  (FA3's intra-warpgroup overlap): QK^T(j) is issued, then PV(j-1), then only QK^T(j) is
  waited for.
- ``PINGPONG`` (with OVERLAP): the two warpgroups take turns issuing their GEMM blocks
  (two mbarriers), so one warpgroup's softmax runs while the other's GEMMs hold the tensor
  cores (FA3's inter-warpgroup schedule).

Grid: (cdiv(S, 128), B * N), longest causal tiles first. Not interpreter-runnable (Gluon has
no interpreter): correctness is checked on the GPU against the fp64 reference.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

ROWS_PER_WG = gl.constexpr(64)  # query rows per consumer warpgroup (wgmma M = 64 with 4 warps)
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _softcap_log2(qk, qk_scale, softcap_mult):
    """``softcap_mult * tanh(qk * qk_scale)`` (log2 domain), as ``_core.softcap_log2``."""
    e = gl.exp2(qk * (qk_scale * 2.8853900817779268))
    return softcap_mult - (2.0 * softcap_mult) / (e + 1.0)


@gluon.jit
def _producer(
    q_desc, k_base, v_base, total_len, stride_kc, stride_vc, q_row, q_col, kv_lo, n_tiles,
    q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
    HEAD: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """One warp: Q (both halves) once, then K/V tile j into slot j % STAGES when both
    consumers released it."""
    kv_rows = gl.maximum(total_len, 1)
    k_desc = tma.make_tensor_descriptor(k_base, shape=[kv_rows, HEAD], strides=[stride_kc, 1],
                                        block_shape=[BLOCK_N, HEAD], layout=k_smem.layout)  # fmt: skip
    v_desc = tma.make_tensor_descriptor(v_base, shape=[kv_rows, HEAD], strides=[stride_vc, 1],
                                        block_shape=[BLOCK_N, HEAD], layout=v_smem.layout)  # fmt: skip
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + ROWS_PER_WG, q_col], q_bar, q_smem.index(1))
    tile_bytes: gl.constexpr = BLOCK_N * HEAD * k_smem.dtype.primitive_bitwidth // 8
    for j in range(n_tiles):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(kv_empty.index(slot), phase ^ 1)  # fresh barrier: passes at once
        start = kv_lo + j * BLOCK_N
        mbarrier.expect(k_ready.index(slot), tile_bytes)
        tma.async_copy_global_to_shared(k_desc, [start, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.expect(v_ready.index(slot), tile_bytes)
        tma.async_copy_global_to_shared(v_desc, [start, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _logits(qk, start, qpos, r_lo, r_hi, window, qk_scale, softcap_mult,
            s_layout: gl.constexpr, BLOCK_N: gl.constexpr, HAS_WINDOW: gl.constexpr,
            HAS_SOFTCAP: gl.constexpr):  # fmt: skip
    """Masked logits of one tile as ``(s [64, BLOCK_N] fp32, unit)``; ``s * unit`` is the
    log2-domain logit (-inf where hidden). The mask is computed only when the tile crosses the
    diagonal of rows [r_lo, r_hi] or the window's lower edge."""
    if HAS_SOFTCAP:
        s = _softcap_log2(qk, qk_scale, softcap_mult)
        unit = 1.0
    else:
        s = qk
        unit = qk_scale
    need = start + BLOCK_N - 1 > r_lo
    if HAS_WINDOW:
        need = need | (start <= r_hi - window)
    if need:
        offs_n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        mask = gl.expand_dims(offs_n, 0) <= gl.expand_dims(qpos, 1)
        if HAS_WINDOW:
            mask = mask & (gl.expand_dims(offs_n, 0) > gl.expand_dims(qpos, 1) - window)
        s = gl.where(mask, s, float("-inf"))
    return s, unit


@gluon.jit
def _softmax_step(s, unit, m_i, l_i):
    """New running max / sum and the tile's probabilities: returns (p, alpha, m_new, l_new)."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * unit)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s * unit - gl.expand_dims(m_safe, 1))
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _turn_wait(turn, it, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait until it is this warpgroup's turn to issue its ``it``-th GEMM block
    (warpgroup 0 goes first; the two alternate)."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), (it & 1) ^ (1 - WG))


@gluon.jit
def _turn_pass(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: hand the tensor cores to the other warpgroup once our GEMMs are issued."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _consumer(
    WG: gl.constexpr, o_ptr, sink_ptr, stride_ob, stride_os, b, n, m0, offset, rows_valid,
    seq_len, kv_lo, n_tiles, window, qk_scale, softcap_mult,
    q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn,
    HEAD: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_SINK: gl.constexpr,
    SINK_FROM_PTR: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
):  # fmt: skip
    """Rows [m0 + 64 WG, m0 + 64 WG + 64) of the CTA's tile: online softmax over every K/V
    tile the producer delivers, then the normalized rows to ``o_ptr``."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = k_smem.dtype

    r0 = m0 + WG * ROWS_PER_WG
    qpos = offset + r0 + gl.arange(0, ROWS_PER_WG, layout=row_s)  # [64]
    r_lo = offset + r0
    r_hi = offset + r0 + ROWS_PER_WG - 1
    q = q_smem.index(WG)  # [64, HEAD] shared
    acc = gl.zeros([ROWS_PER_WG, HEAD], gl.float32, layout=o_layout)  # [64, HEAD]
    m_i = gl.full([ROWS_PER_WG], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([ROWS_PER_WG], gl.float32, layout=row_s)
    s_zero = gl.zeros([ROWS_PER_WG, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)

    if OVERLAP:
        if n_tiles > 0:
            mbarrier.wait(k_ready.index(0), 0)
            _turn_wait(turn, 0, WG, PINGPONG)
            qk = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)  # fmt: skip
            _turn_pass(turn, WG, PINGPONG)
            qk = warpgroup_mma_wait(0, deps=(qk,))
            s, unit = _logits(qk, kv_lo, qpos, r_lo, r_hi, window, qk_scale, softcap_mult,
                              s_layout, BLOCK_N, HAS_WINDOW, HAS_SOFTCAP)  # fmt: skip
            p, alpha, m_i, l_i = _softmax_step(s, unit, m_i, l_i)
            for j in range(1, n_tiles):
                slot = j % STAGES
                phase = (j // STAGES) & 1
                prev = (j - 1) % STAGES
                p_op = gl.convert_layout(p.to(dtype), p_layout)  # [64, BLOCK_N] of tile j-1
                mbarrier.wait(k_ready.index(slot), phase)
                mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
                _turn_wait(turn, j, WG, PINGPONG)
                qk = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                                   is_async=True)  # fmt: skip
                acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
                _turn_pass(turn, WG, PINGPONG)
                qk = warpgroup_mma_wait(1, deps=(qk,))  # QK^T(j) done; PV(j-1) may still run
                s, unit = _logits(qk, kv_lo + j * BLOCK_N, qpos, r_lo, r_hi, window, qk_scale,
                                  softcap_mult, s_layout, BLOCK_N, HAS_WINDOW, HAS_SOFTCAP)  # fmt: skip
                p, alpha, m_i, l_i = _softmax_step(s, unit, m_i, l_i)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(kv_empty.index(prev), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            last = (n_tiles - 1) % STAGES
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
            _turn_wait(turn, n_tiles, WG, PINGPONG)
            acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
            _turn_pass(turn, WG, PINGPONG)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(kv_empty.index(last), count=1)
    else:
        for j in range(n_tiles):
            slot = j % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            qk = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)  # fmt: skip
            qk = warpgroup_mma_wait(0, deps=(qk,))
            s, unit = _logits(qk, kv_lo + j * BLOCK_N, qpos, r_lo, r_hi, window, qk_scale,
                              softcap_mult, s_layout, BLOCK_N, HAS_WINDOW, HAS_SOFTCAP)  # fmt: skip
            p, alpha, m_i, l_i = _softmax_step(s, unit, m_i, l_i)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.wait(v_ready.index(slot), phase)
            acc = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(kv_empty.index(slot), count=1)

    if HAS_SINK:
        if SINK_FROM_PTR:
            sink2 = gl.load(sink_ptr + n).to(gl.float32) * LOG2E
        else:
            sink2 = 0.0
        m_f = gl.maximum(m_i, sink2)
        alpha = gl.exp2(m_i - m_f)
        l_i = l_i * alpha + gl.exp2(sink2 - m_f)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    inv = gl.where(l_i > 0.0, 1.0 / gl.where(l_i > 0.0, l_i, 1.0), 0.0)  # [64]
    acc = acc * gl.expand_dims(gl.convert_layout(inv, row_o), 1)
    rows = r0 + gl.arange(0, ROWS_PER_WG, layout=row_o)  # [64] new-token index
    acc = gl.where(gl.expand_dims(rows < rows_valid, 1), acc, 0.0)  # padding rows -> zeros
    cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = (
        o_ptr
        + b.to(gl.int64) * stride_ob
        + gl.expand_dims(rows.to(gl.int64) * stride_os, 1)
        + n * HEAD
        + gl.expand_dims(cols, 0)
    )
    gl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=gl.expand_dims(rows < seq_len, 1))


@gluon.jit
def gqa_prefill_gluon_kernel(
    q_desc,  # [B * S, N * HEAD] rotated Q (contiguous, dot dtype), block [64, HEAD]
    k_ptr,  # [B, KV, C, HEAD] cache (dot dtype)
    v_ptr,
    o_ptr,  # [B, S, N * HEAD] output (stride 1 along the last axis)
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
    stride_ob,
    stride_os,
    qk_scale,  # scale * log2(e), or scale / softcap with softcap
    softcap_mult,
    NUM_HEADS: gl.constexpr,
    GROUP: gl.constexpr,
    HEAD: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    IS_FIRST_PROMPT: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr,
    HAS_SINK: gl.constexpr,
    SINK_FROM_PTR: gl.constexpr,
    OVERLAP: gl.constexpr,
    PINGPONG: gl.constexpr,  # the two warpgroups alternate GEMM issue (needs OVERLAP)
    CONSUMER_REGS: gl.constexpr,
):
    BLOCK_M: gl.constexpr = 2 * ROWS_PER_WG
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # longest causal tiles first
    pid_bn = gl.program_id(1)
    b = pid_bn // NUM_HEADS
    n = pid_bn % NUM_HEADS
    kvh = n // GROUP
    t = gl.load(seqlens_ptr + b) + 1
    total_len = gl.minimum(gl.maximum(t, 0), max_total)
    if IS_FIRST_PROMPT:
        offset = 0
        rows_valid = gl.minimum(seq_len, total_len)  # rows >= total_len are right padding
    else:
        offset = total_len - seq_len
        rows_valid = seq_len
    m0 = pid_m * BLOCK_M
    q_lo = offset + m0
    q_hi = offset + gl.minimum(m0 + BLOCK_M, rows_valid) - 1
    kv_hi = gl.where(m0 < rows_valid, gl.minimum(q_hi + 1, total_len), 0)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = gl.maximum(q_lo - window + 1, 0)
    kv_lo = gl.minimum(kv_lo, kv_hi)
    n_tiles = gl.cdiv(kv_hi - kv_lo, BLOCK_N)

    dtype: gl.constexpr = q_desc.dtype
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS_PER_WG, HEAD], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # both consumer warpgroups release a slot

    k_base = k_ptr + b.to(gl.int64) * stride_kb + kvh.to(gl.int64) * stride_kh
    v_base = v_ptr + b.to(gl.int64) * stride_vb + kvh.to(gl.int64) * stride_vh
    q_row = b * seq_len + m0
    # fmt: off
    gl.warp_specialize(
        [
            (_consumer, (0, o_ptr, sink_ptr, stride_ob, stride_os, b, n, m0, offset, rows_valid,
                         seq_len, kv_lo, n_tiles, window, qk_scale, softcap_mult, q_smem, k_smem,
                         v_smem, q_bar, k_ready, v_ready, kv_empty, turn, HEAD, BLOCK_N, STAGES,
                         HAS_WINDOW, HAS_SOFTCAP, HAS_SINK, SINK_FROM_PTR, OVERLAP,
                         PINGPONG and OVERLAP)),
            (_consumer, (1, o_ptr, sink_ptr, stride_ob, stride_os, b, n, m0, offset, rows_valid,
                         seq_len, kv_lo, n_tiles, window, qk_scale, softcap_mult, q_smem, k_smem,
                         v_smem, q_bar, k_ready, v_ready, kv_empty, turn, HEAD, BLOCK_N, STAGES,
                         HAS_WINDOW, HAS_SOFTCAP, HAS_SINK, SINK_FROM_PTR, OVERLAP,
                         PINGPONG and OVERLAP)),
            (_producer, (q_desc, k_base, v_base, total_len, stride_kc, stride_vc, q_row,
                         n * HEAD, kv_lo, n_tiles, q_smem, k_smem, v_smem, q_bar, k_ready,
                         v_ready, kv_empty, HEAD, BLOCK_N, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )
    # fmt: on
