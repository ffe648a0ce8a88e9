"""Triton split-K decode (flash-decoding) kernels of GQA: S == 1 and small S.

``gqa_decode_split_kernel`` grid: (KV, B, splits). One program owns one KV head of one
sequence and one slice of its key range, and packs every query row that reads that KV head into
one tile: row r = (new token s = r // GROUP, head kvh * GROUP + r % GROUP), padded to >= 16 rows
for ``tl.dot``. Each K/V byte is therefore read once per group. It writes fp32 partials
``o_part [B, S, N, splits, HEAD]`` (normalized) and ``lse_part [B, S, N, splits]``
(log2 domain; -inf for an empty slice).

``BALANCED`` (a ``decode_cfg`` option; the default where ``decode_config`` finds the split plan's
last wave >= 10% empty, ``split_wave_fill``): grid (programs,), about one wave of resident
CTAs. The pairs' key tiles are laid end to end (pair-major) and program i takes the run of
tiles ``[i * total / programs, (i + 1) * total / programs)``, crossing pair boundaries: one
part (``_split_part``, the same body) per pair it touches, each into its own o_part slot (the
part's index among the pair's consecutive programs); the pair's first part marks the slots
no program fills as empty (lse -inf). No SM idles in a part-empty last wave (B=17 at KV=8 is
136 pairs on 132 SMs), at the price of a second part (Q setup, pipeline fill) in some
programs, which loses where the split plan already fills its waves.

The slices are merged by ``longattn._triton_merge.merge_splits`` (log-sum-exp, the sink
(head_sink / smooth_softmax) exactly once, one rounding to the output), shared with DSA.
``DIRECT_OUT`` (a ``decode_cfg`` option, off; ``launch.run_decode`` keeps it only for one split
of the split grid, e.g. B=32 at KV=8): the program finishes its rows itself
(``_core.finish_rows``: the same sink, ``1 / l``, ``v_scale`` and one rounding) into the
output, and neither partials nor the merge launch happen.

``FUSE_PROLOGUE`` (S = 1, a ``decode_cfg`` option; the default at H <= 128 on the GPU, see
``decode_config``; the interpreter config leaves it off): the kernel takes the prologue's work
(``longattn._triton_prologue``): each program computes its Q rows from the raw query; the new
token's row (the sequence's last key) is left out of every tile and folded in by the split whose
range holds it, which also appends it to the cache after its reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_prologue import (
    fold_new_row,
    fused_new_v,
    fused_q_k,
    new_row_logits,
    rotary_pos,
    store_new_row,
)
from ..._triton_utils import INT8_SHIFT, cdiv, interleave_channels, wait_prior_grids
from ._core import (
    causal_window_mask,
    finish_rows,
    load_int8_pairs,
    load_kv_tile,
    load_row_scale,
    load_total_len,
    new_row_span,
    normalize,
    online_softmax_pairs,
    online_softmax_step,
    scores,
    scores_pairs,
    softcap_log2,
    softmax_state,
    unshift_acc,
)


@triton.jit
def _decode_block(
    acc, acc2, m_i, l_i, q, q2, qpos, row_ok, s_idx, n_idx, k_base, v_base, bias_ptr, b64,
    start_n, end, window, stride_kc, stride_vc, stride_bias_b, stride_bias_n, stride_bias_s,
    stride_bias_t, qk_scale, row_scale, softcap_mult, HEAD: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    PV_DTYPE: tl.constexpr, WIDE_I8: tl.constexpr, V_PAIRS: tl.constexpr,
    K_PAIRS: tl.constexpr, K_SHIFT: tl.constexpr, V_SHIFT: tl.constexpr,
):  # fmt: skip
    """One KV tile [start_n, start_n + BLOCK_N) for every packed row. ``MASKED``: keys >= end
    are not read and the causal/window mask applies; otherwise every key of the tile is visible
    to every packed row (the kernel takes such tiles only when every stored row is valid).
    ``V_PAIRS``: ``acc`` / ``acc2`` hold the even / odd output channels (``load_int8_pairs``);
    otherwise ``acc`` holds them all and ``acc2`` is carried unused. ``K_PAIRS``: ``q`` / ``q2``
    are Q's even / odd channels (``scores_pairs``); otherwise ``q`` is Q and ``q2`` unused.
    ``K_SHIFT`` / ``V_SHIFT``: int8 K / V (with ``V_PAIRS``) enter the dots as ``k + INT8_SHIFT``
    (see ``_split_part``)."""
    offs_d = tl.arange(0, HEAD)  # [HEAD]
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    if K_PAIRS:
        k_e, k_o = load_int8_pairs(k_base, start_n, stride_kc, end, BLOCK_N, HEAD, MASKED,
                                   K_SHIFT)  # fmt: skip
    else:
        k = load_kv_tile(k_base, start_n, offs_d, stride_kc, end, BLOCK_N, DOT_DTYPE, MASKED,
                         True, WIDE_I8, K_SHIFT)  # fmt: skip
    bias = 0.0
    if HAS_BIAS:
        b_ptrs = (
            bias_ptr
            + b64 * stride_bias_b
            + n_idx.to(tl.int64)[:, None] * stride_bias_n
            + s_idx.to(tl.int64)[:, None] * stride_bias_s
            + offs_n.to(tl.int64)[None, :] * stride_bias_t
        )
        b_mask = row_ok[:, None] & (offs_n < end)[None, :]
        bias = tl.load(b_ptrs, mask=b_mask, other=0.0).to(tl.float32)  # [ROWS_PAD, BLOCK_N]
    if K_PAIRS:
        s, unit = scores_pairs(q, q2, k_e, k_o, qk_scale, row_scale, softcap_mult, bias,
                               HAS_SOFTCAP, HAS_BIAS, DOT_PREC)  # fmt: skip
    else:
        s, unit = scores(q, k, qk_scale, row_scale, softcap_mult, bias, HAS_SOFTCAP, HAS_BIAS,
                         DOT_PREC)  # fmt: skip
    if MASKED:
        mask = causal_window_mask(qpos, offs_n, end, window, HAS_WINDOW)
        s = tl.where(mask, s, float("-inf"))  # [ROWS_PAD, BLOCK_N]
    if V_PAIRS:
        v_e, v_o = load_int8_pairs(v_base, start_n, stride_vc, end, BLOCK_N, HEAD, MASKED,
                                   V_SHIFT)  # fmt: skip
        acc, acc2, m_i, l_i = online_softmax_pairs(acc, acc2, m_i, l_i, s, unit, v_e, v_o,
                                                   DOT_PREC, V_SHIFT)  # fmt: skip
    else:
        v = load_kv_tile(v_base, start_n, offs_d, stride_vc, end, BLOCK_N, PV_DTYPE, MASKED,
                         False, WIDE_I8)  # fmt: skip
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, unit, v, DOT_PREC)
    return acc, acc2, m_i, l_i


@triton.jit
def _decode_range(
    acc, acc2, m_i, l_i, q, q2, qpos, row_ok, s_idx, n_idx, k_base, v_base, bias_ptr, b64, lo,
    hi, end, window, stride_kc, stride_vc, stride_bias_b, stride_bias_n, stride_bias_s,
    stride_bias_t, qk_scale, row_scale, softcap_mult, HEAD: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    PV_DTYPE: tl.constexpr,
    INTERPRET: tl.constexpr,
    WIDE_I8: tl.constexpr,
    V_PAIRS: tl.constexpr,
    K_PAIRS: tl.constexpr,
    K_SHIFT: tl.constexpr,
    V_SHIFT: tl.constexpr,
):  # fmt: skip
    """Tiles lo, lo + BLOCK_N, ... < hi. The interpreter (numpy 2) cannot take tensor bounds in
    ``range`` (see prefill._attend_range), so it runs the same body in a while loop."""
    if INTERPRET:
        start_n = lo
        while start_n < hi:
            acc, acc2, m_i, l_i = _decode_block(
                acc, acc2, m_i, l_i, q, q2, qpos, row_ok, s_idx, n_idx, k_base, v_base, bias_ptr,
                b64, start_n, end, window, stride_kc, stride_vc, stride_bias_b, stride_bias_n,
                stride_bias_s, stride_bias_t, qk_scale, row_scale, softcap_mult, HEAD, BLOCK_N,
                MASKED, HAS_WINDOW, HAS_SOFTCAP, HAS_BIAS, DOT_DTYPE, DOT_PREC, PV_DTYPE, WIDE_I8,
                V_PAIRS, K_PAIRS, K_SHIFT, V_SHIFT,
            )  # fmt: skip
            start_n += BLOCK_N
    else:
        for start_n in range(lo, hi, BLOCK_N):
            acc, acc2, m_i, l_i = _decode_block(
                acc, acc2, m_i, l_i, q, q2, qpos, row_ok, s_idx, n_idx, k_base, v_base, bias_ptr,
                b64, start_n, end, window, stride_kc, stride_vc, stride_bias_b, stride_bias_n,
                stride_bias_s, stride_bias_t, qk_scale, row_scale, softcap_mult, HEAD, BLOCK_N,
                MASKED, HAS_WINDOW, HAS_SOFTCAP, HAS_BIAS, DOT_DTYPE, DOT_PREC, PV_DTYPE, WIDE_I8,
                V_PAIRS, K_PAIRS, K_SHIFT, V_SHIFT,
            )  # fmt: skip
    return acc, acc2, m_i, l_i


@triton.jit
def _new_row_scores(qk_new, qk_scale, rs, softcap_mult, bias_ptr, b64, n_idx, new_pos, row_ok,
                    stride_bias_b, stride_bias_n, stride_bias_t, HAS_SOFTCAP: tl.constexpr,
                    HAS_BIAS: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
    """``[ROWS_PAD]`` log2-domain logits of the new row from its raw dot products ``qk_new`` and
    the rows' Q factors ``rs [ROWS_PAD]`` (ones without power-of-two rows), as ``scores`` makes
    them for a tile (softcap, bias of key ``new_pos``; S = 1)."""
    if HAS_SOFTCAP:
        s = softcap_log2(qk_new * rs, qk_scale, softcap_mult, PRECISE)
    else:
        s = qk_new * (qk_scale * rs)
    if HAS_BIAS:
        ptrs = (bias_ptr + b64 * stride_bias_b + n_idx.to(tl.int64) * stride_bias_n
                + new_pos * stride_bias_t)  # fmt: skip
        bias = tl.load(ptrs, mask=row_ok & (new_pos >= 0), other=0.0).to(tl.float32)  # [M]
        s = s + bias * 1.4426950408889634
    return s


@triton.jit
def _split_start(offset, window, lo, HAS_WINDOW: tl.constexpr):
    """First key of the part that starts ``lo`` keys into the sequence's key range (which
    starts at 0, or at the window's first key)."""
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(offset - window + 1, 0)
    return kv_lo + lo


@triton.jit
def _split_part(
    b, kvh, split, pieces, lo,  # sequence, KV head, part slot, the pair's parts, first key
    # the kernel's arguments (gqa_decode_split_kernel), chunk = the part's keys:
    q_ptr, k_ptr, v_ptr, seqlens_ptr, max_total, bias_ptr, vs_ptr, qs_ptr, o_part_ptr,
    lse_part_ptr, xq_ptr, xk_ptr, xv_ptr, qn_w_ptr, kn_w_ptr, cos_ptr, sin_ptr, pos_ptr, ks_ptr,
    seq_len, cap, window, chunk, num_splits, stride_qb, stride_qs, stride_qn, stride_kb, stride_kh,
    stride_kc, stride_vb, stride_vh, stride_vc, stride_bias_b, stride_bias_n, stride_bias_s,
    stride_bias_t, stride_vs_h, stride_vs_d, stride_xqb, stride_xkb, stride_xvb, stride_pb,
    stride_cos, stride_sin, stride_ks_h, stride_ks_d, max_pos, eps, qk_scale, softcap_mult,
    NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD: tl.constexpr,
    ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, IS_FIRST_PROMPT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_VSCALE: tl.constexpr, HAS_QSCALE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr, PV_DTYPE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
    FUSE_PROLOGUE: tl.constexpr = False, Q_DTYPE: tl.constexpr = tl.bfloat16,
    ROT_DIM: tl.constexpr = 0, HAS_ROTARY: tl.constexpr = False, INTERLEAVED: tl.constexpr = False,
    HAS_POS: tl.constexpr = False, HAS_QNORM: tl.constexpr = False,
    HAS_KNORM: tl.constexpr = False, K_QUANT: tl.constexpr = False,
    FILL_PIECES: tl.constexpr = False, WIDE_I8: tl.constexpr = False,
    V_PAIRS: tl.constexpr = False, K_PAIRS: tl.constexpr = False,
    K_SHIFT: tl.constexpr = False, V_SHIFT: tl.constexpr = False, out_ptr=None, sink_ptr=None,
    DIRECT_OUT: tl.constexpr = False, HAS_SINK: tl.constexpr = False,
    SINK_FROM_PTR: tl.constexpr = False,
):  # fmt: skip
    """One part (keys ``[start, start + chunk)`` of one (sequence, KV head) pair) of the split
    kernel: every packed query row of the pair's KV head, partials into slot ``split``
    (``DIRECT_OUT``: the pair's only part, its rows finished into ``out_ptr``)."""
    b64 = b.to(tl.int64)
    total_len = load_total_len(seqlens_ptr, b, max_total)
    offset, rows_valid = new_row_span(total_len, seq_len, IS_FIRST_PROMPT)

    offs_r = tl.arange(0, ROWS_PAD)  # [ROWS_PAD]
    offs_d = tl.arange(0, HEAD)  # [HEAD]
    s_idx = offs_r // GROUP  # [ROWS_PAD] new-token index of each row
    n_idx = kvh * GROUP + offs_r % GROUP  # [ROWS_PAD] query head of each row
    in_rows = offs_r < seq_len * GROUP
    row_ok = in_rows & (s_idx < rows_valid)
    qpos = tl.where(row_ok, s_idx + offset, -1)  # rows that must see nothing get qpos -1

    if FUSE_PROLOGUE:  # seq_len == 1
        # the prologue's own view of the token: the raw (unclamped) length sets the append row
        raw_qpos = tl.load(seqlens_ptr + b).to(tl.int64)  # total_len - 1
        if IS_FIRST_PROMPT:
            write = raw_qpos >= 0  # s = 0 < total_len
            raw_qpos = raw_qpos * 0
        else:
            write = raw_qpos >= 0
        write = write & (raw_qpos < cap)
        rot_pos = rotary_pos(pos_ptr, b64, raw_qpos, stride_pb, max_pos, HAS_POS)
        q, unscale, k_new = fused_q_k(
            xq_ptr, xk_ptr, qn_w_ptr, kn_w_ptr, cos_ptr, sin_ptr, ks_ptr, b64, rot_pos, kvh,
            n_idx, in_rows, stride_xqb, stride_xkb, stride_cos, stride_sin, stride_ks_h,
            stride_ks_d, eps, NUM_HEADS, KV_HEADS, HEAD, HEAD, ROT_DIM, HAS_ROTARY, INTERLEAVED,
            HAS_QNORM, HAS_KNORM, K_QUANT, HAS_QSCALE, DOT_DTYPE, k_ptr.dtype.element_ty,
        )  # fmt: skip
        row_scale = 1.0
        if HAS_QSCALE:
            row_scale = unscale[:, None]  # [ROWS_PAD, 1]
        qk_new = new_row_logits(q, k_new, DOT_DTYPE)  # [ROWS_PAD] raw dot products
        # Folded here (not read from the cache) when it is the last key the row sees; no
        # tile of any split reads it. (Metadata past max_total: the tiles read the clamped
        # range as unfused, and the row goes only to the cache.)
        kv_hi = tl.minimum(offset + rows_valid, total_len)
        start = _split_start(offset, window, lo, HAS_WINDOW)
        new_pos = tl.where(write & (raw_qpos == offset) & (rows_valid > 0), raw_qpos, -1)
        mine = (new_pos >= 0) & (start <= new_pos) & (new_pos < start + chunk)
        kv_hi = tl.where(new_pos >= 0, new_pos, kv_hi)
    else:
        q_ptrs = (
            q_ptr
            + b64 * stride_qb
            + s_idx.to(tl.int64)[:, None] * stride_qs
            + n_idx.to(tl.int64)[:, None] * stride_qn
            + offs_d[None, :]
        )
        q = tl.load(q_ptrs, mask=in_rows[:, None], other=0.0)  # [ROWS_PAD, HEAD]
        row_scale = load_row_scale(qs_ptr, b64, seq_len, s_idx, n_idx, in_rows, NUM_HEADS,
                                   HAS_QSCALE)  # fmt: skip
        kv_hi = tl.minimum(offset + rows_valid, total_len)
        start = _split_start(offset, window, lo, HAS_WINDOW)
    end = tl.minimum(start + chunk, kv_hi)

    k_base = k_ptr + b64 * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + b64 * stride_vb + kvh.to(tl.int64) * stride_vh
    shift = 0.0
    if K_SHIFT:
        # int8 K enters Q.K as k + INT8_SHIFT (no fp16 subtract per K pair): every logit of a
        # row grows by the same INT8_SHIFT * sum(Q row) (log2 units below), which the
        # softmax's running max absorbs; it is taken off m_i after the tiles. (No softcap:
        # the host gate.) V_SHIFT (with V_PAIRS): int8 V enters P.V as v + INT8_SHIFT, l_i
        # sums the rounded weights the dots take, and INT8_SHIFT * l_i comes off acc after the
        # tiles (before the new row's fold, which adds its own v).
        shift = tl.sum(q.to(tl.float32) * row_scale, 1) * (INT8_SHIFT * qk_scale)  # [ROWS_PAD]
    if K_PAIRS:  # Q's even / odd channels [ROWS_PAD, HEAD // 2] each, for scores_pairs
        q_lo, q_hi = tl.split(tl.reshape(q, (ROWS_PAD, HEAD // 2, 2)))
    else:
        q_lo, q_hi = q, q  # (q_hi unused)
    acc, acc2, m_i, l_i = softmax_state(ROWS_PAD, HEAD, V_PAIRS)  # V_PAIRS: even / odd halves
    # Keys < full_end are visible to every valid row (causal: <= the first new token's
    # position); whole tiles of them skip the mask. The window edge keeps every tile masked.
    # Such tiles need offset >= BLOCK_N, i.e. a subsequent prompt, where every stored row is
    # valid (row_ok == in_rows); a first prompt's padding rows only meet masked tiles.
    full_end = tl.minimum(offset + 1, end)
    if HAS_WINDOW:
        full_end = start
    full_hi = start + tl.maximum(full_end - start, 0) // BLOCK_N * BLOCK_N
    for masked in tl.static_range(2):  # the whole unmasked tiles, then the masked rest
        if masked == 0:
            lo = start
            hi = full_hi
        else:
            lo = full_hi
            hi = end
        acc, acc2, m_i, l_i = _decode_range(
            acc, acc2, m_i, l_i, q_lo, q_hi, qpos, row_ok, s_idx, n_idx, k_base, v_base,
            bias_ptr, b64, lo, hi, end, window, stride_kc, stride_vc, stride_bias_b,
            stride_bias_n, stride_bias_s, stride_bias_t, qk_scale, row_scale, softcap_mult,
            HEAD=HEAD, BLOCK_N=BLOCK_N, MASKED=masked == 1, HAS_WINDOW=HAS_WINDOW,
            HAS_SOFTCAP=HAS_SOFTCAP, HAS_BIAS=HAS_BIAS, DOT_DTYPE=DOT_DTYPE, DOT_PREC=DOT_PREC,
            PV_DTYPE=PV_DTYPE, INTERPRET=INTERPRET, WIDE_I8=WIDE_I8, V_PAIRS=V_PAIRS,
            K_PAIRS=K_PAIRS, K_SHIFT=K_SHIFT, V_SHIFT=V_SHIFT,
        )  # fmt: skip
    if V_SHIFT:
        acc = unshift_acc(acc, l_i)
        acc2 = unshift_acc(acc2, l_i)
    if K_SHIFT:
        m_i = m_i - shift  # back to the logits of k; -inf stays -inf
    if V_PAIRS:
        acc = interleave_channels(acc, acc2)  # [ROWS_PAD, HEAD]

    if FUSE_PROLOGUE:
        # the split whose range holds the new row folds it in (its V loaded only now) and
        # appends it to the cache after its reads; split 0 appends when no split folds it
        s_new = _new_row_scores(qk_new, qk_scale, unscale, softcap_mult, bias_ptr, b64, n_idx,
                                new_pos, row_ok, stride_bias_b, stride_bias_n, stride_bias_t,
                                HAS_SOFTCAP, HAS_BIAS, DOT_PREC == "ieee")  # fmt: skip
        v_new = fused_new_v(xv_ptr, vs_ptr, b64, kvh, stride_xvb, stride_vs_h, stride_vs_d, HEAD,
                            HEAD, HAS_VSCALE, v_ptr.dtype.element_ty)  # fmt: skip
        weight = (row_ok & mine).to(tl.int32)  # [ROWS_PAD]
        acc, m_i, l_i = fold_new_row(acc, m_i, l_i, weight, s_new, v_new, PV_DTYPE)
        appender = mine | ((new_pos < 0) & (split == 0))
        store_new_row(k_base + raw_qpos * stride_kc, v_base + raw_qpos * stride_vc, k_new,
                      v_new, write & appender, HEAD, HEAD)  # fmt: skip

    row = (b64 * seq_len + s_idx) * NUM_HEADS + n_idx  # [ROWS_PAD] (token, head) of each row
    if DIRECT_OUT:  # one part per pair: what the merge would make of it, in one rounding
        o = finish_rows(acc, m_i, l_i, n_idx, kvh, sink_ptr, vs_ptr, stride_vs_h, stride_vs_d,
                        HEAD, HAS_SINK, SINK_FROM_PTR, HAS_VSCALE)  # fmt: skip
        o_ptrs = out_ptr + row[:, None] * HEAD + offs_d[None, :]  # o: [ROWS_PAD, HEAD] fp32
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=in_rows[:, None])
    else:
        o = normalize(acc, l_i)  # [ROWS_PAD, HEAD]
        if HAS_VSCALE:
            vs = tl.load(vs_ptr + kvh * stride_vs_h + offs_d * stride_vs_d)  # [HEAD] fp32
            o = o * vs[None, :]
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        part = row * num_splits + split  # [ROWS_PAD]
        tl.store(lse_part_ptr + part, lse, mask=in_rows)
        tl.store(o_part_ptr + part[:, None] * HEAD + offs_d[None, :], o, mask=in_rows[:, None])
        if FILL_PIECES:  # balanced grid: the pair's first part marks its unused slots empty
            j = pieces
            while j < num_splits:
                tl.store(lse_part_ptr + part - split + j, float("-inf"),
                         mask=in_rows & (split == 0))  # fmt: skip
                j += 1


# the balanced grid's tile counts vary with every length: no value specialization (a
# recompile whenever one turns divisible by 16), as for the split grid, which ignores them
@triton.jit(do_not_specialize=["tiles_per_pair", "total_tiles"])
def gqa_decode_split_kernel(
    q_ptr,  # [B, S, N, HEAD] rotated Q in the dot dtype
    k_ptr,  # [B, KV, C, HEAD] cache
    v_ptr,
    seqlens_ptr,  # [B] int32, total_len - 1
    max_total,  # T: total lengths are clamped to it (the caches hold >= T rows)
    bias_ptr,  # [B|1, N|1, S, T]
    vs_ptr,  # v_scale [1] or [KV, 1, HEAD] fp32
    qs_ptr,  # [B, S, N] fp32 power-of-two factor of each Q row (HAS_QSCALE)
    o_part_ptr,  # [B, S, N, splits, HEAD] fp32 (unused with DIRECT_OUT)
    lse_part_ptr,  # [B, S, N, splits] fp32 (unused with DIRECT_OUT)
    out_ptr,  # DIRECT_OUT: [B, S, N * HEAD] output dtype, contiguous
    sink_ptr,  # DIRECT_OUT: head_sink [N] (SINK_FROM_PTR)
    xq_ptr,  # FUSE_PROLOGUE: the raw query [B, 1, N*HEAD] (or packed QKV's Q part)
    xk_ptr,  # FUSE_PROLOGUE: new K [B, 1, KV*HEAD]
    xv_ptr,  # FUSE_PROLOGUE: new V [B, 1, KV*HEAD]
    qn_w_ptr,  # [HEAD] (HAS_QNORM)
    kn_w_ptr,  # [HEAD] (HAS_KNORM)
    cos_ptr,  # [max_pos, ROT_DIM / 2] (HAS_ROTARY)
    sin_ptr,
    pos_ptr,  # [B, 1] int64 position ids (HAS_POS)
    ks_ptr,  # k_scale fp32 [1] or [KV, 1, HEAD] (K_QUANT)
    seq_len,
    cap,  # C: cache rows (FUSE_PROLOGUE: the append's bound, as the prologue's)
    window,
    chunk,  # keys per split (multiple of BLOCK_N)
    num_splits,
    tiles_per_pair,  # BALANCED: BLOCK_N tiles of each pair's key range
    total_tiles,  # BALANCED: pairs * tiles_per_pair
    stride_qb,
    stride_qs,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kc,
    stride_vb,
    stride_vh,
    stride_vc,
    stride_bias_b,
    stride_bias_n,
    stride_bias_s,
    stride_bias_t,
    stride_vs_h,
    stride_vs_d,
    stride_xqb,
    stride_xkb,
    stride_xvb,
    stride_pb,
    stride_cos,
    stride_sin,
    stride_ks_h,
    stride_ks_d,
    max_pos,
    eps,
    qk_scale,
    softcap_mult,
    NUM_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD: tl.constexpr,
    ROWS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FIRST_PROMPT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_VSCALE: tl.constexpr,
    HAS_QSCALE: tl.constexpr,  # Q rows carry a power-of-two scale (qs_ptr): int8 K in fp16
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PV_DTYPE: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch
    FUSE_PROLOGUE: tl.constexpr = False,  # S = 1: the prologue's work in this kernel
    Q_DTYPE: tl.constexpr = tl.bfloat16,  # FUSE_PROLOGUE: == DOT_DTYPE
    ROT_DIM: tl.constexpr = 0,
    HAS_ROTARY: tl.constexpr = False,
    INTERLEAVED: tl.constexpr = False,
    HAS_POS: tl.constexpr = False,
    HAS_QNORM: tl.constexpr = False,
    HAS_KNORM: tl.constexpr = False,
    K_QUANT: tl.constexpr = False,
    BALANCED: tl.constexpr = False,  # grid (programs,): equal tile ranges over all pairs
    WIDE_I8: tl.constexpr = False,  # int8 K/V tiles read as int32 words (load_kv_tile)
    V_PAIRS: tl.constexpr = False,  # int8 V tiles read as int16 channel pairs (load_int8_pairs)
    K_PAIRS: tl.constexpr = False,  # int8 K tiles too, Q split into even / odd channels
    K_SHIFT: tl.constexpr = False,  # int8 K tiles as k + INT8_SHIFT (see _split_part)
    V_SHIFT: tl.constexpr = False,  # int8 V tiles (V_PAIRS) as v + INT8_SHIFT (_split_part)
    DIRECT_OUT: tl.constexpr = False,  # one split (not BALANCED): rows finished into out_ptr
    HAS_SINK: tl.constexpr = False,  # DIRECT_OUT: head_sink or smooth_softmax
    SINK_FROM_PTR: tl.constexpr = False,  # DIRECT_OUT: head_sink (else the zero logit)
):
    wait_prior_grids(PDL)  # the previous grid's writes are visible from here on
    if BALANCED:
        # the pairs' key tiles laid end to end (pair-major), program i takes tiles
        # [i * total / P, (i + 1) * total / P): one part per pair it touches
        pid = tl.program_id(0).to(tl.int64)
        progs = tl.num_programs(0).to(tl.int64)
        t = pid * total_tiles // progs
        t_stop = (pid + 1) * total_tiles // progs
        while t < t_stop:
            pair = t // tiles_per_pair
            pair_lo = pair * tiles_per_pair
            seg_end = tl.minimum(t_stop, pair_lo + tiles_per_pair)
            first = ((pair_lo + 1) * progs - 1) // total_tiles  # program holding tile pair_lo
            last = ((pair_lo + tiles_per_pair) * progs - 1) // total_tiles
            _split_part(
                (pair // KV_HEADS).to(tl.int32), (pair % KV_HEADS).to(tl.int32),
                (pid - first).to(tl.int32), (last - first + 1).to(tl.int32),
                ((t - pair_lo) * BLOCK_N).to(tl.int32), q_ptr, k_ptr, v_ptr,
                seqlens_ptr, max_total, bias_ptr, vs_ptr, qs_ptr, o_part_ptr,
                lse_part_ptr, xq_ptr, xk_ptr, xv_ptr, qn_w_ptr, kn_w_ptr, cos_ptr,
                sin_ptr, pos_ptr, ks_ptr, seq_len, cap, window, ((seg_end - t) *
                BLOCK_N).to(tl.int32), num_splits, stride_qb, stride_qs, stride_qn,
                stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc,
                stride_bias_b, stride_bias_n, stride_bias_s, stride_bias_t,
                stride_vs_h, stride_vs_d, stride_xqb, stride_xkb, stride_xvb,
                stride_pb, stride_cos, stride_sin, stride_ks_h, stride_ks_d,
                max_pos, eps, qk_scale, softcap_mult, NUM_HEADS, KV_HEADS, GROUP,
                HEAD, ROWS_PAD, BLOCK_N, IS_FIRST_PROMPT, HAS_WINDOW, HAS_SOFTCAP,
                HAS_BIAS, HAS_VSCALE, HAS_QSCALE, DOT_DTYPE, DOT_PREC, PV_DTYPE,
                INTERPRET, PDL, FUSE_PROLOGUE, Q_DTYPE, ROT_DIM, HAS_ROTARY,
                INTERLEAVED, HAS_POS, HAS_QNORM, HAS_KNORM, K_QUANT,
                FILL_PIECES=True, WIDE_I8=WIDE_I8, V_PAIRS=V_PAIRS, K_PAIRS=K_PAIRS,
                K_SHIFT=K_SHIFT, V_SHIFT=V_SHIFT,
            )  # fmt: skip
            t = seg_end
    else:
        split = tl.program_id(2)
        _split_part(
            tl.program_id(1), tl.program_id(0), split, 1, split * chunk, q_ptr, k_ptr,
            v_ptr, seqlens_ptr, max_total, bias_ptr, vs_ptr, qs_ptr, o_part_ptr,
            lse_part_ptr, xq_ptr, xk_ptr, xv_ptr, qn_w_ptr, kn_w_ptr, cos_ptr, sin_ptr,
            pos_ptr, ks_ptr, seq_len, cap, window, chunk, num_splits, stride_qb,
            stride_qs, stride_qn, stride_kb, stride_kh, stride_kc, stride_vb,
            stride_vh, stride_vc, stride_bias_b, stride_bias_n, stride_bias_s,
            stride_bias_t, stride_vs_h, stride_vs_d, stride_xqb, stride_xkb,
            stride_xvb, stride_pb, stride_cos, stride_sin, stride_ks_h, stride_ks_d,
            max_pos, eps, qk_scale, softcap_mult, NUM_HEADS, KV_HEADS, GROUP, HEAD,
            ROWS_PAD, BLOCK_N, IS_FIRST_PROMPT, HAS_WINDOW, HAS_SOFTCAP, HAS_BIAS,
            HAS_VSCALE, HAS_QSCALE, DOT_DTYPE, DOT_PREC, PV_DTYPE, INTERPRET, PDL,
            FUSE_PROLOGUE, Q_DTYPE, ROT_DIM, HAS_ROTARY, INTERLEAVED, HAS_POS,
            HAS_QNORM, HAS_KNORM, K_QUANT, WIDE_I8=WIDE_I8, V_PAIRS=V_PAIRS, K_PAIRS=K_PAIRS,
            K_SHIFT=K_SHIFT, V_SHIFT=V_SHIFT, out_ptr=out_ptr, sink_ptr=sink_ptr,
            DIRECT_OUT=DIRECT_OUT, HAS_SINK=HAS_SINK, SINK_FROM_PTR=SINK_FROM_PTR,
        )  # fmt: skip


def pair_count_plan(head: int, dot_dtype, cache_dtype) -> bool:
    """The split-kernel build whose plan follows the (sequence, KV head) pair count: 16-bit dots
    and caches at H <= 128 (``decode_config``'s 2 stages in ``four_split_band``, and
    ``launch.choose_num_splits``' ``balance``); the builds it was measured on."""
    return head <= 128 and dot_dtype.itemsize == 2 and cache_dtype != torch.int8


def four_split_band(pairs: int, num_sms: int) -> bool:
    """9/8 to 3/2 waves of (sequence, KV head) pairs (B = 19..24 at KV = 8 on 132 SMs): the
    16-bit H <= 128 build runs 2 stages (3 CTAs per SM) with 4 splits there
    (``decode_config``, ``launch.choose_num_splits``), the one band where that plan beat the
    4-stage, one-split plan on both GPUs, same process (us, new vs old): H200 B=20 / 24
    T=32K 710.2 / 756.4 vs 738.8 / 818.6 (cuDNN 641.2 / 762.9; ``gqa_waves*_h200.json``),
    H100 B=20 T=32K / 4K 901.6 / 127.7 vs 1004.1 / 136.1, B=24 T=4K 143.2 vs 148.9
    (``gqa_waves_b20_64_h100.json``). Outside it the 2-stage plan lost on the H200 (B=17 3
    splits T=4K / 32K 90.6 / 616.3 vs 85.7 / 599.9; B=28 1 split 127.2 / 932.7 vs 124.6 /
    907.7; B=32 136.1 / 997.8 vs 132.2 / 964.8; B=64 T=4K 262.4 vs 254.8) while it won on
    the H100 (B=17 T=32K 761.1 vs 839.6; B=28 158.9 / 1189.3 vs 167.7 / 1249.9; B=32 and 64
    by 0.2-1.7%): the target GPU decides."""
    return num_sms > 0 and 9 * num_sms <= 8 * pairs < 12 * num_sms


def wave_fill(ctas: int, slots: int) -> float:
    """Busy fraction of ``slots`` resident CTA slots over the waves that ``ctas`` programs of
    equal length take (1.0 for a whole number of waves)."""
    return ctas / (cdiv(ctas, slots) * slots) if ctas > 0 and slots > 0 else 1.0


def split_wave_fill(pairs: int, num_sms: int) -> float:
    """Busy fraction of the CTA slots over the waves of the 16-bit H <= 128 split plan when the
    pairs alone fill a wave (``pairs > num_sms``: one split, 4 stages, one CTA per SM; 4 splits
    at 2 stages, 3 CTAs per SM, in ``four_split_band``): e.g. B=17 at KV=8 on 132 SMs, 136
    CTAs in 2 waves of 132 = 0.52; B=20 (band) 640 in 2 waves of 396 = 0.81; B=32 0.97.
    1.0 when the pairs do not fill one wave (the plan then splits into about one wave)."""
    if num_sms <= 0 or pairs <= num_sms:
        return 1.0
    ctas, slots = (4 * pairs, 3 * num_sms) if four_split_band(pairs, num_sms) else (pairs, num_sms)
    return wave_fill(ctas, slots)


BALANCED_BELOW_FILL = 0.9  # split_wave_fill under which the 16-bit plan takes the BALANCED grid


def decode_config(head: int, dot_dtype, cache_dtype, interpret: bool, pairs: int = 0,
                  num_sms: int = 0) -> dict:  # fmt: skip
    """(BLOCK_N, num_warps, num_stages, FUSE_PROLOGUE) of the split kernel, keyed on head size,
    dot and cache dtype, and on ``pairs`` = B * KV (sequence, KV head) pairs vs ``num_sms``
    (0: unknown). H200, bf16 H=128: BLOCK_N 32..128 with 4 warps all reach ~4.4 TB/s at
    B*T >= 256K.
    int8 tiles use twice the keys (same bytes per tile) and 3 stages: B=8, T=128K 658 us vs 699
    (64, 4 stages), 664 (128, 4 stages), 850 (128, 8 warps) (session 10). With fp16 K
    (``int8x4_to_fp16``, power-of-two Q rows): B=8 / 32 628 / 2439 us, 1.52x / 1.56x the bf16
    cache. The int8 loop is instruction-issue bound (sm_90 SASS, BLOCK_N=128: 1023
    instructions per tile; 1081 with bf16 K, 1518 before the fp16 V conversion): it runs at
    the 255-register limit (~200 register moves per tile), and V's bytes reach the P.V MMA
    layout one byte-load each (key-major pairs); BLOCK_N 64 or 8 warps issue more per key.
    ``V_PAIRS`` (default for int8 since session 36) reads V as int16 channel pairs instead."""
    # V_PAIRS (int8 V with the fp16 P.V dot; run_decode keeps it for 2-byte aligned V caches):
    # the V tile read as int16 channel pairs into two dots (_core.load_int8_pairs), sm_90 SASS
    # BLOCK_N 128: 1023 -> 762 instructions per tile (fused prologue 993 -> 741), no per-byte
    # shared loads. H100, same process (session 36, gqa_cache_v_pairs_session36_h100.json),
    # T=128K B=1 / 8 / 32: 102.6 / 715.4 / 2757.8 -> 98.6 / 691.6 / 2701.4 us (int8 vs bf16
    # 1.76 / 1.89 / 1.94x -> 1.83 / 1.96 / 1.98x)
    v_pairs = dict(V_PAIRS=True) if cache_dtype == torch.int8 and dot_dtype.itemsize == 2 else {}
    if interpret:
        return dict(BLOCK_N=16, num_warps=4, num_stages=1, **v_pairs)
    if dot_dtype.itemsize == 4:
        return dict(BLOCK_N=32, num_warps=4, num_stages=2)
    block_n = 64 if head <= 128 else 32
    if cache_dtype == torch.int8:
        # WIDE_I8 (an option, off): the tiles read as int32 words and converted in a blocked
        # layout, the MMA operands by ldmatrix at kWidth 2: 724 instead of 1023 instructions
        # per 128-key tile (sm_90 SASS), but H100 B=8 T=128K 821.7 vs 734.8 us (B=1 114.5 vs
        # 106.0, B=32 3146 vs 2851): the fp16 round trip through shared memory costs more
        # shared-memory wavefronts than the byte loads it replaces (session 35,
        # gqa_cache_int8_wide_session35_h100.json)
        cfg = dict(BLOCK_N=2 * block_n, num_warps=4, num_stages=3, **v_pairs)
    else:
        cfg = dict(BLOCK_N=block_n, num_warps=4, num_stages=4 if head <= 128 else 3)
        if pair_count_plan(head, dot_dtype, cache_dtype):
            if split_wave_fill(pairs, num_sms) < BALANCED_BELOW_FILL:
                # more pairs than SMs, and the split plan's last wave would run part empty: the
                # BALANCED grid, 3 stages (2 CTAs per SM). H100, same process, us (split plan;
                # balanced at 4 / 3 stages; cuDNN): B=17 T=32K 865.7; 752.5 / 748.1; 782.2, B=17
                # T=4K 117.4; 105.8 / 107.6; 100.5, B=20 T=32K (band) 918.6; 880.8 / 874.0; 960.4,
                # B=28 T=32K 1291.3; 1236.9 / 1223.6; 1257.5. Where the plan fills its waves it
                # lost or tied: B=1 T=32K 54.0; 61.7 / 56.5, B=8 T=4K 53.9; 59.8 / 59.2, B=32
                # T=32K 1393.6; 1396.1 / 1389.4 (a program's second part costs a Q setup and a
                # pipeline fill; gqa_balanced_ab_h100.json)
                cfg.update(num_stages=3, BALANCED=True)
            elif four_split_band(pairs, num_sms):
                # 9/8-3/2 waves of (sequence, KV head) pairs: 2 stages (64 KB, 3 CTAs per SM)
                # and 4 splits instead of 1.1-1.5 waves of one CTA per SM (four_split_band)
                cfg["num_stages"] = 2
    # S = 1: the split kernel does the prologue's work (``_triton_prologue.fuse_prologue``).
    # H=128 same-process A/Bs on an H100 (sessions 21 and 23, ab_decode_options2_h100.json,
    # interleaved twice): never slower beyond 1%, chained graphs 1.00-1.05x (bf16 B=1 T=4K
    # 13.2 -> 12.7 us, int8 B=1 T=128K 106.2 -> 101.4), one-call graphs 0.99-1.04x.
    cfg["FUSE_PROLOGUE"] = head <= 128
    return cfg
