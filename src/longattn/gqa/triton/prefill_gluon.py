"""Warp-specialized GQA prefill for sm_90 in Gluon (triton.experimental.gluon).

Same math as ``prefill.gqa_prefill_kernel`` for the plain case (16-bit cache in the dot dtype,
no bias, no int8 / per-row Q scale), laid out the way FlashAttention-3 runs on Hopper:

- a work item is 128 query rows of one head; three partitions share a CTA: two consumer
  warpgroups (64 rows each: QK^T wgmma, softmax, PV wgmma with P from registers) and one
  producer warp that issues every TMA load (a work item's two Q tiles, then its K and V tiles
  into a ring of ``STAGES`` shared-memory slots guarded by ready / empty mbarriers). The
  consumers run independently, so the warp schedulers overlap one warpgroup's softmax with the
  other's GEMMs;
- persistent: CTA c takes work items c, c + G, ... (G = the grid size), heaviest causal row
  blocks first; the producer loads the next item's Q and K/V while the consumers finish the
  current one (a grid of one CTA per item is the non-persistent kernel);
- no tile reads a cache row at or past the sequence's length (those rows may hold NaN
  garbage; 0 * NaN would poison the PV product): the last tile of a range is shifted back to
  end at the range's end, and the columns it shares with the previous tile are masked (rows
  before 0 are zero-filled by TMA);
- the causal / window / duplicate-column mask is applied only on tiles that need it.

Measured and not kept (``benchmarks/results/prefill_gluon_ab{1,2,3}_h200.json``): FA3's
explicit intra-warpgroup overlap (softmax of tile j during PV of j-1; 2-9% slower) and
inter-warpgroup ping-pong (3-13% slower), per-CTA device-side descriptors bounded by the
sequence length (slower in 5 of 6 shapes), three consumer warpgroups with BLOCK_N 64 (-5 to
+2%), BLOCK_N 32 at H = 256 (-16 to -19%), 3 stages at H = 128 (0 to -9%).

Grid: (G,) with G <= cdiv(S, 128) * B * N. Gluon has no interpreter:
the kernel is checked on the GPU against the fp64 reference, and its sm_90 compile in CI
(``tests/test_sass.py``).
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

from ._core import (
    add_sink,
    load_total_len,
    new_row_span,
    normalize,
    prefill_key_range,
    softcap_log2,
)

ROWS_PER_WG = gl.constexpr(64)  # query rows per consumer warpgroup (wgmma M = 64, 4 warps)
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.constexpr_function
def _wgmma_layout(n):
    """Register layout of a 64-row wgmma result with n columns, one warpgroup (4 warps)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _work(w, n_bn, n_m, seqlens_ptr, max_total, seq_len, window,
          NUM_HEADS: gl.constexpr, BLOCK_N: gl.constexpr, IS_FIRST_PROMPT: gl.constexpr,
          HAS_WINDOW: gl.constexpr, HEAD_MAJOR: gl.constexpr):  # fmt: skip
    """Work item ``w`` as (b, n, m0, offset, rows_valid, kv_lo, kv_hi, n_tiles): rows
    [m0, m0 + 128) of head n of sequence b against keys [kv_lo, kv_hi), n_tiles tiles
    (n_bn = B * N, n_m = cdiv(S, 128)). Items go heaviest causal row block first: every (b, n)
    of the last row block, then the one before, ...; HEAD_MAJOR: every row block of (0, 0)
    heaviest first, then of (0, 1), ... (the launch order of the earlier 2-D grid: CTAs that
    run together share one head's K/V)."""
    if HEAD_MAJOR:
        pid_m = n_m - 1 - w % n_m
        pid_bn = w // n_m
    else:
        pid_m = n_m - 1 - w // n_bn
        pid_bn = w % n_bn
    b = pid_bn // NUM_HEADS
    n = pid_bn % NUM_HEADS
    total_len = load_total_len(seqlens_ptr, b, max_total)
    offset, rows_valid = new_row_span(total_len, seq_len, IS_FIRST_PROMPT)
    m0 = pid_m * (2 * ROWS_PER_WG)
    q_lo, q_hi, kv_lo, kv_hi = prefill_key_range(offset, rows_valid, total_len, m0, window,
                                                 2 * ROWS_PER_WG, HAS_WINDOW)  # fmt: skip
    n_tiles = gl.cdiv(kv_hi - kv_lo, BLOCK_N)
    return b, n, m0, offset, rows_valid, kv_lo, kv_hi, n_tiles


@gluon.jit
def _tile_start(j, kv_lo, kv_hi, n_tiles, BLOCK_N: gl.constexpr):
    """First key row of tile j; the last tile ends at kv_hi (it may start before 0: TMA
    zero-fills those rows)."""
    return gl.where(j == n_tiles - 1, kv_hi - BLOCK_N, kv_lo + j * BLOCK_N)


@gluon.jit
def _producer(
    q_desc, k_desc, v_desc, seqlens_ptr, max_total, seq_len, window, n_bn, n_m, q_smem, k_smem,
    v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty,
    NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, IS_FIRST_PROMPT: gl.constexpr, HAS_WINDOW: gl.constexpr,
    HEAD_MAJOR: gl.constexpr,
):  # fmt: skip
    """One warp: per work item, its two Q tiles (once both consumers released the previous
    item's), then K/V tile j into ring slot ``it % STAGES`` (``it`` counts tiles across
    items) once both consumers released the slot's previous tile."""
    tile_bytes: gl.constexpr = BLOCK_N * HEAD * k_smem.dtype.primitive_bitwidth // 8
    it = 0
    item = 0
    for w in range(gl.program_id(0), n_bn * n_m, gl.num_programs(0)):
        b, n, m0, offset, rows_valid, kv_lo, kv_hi, n_tiles = _work(
            w, n_bn, n_m, seqlens_ptr, max_total, seq_len, window, NUM_HEADS, BLOCK_N,
            IS_FIRST_PROMPT, HAS_WINDOW, HEAD_MAJOR)  # fmt: skip
        kvh = n // GROUP
        q_row = b * seq_len + m0
        mbarrier.wait(q_empty, (item & 1) ^ 1)  # a fresh barrier passes at once
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, n * HEAD], q_bar, q_smem.index(0))
        tma.async_copy_global_to_shared(q_desc, [q_row + ROWS_PER_WG, n * HEAD], q_bar,
                                        q_smem.index(1))  # fmt: skip
        for j in range(n_tiles):
            slot = it % STAGES
            phase = (it // STAGES) & 1
            mbarrier.wait(kv_empty.index(slot), phase ^ 1)
            start = _tile_start(j, kv_lo, kv_hi, n_tiles, BLOCK_N)
            mbarrier.expect(k_ready.index(slot), tile_bytes)
            mbarrier.expect(v_ready.index(slot), tile_bytes)
            k_dst = k_smem.index(slot).reshape([1, 1, BLOCK_N, HEAD])  # [BLOCK_N, HEAD] slot
            v_dst = v_smem.index(slot).reshape([1, 1, BLOCK_N, HEAD])
            tma.async_copy_global_to_shared(k_desc, [b, kvh, start, 0], k_ready.index(slot),
                                            k_dst)  # fmt: skip
            tma.async_copy_global_to_shared(v_desc, [b, kvh, start, 0], v_ready.index(slot),
                                            v_dst)  # fmt: skip
            it += 1
        item += 1


@gluon.jit
def _logits(qk, start, lo, qpos, r_lo, r_hi, window, qk_scale, softcap_mult, last,
            s_layout: gl.constexpr, BLOCK_N: gl.constexpr, HAS_WINDOW: gl.constexpr,
            HAS_SOFTCAP: gl.constexpr):  # fmt: skip
    """Masked logits of one tile as ``(s [64, BLOCK_N] fp32, unit)``; ``s * unit`` is the
    log2-domain logit (-inf where hidden). Keys ``< lo`` (the part of a shifted last tile that
    the previous tile covered) are hidden too. The mask is built only on the last tile, tiles
    crossing the diagonal of rows [r_lo, r_hi], and tiles below the window's edge."""
    if HAS_SOFTCAP:
        s = softcap_log2(qk, qk_scale, softcap_mult)
        unit = 1.0
    else:
        s = qk
        unit = qk_scale
    need = last | (start + BLOCK_N - 1 > r_lo)
    if HAS_WINDOW:
        need = need | (start <= r_hi - window)
    if need:
        offs_n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        cols = gl.expand_dims(offs_n, 0)  # [1, BLOCK_N]
        rows = gl.expand_dims(qpos, 1)  # [64, 1]
        mask = (cols <= rows) & (cols >= lo)
        if HAS_WINDOW:
            mask = mask & (cols > rows - window)
        s = gl.where(mask, s, float("-inf"))
    return s, unit


@gluon.jit
def _attend(
    it, q, qpos, r_lo, r_hi, kv_lo, kv_hi, n_tiles, window, qk_scale,
    softcap_mult, k_smem, v_smem, k_ready, v_ready, kv_empty,
    HEAD: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr, Q_IN_REGS: gl.constexpr,
):  # fmt: skip
    """Online softmax of one warpgroup's 64 rows over the item's n_tiles K/V tiles (ring
    slots from tile counter ``it``): returns (acc [64, HEAD] fp32, m [64], l [64], it).
    Q_IN_REGS: Q is the QK^T wgmma's register A operand (loaded once from its shared tile), so
    each tile's QK^T reads only K from shared memory."""
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)  # [64, BLOCK_N] logits
    o_layout: gl.constexpr = _wgmma_layout(HEAD)  # [64, HEAD] accumulator
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    acc = gl.zeros([ROWS_PER_WG, HEAD], gl.float32, layout=o_layout)  # [64, HEAD]
    m_i = gl.full([ROWS_PER_WG], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([ROWS_PER_WG], gl.float32, layout=row_s)
    s_zero = gl.zeros([ROWS_PER_WG, BLOCK_N], gl.float32, layout=s_layout)
    if Q_IN_REGS:
        q = q.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    for j in range(n_tiles):
        slot = it % STAGES
        phase = (it // STAGES) & 1
        start = _tile_start(j, kv_lo, kv_hi, n_tiles, BLOCK_N)
        mbarrier.wait(k_ready.index(slot), phase)
        qk = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)  # fmt: skip
        qk = warpgroup_mma_wait(0, deps=(qk,))  # [64, BLOCK_N] fp32
        s, unit = _logits(qk, start, kv_lo + j * BLOCK_N, qpos, r_lo, r_hi, window, qk_scale,
                          softcap_mult, j == n_tiles - 1, s_layout, BLOCK_N, HAS_WINDOW,
                          HAS_SOFTCAP)  # fmt: skip
        m_new = gl.maximum(m_i, gl.max(s, 1) * unit)  # [64]
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s * unit - gl.expand_dims(m_safe, 1))  # [64, BLOCK_N]: one FMA + exp2
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p_op = gl.convert_layout(p.to(k_smem.dtype), p_layout)  # registers: wgmma A operand
        mbarrier.wait(v_ready.index(slot), phase)
        acc = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(kv_empty.index(slot), count=1)
        it += 1
    return acc, m_i, l_i, it


@gluon.jit
def _consumer(
    WG: gl.constexpr, o_ptr, sink_ptr, stride_ob, stride_os, seqlens_ptr, max_total, seq_len,
    window, n_bn, n_m, qk_scale, softcap_mult, q_smem, k_smem, v_smem, q_bar, q_empty,
    k_ready, v_ready, kv_empty,
    NUM_HEADS: gl.constexpr, HEAD: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    IS_FIRST_PROMPT: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    HAS_SINK: gl.constexpr, SINK_FROM_PTR: gl.constexpr, HEAD_MAJOR: gl.constexpr,
    Q_IN_REGS: gl.constexpr,
):  # fmt: skip
    """Per work item, rows [m0 + 64 WG, m0 + 64 WG + 64): the online softmax over its K/V
    tiles, then the normalized rows to ``o_ptr`` (while the producer loads the next item)."""
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)  # [64, BLOCK_N] logits
    o_layout: gl.constexpr = _wgmma_layout(HEAD)  # [64, HEAD] accumulator
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    it = 0
    item = 0
    for w in range(gl.program_id(0), n_bn * n_m, gl.num_programs(0)):
        b, n, m0, offset, rows_valid, kv_lo, kv_hi, n_tiles = _work(
            w, n_bn, n_m, seqlens_ptr, max_total, seq_len, window, NUM_HEADS, BLOCK_N,
            IS_FIRST_PROMPT, HAS_WINDOW, HEAD_MAJOR)  # fmt: skip
        r0 = m0 + WG * ROWS_PER_WG
        qpos = offset + r0 + gl.arange(0, ROWS_PER_WG, layout=row_s)  # [64]
        mbarrier.wait(q_bar, item & 1)
        acc, m_i, l_i, it = _attend(
            it, q_smem.index(WG), qpos, offset + r0, offset + r0 + ROWS_PER_WG - 1, kv_lo,
            kv_hi, n_tiles, window, qk_scale, softcap_mult, k_smem, v_smem, k_ready, v_ready,
            kv_empty, HEAD, BLOCK_N, STAGES, HAS_WINDOW, HAS_SOFTCAP, Q_IN_REGS)  # fmt: skip
        mbarrier.arrive(q_empty, count=1)  # this warpgroup's Q tile is free
        m_i = gl.convert_layout(m_i, row_o)  # the accumulator's rows
        l_i = gl.convert_layout(l_i, row_o)
        if HAS_SINK:
            if SINK_FROM_PTR:
                sink2 = gl.load(sink_ptr + n).to(gl.float32) * LOG2E
            else:
                sink2 = 0.0
            acc, m_i, l_i = add_sink(acc, m_i, l_i, sink2)
        acc = normalize(acc, l_i)
        rows = r0 + gl.arange(0, ROWS_PER_WG, layout=row_o)  # [64] new-token index
        acc = gl.where(gl.expand_dims(rows < rows_valid, 1), acc, 0.0)  # padding rows -> 0
        cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = (
            o_ptr
            + b.to(gl.int64) * stride_ob
            + gl.expand_dims(rows.to(gl.int64) * stride_os, 1)
            + n * HEAD
            + gl.expand_dims(cols, 0)
        )
        gl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=gl.expand_dims(rows < seq_len, 1))
        item += 1


@gluon.jit
def gqa_prefill_gluon_kernel(
    q_desc,  # [B * S, N * HEAD] rotated Q (contiguous, dot dtype), block [64, HEAD]
    k_desc,  # [B, KV, C, HEAD] cache (dot dtype), block [1, 1, BLOCK_N, HEAD]
    v_desc,
    o_ptr,  # [B, S, N * HEAD] output (stride 1 along the last axis)
    seqlens_ptr,  # [B] int32, total_len - 1
    sink_ptr,  # [N]
    max_total,
    seq_len,
    window,
    n_bn,  # B * N
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
    CONSUMER_REGS: gl.constexpr,
    HEAD_MAJOR: gl.constexpr,  # work order (see _work)
    Q_IN_REGS: gl.constexpr,  # Q as the register A operand of QK^T (see _attend)
):
    n_m = gl.cdiv(seq_len, 2 * ROWS_PER_WG)
    dtype: gl.constexpr = q_desc.dtype
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS_PER_WG, HEAD], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=2)  # both consumers release the Q tiles
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # both consumers release a slot
    # fmt: off
    gl.warp_specialize(
        [
            (_consumer, (0, o_ptr, sink_ptr, stride_ob, stride_os, seqlens_ptr, max_total,
                         seq_len, window, n_bn, n_m, qk_scale, softcap_mult, q_smem, k_smem,
                         v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty, NUM_HEADS, HEAD,
                         BLOCK_N, STAGES, IS_FIRST_PROMPT, HAS_WINDOW, HAS_SOFTCAP, HAS_SINK,
                         SINK_FROM_PTR, HEAD_MAJOR, Q_IN_REGS)),
            (_consumer, (1, o_ptr, sink_ptr, stride_ob, stride_os, seqlens_ptr, max_total,
                         seq_len, window, n_bn, n_m, qk_scale, softcap_mult, q_smem, k_smem,
                         v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty, NUM_HEADS, HEAD,
                         BLOCK_N, STAGES, IS_FIRST_PROMPT, HAS_WINDOW, HAS_SOFTCAP, HAS_SINK,
                         SINK_FROM_PTR, HEAD_MAJOR, Q_IN_REGS)),
            (_producer, (q_desc, k_desc, v_desc, seqlens_ptr, max_total, seq_len, window, n_bn,
                         n_m, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                         kv_empty, NUM_HEADS, GROUP, HEAD, BLOCK_N, STAGES, IS_FIRST_PROMPT,
                         HAS_WINDOW, HEAD_MAJOR)),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )
    # fmt: on
