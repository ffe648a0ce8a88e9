"""Triton paged attention: one kernel for varlen prefill and split-K decode, plus the merge.

``paged_attn_kernel`` grid: (items bound, KV). A program takes one item of the launch's schedule
(``_schedule.schedule``: sequence ``b``, query tile, key split) for one KV head, and packs every
query row of that tile that reads the KV head into one ``[ROWS, HEAD]`` tile: row ``r`` is new
token ``qblock * TOK_M + r // GROUP`` of the sequence, query head ``kvh * GROUP + r % GROUP``.
Each K/V byte a tile needs is read once per KV group. The decode launch uses ROWS = 16 (a single
tile per decode sequence, key range split over many programs); the prefill launch uses the GQA
prefill tile height (128 rows).

K/V tiles are read straight from the paged caches: key position ``j`` lives in block
``block_table[b, j // BLOCK_SIZE]`` at row ``j % BLOCK_SIZE`` (BLOCK_SIZE a power of two). The
block entries of the next tile are loaded one iteration ahead (a software prefetch of the
indirection), and clamped into ``[0, num_blocks)`` so a bad table can never read out of bounds.
The key range of a tile is computed from its first/last query position (causal bottom-right, the
window) and splits into a masked lead-in, an unmasked middle and a masked tail, as in the GQA
prefill kernel.

An item of an unsplit sequence finishes its rows (sink, ``1 / l``, ``v_scale``, one rounding)
directly into the output; an item of a split sequence writes fp32 partials (normalized ``o`` and
its log2-domain ``lse``) that ``paged_merge_kernel`` (grid: (split tiles bound, KV)) combines.

``HAS_QSCALE`` (int8 K cache, 16-bit activations): Q rows come power-of-two scaled in fp16 from
the prologue; each row's fp32 dot products are multiplied by its inverse factor (``qs``) before
softcap, mask and softmax (``_core.scores``' ``row_scale``), as in the GQA kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..._triton_utils import (
    cache_to_dot,
    int8_pairs_to_fp16,
    interleave_channels,
    wait_prior_grids,
)
from ...gqa.triton._core import (
    causal_window_mask,
    finish_rows,
    load_row_scale,
    normalize,
    online_softmax_pairs,
    online_softmax_step,
    scores,
    softmax_state,
)
from ._schedule import pick, schedule


@triton.jit
def tile_blocks(table_row, offs_n, max_blocks, num_blocks, BLOCK_SIZE: tl.constexpr):
    """``[BLOCK_N]`` int64 physical blocks of key positions ``offs_n`` (clamped, never OOB)."""
    col = offs_n // BLOCK_SIZE
    blk = tl.load(table_row + col, mask=(col < max_blocks) & (offs_n >= 0), other=0)
    return tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)


@triton.jit
def next_blocks(table_row, start_n, max_blocks, num_blocks, BLOCK_N: tl.constexpr,
                BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """Block entries of the tile at ``start_n``: one scalar when a tile lies inside one block
    (BLOCK_SIZE >= BLOCK_N; tiles start on multiples of BLOCK_N), else ``[BLOCK_N]``."""
    if BLOCK_SIZE >= BLOCK_N:
        col = start_n // BLOCK_SIZE
        blk = tl.load(table_row + col, mask=col < max_blocks, other=0)
        return tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        return tile_blocks(table_row, offs_n, max_blocks, num_blocks, BLOCK_SIZE)


@triton.jit
def _tile_ptrs(cache_ptr, blk, start_n, head_off, stride_slot, BLOCK_N: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, COLS: tl.constexpr, WORD: tl.constexpr):  # fmt: skip
    """``[BLOCK_N, COLS]`` pointers to the tile's rows of one KV head read as ``WORD`` words
    (the cache's element type, or int16 channel pairs). Inside one block (BLOCK_SIZE >=
    BLOCK_N) the rows are affine: one scalar int64 origin and loop-invariant int32 offsets, as
    the GQA kernels' contiguous tiles; else one int64 slot per row."""
    STEP: tl.constexpr = WORD.primitive_bitwidth // cache_ptr.dtype.element_ty.primitive_bitwidth
    words = cache_ptr.to(tl.pointer_type(WORD))
    cols = tl.arange(0, COLS)  # [COLS]
    if BLOCK_SIZE >= BLOCK_N:
        first = (blk * BLOCK_SIZE + start_n % BLOCK_SIZE) * stride_slot + head_off  # int64
        rows = tl.arange(0, BLOCK_N) * (stride_slot // STEP)  # [BLOCK_N] int32
        ptrs = words + first // STEP + (rows[:, None] + cols[None, :])
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        slots = blk * BLOCK_SIZE + (offs_n % BLOCK_SIZE).to(tl.int64)  # [BLOCK_N] int64
        ptrs = words + ((slots * stride_slot + head_off) // STEP)[:, None] + cols[None, :]
    return ptrs  # [BLOCK_N, COLS]


@triton.jit
def load_paged_pairs(cache_ptr, blk, start_n, head_off, end, stride_slot, BLOCK_N: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, HEAD: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """A paged int8 V tile as two exact fp16 halves ``(even, odd)`` ``[BLOCK_N, HEAD // 2]``
    (channels ``2j`` / ``2j + 1``), read as int16 words (``_triton_utils.int8_pairs_to_fp16``;
    the host checks the cache's base alignment, and ``stride_slot`` / ``head_off`` are
    multiples of HEAD, which is even): GQA's ``V_PAIRS`` for ``online_softmax_pairs``."""
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    ptrs = _tile_ptrs(
        cache_ptr, blk, start_n, head_off, stride_slot, BLOCK_N, BLOCK_SIZE, HEAD // 2, tl.int16
    )  # [BLOCK_N, HEAD // 2] int16 words
    if MASKED:
        w = tl.load(ptrs, mask=(offs_n < end)[:, None], other=0)
    else:
        w = tl.load(ptrs)
    return int8_pairs_to_fp16(w)  # [BLOCK_N, HEAD // 2] x 2


@triton.jit
def load_paged_tile(
    cache_ptr,  # [num_blocks, BLOCK_SIZE, KV, HEAD]
    blk,  # int64 physical block(s): scalar (BLOCK_SIZE >= BLOCK_N) or [BLOCK_N]
    start_n,  # first key position of the tile (a multiple of BLOCK_N)
    offs_d,  # [HEAD]
    head_off,  # kvh * HEAD
    end,  # keys >= end are not read
    stride_slot,  # KV * HEAD
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    MASKED: tl.constexpr,
    KEYS: tl.constexpr,  # the tile is K (the Q.K^T operand) rather than V
    I8_I2F: tl.constexpr = False,  # int8 -> the dot dtype by I2F (the build before session 44)
):
    """``[BLOCK_N, HEAD]`` paged K or V tile converted to the dot dtype (int8 -> exact ints,
    fp16 without the I2F unit: ``_triton_utils.cache_to_dot``, as the GQA kernels). Inside one
    block the row addresses are affine (one base + offsets, as a contiguous cache)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    ELEM: tl.constexpr = cache_ptr.dtype.element_ty
    ptrs = _tile_ptrs(
        cache_ptr, blk, start_n, head_off, stride_slot, BLOCK_N, BLOCK_SIZE, offs_d.shape[0], ELEM
    )  # [BLOCK_N, HEAD]
    if MASKED:
        t = tl.load(ptrs, mask=(offs_n < end)[:, None], other=0)
    else:
        t = tl.load(ptrs)
    if I8_I2F:
        return t.to(DOT_DTYPE)
    return cache_to_dot(t, DOT_DTYPE, KEYS)


@triton.jit
def _attend_tile(
    acc, acc2, m_i, l_i, q, qpos, blk, kc_ptr, vc_ptr, start_n, end, head_off, stride_slot, window,
    qk_scale, row_scale, softcap_mult, HEAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    I8_I2F: tl.constexpr = False, V_PAIRS: tl.constexpr = False,
):  # fmt: skip
    """Fold the KV tile [start_n, start_n + BLOCK_N) (blocks ``blk``) into the softmax state
    (``V_PAIRS``: ``acc`` / ``acc2`` the even / odd output channels, else ``acc2`` unused)."""
    offs_d = tl.arange(0, HEAD)  # [HEAD]
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    k = load_paged_tile(kc_ptr, blk, start_n, offs_d, head_off, end, stride_slot, BLOCK_N,
                        BLOCK_SIZE, DOT_DTYPE, MASKED, KEYS=True, I8_I2F=I8_I2F)  # fmt: skip
    s, unit = scores(q, k, qk_scale, row_scale, softcap_mult, 0.0, HAS_SOFTCAP, False, DOT_PREC)
    if MASKED:
        mask = causal_window_mask(qpos, offs_n, end, window, HAS_WINDOW)
        s = tl.where(mask, s, float("-inf"))
    if V_PAIRS:
        v_e, v_o = load_paged_pairs(vc_ptr, blk, start_n, head_off, end, stride_slot, BLOCK_N,
                                    BLOCK_SIZE, HEAD, MASKED)  # fmt: skip
        acc, acc2, m_i, l_i = online_softmax_pairs(acc, acc2, m_i, l_i, s, unit, v_e, v_o,
                                                   DOT_PREC)  # fmt: skip
    else:
        v = load_paged_tile(vc_ptr, blk, start_n, offs_d, head_off, end, stride_slot, BLOCK_N,
                            BLOCK_SIZE, DOT_DTYPE, MASKED, KEYS=False, I8_I2F=I8_I2F)  # fmt: skip
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, unit, v, DOT_PREC)
    return acc, acc2, m_i, l_i


@triton.jit
def _attend_range(
    acc, acc2, m_i, l_i, q, qpos, table_row, kc_ptr, vc_ptr, lo, hi, end, head_off, stride_slot,
    max_blocks, num_blocks, window, qk_scale, row_scale, softcap_mult, HEAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr, I8_I2F: tl.constexpr = False,
    V_PAIRS: tl.constexpr = False,
):  # fmt: skip
    """KV tiles lo, lo + BLOCK_N, ... < hi; the next tile's block entries are prefetched.
    ``row_scale``: ``[ROWS, 1]`` fp32 factors of the rows' dots (power-of-two Q rows), or 1.0.
    The interpreter (numpy 2) cannot take tensor bounds in ``range``: it runs a while loop."""
    blk = next_blocks(table_row, lo, max_blocks, num_blocks, BLOCK_N, BLOCK_SIZE)
    if INTERPRET:
        start_n = lo
        while start_n < hi:
            nxt = next_blocks(table_row, start_n + BLOCK_N, max_blocks, num_blocks, BLOCK_N,
                              BLOCK_SIZE)  # fmt: skip
            acc, acc2, m_i, l_i = _attend_tile(
                acc, acc2, m_i, l_i, q, qpos, blk, kc_ptr, vc_ptr, start_n, end, head_off,
                stride_slot, window, qk_scale, row_scale, softcap_mult, HEAD, BLOCK_N,
                BLOCK_SIZE, MASKED, HAS_WINDOW, HAS_SOFTCAP, DOT_DTYPE, DOT_PREC, I8_I2F,
                V_PAIRS,
            )  # fmt: skip
            blk = nxt
            start_n += BLOCK_N
    else:
        for start_n in range(lo, hi, BLOCK_N):
            nxt = next_blocks(table_row, start_n + BLOCK_N, max_blocks, num_blocks, BLOCK_N,
                              BLOCK_SIZE)  # fmt: skip
            acc, acc2, m_i, l_i = _attend_tile(
                acc, acc2, m_i, l_i, q, qpos, blk, kc_ptr, vc_ptr, start_n, end, head_off,
                stride_slot, window, qk_scale, row_scale, softcap_mult, HEAD, BLOCK_N,
                BLOCK_SIZE, MASKED, HAS_WINDOW, HAS_SOFTCAP, DOT_DTYPE, DOT_PREC, I8_I2F,
                V_PAIRS,
            )  # fmt: skip
            blk = nxt
    return acc, acc2, m_i, l_i


@triton.jit
def paged_attn_kernel(
    q_ptr,  # [tokens, N, HEAD] rotated Q, dot dtype
    kc_ptr,  # [num_blocks, BLOCK_SIZE, KV, HEAD] caches
    vc_ptr,
    o_ptr,  # [tokens, N * HEAD] activation dtype
    o_part_ptr,  # [extra, KV, ROWS, HEAD] fp32
    lse_part_ptr,  # [extra, KV, ROWS] fp32
    cu_ptr,  # [B + 1] int32
    past_ptr,  # [B] int32
    table_ptr,  # [B, max_blocks] int32
    sink_ptr,  # [N]
    vs_ptr,  # v_scale [1] or [KV, 1, HEAD] fp32
    qs_ptr,  # [tokens, N] fp32 inverse power-of-two factor of each Q row (HAS_QSCALE)
    batch,
    tokens,  # rows of q / o: a query row outside [0, tokens) (bad cu_seqlens) is skipped
    max_blocks,
    num_blocks,
    window,
    extra,
    min_chunk,
    stride_table,
    stride_vs_h,
    stride_vs_d,
    qk_scale,
    softcap_mult,
    NUM_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD: tl.constexpr,
    ROWS: tl.constexpr,
    TOK_M: tl.constexpr,
    DEC_TOK: tl.constexpr,
    IS_DECODE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    B_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINK: tl.constexpr,
    SINK_FROM_PTR: tl.constexpr,
    HAS_VSCALE: tl.constexpr,
    HAS_QSCALE: tl.constexpr,  # Q rows carry a power-of-two scale (qs_ptr): int8 K in fp16
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch
    I8_I2F: tl.constexpr = False,  # a decode / prefill cfg option: int8 tiles converted by I2F
    V_PAIRS: tl.constexpr = False,  # a cfg option: int8 V read as int16 channel pairs
):
    wait_prior_grids(PDL)  # first: the previous grid's writes are visible
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_b = tl.arange(0, B_PAD)  # [B_PAD]
    cu0_v, new_v, past_v, qblocks_v, splits_v, item_end_v, pslot_end_v, _ = schedule(
        cu_ptr, past_ptr, batch, window, extra, min_chunk, B_PAD=B_PAD, TOK_M=TOK_M,
        DEC_TOK=DEC_TOK, IS_DECODE=IS_DECODE, HAS_WINDOW=HAS_WINDOW,
    )  # fmt: skip
    b = tl.sum((item_end_v <= pid).to(tl.int32), 0)  # items past the last one: b >= batch
    if b < batch:
        splits = pick(splits_v, offs_b, b)
        items_b = pick(qblocks_v, offs_b, b) * splits
        local = pid - (pick(item_end_v, offs_b, b) - items_b)
        qblock = local // splits
        split = local % splits
        cu0 = pick(cu0_v, offs_b, b)
        s_len = pick(new_v, offs_b, b)
        past = pick(past_v, offs_b, b)
        total = past + s_len
        pslot = pick(pslot_end_v, offs_b, b) - items_b + local  # partial slot (split items)

        offs_r = tl.arange(0, ROWS)  # [ROWS]
        offs_d = tl.arange(0, HEAD)  # [HEAD]
        t_lo = qblock * TOK_M  # first new-token index of the tile
        s_idx = t_lo + offs_r // GROUP  # [ROWS] new-token index of each row
        n_idx = kvh * GROUP + offs_r % GROUP  # [ROWS] query head of each row
        tok = (cu0 + s_idx).to(tl.int64)  # [ROWS] query row in the varlen batch
        row_ok = (offs_r < TOK_M * GROUP) & (s_idx < s_len) & (tok >= 0) & (tok < tokens)
        qpos = tl.where(row_ok, past + s_idx, -1)  # rows that must see nothing get qpos -1
        q_ptrs = q_ptr + (tok * NUM_HEADS + n_idx)[:, None] * HEAD + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # [ROWS, HEAD]
        # [ROWS, 1] (or 1.0): the varlen batch is one sequence of ``tokens`` rows of qs
        row_scale = load_row_scale(qs_ptr, 0, 0, tok, n_idx, row_ok, NUM_HEADS, HAS_QSCALE)

        # Key range of the tile, then of this split.
        q_lo = past + t_lo
        q_hi = past + tl.minimum(t_lo + TOK_M, s_len) - 1
        kv_hi = tl.minimum(q_hi + 1, total)
        kv_lo = 0
        if HAS_WINDOW:
            kv_lo = tl.maximum(q_lo - window + 1, 0) // BLOCK_N * BLOCK_N  # tiles on the grid
        kv_lo = tl.minimum(kv_lo, kv_hi)
        chunk = tl.cdiv(tl.cdiv(kv_hi - kv_lo, splits), BLOCK_N) * BLOCK_N
        start = kv_lo + split * chunk
        end = tl.minimum(start + chunk, kv_hi)
        start = tl.minimum(start, end)
        # Unmasked middle: tiles every row of the tile sees whole (same grid as start).
        full_lo = kv_lo
        if HAS_WINDOW:
            lead = tl.maximum(q_hi - window + 1 - kv_lo, 0)
            full_lo = tl.minimum(kv_lo + tl.cdiv(lead, BLOCK_N) * BLOCK_N, kv_hi)
        full_end = tl.minimum(q_lo + 1, total)
        full_hi = full_lo + tl.maximum(full_end - full_lo, 0) // BLOCK_N * BLOCK_N
        mid_lo = tl.minimum(tl.maximum(full_lo, start), end)
        mid_hi = tl.maximum(tl.minimum(full_hi, end), mid_lo)

        table_row = table_ptr + b.to(tl.int64) * stride_table
        head_off = kvh.to(tl.int64) * HEAD
        stride_slot = KV_HEADS * HEAD
        acc, acc2, m_i, l_i = softmax_state(ROWS, HEAD, V_PAIRS)
        acc, acc2, m_i, l_i = _attend_range(
            acc, acc2, m_i, l_i, q, qpos, table_row, kc_ptr, vc_ptr, start, mid_lo, end, head_off,
            stride_slot, max_blocks, num_blocks, window, qk_scale, row_scale, softcap_mult,
            HEAD=HEAD, BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE, MASKED=True,
            HAS_WINDOW=HAS_WINDOW, HAS_SOFTCAP=HAS_SOFTCAP, DOT_DTYPE=DOT_DTYPE,
            DOT_PREC=DOT_PREC, INTERPRET=INTERPRET, I8_I2F=I8_I2F, V_PAIRS=V_PAIRS,
        )  # fmt: skip
        acc, acc2, m_i, l_i = _attend_range(
            acc, acc2, m_i, l_i, q, qpos, table_row, kc_ptr, vc_ptr, mid_lo, mid_hi, end, head_off,
            stride_slot, max_blocks, num_blocks, window, qk_scale, row_scale, softcap_mult,
            HEAD=HEAD, BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE, MASKED=False,
            HAS_WINDOW=HAS_WINDOW, HAS_SOFTCAP=HAS_SOFTCAP, DOT_DTYPE=DOT_DTYPE,
            DOT_PREC=DOT_PREC, INTERPRET=INTERPRET, I8_I2F=I8_I2F, V_PAIRS=V_PAIRS,
        )  # fmt: skip
        acc, acc2, m_i, l_i = _attend_range(
            acc, acc2, m_i, l_i, q, qpos, table_row, kc_ptr, vc_ptr, mid_hi, end, end, head_off,
            stride_slot, max_blocks, num_blocks, window, qk_scale, row_scale, softcap_mult,
            HEAD=HEAD, BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE, MASKED=True,
            HAS_WINDOW=HAS_WINDOW, HAS_SOFTCAP=HAS_SOFTCAP, DOT_DTYPE=DOT_DTYPE,
            DOT_PREC=DOT_PREC, INTERPRET=INTERPRET, I8_I2F=I8_I2F, V_PAIRS=V_PAIRS,
        )  # fmt: skip
        if V_PAIRS:
            acc = interleave_channels(acc, acc2)  # [ROWS, HEAD]

        if splits == 1:
            o = finish_rows(acc, m_i, l_i, n_idx, kvh, sink_ptr, vs_ptr, stride_vs_h,
                            stride_vs_d, HEAD, HAS_SINK, SINK_FROM_PTR, HAS_VSCALE)  # fmt: skip
            o_ptrs = o_ptr + (tok * NUM_HEADS + n_idx)[:, None] * HEAD + offs_d[None, :]
            tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            part = (pslot.to(tl.int64) * KV_HEADS + kvh) * ROWS + offs_r  # [ROWS]
            o = normalize(acc, l_i)
            lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
            tl.store(lse_part_ptr + part, lse, mask=row_ok)
            tl.store(o_part_ptr + part[:, None] * HEAD + offs_d[None, :], o, mask=row_ok[:, None])


@triton.jit
def _merge_step(acc, m_i, l_i, o_part_ptr, lse_part_ptr, pslot, kvh, offs_r, offs_d, row_ok,
                KV_HEADS: tl.constexpr, ROWS: tl.constexpr, HEAD: tl.constexpr):  # fmt: skip
    """Fold partial slot ``pslot`` (normalized o [ROWS, HEAD], lse [ROWS]) into the state."""
    part = (pslot.to(tl.int64) * KV_HEADS + kvh) * ROWS + offs_r  # [ROWS]
    lse = tl.load(lse_part_ptr + part, mask=row_ok, other=float("-inf"))
    o = tl.load(o_part_ptr + part[:, None] * HEAD + offs_d[None, :], mask=row_ok[:, None],
                other=0.0)  # fmt: skip
    m_new = tl.maximum(m_i, lse)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    w = tl.exp2(lse - m_safe)
    return acc * alpha[:, None] + o * w[:, None], m_new, l_i * alpha + w


@triton.jit
def paged_merge_kernel(
    o_part_ptr,  # [extra, KV, ROWS, HEAD] fp32
    lse_part_ptr,  # [extra, KV, ROWS] fp32
    o_ptr,  # [tokens, N * HEAD] activation dtype
    cu_ptr,
    past_ptr,
    sink_ptr,
    vs_ptr,
    batch,
    tokens,  # rows of o (see paged_attn_kernel)
    window,
    extra,
    min_chunk,
    stride_vs_h,
    stride_vs_d,
    NUM_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD: tl.constexpr,
    ROWS: tl.constexpr,
    TOK_M: tl.constexpr,
    DEC_TOK: tl.constexpr,
    IS_DECODE: tl.constexpr,
    B_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINK: tl.constexpr,
    SINK_FROM_PTR: tl.constexpr,
    HAS_VSCALE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Log-sum-exp merge of one split query tile's partials (the sink enters once)."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_b = tl.arange(0, B_PAD)
    cu0_v, new_v, _, qblocks_v, splits_v, _, pslot_end_v, mq_end_v = schedule(
        cu_ptr, past_ptr, batch, window, extra, min_chunk, B_PAD=B_PAD, TOK_M=TOK_M,
        DEC_TOK=DEC_TOK, IS_DECODE=IS_DECODE, HAS_WINDOW=HAS_WINDOW,
    )  # fmt: skip
    b = tl.sum((mq_end_v <= pid).to(tl.int32), 0)
    if b < batch:
        qblocks = pick(qblocks_v, offs_b, b)
        splits = pick(splits_v, offs_b, b)
        qblock = pid - (pick(mq_end_v, offs_b, b) - qblocks)
        base = pick(pslot_end_v, offs_b, b) - qblocks * splits + qblock * splits
        cu0 = pick(cu0_v, offs_b, b)
        s_len = pick(new_v, offs_b, b)
        offs_r = tl.arange(0, ROWS)  # [ROWS]
        offs_d = tl.arange(0, HEAD)  # [HEAD]
        s_idx = qblock * TOK_M + offs_r // GROUP
        n_idx = kvh * GROUP + offs_r % GROUP
        tok = (cu0 + s_idx).to(tl.int64)
        row_ok = (offs_r < TOK_M * GROUP) & (s_idx < s_len) & (tok >= 0) & (tok < tokens)
        acc = tl.zeros([ROWS, HEAD], dtype=tl.float32)
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        if INTERPRET:  # numpy-2 interpreter: no tensor bounds in range
            sp = 0
            while sp < splits:
                acc, m_i, l_i = _merge_step(acc, m_i, l_i, o_part_ptr, lse_part_ptr, base + sp,
                                            kvh, offs_r, offs_d, row_ok, KV_HEADS, ROWS, HEAD)  # fmt: skip
                sp += 1
        else:
            for sp in range(0, splits):
                acc, m_i, l_i = _merge_step(acc, m_i, l_i, o_part_ptr, lse_part_ptr, base + sp,
                                            kvh, offs_r, offs_d, row_ok, KV_HEADS, ROWS, HEAD)  # fmt: skip
        o = finish_rows(acc, m_i, l_i, n_idx, kvh, sink_ptr, vs_ptr, stride_vs_h, stride_vs_d,
                        HEAD, HAS_SINK, SINK_FROM_PTR, HAS_VSCALE)  # fmt: skip
        o_ptrs = o_ptr + (tok * NUM_HEADS + n_idx)[:, None] * HEAD + offs_d[None, :]
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
