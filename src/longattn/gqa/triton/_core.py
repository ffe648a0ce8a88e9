"""Reusable Triton building blocks of the attention kernels (GQA now; Paged/DynamicSparse later).

Conventions shared by every piece:
- Logits live in the log2 domain: ``s = log2(e) * x`` where ``x`` is the natural-units logit of
  spec.md (``scale * q.k``, softcap, + bias). The host folds ``log2(e)`` into the scalars, so the
  softmax uses ``exp2`` only. An ``lse`` is ``m + log2(l)`` in the same domain.
- All math is fp32. The only roundings are the dot operands (Q in the dot dtype, P rounded to
  the V dtype for the P.V dot) and the one final rounding of the output.
- Masked logits are ``-inf``; a row that saw nothing keeps ``m = -inf, l = 0`` and ends as zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..._triton_utils import INT8_SHIFT, cache_to_dot, int8_pairs_to_fp16, int8_words_to_fp16

LOG2E = 1.4426950408889634


@triton.jit
def softcap_log2(qk, qk_scale, softcap_mult, PRECISE: tl.constexpr = False):
    """``softcap_mult * tanh(qk * qk_scale)`` as ``c - 2c / (exp(2y) + 1)`` (c = softcap_mult,
    y = qk * qk_scale): one multiply, exp2, add, reciprocal-divide and FMA per logit, sign and
    saturation included (exp2 -> inf gives c, -> 0 gives -c). The subtraction cancels near
    y = 0: an absolute error of ~c * 2**-23 instead of a tanh's ~|c * y| * 2**-23, below the
    rounding of 16-bit Q / K but ~15x an fp32 computation's output error at c = 50 (session 24
    audit). ``PRECISE`` (fp32 dots): |y| < 0.5 takes tanh's odd Taylor polynomial through y**15
    (truncation < 5e-9 relative), 8 more FMAs per logit."""
    y = qk * qk_scale
    e = tl.exp2(y * 2.8853900817779268)  # exp(2y)
    s = softcap_mult - (2.0 * softcap_mult) / (e + 1.0)
    if PRECISE:
        y2 = y * y
        p = -0.0014558343870513183 * y2 + 0.0035921280365724811
        p = p * y2 - 0.0088632355299021966
        p = p * y2 + 0.021869488536155203
        p = p * y2 - 0.053968253968253968
        p = p * y2 + 0.13333333333333333
        p = p * y2 - 0.33333333333333333
        p = p * y2 + 1.0
        s = tl.where(tl.abs(y) < 0.5, softcap_mult * (y * p), s)
    return s


@triton.jit
def load_total_len(seqlens_ptr, b, max_total):
    """Total length of sequence ``b`` (``seqlens_k[b] + 1``) clamped into ``[0, max_total]``.

    ``max_total`` is T (total_sequence_length): the caches hold >= T rows, so metadata that was
    not validated on the host (CUDA-graph capture, torch.compile, ``validate=False``) can never
    make a kernel read past them; such a sequence gets an undefined but in-bounds result.
    """
    t = tl.load(seqlens_ptr + b) + 1
    return tl.minimum(tl.maximum(t, 0), max_total)


@triton.jit
def new_row_span(total_len, seq_len, IS_FIRST_PROMPT: tl.constexpr):
    """(offset, rows_valid) of a call's S new rows in a sequence of total_len tokens:
    row s sits at position s + offset; rows >= rows_valid are right padding (first prompt) and
    give zeros."""
    if IS_FIRST_PROMPT:
        offset = 0
        rows_valid = tl.minimum(seq_len, total_len)
    else:
        offset = total_len - seq_len
        rows_valid = seq_len
    return offset, rows_valid


@triton.jit
def prefill_key_range(offset, rows_valid, total_len, m0, window, BLOCK_M: tl.constexpr,
                      HAS_WINDOW: tl.constexpr):  # fmt: skip
    """(q_lo, q_hi, kv_lo, kv_hi) of the row tile [m0, m0 + BLOCK_M): the positions of its
    first and last valid rows and the keys [kv_lo, kv_hi) any of them sees (causal, window);
    a tile of padding rows only (m0 >= rows_valid) gets no keys."""
    q_lo = offset + m0
    q_hi = offset + tl.minimum(m0 + BLOCK_M, rows_valid) - 1
    kv_hi = tl.where(m0 < rows_valid, tl.minimum(q_hi + 1, total_len), 0)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(q_lo - window + 1, 0)
    return q_lo, q_hi, tl.minimum(kv_lo, kv_hi), kv_hi


@triton.jit
def load_row_scale(qs_ptr, b64, seq_len, s_idx, n_idx, row_ok, NUM_HEADS: tl.constexpr,
                   HAS_QSCALE: tl.constexpr):  # fmt: skip
    """Per-row dot factor of a power-of-two-scaled Q (``qs [B, S, N]`` fp32 at rows (s_idx,
    n_idx) of sequence ``b64``) as ``[M, 1]``, or the scalar 1.0 without ``HAS_QSCALE``."""
    scale = 1.0
    if HAS_QSCALE:
        rows = qs_ptr + (b64 * seq_len + s_idx) * NUM_HEADS + n_idx  # [M]
        scale = tl.load(rows, mask=row_ok, other=1.0)[:, None]  # [M, 1]
    return scale


@triton.jit
def scores(
    q,  # [M, HEAD] dot dtype
    k,  # [BLOCK_N, HEAD] dot dtype
    qk_scale,  # scale * log2(e) without softcap; scale / softcap with softcap
    row_scale,  # [M, 1] fp32 factor of each row's dot (a power-of-two-scaled Q), or 1.0
    softcap_mult,  # softcap * log2(e) (used only with HAS_SOFTCAP)
    bias,  # [M, BLOCK_N] fp32 natural-units bias (used only with HAS_BIAS)
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Logits of one K tile (mask not applied) as ``(s [M, BLOCK_N] fp32, unit)``: ``s * unit``
    is the log2-domain logit. Plain logits stay raw dot products (``unit = qk_scale *
    row_scale > 0``), so the softmax folds the scale into one FMA with the max subtraction;
    softcap/bias logits come out scaled (``unit = 1``)."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [M, BLOCK_N] fp32
    return logits(qk, qk_scale, row_scale, softcap_mult, bias, HAS_SOFTCAP, HAS_BIAS, DOT_PREC)


@triton.jit
def scores_pairs(
    q_e, q_o, k_e, k_o, qk_scale, row_scale, softcap_mult, bias, HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """``scores`` with Q and K in even / odd channel halves (``[M, HEAD // 2]``, ``[BLOCK_N,
    HEAD // 2]``; ``load_int8_pairs``): two dots of half depth into one fp32 product."""
    qk = tl.dot(q_e, tl.trans(k_e), input_precision=DOT_PREC)  # [M, BLOCK_N] fp32
    qk = tl.dot(q_o, tl.trans(k_o), qk, input_precision=DOT_PREC)
    return logits(qk, qk_scale, row_scale, softcap_mult, bias, HAS_SOFTCAP, HAS_BIAS, DOT_PREC)


@triton.jit
def logits(qk, qk_scale, row_scale, softcap_mult, bias, HAS_SOFTCAP: tl.constexpr,
           HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """``(s, unit)`` of ``scores`` from the raw dot products ``qk [M, BLOCK_N]`` fp32."""
    if HAS_SOFTCAP:
        s = softcap_log2(qk * row_scale, qk_scale, softcap_mult, DOT_PREC == "ieee")
        unit = 1.0
    elif HAS_BIAS:
        s = qk * (qk_scale * row_scale)
        unit = 1.0
    else:
        s = qk
        unit = qk_scale * row_scale  # scalar or [M, 1]: folded into the softmax's FMA
    if HAS_BIAS:
        s = s + bias * 1.4426950408889634
    return s, unit


@triton.jit
def causal_window_mask(
    qpos,  # [M] int32 absolute query positions
    offs_n,  # [BLOCK_N] int32 absolute key positions
    kv_hi,  # keys >= kv_hi are invalid (scalar or [M])
    window,  # W (used only with HAS_WINDOW)
    HAS_WINDOW: tl.constexpr,
):
    """``[M, BLOCK_N]`` bool: key j visible to the query at qpos (causal, length, window)."""
    mask = (offs_n[None, :] <= qpos[:, None]) & (offs_n[None, :] < kv_hi)
    if HAS_WINDOW:
        mask = mask & (offs_n[None, :] > qpos[:, None] - window)
    return mask


@triton.jit
def online_softmax_step(acc, m_i, l_i, s, unit, v, DOT_PREC: tl.constexpr):
    """Fold one tile into the running (acc [M, HEAD], m [M], l [M]) state.

    s: [M, BLOCK_N] fp32 logits, -inf where masked, with ``s * unit`` in the log2 domain
    (``unit > 0``, a scalar or per-row ``[M, 1]``: the max commutes with it); v: [BLOCK_N,
    HEAD] dot dtype. The P.V product
    accumulates into the rescaled acc on the tensor cores.
    """
    p, alpha, m_new, l_i = softmax_weights(m_i, l_i, s, unit)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def softmax_weights(m_i, l_i, s, unit):
    """``(p [M, BLOCK_N], alpha [M], m_new [M], l_new [M])`` of one tile of logits ``s`` (see
    ``online_softmax_step``): the tile's weights, the rescale factor of the running state, and
    the new running max and denominator."""
    # unit: scalar or [M, 1]; the size-1 max only drops the column axis
    m_new = tl.maximum(m_i, tl.max(tl.max(s, 1)[:, None] * unit, 1))  # [M]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet stay finite
    alpha = tl.exp2(m_i - m_safe)  # [M]
    p = tl.exp2(s * unit - m_safe[:, None])  # [M, BLOCK_N], one FMA + exp2 per logit
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def softmax_state(ROWS: tl.constexpr, HEAD: tl.constexpr, V_PAIRS: tl.constexpr = False):
    """The empty running state ``(acc, acc2, m, l)`` of ``ROWS`` rows: ``acc [ROWS, HEAD]``
    fp32 (``acc2`` unused), or with ``V_PAIRS`` the even / odd output channels apart until after
    the tile loops (``online_softmax_pairs``), ``[ROWS, HEAD // 2]`` each."""
    if V_PAIRS:
        acc = tl.zeros([ROWS, HEAD // 2], dtype=tl.float32)  # [ROWS, HEAD // 2]
        acc2 = tl.zeros([ROWS, HEAD // 2], dtype=tl.float32)  # [ROWS, HEAD // 2]
    else:
        acc = tl.zeros([ROWS, HEAD], dtype=tl.float32)  # [ROWS, HEAD]
        acc2 = tl.zeros([1], dtype=tl.float32)  # (unused)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)  # [ROWS]
    l_i = tl.zeros([ROWS], dtype=tl.float32)  # [ROWS]
    return acc, acc2, m_i, l_i


@triton.jit
def online_softmax_pairs(acc_e, acc_o, m_i, l_i, s, unit, v_e, v_o, DOT_PREC: tl.constexpr,
                         V_SHIFT: tl.constexpr = False):  # fmt: skip
    """``online_softmax_step`` with V in two halves (``load_int8_pairs``): the even channels
    ``v_e`` and the odd ones ``v_o`` ``[BLOCK_N, HEAD // 2]``, accumulated into ``acc_e`` /
    ``acc_o`` ``[M, HEAD // 2]`` by two dots of the same P (the MMAs of one ``HEAD``-wide
    dot); ``_triton_utils.interleave_channels`` puts the halves back together after the loop.
    ``V_SHIFT``: V holds ``v + INT8_SHIFT`` and ``l`` sums the rounded weights the dots take,
    so that ``acc - INT8_SHIFT * l`` is the accumulator of ``v`` (``unshift_acc``)."""
    p, alpha, m_new, l_new = softmax_weights(m_i, l_i, s, unit)
    pv = p.to(v_e.dtype)  # [M, BLOCK_N]
    if V_SHIFT:
        l_new = l_i * alpha + tl.sum(pv.to(tl.float32), 1)
    l_i = l_new
    acc_e = tl.dot(pv, v_e, acc_e * alpha[:, None], input_precision=DOT_PREC)
    acc_o = tl.dot(pv, v_o, acc_o * alpha[:, None], input_precision=DOT_PREC)
    return acc_e, acc_o, m_new, l_i


@triton.jit
def unshift_acc(acc, l_i):
    """The accumulator of ``v`` from that of ``v + INT8_SHIFT`` (``online_softmax_pairs``'
    ``V_SHIFT``; every tile's weights summed into ``l_i``): ``[M, C]`` fp32."""
    return acc - INT8_SHIFT * l_i[:, None]


@triton.jit
def add_sink(acc, m_i, l_i, sink2):
    """Let the log2-domain sink logit ``sink2`` [M] join the denominator (no value vector)."""
    m_new = tl.maximum(m_i, sink2)  # [M], finite
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.exp2(sink2 - m_new)
    return acc * alpha[:, None], m_new, l_i


@triton.jit
def normalize(acc, l_i):
    """acc / l with rows of l == 0 (nothing attended) giving zeros; [M, HEAD] fp32."""
    inv = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)  # [M]
    return acc * inv[:, None]


@triton.jit
def finish_rows(acc, m_i, l_i, n_idx, kvh, sink_ptr, vs_ptr, stride_vs_h, stride_vs_d,
                 HEAD: tl.constexpr, HAS_SINK: tl.constexpr, SINK_FROM_PTR: tl.constexpr,
                 HAS_VSCALE: tl.constexpr):  # fmt: skip
    """A row's finished output from its whole softmax state: the sink (once; ``head_sink [N]``
    at ``n_idx``, or the smooth softmax's zero logit), ``1 / l`` (rows that saw nothing ->
    zeros), ``v_scale``: ``[ROWS, HEAD]`` fp32. What the merge kernel makes of a single part."""
    if HAS_SINK:
        if SINK_FROM_PTR:
            sink2 = tl.load(sink_ptr + n_idx).to(tl.float32) * 1.4426950408889634  # [ROWS]
        else:
            sink2 = tl.zeros_like(m_i)
        acc, m_i, l_i = add_sink(acc, m_i, l_i, sink2)
    o = normalize(acc, l_i)
    if HAS_VSCALE:
        offs_d = tl.arange(0, HEAD)
        vs = tl.load(vs_ptr + kvh * stride_vs_h + offs_d * stride_vs_d)  # [HEAD] fp32
        o = o * vs[None, :]
    return o


@triton.jit
def _load_words(base, start_n, stride_row, kv_hi, BLOCK_N: tl.constexpr, HEAD: tl.constexpr,
                WORD: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Rows ``[start_n, start_n + BLOCK_N)`` of a cache tile read as ``WORD`` words (the cache's
    element type, or a wider integer: ``[BLOCK_N, HEAD * elem_bytes // word_bytes]``); rows
    >= ``kv_hi`` are not read (zeros) when ``MASKED``."""
    ELEM: tl.constexpr = base.dtype.element_ty
    COLS: tl.constexpr = HEAD * ELEM.primitive_bitwidth // WORD.primitive_bitwidth
    STEP: tl.constexpr = WORD.primitive_bitwidth // ELEM.primitive_bitwidth  # elements per word
    rows = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    origin = base + start_n.to(tl.int64) * stride_row  # the tile's first row
    row_step = stride_row
    if STEP > 1:
        origin = origin.to(tl.pointer_type(WORD))
        row_step = stride_row // STEP
    cols = tl.arange(0, COLS)  # [COLS]
    ptrs = origin + (rows[:, None] * row_step + cols[None, :])  # [BLOCK_N, COLS]
    if MASKED:
        return tl.load(ptrs, mask=(start_n + rows < kv_hi)[:, None], other=0)
    return tl.load(ptrs)


@triton.jit
def load_int8_pairs(base, start_n, stride_row, kv_hi, BLOCK_N: tl.constexpr, HEAD: tl.constexpr,
                 MASKED: tl.constexpr, SHIFTED: tl.constexpr = False):  # fmt: skip
    """An int8 K or V tile as two exact fp16 halves ``(even, odd)``, each ``[BLOCK_N, HEAD //
    2]`` (channels ``2j`` and ``2j + 1``), read as int16 words (``int8_pairs_to_fp16``; the
    host checks that the base and ``stride_row`` are even): the decode kernels' ``V_PAIRS``
    (for ``online_softmax_pairs``) and ``K_PAIRS`` (for ``scores_pairs``); masking as
    ``load_kv_tile``; ``SHIFTED``: values ``t + INT8_SHIFT`` (``int8_to_fp16``)."""
    w = _load_words(base, start_n, stride_row, kv_hi, BLOCK_N, HEAD, tl.int16, MASKED)
    return int8_pairs_to_fp16(w, SHIFTED)  # [BLOCK_N, HEAD // 2] x 2


@triton.jit
def load_kv_tile(
    base,  # pointer to row 0 of this (batch, kv head) in the cache
    start_n,  # first key position of the tile
    offs_d,  # [HEAD] int32
    stride_row,
    kv_hi,  # keys >= kv_hi are not read (they may hold garbage / NaN)
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    MASKED: tl.constexpr,
    KEYS: tl.constexpr,  # the tile is K (the Q.K^T operand) rather than V
    WIDE_I8: tl.constexpr = False,  # int8 tile -> fp16 read as int32 words (see below)
    SHIFTED: tl.constexpr = False,  # int8 -> fp16 as t + INT8_SHIFT (not with WIDE_I8)
):
    """``[BLOCK_N, HEAD]`` cache tile converted to the dot dtype (int8 -> exact integers).

    The tile's origin is one 64-bit scalar; the in-tile offsets are loop-invariant int32
    (``BLOCK_N * stride_row`` < 2**31: the host checks cache strides), which saves the
    per-element 64-bit address math of every tile. int8 reaches fp16 through the xor tricks of
    ``_triton_utils.cache_to_dot``; with ``WIDE_I8`` (an int8 tile, an fp16 dot; the host
    checks that the base and ``stride_row`` are multiples of 4 bytes) the tile is read as
    int32 words and converted in a blocked layout (``_triton_utils.int8_words_to_fp16``)."""
    WIDE: tl.constexpr = WIDE_I8 and DOT_DTYPE == tl.float16 and base.dtype.element_ty == tl.int8
    HEAD: tl.constexpr = offs_d.shape[0]
    if WIDE:  # int32 words of 4 channels: [BLOCK_N, HEAD // 4]
        w = _load_words(base, start_n, stride_row, kv_hi, BLOCK_N, HEAD, tl.int32, MASKED)
        t = int8_words_to_fp16(w, BLOCK_N, HEAD)
    else:  # [BLOCK_N, HEAD] elements
        elems = base.dtype.element_ty
        t = _load_words(base, start_n, stride_row, kv_hi, BLOCK_N, HEAD, elems, MASKED)
        t = cache_to_dot(t, DOT_DTYPE, KEYS, SHIFTED)
    return t  # [BLOCK_N, HEAD]
