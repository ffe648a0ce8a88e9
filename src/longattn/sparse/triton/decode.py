"""Triton DynamicSparseAttention: grouped split-candidate kernel + log-sum-exp merge.

``dsa_split_kernel`` grid: (splits, KV, B*S). One program owns one query row ``r = b*S + s``,
one KV head and one slice (split) of the row's candidate list, and packs the ``GROUP`` query
heads of that KV head into one ``[G_PAD >= 16, HEAD_PAD]`` tile, so every gathered K/V row is
read once per group. Candidates, in the spec's order:

- window splits ``0 .. win_splits-1`` (local mode): main-cache rows ``lo + c``,
  ``lo = qpos - W + 1``, valid iff ``row real``, ``>= 0`` and ``< C``;
- selected splits ``win_splits ..``: entries ``j < min(selected_counts[r], M)`` of
  ``selected_indices[r]``; main entries valid iff ``0 <= idx <= qpos``, ``idx < C`` and (local
  mode) ``idx < lo`` (no double count); auxiliary entries valid iff ``0 <= idx < A``.

Each split is single-source, so an int8 main V's scale is applied to that split's normalized
output (exact algebra: ``sum_j p_j q_jd * s_d``). Invalid candidates are never loaded (masked
loads: NaN in unused cache rows cannot leak). Logits are in the log2 domain (the host folds
``log2(e)`` into the scale), softmax in fp32 with ``exp2``. Partials: ``o_part [R, N, splits,
HEAD]`` fp32 (normalized over the split) and ``lse_part [R, N, splits]`` (log2; -inf if empty).

``longattn._triton_merge.merge_splits`` (shared with GQA) merges the splits by log-sum-exp;
the sink (``head_sink`` or the ``smooth_softmax`` zero logit) enters the denominator exactly
once; one rounding to the output dtype. A row with nothing valid gives zeros.

Dot operands: Q in the "Q dtype" (``q_dtype_for``; rounded once; an int8 K cache has its scale
folded into Q before that rounding, so K's stored integers enter the dot exactly; with 16-bit
activations that Q is fp16 with power-of-two rows, ``q_pow2``); in local mode with an int8 main
cache, the float auxiliary keys meet a second Q without the fold (``qa_ptr``, in
``plain_q_dtype``, unscaled). A K tile enters the dot in its Q's dtype when it has that dtype
(or is int8: ``cache_to_dot``), otherwise both are upcast to fp32 (exact ``ieee`` dot). P is
rounded to the V tile's 16-bit dtype for the P.V dot (fp32 V: exact fp32 dot; int8 V: fp16,
whose integers are exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._attention_torch import prepare_from_params, scale_view
from ..._triton_merge import merge_splits
from ..._triton_prologue import (
    fold_new_row,
    fuse_prologue,
    fused_new_v,
    fused_prologue_args,
    fused_q_k,
    new_row_logits,
    pow2_q_rows,
    rotary_pos,
    store_new_row,
)
from ..._triton_utils import TL_DTYPES as _TL
from ..._triton_utils import (
    cache_to_dot,
    cdiv,
    cfg_flag,
    int8_pairs_ok,
    int8_pairs_to_fp16,
    int8_words_to_fp16,
    interleave_channels,
    next_pow2,
    pdl_kwargs,
    wait_prior_grids,
    words_aligned,
)
from ..._triton_utils import interpret as _interpret
from ..._triton_utils import num_sms as _num_sms
from ..._triton_utils import scale_strides as _scale_strides
from .._params import DSAParams

LOG2E = 1.4426950408889634
MAX_SPLITS = 128  # bound on splits per (row, KV head) (the merge loops over them)

_empty = torch.empty  # every buffer of this tier is allocated here (tests poison it with NaN)


# ---------------------------------------------------------------------------------------------
# Kernels.


@triton.jit
def _attend_tiles(
    acc, acc2, m_i, l_i, n_new, q, k_base, v_base, idx_ptr, stride_idx, stride_kc, stride_vc,
    j_start, j_load_end, j_end, lo, qpos, row_real, limit, offs_d, mask_d, qk_scale, new_pos,
    IS_WINDOW: tl.constexpr, SEL_MAIN: tl.constexpr, DEDUP: tl.constexpr,
    QK_DTYPE: tl.constexpr, QK_PREC: tl.constexpr, PV_DTYPE: tl.constexpr,
    PV_PREC: tl.constexpr, BLOCK_N: tl.constexpr, SUBST: tl.constexpr, INTERPRET: tl.constexpr,
    PREFETCH: tl.constexpr = False, WIDE_I8: tl.constexpr = False, V_PAIRS: tl.constexpr = False,
):  # fmt: skip
    """Fold candidates ``j_start .. j_end-1`` of one segment into (acc [G_PAD, HEAD_PAD], m, l);
    ``V_PAIRS`` (int8 main-cache V read as int16 channel pairs, ``_load_row_pairs``): ``acc`` /
    ``acc2`` ``[G_PAD, HEAD_PAD // 2]`` hold the even / odd channels (else ``acc2`` is unused).

    The tiles cover ``j_start .. j_load_end-1`` (``>= j_end``; the index entries there are
    read, the candidates past ``j_end`` masked): a bound the host knows lets the index loads
    go out without waiting for ``selected_counts`` (``EARLY_CNT``).

    Window segment: candidate c is main row ``lo + c``. Selected segment: candidate j is
    ``idx_ptr[j * stride_idx]``; ``limit`` is C (main) or A (auxiliary). ``SUBST`` (fused
    prologue, main-cache segments): valid candidates at row ``new_pos`` (the new token's row,
    which another program of the grid may be writing) are not loaded but counted in
    ``n_new`` (int32 scalar), for ``_fold_new_row`` after the loop.

    ``PREFETCH``: each tile's index entries are loaded one step ahead (after the previous
    tile's math, carried into the next step), as the paged kernel does with its block
    entries. Triton 3.6's pipeliner then multi-buffers the K/V gathers (``num_stages`` >= 3:
    ``num_stages - 1`` shared-memory tiles, the next tile's rows in flight during this one's
    math); with the index load inside the step it gives them one buffer (each tile waits for
    its index load, then its K/V round trip, after the previous tile's math).
    """
    if PREFETCH:
        pos, ok, nn = _tile_rows(
            idx_ptr, stride_idx, j_start, j_load_end, j_end, lo, qpos, row_real, limit,
            new_pos, IS_WINDOW, SEL_MAIN, DEDUP, BLOCK_N, SUBST,
        )  # fmt: skip
        if INTERPRET:  # numpy-2 interpreter: no tensor bounds in range()
            j0 = j_start
            while j0 < j_load_end:
                acc, acc2, m_i, l_i, n_new, pos, ok, nn = _ahead_step(
                    acc, acc2, m_i, l_i, n_new, q, pos, ok, nn, k_base, v_base, idx_ptr, stride_idx,
                    stride_kc, stride_vc, j0, j_load_end, j_end, lo, qpos, row_real, limit,
                    offs_d, mask_d, qk_scale, new_pos, IS_WINDOW, SEL_MAIN, DEDUP, QK_DTYPE,
                    QK_PREC, PV_DTYPE, PV_PREC, BLOCK_N, SUBST, WIDE_I8, V_PAIRS,
                )  # fmt: skip
                j0 += BLOCK_N
        else:
            for j0 in range(j_start, j_load_end, BLOCK_N):
                acc, acc2, m_i, l_i, n_new, pos, ok, nn = _ahead_step(
                    acc, acc2, m_i, l_i, n_new, q, pos, ok, nn, k_base, v_base, idx_ptr, stride_idx,
                    stride_kc, stride_vc, j0, j_load_end, j_end, lo, qpos, row_real, limit,
                    offs_d, mask_d, qk_scale, new_pos, IS_WINDOW, SEL_MAIN, DEDUP, QK_DTYPE,
                    QK_PREC, PV_DTYPE, PV_PREC, BLOCK_N, SUBST, WIDE_I8, V_PAIRS,
                )  # fmt: skip
    elif INTERPRET:  # numpy-2 interpreter: no tensor bounds in range()
        j0 = j_start
        while j0 < j_load_end:
            acc, acc2, m_i, l_i, n_new = _attend_tile(
                acc, acc2, m_i, l_i, n_new, q, k_base, v_base, idx_ptr, stride_idx, stride_kc,
                stride_vc, j0, j_load_end, j_end, lo, qpos, row_real, limit, offs_d, mask_d, qk_scale,
                new_pos, IS_WINDOW, SEL_MAIN, DEDUP, QK_DTYPE, QK_PREC, PV_DTYPE, PV_PREC,
                BLOCK_N, SUBST, WIDE_I8, V_PAIRS,
            )  # fmt: skip
            j0 += BLOCK_N
    else:
        for j0 in range(j_start, j_load_end, BLOCK_N):
            acc, acc2, m_i, l_i, n_new = _attend_tile(
                acc, acc2, m_i, l_i, n_new, q, k_base, v_base, idx_ptr, stride_idx, stride_kc,
                stride_vc, j0, j_load_end, j_end, lo, qpos, row_real, limit, offs_d, mask_d, qk_scale,
                new_pos, IS_WINDOW, SEL_MAIN, DEDUP, QK_DTYPE, QK_PREC, PV_DTYPE, PV_PREC,
                BLOCK_N, SUBST, WIDE_I8, V_PAIRS,
            )  # fmt: skip
    return acc, acc2, m_i, l_i, n_new


@triton.jit
def _tile_rows(
    idx_ptr, stride_idx, j0, j_load_end, j_end, lo, qpos, row_real, limit, new_pos,
    IS_WINDOW: tl.constexpr, SEL_MAIN: tl.constexpr, DEDUP: tl.constexpr,
    BLOCK_N: tl.constexpr, SUBST: tl.constexpr,
):  # fmt: skip
    """``(pos [BLOCK_N] int32 (0 where not loaded), ok [BLOCK_N], n_new)`` of the tile of
    candidate slots ``j0 ..``: the cache rows to load and which to fold in (see
    ``_attend_tiles``); ``n_new`` (``SUBST``) counts the valid candidates at ``new_pos``,
    which are left out of ``ok``."""
    offs_j = j0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] candidate slots
    in_range = offs_j < j_end
    if IS_WINDOW:
        pos = lo + offs_j.to(tl.int64)  # [BLOCK_N] main rows
        ok = in_range & (pos >= 0) & (pos < limit) & row_real
    else:
        pos = tl.load(idx_ptr + offs_j.to(tl.int64) * stride_idx, mask=offs_j < j_load_end,
                      other=-1)  # fmt: skip
        pos = pos.to(tl.int64)  # [BLOCK_N]
        ok = in_range & (pos >= 0) & (pos < limit) & row_real
        if SEL_MAIN:
            ok = ok & (pos <= qpos)
            if DEDUP:
                ok = ok & (pos < lo)  # inside the window: already a candidate
    n_new = tl.zeros([], dtype=tl.int32)
    if SUBST:
        is_new = ok & (pos == new_pos)  # [BLOCK_N]
        n_new = tl.sum(is_new.to(tl.int32), 0)
        ok = ok & (pos != new_pos)
    # in-head offsets fit int32 (the host checks C * stride < 2**31); the base is int64
    return tl.where(ok, pos, 0).to(tl.int32), ok, n_new


@triton.jit
def _load_rows(base, pos, ok, stride, offs_d, mask_d, WIDE_I8: tl.constexpr = False):
    """The cache rows ``pos [BLOCK_N]`` where ``ok`` (zeros elsewhere): ``[BLOCK_N, HEAD_PAD]``
    (``mask_d``: a constant when HEAD == HEAD_PAD). ``WIDE_I8`` (int8 rows, HEAD == HEAD_PAD;
    the host checks 4-byte alignment): the rows read as int32 words and returned as exact
    fp16 (``_triton_utils.int8_words_to_fp16``)."""
    WIDE: tl.constexpr = WIDE_I8 and base.dtype.element_ty == tl.int8
    HEAD_PAD: tl.constexpr = offs_d.shape[0]
    if WIDE:  # int32 words of 4 channels: [BLOCK_N, HEAD_PAD // 4] (HEAD == HEAD_PAD)
        w = _load_row_words(base, pos, ok, stride, HEAD_PAD, tl.int32)
        t = int8_words_to_fp16(w, pos.shape[0], HEAD_PAD)
    else:
        ld_mask = ok[:, None] & mask_d[None, :]  # [BLOCK_N, HEAD_PAD]
        t = tl.load(base + (pos[:, None] * stride + offs_d[None, :]), mask=ld_mask, other=0)
    return t


@triton.jit
def _load_row_words(base, pos, ok, stride, HEAD_PAD: tl.constexpr, WORD: tl.constexpr):
    """int8 cache rows ``pos`` where ``ok`` (zeros elsewhere) read as ``WORD`` (int16 / int32)
    words: ``[BLOCK_N, HEAD_PAD // word_bytes]`` (HEAD == HEAD_PAD; the host checks that the
    base and ``stride`` are multiples of the word)."""
    STEP: tl.constexpr = WORD.primitive_bitwidth // 8  # channels per word
    cols = tl.arange(0, HEAD_PAD // STEP)  # [HEAD_PAD // STEP]
    ptrs = base.to(tl.pointer_type(WORD)) + (pos[:, None] * (stride // STEP) + cols[None, :])
    return tl.load(ptrs, mask=ok[:, None], other=0)


@triton.jit
def _load_row_pairs(base, pos, ok, stride, HEAD_PAD: tl.constexpr):
    """``V_PAIRS``: int8 cache rows ``pos`` where ``ok`` (zeros elsewhere) read as int16 words
    of two channels and returned as exact fp16 halves ``(even, odd)``, each ``[BLOCK_N,
    HEAD_PAD // 2]`` (HEAD == HEAD_PAD; the host checks 2-byte alignment)."""
    return int8_pairs_to_fp16(_load_row_words(base, pos, ok, stride, HEAD_PAD, tl.int16))


@triton.jit
def _tile_pv_pairs(acc, acc2, alpha, p, v_e, v_o, PV_PREC: tl.constexpr):
    """``_tile_pv`` with V in even / odd channel halves into ``acc`` / ``acc2``."""
    pv = p.to(tl.float16)  # [G_PAD, BLOCK_N]
    acc = acc * alpha[:, None] + tl.dot(pv, v_e, input_precision=PV_PREC)
    acc2 = acc2 * alpha[:, None] + tl.dot(pv, v_o, input_precision=PV_PREC)
    return acc, acc2


@triton.jit
def _tile_softmax(q, k, ok, m_i, l_i, qk_scale, QK_DTYPE: tl.constexpr, QK_PREC: tl.constexpr):
    """``(p [G_PAD, BLOCK_N], alpha [G_PAD], m_new, l_new)`` of the online softmax over one K
    tile ``k [BLOCK_N, HEAD_PAD]`` (cache dtype; masked slots ``~ok`` take no weight)."""
    k = cache_to_dot(k, QK_DTYPE, True)  # [BLOCK_N, HEAD_PAD]
    qk = tl.dot(q.to(QK_DTYPE), tl.trans(k), input_precision=QK_PREC)
    # qk_scale: a scalar, or [G_PAD, 1] (power-of-two Q rows: each row's inverse factor)
    s = tl.where(ok[None, :], qk * qk_scale, float("-inf"))  # [G_PAD, BLOCK_N] log2 domain
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [G_PAD]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)  # m_i = -inf -> 0
    p = tl.exp2(s - m_safe[:, None])  # [G_PAD, BLOCK_N], 0 where masked
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _tile_pv(acc, alpha, p, v, PV_DTYPE: tl.constexpr, PV_PREC: tl.constexpr):
    """``acc [G_PAD, HEAD_PAD]`` rescaled by ``alpha`` plus ``p . v`` (V tile in cache dtype)."""
    v = cache_to_dot(v, PV_DTYPE, False)  # [BLOCK_N, HEAD_PAD]
    pv = tl.dot(p.to(PV_DTYPE), v, input_precision=PV_PREC)  # [G_PAD, HEAD_PAD]
    return acc * alpha[:, None] + pv


@triton.jit
def _fold_rows(
    acc, acc2, m_i, l_i, q, pos, ok, k_base, v_base, stride_kc, stride_vc, offs_d, mask_d, qk_scale,
    QK_DTYPE: tl.constexpr, QK_PREC: tl.constexpr, PV_DTYPE: tl.constexpr,
    PV_PREC: tl.constexpr, WIDE_I8: tl.constexpr, V_PAIRS: tl.constexpr,
):  # fmt: skip
    """One tile of cache rows ``pos`` (``_tile_rows``) folded into ``(acc, acc2, m, l)``: its K
    rows loaded, the online softmax, then its V rows and ``P.V`` (the V load after the
    softmax)."""
    k = _load_rows(k_base, pos, ok, stride_kc, offs_d, mask_d, WIDE_I8)  # [BLOCK_N, HEAD_PAD]
    p, alpha, m_new, l_i = _tile_softmax(q, k, ok, m_i, l_i, qk_scale, QK_DTYPE, QK_PREC)
    if V_PAIRS:
        v_e, v_o = _load_row_pairs(v_base, pos, ok, stride_vc, offs_d.shape[0])
        acc, acc2 = _tile_pv_pairs(acc, acc2, alpha, p, v_e, v_o, PV_PREC)
    else:
        v = _load_rows(v_base, pos, ok, stride_vc, offs_d, mask_d, WIDE_I8)
        acc = _tile_pv(acc, alpha, p, v, PV_DTYPE, PV_PREC)
    return acc, acc2, m_new, l_i


@triton.jit
def _attend_tile(
    acc, acc2, m_i, l_i, n_new, q, k_base, v_base, idx_ptr, stride_idx, stride_kc, stride_vc, j0,
    j_load_end, j_end, lo, qpos, row_real, limit, offs_d, mask_d, qk_scale, new_pos, IS_WINDOW: tl.constexpr, SEL_MAIN: tl.constexpr, DEDUP: tl.constexpr,
    QK_DTYPE: tl.constexpr, QK_PREC: tl.constexpr, PV_DTYPE: tl.constexpr,
    PV_PREC: tl.constexpr, BLOCK_N: tl.constexpr, SUBST: tl.constexpr, WIDE_I8: tl.constexpr,
    V_PAIRS: tl.constexpr,
):  # fmt: skip
    """One tile: its index entries, then its rows (the default loop)."""
    pos, ok, nn = _tile_rows(
        idx_ptr, stride_idx, j0, j_load_end, j_end, lo, qpos, row_real, limit, new_pos,
        IS_WINDOW, SEL_MAIN, DEDUP, BLOCK_N, SUBST,
    )  # fmt: skip
    acc, acc2, m_i, l_i = _fold_rows(
        acc, acc2, m_i, l_i, q, pos, ok, k_base, v_base, stride_kc, stride_vc, offs_d, mask_d,
        qk_scale, QK_DTYPE, QK_PREC, PV_DTYPE, PV_PREC, WIDE_I8, V_PAIRS,
    )  # fmt: skip
    return acc, acc2, m_i, l_i, n_new + nn


@triton.jit
def _ahead_step(
    acc, acc2, m_i, l_i, n_new, q, pos, ok, nn, k_base, v_base, idx_ptr, stride_idx, stride_kc,
    stride_vc, j0, j_load_end, j_end, lo, qpos, row_real, limit, offs_d, mask_d, qk_scale,
    new_pos, IS_WINDOW: tl.constexpr, SEL_MAIN: tl.constexpr, DEDUP: tl.constexpr,
    QK_DTYPE: tl.constexpr, QK_PREC: tl.constexpr, PV_DTYPE: tl.constexpr,
    PV_PREC: tl.constexpr, BLOCK_N: tl.constexpr, SUBST: tl.constexpr, WIDE_I8: tl.constexpr,
    V_PAIRS: tl.constexpr,
):  # fmt: skip
    """``PREFETCH``: fold in tile ``j0`` (rows ``pos, ok, nn`` loaded one step earlier), then
    load the index entries of tile ``j0 + BLOCK_N`` for the next step."""
    acc, acc2, m_i, l_i = _fold_rows(
        acc, acc2, m_i, l_i, q, pos, ok, k_base, v_base, stride_kc, stride_vc, offs_d, mask_d,
        qk_scale, QK_DTYPE, QK_PREC, PV_DTYPE, PV_PREC, WIDE_I8, V_PAIRS,
    )  # fmt: skip
    pos_n, ok_n, nn_n = _tile_rows(
        idx_ptr, stride_idx, j0 + BLOCK_N, j_load_end, j_end, lo, qpos, row_real, limit,
        new_pos, IS_WINDOW, SEL_MAIN, DEDUP, BLOCK_N, SUBST,
    )  # fmt: skip
    return acc, acc2, m_i, l_i, n_new + nn, pos_n, ok_n, nn_n


@triton.jit
def dsa_split_kernel(
    q_ptr,  # [B, S, N, HEAD] prepared Q (Q dtype; int8 K: * k_scale), contiguous (unfused)
    qa_ptr,  # Q without the k_scale fold or row scaling, for auxiliary K (== q_ptr: no fold)
    kc_ptr,  # [B, KV, C, HEAD] main cache (float or int8)
    vc_ptr,
    ka_ptr,  # [B, KV, A, HEAD] auxiliary K (float; dummy without SEL_AUX)
    va_ptr,  # auxiliary V (auxiliary K when shared)
    sel_ptr,  # [B*S, M] int32/int64
    cnt_ptr,  # [B*S] int32/int64
    seqlens_ptr,  # [B] int32, total_len - 1
    vs_ptr,  # v_scale fp32 [1] or [KV, 1, HEAD] (HAS_VSCALE)
    o_part_ptr,  # [B*S, N, num_splits, HEAD] fp32
    lse_part_ptr,  # [B*S, N, num_splits] fp32
    xq_ptr,  # FUSE_PROLOGUE: the raw query [B, 1, N*HEAD] (or packed QKV's Q part)
    xk_ptr,  # FUSE_PROLOGUE: new K [B, 1, KV*HEAD]
    xv_ptr,  # FUSE_PROLOGUE: new V [B, 1, KV*HEAD]
    qn_w_ptr,  # [HEAD] (HAS_QNORM)
    kn_w_ptr,  # [HEAD] (HAS_KNORM)
    cos_ptr,  # [max_pos, ROT_DIM / 2] (HAS_ROTARY)
    sin_ptr,
    pos_ptr,  # [B, 1] int64 position ids (HAS_POS)
    ks_ptr,  # k_scale fp32 [1] or [KV, 1, HEAD] (K_QUANT)
    qs_ptr,  # [B*S, N] fp32 inverse power-of-two factors of the Q rows (HAS_QSCALE, unfused)
    seq_len,
    cap,  # C
    aux_len,  # A
    max_sel,  # M
    window,  # W (HAS_WINDOW)
    chunk,  # candidates per split (multiple of BLOCK_N)
    win_splits,  # splits of the window segment (0 without HAS_WINDOW)
    num_splits,
    stride_sel_r,
    stride_sel_j,
    stride_cnt,
    stride_kcb,
    stride_kch,
    stride_kcc,
    stride_vcb,
    stride_vch,
    stride_vcc,
    stride_kab,
    stride_kah,
    stride_kac,
    stride_vab,
    stride_vah,
    stride_vac,
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
    qk_scale,  # scale * log2(e)
    NUM_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FIRST_PROMPT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SEL_AUX: tl.constexpr,
    HAS_VSCALE: tl.constexpr,
    MAIN_QK_DTYPE: tl.constexpr,
    MAIN_QK_PREC: tl.constexpr,
    MAIN_PV_DTYPE: tl.constexpr,
    MAIN_PV_PREC: tl.constexpr,
    SEL_QK_DTYPE: tl.constexpr,
    SEL_QK_PREC: tl.constexpr,
    SEL_PV_DTYPE: tl.constexpr,
    SEL_PV_PREC: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch
    FUSE_PROLOGUE: tl.constexpr = False,  # S = 1: the prologue's work in this kernel
    Q_DTYPE: tl.constexpr = tl.bfloat16,  # FUSE_PROLOGUE: the dtype Q is rounded to
    ROT_DIM: tl.constexpr = 0,
    HAS_ROTARY: tl.constexpr = False,
    INTERLEAVED: tl.constexpr = False,
    HAS_POS: tl.constexpr = False,
    HAS_QNORM: tl.constexpr = False,
    HAS_KNORM: tl.constexpr = False,
    K_QUANT: tl.constexpr = False,
    HAS_QSCALE: tl.constexpr = False,  # Q rows scaled by powers of two (fp16 Q, int8 K)
    EARLY_CNT: tl.constexpr = False,  # index loads not waiting for selected_counts (cfg)
    PREFETCH: tl.constexpr = False,  # index entries one tile ahead (cfg; num_stages >= 3)
    WIDE_I8: tl.constexpr = False,  # int8 main-cache rows read as int32 words (_load_rows)
    V_PAIRS: tl.constexpr = False,  # int8 main V as int16 channel pairs (no SEL_AUX)
):
    split = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    row = tl.program_id(2).to(tl.int64)
    wait_prior_grids(PDL)  # the previous grid's writes are visible from here on
    b = row // seq_len
    s = row % seq_len
    total_len = tl.load(seqlens_ptr + b).to(tl.int64) + 1
    if IS_FIRST_PROMPT:
        qpos = s
    else:
        qpos = total_len - seq_len + s
    row_real = (qpos >= 0) & (qpos < total_len)  # padding rows of a first prompt see nothing
    lo = qpos - window + 1

    offs_g = tl.arange(0, G_PAD)  # [G_PAD] query head within the group
    offs_d = tl.arange(0, HEAD_PAD)  # [HEAD_PAD]
    mask_g = offs_g < GROUP
    if HEAD == HEAD_PAD:
        mask_d = tl.full([HEAD_PAD], 1, dtype=tl.int1)  # constant: row masks only, vectorized
    else:
        mask_d = offs_d < HEAD
    heads = kvh * GROUP + offs_g  # [G_PAD] query heads
    q_offs = (row * NUM_HEADS + heads)[:, None] * HEAD + offs_d[None, :]
    q_mask = mask_g[:, None] & mask_d[None, :]
    kc_base = kc_ptr + b * stride_kcb + kvh * stride_kch
    vc_base = vc_ptr + b * stride_vcb + kvh * stride_vch
    if FUSE_PROLOGUE:  # seq_len == 1: row == b
        rot_pos = rotary_pos(pos_ptr, b, qpos, stride_pb, max_pos, HAS_POS)
        q, unscale, k_new = fused_q_k(
            xq_ptr, xk_ptr, qn_w_ptr, kn_w_ptr, cos_ptr, sin_ptr, ks_ptr, b, rot_pos, kvh,
            heads, mask_g, stride_xqb, stride_xkb, stride_cos, stride_sin, stride_ks_h,
            stride_ks_d, eps, NUM_HEADS, KV_HEADS, HEAD, HEAD_PAD, ROT_DIM, HAS_ROTARY,
            INTERLEAVED, HAS_QNORM, HAS_KNORM, K_QUANT, HAS_QSCALE, Q_DTYPE,
            kc_ptr.dtype.element_ty,
        )  # fmt: skip
        row_scale = unscale  # [G_PAD] (ones without HAS_QSCALE)
        write = (qpos >= 0) & (qpos < cap) & (total_len > 0)
        new_pos = tl.where(write, qpos, -1)  # the row the new token goes to (-1: none)
    else:
        q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)  # [G_PAD, HEAD_PAD]
        if HAS_QSCALE:
            row_scale = tl.load(qs_ptr + row * NUM_HEADS + heads, mask=mask_g, other=1.0)
        new_pos = -1
    n_new = tl.zeros([], dtype=tl.int32)  # candidates at new_pos (FUSE_PROLOGUE)
    if HAS_QSCALE:  # main-cache logits: undo each Q row's power of two on the fp32 dots
        qk_row = qk_scale * row_scale  # [G_PAD]
        qk_main = qk_row[:, None]  # [G_PAD, 1]
    else:
        qk_row = qk_scale
        qk_main = qk_scale
    if FUSE_PROLOGUE:
        s_new = new_row_logits(q, k_new, MAIN_QK_DTYPE) * qk_row  # [G_PAD] log2 domain

    if V_PAIRS:  # the even / odd output channels apart until after the segments
        acc = tl.zeros([G_PAD, HEAD_PAD // 2], dtype=tl.float32)
        acc2 = tl.zeros([G_PAD, HEAD_PAD // 2], dtype=tl.float32)
    else:
        acc = tl.zeros([G_PAD, HEAD_PAD], dtype=tl.float32)
        acc2 = tl.zeros([1], dtype=tl.float32)  # (unused)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    from_main = split >= 0  # this split reads the main cache (scalar bool)
    if HAS_WINDOW:
        w0 = split * chunk
        w1 = tl.minimum(w0 + chunk, window)  # empty for selected splits
        acc, acc2, m_i, l_i, n_new = _attend_tiles(
            acc, acc2, m_i, l_i, n_new, q, kc_base, vc_base, sel_ptr, 0, stride_kcc, stride_vcc, w0,
            w1, w1, lo, qpos, row_real, cap, offs_d, mask_d, qk_main, new_pos, True, True, False, MAIN_QK_DTYPE, MAIN_QK_PREC, MAIN_PV_DTYPE, MAIN_PV_PREC, BLOCK_N,
            FUSE_PROLOGUE, INTERPRET, PREFETCH, WIDE_I8, V_PAIRS,
        )  # fmt: skip
    cnt = tl.load(cnt_ptr + row * stride_cnt).to(tl.int64)
    j0 = (split - win_splits).to(tl.int64) * chunk
    j_stop = tl.minimum(j0 + chunk, max_sel)  # the split's slots (host-known bounds)
    j1 = tl.minimum(j_stop, cnt)  # its valid entries
    j0 = tl.where(split < win_splits, j_stop, j0)  # window splits: empty selected range
    if EARLY_CNT:  # tiles over every slot, index loads beside the count load
        j_load = j_stop
    else:  # tiles up to the count (slots past it are not read)
        j_load = tl.maximum(j1, j0)
    idx_row = sel_ptr + row * stride_sel_r
    if SEL_AUX:
        from_main = split < win_splits
        ka_base = ka_ptr + b * stride_kab + kvh * stride_kah
        va_base = va_ptr + b * stride_vab + kvh * stride_vah
        if FUSE_PROLOGUE:  # (the host fuses only when Q needs no second, unfolded copy)
            qa = q
        else:
            qa = tl.load(qa_ptr + q_offs, mask=q_mask, other=0.0)  # [G_PAD, HEAD_PAD]
        acc, acc2, m_i, l_i, n_new = _attend_tiles(
            acc, acc2, m_i, l_i, n_new, qa, ka_base, va_base, idx_row, stride_sel_j, stride_kac,
            stride_vac, j0, j_load, j1, lo, qpos, row_real, aux_len, offs_d, mask_d, qk_scale, new_pos,
            False, False, False, SEL_QK_DTYPE, SEL_QK_PREC, SEL_PV_DTYPE, SEL_PV_PREC,
            BLOCK_N, False, INTERPRET, PREFETCH,
        )  # fmt: skip
    else:
        acc, acc2, m_i, l_i, n_new = _attend_tiles(
            acc, acc2, m_i, l_i, n_new, q, kc_base, vc_base, idx_row, stride_sel_j, stride_kcc,
            stride_vcc, j0, j_load, j1, lo, qpos, row_real, cap, offs_d, mask_d, qk_main, new_pos,
            False, True, HAS_WINDOW, MAIN_QK_DTYPE, MAIN_QK_PREC, MAIN_PV_DTYPE, MAIN_PV_PREC,
            BLOCK_N, FUSE_PROLOGUE, INTERPRET, PREFETCH, WIDE_I8, V_PAIRS,
        )  # fmt: skip
    if V_PAIRS:
        acc = interleave_channels(acc, acc2)  # [G_PAD, HEAD_PAD]

    if FUSE_PROLOGUE:
        # The new token's row: folded in as many times as it was a candidate (its V loaded
        # only now), and appended to the cache by split 0, after this program's reads.
        v_new = fused_new_v(xv_ptr, vs_ptr, b, kvh, stride_xvb, stride_vs_h, stride_vs_d, HEAD,
                            HEAD_PAD, HAS_VSCALE, vc_ptr.dtype.element_ty)  # fmt: skip
        acc, m_i, l_i = fold_new_row(acc, m_i, l_i, n_new, s_new, v_new, MAIN_PV_DTYPE)
        store_new_row(kc_base + new_pos * stride_kcc, vc_base + new_pos * stride_vcc, k_new,
                      v_new, (new_pos >= 0) & (split == 0), HEAD, HEAD_PAD)  # fmt: skip

    inv = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)  # [G_PAD]
    o = acc * inv[:, None]  # [G_PAD, HEAD_PAD], zeros for an empty split
    if HAS_VSCALE:  # int8 main V: its scale multiplies the split's output (per channel)
        vs = tl.load(vs_ptr + kvh * stride_vs_h + offs_d * stride_vs_d, mask=mask_d, other=1.0)
        o = o * tl.where(from_main, vs, 1.0)[None, :]
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    part = (row * NUM_HEADS + heads) * num_splits + split  # [G_PAD]
    tl.store(lse_part_ptr + part, lse, mask=mask_g)
    o_ptrs = o_part_ptr + part[:, None] * HEAD + offs_d[None, :]
    tl.store(o_ptrs, o, mask=mask_g[:, None] & mask_d[None, :])


# ---------------------------------------------------------------------------------------------
# Host side.


def q_pow2(p: DSAParams, act_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Power-of-two Q rows: an int8 main K cache with 16-bit activations and no ``query_dtype``
    asked for. Each (token, head) row of the prepared Q (k_scale folded in) is multiplied by the
    power of two that puts its largest magnitude in ``[2**14, 2**15)`` and rounded once to fp16
    (11 significant bits: never an overflow, no underflow of a small ``q * k_scale``, 3 bits
    more than bf16); the kernel undoes the factor on the fp32 dot products of the main-cache
    keys. The int8 K tiles then enter fp16 dots through ``int8x4_to_fp16`` (no I2F conversion),
    as the GQA tier's decode does. Local mode with auxiliary keys: only the folded Q (the
    window's main-cache keys) is scaled; the auxiliary keys take the unfolded Q in
    ``plain_q_dtype``."""
    return pow2_q_rows(act_dtype, cache_dtype) and p.query_dtype is None


def q_dtype_for(p: DSAParams, act_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype the prepared Q is rounded to once (and the main-cache dot dtype).

    ``p.query_dtype`` when given; else fp16 for bf16 activations with an fp16 cache (ORT's FP16
    query path: both operands carry 11 significant bits) or with power-of-two Q rows
    (``q_pow2``: int8 main K); else the activation dtype.
    """
    if p.query_dtype is not None:
        return p.query_dtype
    if act_dtype == torch.bfloat16 and cache_dtype == torch.float16:
        return torch.float16
    if q_pow2(p, act_dtype, cache_dtype):
        return torch.float16
    return act_dtype


def plain_q_dtype(p: DSAParams, act_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the second, unfolded Q (``q_plain``, the float auxiliary keys' operand
    when the main K cache is int8): ``p.query_dtype`` when given, else the activation dtype
    (the fp16 of ``q_pow2`` is the folded Q's only)."""
    return p.query_dtype or act_dtype


def _qk_operands(q_dtype: torch.dtype, k_dtype: torch.dtype) -> tuple:
    """(dot dtype, precision) of Q.K^T: Q's 16-bit dtype when K has it (or is int8), else fp32."""
    if q_dtype != torch.float32 and k_dtype in (q_dtype, torch.int8):
        return _TL[q_dtype], "tf32"  # precision is unused for 16-bit operands
    return tl.float32, "ieee"


def _pv_operands(q_dtype: torch.dtype, v_dtype: torch.dtype) -> tuple:
    """(dot dtype, precision) of P.V. P is rounded at most to Q's precision (an fp32 Q keeps
    P in fp32: rounding it to a 16-bit V's dtype cost ~1000x the fp32 error, session 24 audit):

    - 16-bit V and a 16-bit Q of no more precision (same dtype, or bf16 Q with an fp16 V): V's
      dtype (P rounded to it);
    - bf16 V with an fp16 Q: fp32 operands at tf32 precision (P keeps fp16's 10 mantissa bits,
      V is exact and never overflows as fp16 would beyond 65504);
    - int8 V with a 16-bit Q: fp16 (the integers are exact, reached by ``int8_to_fp16``'s xor +
      subtract, and P keeps 3 more bits than in bf16);
    - otherwise (an fp32 Q, or fp32 V): exact fp32."""
    if q_dtype != torch.float32 and v_dtype in (torch.float16, torch.bfloat16):
        if v_dtype == torch.bfloat16 and q_dtype == torch.float16:
            return tl.float32, "tf32"
        return _TL[v_dtype], "tf32"
    if v_dtype == torch.int8 and q_dtype != torch.float32:
        return tl.float16, "tf32"
    return tl.float32, "ieee"


def decode_config(head: int, q_dtype, cache_dtype, interpret: bool) -> dict:
    """(BLOCK_N, num_warps, num_stages; int8: maxnreg, SM_PROGRAMS, LONG_SPLIT_STAGES) of the
    split kernel, keyed on head size and dtypes.

    Gathered rows are ``HEAD * itemsize`` contiguous bytes each; ~16 KiB of K per tile.
    """
    # V_PAIRS (int8 main V, fp16 P.V; the launch keeps it for main-cache-only builds with H ==
    # HEAD_PAD and a 2-byte aligned V cache): V's rows read as int16 channel pairs, P.V as two
    # half-width dots (_load_row_pairs). H100, same process (session 36,
    # sparse_cache_v_pairs_session36_h100.json), budget 8192 T=128K, us: B=1 S=1 26.53 ->
    # 25.22, B=1 S=8 98.34 -> 73.34, B=4 S=1 50.11 -> 43.49, B=4 S=8 260.03 -> 199.68
    v_pairs = dict(V_PAIRS=True) if cache_dtype == torch.int8 and q_dtype != torch.float32 else {}
    if interpret:
        return dict(BLOCK_N=16, num_warps=4, num_stages=1, **v_pairs)
    if q_dtype == torch.float32:
        return dict(BLOCK_N=16 if head > 128 else 32, num_warps=4, num_stages=2)
    # sm_90 compile (offline): H=256/BLOCK_N=32 and H<=128/BLOCK_N=64 at 4 warps use <= ~240
    # registers without spills (int8 included); larger tiles spill. H200 sweep (benchmarks/
    # results/tune_dsa_h200.json, H=256 bf16, T=128K): 2 stages are as fast or faster than 3-4
    # at every (B, S) and splits count (a split holds only a few tiles).
    cfg = dict(BLOCK_N=64 if head <= 128 else 32, num_warps=4, num_stages=2 if head > 128 else 3)
    if cache_dtype == torch.int8:
        # The int8 build holds 209 (H=256) / 238 (H=128) registers: 2 programs per SM, so the
        # plan's 4 per SM ran ~1.3-2 waves. Capped at 168 (3 per SM; H=256 spills 40 bytes,
        # H=128 none) with the plan at one wave of them. Same-process A/B on an H100
        # (ab_decode_options_h100.json, H=256, budget 8192, T=128K), uncapped -> this:
        # B=1 S=1 33.2 -> 27.3 us, S=8 153.8 -> 106.8; B=4 S=1 64.1 -> 54.6, S=8 455.9 -> 286.9.
        # At the cap only H=256's 2-stage build spills, and it was never the fastest (H100
        # same-process rows, sparse_cache_h100.json / ab_decode_options2_h100.json, stages
        # 1 / 2 / 3 in us): B=1 S=1 (3 tiles per split) 26.4 / 27.3 / 26.9-29.9, B=4 S=1 (11)
        # 53.4 / 54.4 / 52.1, B=1 S=8 (29) 110.9 / 106.7 / 101.6, B=4 S=8 (86) 312.2 / 287.4
        # / 270.3. So 1 stage, and 3 for splits of >= 8 tiles (LONG_SPLIT_STAGES).
        # Those long splits also load their index entries one tile ahead (PREFETCH, see
        # _attend_tiles). H100, same process, two runs, us, 3 stages without -> with
        # (sparse_cache_prefetch_session34_h100.json): B=4 S=1 (11 tiles) 56.8 / 56.0 ->
        # 49.4 / 48.9, B=1 S=8 (29) 114.1 / 115.3 -> 98.2 / 96.2, B=4 S=8 (86) 309.8 / 307.8
        # -> 258.1 / 258.3; the 3-tile splits of B=1 S=1 gained nothing (26.5 / 26.8 -> 28.0
        # / 26.9). Not yet timed on an H200.
        # WIDE_I8 (an option, off; _load_rows): the rows read as int32 words, both dots from
        # ldmatrix operands: sm_90 SASS 726 -> 571 instructions per tile (1 stage, 127
        # registers), but H100 budget 8192 T=128K 2-6% slower (B=1 S=1 27.62 vs 26.46 us, B=1
        # S=8 103.78 vs 98.21, B=4 S=1 51.84 vs 49.98, B=4 S=8 268.51 vs 260.99; session 35,
        # sparse_cache_int8_wide_session35_h100.json)
        cfg.update(maxnreg=168, SM_PROGRAMS=3, LONG_SPLIT_STAGES=3, LONG_SPLIT_PREFETCH=True,
                   **v_pairs)  # fmt: skip
        if head > 128:
            cfg["num_stages"] = 1
    return cfg


PREFETCH_STAGES = 3  # least pipeline depth of a PREFETCH launch (2 K/V tiles in shared memory)
LONG_SPLIT_TILES = 8  # a split of at least this many BLOCK_N tiles is a long one


def is_long_split(chunk: int, block_n: int) -> bool:
    """Whether splits of ``chunk`` candidates hold at least LONG_SPLIT_TILES tiles (they take
    the config's ``LONG_SPLIT_STAGES`` and ``LONG_SPLIT_PREFETCH``)."""
    return chunk >= LONG_SPLIT_TILES * block_n


def stages_for_chunk(num_stages: int, long_split_stages, chunk: int, block_n: int) -> int:
    """The split kernel's pipeline depth for splits of ``chunk`` candidates: the config's
    ``LONG_SPLIT_STAGES`` (a positive int; None: no change) for long splits
    (``is_long_split``), else ``num_stages``."""
    if long_split_stages is None or not is_long_split(chunk, block_n):
        return num_stages
    return long_split_stages


def _pop_positive_int(cfg: dict, key: str) -> int | None:
    """Remove host-side key ``key`` from ``cfg`` (it is no kernel argument) and return it: a
    positive int, or None when absent; anything else (a float or bool would silently change
    the plan) is a ValueError naming the key."""
    value = cfg.pop(key, None)
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"cfg[{key!r}] must be a positive int, got {value!r}")
    return value


def plan_splits(
    rows: int, kv: int, window: int, max_sel: int, block_n: int, num_sms: int, num_splits=None,
    sm_programs: int | None = None,
) -> tuple[int, int, int]:  # fmt: skip
    """``(chunk, win_splits, sel_splits)`` from host-known sizes only (no sync).

    ``rows * kv * (win_splits + sel_splits)`` programs should fill the SMs about twice, four
    times when there are at most 16 (row, KV head) pairs (H200, B=4 S=1 T=128K: 33 splits
    22.8 us vs 17 splits 25.3 us; at B=4 S=8 more splits are slower); each split at least one
    tile of ``block_n`` candidates; at most ``MAX_SPLITS`` in all. ``sm_programs`` (the
    config's ``SM_PROGRAMS``: programs of its build resident per SM, None: no cap) caps the
    grid at one wave of them (an int8 build at 209 registers holds 2 per SM, so the bf16
    rule's four per SM would run two waves). ``num_splits`` (tuning hook) asks for about that
    many splits in all.
    """
    cand = max(window, 0) + max_sel
    pairs = max(rows * kv, 1)
    want = num_splits or cdiv((4 if pairs <= 16 else 2) * num_sms, pairs)
    if sm_programs and not num_splits:
        want = min(want, max(1, sm_programs * num_sms // pairs))
    want = max(1, min(want, MAX_SPLITS - 1))
    chunk = max(block_n, cdiv(cdiv(max(cand, 1), want), block_n) * block_n)
    win = cdiv(window, chunk) if window > 0 else 0
    sel = max(1, cdiv(max_sel, chunk))
    return chunk, win, sel


def triton_prologue_fits(p: DSAParams) -> bool:
    """The GQA Triton prologue handles everything but a rotary offset."""
    return not (p.do_rotary and p.rotary_offset != 0)


def run_prologue(query, key, value, present_key, present_value, seqlens_k, p, q_rot, use_triton,
                 q_plain=None, q_scale=None):  # fmt: skip
    """QK-norm + rotary of Q (-> ``q_rot [B, S, N, H]``, int8 K: ``* k_scale`` then one
    rounding) and of the new K; K (rounded/quantized once) and raw V appended at rows qpos.
    ``q_plain`` (torch path only): also Q without the k_scale fold or row scaling (for
    auxiliary keys), rounded once to its own dtype (``plain_q_dtype``).
    ``q_scale [B, S, N]`` fp32 (``q_pow2``): receives each Q row's inverse power of two (the
    rows of ``q_rot`` are scaled by it, see ``q_pow2``).

    ``use_triton``: the GQA tier's one-pass Triton prologue (``gqa.triton.launch.run_prologue``,
    whose contract DSAParams satisfies); else the shared torch prologue (fp32 math).
    """
    if use_triton:
        from ...gqa.triton.launch import run_prologue as gqa_prologue

        gqa_prologue(query, key, value, present_key, present_value, seqlens_k, p, q_rot, q_scale)
        return

    qf, _, _ = prepare_from_params(
        query, key, value, present_key, present_value, seqlens_k, p, dtype=torch.float32
    )
    if q_plain is not None:
        q_plain.copy_(qf)
    if present_key.dtype == torch.int8:  # fold the K scale into Q before its one rounding
        g = p.group
        ks = scale_view(p.k_scale, kv_axis=-2).to(torch.float32)  # [] or [KV, H]
        if ks.dim() == 2:
            ks = ks.repeat_interleave(g, 0)  # [N, H]
        qf = qf * ks
    if q_scale is not None:
        qf, unscale = pow2_rows_torch(qf)
        q_scale.copy_(unscale)
    q_rot.copy_(qf)


def q_buffers(query: torch.Tensor, present_key: torch.Tensor,
              p: DSAParams) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``(q_rot [B, S, N, H]`` in ``q_dtype_for``, ``q_scale [B, S, N]`` fp32 or None``)``: the
    prepared Q the prologue writes (``q_scale`` with ``q_pow2``)."""
    b, s = query.shape[:2]
    n, h = p.num_heads, p.head_size
    q_rot = _empty((b, s, n, h), dtype=q_dtype_for(p, query.dtype, present_key.dtype),
                   device=query.device)  # fmt: skip
    pow2 = q_pow2(p, query.dtype, present_key.dtype)
    q_scale = _empty((b, s, n), dtype=torch.float32, device=query.device) if pow2 else None
    return q_rot, q_scale


def pow2_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_triton_prologue.pow2_rows`` in torch, bit for bit: rows (last axis) of fp32 ``x``
    times ``2**(14 - e)``, ``e = floor(log2(max |row|))`` clamped to ``[-112, 127]``; returns
    ``(scaled, 2**(e - 14))``."""
    amax = x.abs().amax(-1)
    e = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
    e = e.clamp(-112, 127)
    up = ((141 - e) << 23).view(torch.float32)
    down = ((113 + e) << 23).view(torch.float32)
    return x * up[..., None], down


def dsa_triton(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    present_key: torch.Tensor,
    present_value: torch.Tensor,
    auxiliary_key: torch.Tensor | None,
    auxiliary_value: torch.Tensor | None,
    selected_indices: torch.Tensor,
    selected_counts: torch.Tensor,
    seqlens_k: torch.Tensor,
    p: DSAParams,
    *,
    cfg: dict | None = None,
    num_splits: int | None = None,
    prologue: str | None = None,
    prepared: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Triton DynamicSparseAttention tier (contract in ``sparse/_params.py``); any S.

    query ``[B, S, N*H]`` (or packed), key/value ``[B, S, KV*H]`` or None; present_key/value
    ``[B, KV, C, H]`` (float or int8 + scales) written in place at rows qpos; auxiliary K/V
    ``[B, KV, A, H]`` float (local_plus_selected); selected_indices ``[B*S, M]`` int32/int64;
    selected_counts ``[B*S]``; seqlens_k ``[B]`` int32. Returns ``[B, S, N*H]`` in query's
    dtype. No host synchronization (CUDA-graph capturable). ``cfg`` (BLOCK_N / num_warps /
    num_stages / FUSE_PROLOGUE / SM_PROGRAMS / LONG_SPLIT_STAGES / PREFETCH), ``num_splits`` and
    ``prologue`` ("triton" | "torch") are tuning/test hooks. ``FUSE_PROLOGUE`` (see
    ``_triton_prologue.fuse_prologue``): at S = 1 the split kernel does the prologue's work
    itself (one launch fewer). ``prepared``: ``(q_rot, q_scale)`` of ``q_buffers`` that a
    Triton prologue already filled (and whose K/V it appended): the sparse layer runs it
    beside its select kernel (``sparse.triton.layer``); no prologue here then.
    ``SM_PROGRAMS`` (a positive int): the split plan's wave cap (see ``plan_splits``).
    ``LONG_SPLIT_STAGES``: the pipeline depth of long splits (see ``stages_for_chunk``).
    ``PREFETCH`` (bool, off): the split loop loads each tile's index entries one step ahead
    (see ``_attend_tiles``; launched with at least PREFETCH_STAGES stages);
    ``LONG_SPLIT_PREFETCH`` (bool; on for int8 caches): the same for long splits only
    (``is_long_split``). ``WIDE_I8`` (bool, off): int8 main-cache rows read as int32 words
    (``_load_rows``; kept off where H != HEAD_PAD or the caches are not 4-byte aligned).
    ``V_PAIRS`` (bool; on for int8 caches): int8 main-cache V read as int16 channel pairs
    (``_load_row_pairs``; kept off with auxiliary keys, under ``WIDE_I8``, where H !=
    HEAD_PAD, for an fp32 P.V and for a V cache not 2-byte aligned).
    """
    b, s = query.shape[:2]
    n, kv, h, g = p.num_heads, p.kv_num_heads, p.head_size, p.group
    rows = b * s
    dev = query.device
    out = _empty((b, s, n * h), dtype=query.dtype, device=dev)
    if out.numel() == 0:
        return out
    q_dtype = q_dtype_for(p, query.dtype, present_key.dtype)
    pow2 = q_pow2(p, query.dtype, present_key.dtype)
    sel_aux = p.selected_kv_source == "auxiliary"
    # int8 main K with auxiliary keys: the aux dot needs Q without the k_scale fold (torch path)
    two_q = sel_aux and present_key.dtype == torch.int8
    use_triton = triton_prologue_fits(p) if prologue is None else prologue == "triton"
    use_triton = use_triton and not two_q
    cfg = dict(cfg or decode_config(h, q_dtype, present_key.dtype, _interpret()))
    # index loads beside the count load: rows of a subsequent prompt or decode step choose
    # about the full budget (a first prompt's early rows choose few: their splits past the
    # count would run masked tiles); H100 session 28 in the layer's "early" options
    cfg["EARLY_CNT"] = cfg_flag(cfg, "EARLY_CNT", not p.is_first_prompt)
    sm_programs = _pop_positive_int(cfg, "SM_PROGRAMS")  # the split plan's wave cap
    long_stages = _pop_positive_int(cfg, "LONG_SPLIT_STAGES")  # see stages_for_chunk
    # checked here, before the prologue appends to the caches (a bad cfg leaves them as they were)
    prefetch = cfg_flag(cfg, "PREFETCH", False, what="DSA cfg")
    long_prefetch = cfg_flag(cfg, "LONG_SPLIT_PREFETCH", False, what="DSA cfg")
    cfg.pop("LONG_SPLIT_PREFETCH", None)  # host-side: decides PREFETCH below
    wide = cfg_flag(cfg, "WIDE_I8", False, what="DSA cfg")
    head_pad = max(16, next_pow2(h))
    cfg["WIDE_I8"] = wide and h == head_pad and words_aligned(present_key, present_value)
    v_pairs = cfg_flag(cfg, "V_PAIRS", False, what="DSA cfg")
    fuse = fuse_prologue(cfg, s, use_triton and prepared is None)
    q_scale = None
    if fuse:
        q_rot = q_plain = None
        fused = fused_prologue_args(query, key, value, p, q_dtype, present_key.dtype)
    else:
        if prepared is not None:
            if two_q:
                raise ValueError("a prepared Q cannot serve auxiliary keys with an int8 K cache")
            (q_rot, q_scale), q_plain = prepared, None
        else:
            q_rot, q_scale = q_buffers(query, present_key, p)
            qa_dtype = plain_q_dtype(p, query.dtype)  # the aux dots' Q (unfolded, unscaled)
            q_plain = _empty((b, s, n, h), dtype=qa_dtype, device=dev) if two_q else None
            run_prologue(query, key, value, present_key, present_value, seqlens_k, p, q_rot,
                         use_triton, q_plain, q_scale)  # fmt: skip
        fused = fused_prologue_args(None, None, None, p, q_dtype, present_key.dtype)
    m_sel = selected_indices.shape[1]
    window = p.local_window_size if p.local else 0
    dev_index = dev.index if dev.type == "cuda" else 0
    chunk, win_splits, sel_splits = plan_splits(
        rows, kv, window, m_sel, cfg["BLOCK_N"], _num_sms(dev_index), num_splits, sm_programs
    )
    cfg["num_stages"] = stages_for_chunk(cfg["num_stages"], long_stages, chunk, cfg["BLOCK_N"])
    if prefetch or (long_prefetch and is_long_split(chunk, cfg["BLOCK_N"])):
        cfg["PREFETCH"] = True  # K/V tiles multi-buffered
        cfg["num_stages"] = max(cfg["num_stages"], PREFETCH_STAGES)
    splits = win_splits + sel_splits
    o_part = _empty((rows, n, splits, h), dtype=torch.float32, device=dev)
    lse_part = _empty((rows, n, splits), dtype=torch.float32, device=dev)

    aux_k = auxiliary_key if sel_aux else present_key
    aux_v = (auxiliary_key if p.auxiliary_kv_shared else auxiliary_value) if sel_aux else aux_k
    quant_v = present_value.dtype == torch.int8
    vs_h, vs_d = _scale_strides(p.v_scale if quant_v else None)
    main_qk = _qk_operands(q_dtype, present_key.dtype)
    main_pv = _pv_operands(q_dtype, present_value.dtype)
    sel_q = q_plain.dtype if q_plain is not None else q_dtype
    sel_qk = _qk_operands(sel_q, aux_k.dtype) if sel_aux else main_qk
    sel_pv = _pv_operands(sel_q, aux_v.dtype) if sel_aux else main_pv
    cfg["V_PAIRS"] = (  # the main-cache segments only: no auxiliary segment in the build
        v_pairs
        and not cfg["WIDE_I8"]
        and not sel_aux
        and h == head_pad
        and int8_pairs_ok(present_value, main_pv[0] == tl.float16)
    )
    q_any = query if q_rot is None else q_rot  # (a dummy pointer when fused)
    dsa_split_kernel[(splits, kv, rows)](
        **pdl_kwargs(query),
        q_ptr=q_any,
        qa_ptr=q_plain if two_q else q_any,
        kc_ptr=present_key,
        vc_ptr=present_value,
        ka_ptr=aux_k,
        va_ptr=aux_v,
        sel_ptr=selected_indices,
        cnt_ptr=selected_counts,
        seqlens_ptr=seqlens_k,
        vs_ptr=p.v_scale if quant_v else q_any,
        qs_ptr=q_scale if q_scale is not None else q_any,
        o_part_ptr=o_part,
        lse_part_ptr=lse_part,
        seq_len=s,
        cap=present_key.shape[2],
        aux_len=aux_k.shape[2],
        max_sel=m_sel,
        window=window,
        chunk=chunk,
        win_splits=win_splits,
        num_splits=splits,
        stride_sel_r=selected_indices.stride(0),
        stride_sel_j=selected_indices.stride(1),
        stride_cnt=selected_counts.stride(0),
        stride_kcb=present_key.stride(0),
        stride_kch=present_key.stride(1),
        stride_kcc=present_key.stride(2),
        stride_vcb=present_value.stride(0),
        stride_vch=present_value.stride(1),
        stride_vcc=present_value.stride(2),
        stride_kab=aux_k.stride(0),
        stride_kah=aux_k.stride(1),
        stride_kac=aux_k.stride(2),
        stride_vab=aux_v.stride(0),
        stride_vah=aux_v.stride(1),
        stride_vac=aux_v.stride(2),
        stride_vs_h=vs_h,
        stride_vs_d=vs_d,
        qk_scale=p.scale * LOG2E,
        NUM_HEADS=n,
        KV_HEADS=kv,
        GROUP=g,
        HEAD=h,
        HEAD_PAD=head_pad,
        G_PAD=max(16, next_pow2(g)),
        IS_FIRST_PROMPT=p.is_first_prompt,
        HAS_WINDOW=window > 0,
        SEL_AUX=sel_aux,
        HAS_VSCALE=quant_v,
        MAIN_QK_DTYPE=main_qk[0],
        MAIN_QK_PREC=main_qk[1],
        MAIN_PV_DTYPE=main_pv[0],
        MAIN_PV_PREC=main_pv[1],
        SEL_QK_DTYPE=sel_qk[0],
        SEL_QK_PREC=sel_qk[1],
        SEL_PV_DTYPE=sel_pv[0],
        SEL_PV_PREC=sel_pv[1],
        INTERPRET=_interpret(),
        HAS_QSCALE=pow2,
        **fused,
        **cfg,
    )
    merge_splits(o_part, lse_part, out, num_heads=n, head_sink=p.head_sink,
                 smooth_softmax=p.smooth_softmax)  # fmt: skip
    return out
