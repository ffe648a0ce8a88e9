"""Per-token prologue math shared by the Triton tiers: RMSNorm + rotary of a token's heads in
fp32, the one conversion (or int8 quantization) of a new K/V row to the cache dtype, and the
power-of-two row scaling of an fp16 Q for int8 keys (the prologue kernels of GQA and paged
attention).

Fused decode prologue (``FUSE_PROLOGUE`` of the GQA and DSA split kernels, one new token per
sequence): a split program computes its query heads' Q itself and the new token's K/V row
(``fused_q_k`` / ``fused_new_v``: the prologue's values and roundings). No
program reads that cache row (another program of the grid is writing it): the tile loops
leave it out, and each program whose candidates include it folds it in once per occurrence
after its loop (``new_row_logits`` before the loop, ``fold_new_row`` after), with the tiles'
operand roundings. One program per (sequence, KV head) appends the row to the cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import TL_DTYPES, cfg_flag, scale_strides

_RINT_MAGIC = tl.constexpr(
    12582912.0
)  # 1.5 * 2**23: (x + M) - M rounds |x| < 2**22 half-to-even in fp32


@triton.jit
def norm_rope_heads(
    row_ptr,  # token's first channel of head 0
    offs_h,  # [BLOCK_H] head indices
    num_heads,
    w_ptr,  # norm weight [HEAD]
    cos_ptr,
    sin_ptr,
    pos,  # rotary position (int64 scalar)
    stride_cos,
    stride_sin,
    eps,
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    ROT_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """``[BLOCK_H, HEAD_PAD]`` fp32: RMSNorm (optional) then rotary (optional) of the heads."""
    x, xp, w, wp, cos, sin = norm_rope_load(
        row_ptr, offs_h, num_heads, w_ptr, cos_ptr, sin_ptr, pos, stride_cos, stride_sin, HEAD,
        HEAD_PAD, ROT_DIM, HAS_NORM, HAS_ROTARY, INTERLEAVED,
    )  # fmt: skip
    return norm_rope_math(x, xp, w, wp, cos, sin, eps, HEAD, HAS_NORM, HAS_ROTARY)


@triton.jit
def norm_rope_load(
    row_ptr, offs_h, num_heads, w_ptr, cos_ptr, sin_ptr, pos, stride_cos, stride_sin,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, ROT_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """Every input of ``norm_rope_math``, all loads issued before any math (one memory round
    trip, no load behind the norm's reduction): ``x, xp [BLOCK_H, HEAD_PAD]`` (the heads and
    their rotary partners) and ``w, wp, cos, sin [HEAD_PAD]`` fp32 (``sin`` signed for the
    first channel of each pair; outside the rotary range cos = 1, sin = 0 pass through).
    Unused pieces are 0.0."""
    offs_d = tl.arange(0, HEAD_PAD)  # [HEAD_PAD]
    mask_d = offs_d < HEAD
    mask = (offs_h < num_heads)[:, None] & mask_d[None, :]  # [BLOCK_H, HEAD_PAD]
    base = row_ptr + offs_h.to(tl.int64)[:, None] * HEAD
    x = tl.load(base + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    w = 0.0
    if HAS_NORM:
        w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)  # [HEAD_PAD]
    xp = 0.0
    wp = 0.0
    cos = 0.0
    sin = 0.0
    if HAS_ROTARY:
        HALF: tl.constexpr = ROT_DIM // 2
        in_rot = (offs_d < ROT_DIM) & mask_d
        if INTERLEAVED:
            first = (offs_d % 2) == 0
            partner = tl.where(first, offs_d + 1, offs_d - 1)
            c_idx = offs_d // 2
        else:
            first = offs_d < HALF
            partner = tl.where(first, offs_d + HALF, offs_d - HALF)
            c_idx = tl.where(first, offs_d, offs_d - HALF)
        partner = tl.where(in_rot, partner, offs_d)  # [HEAD_PAD]
        c_idx = tl.where(in_rot, c_idx, 0)
        xp = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            wp = tl.load(w_ptr + partner, mask=mask_d, other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + pos * stride_cos + c_idx, mask=in_rot, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * stride_sin + c_idx, mask=in_rot, other=0.0).to(tl.float32)
        sin = tl.where(first, -sin, sin)  # [HEAD_PAD]
    return x, xp, w, wp, cos, sin


@triton.jit
def norm_rope_math(x, xp, w, wp, cos, sin, eps, HEAD: tl.constexpr, HAS_NORM: tl.constexpr,
                   HAS_ROTARY: tl.constexpr):  # fmt: skip
    """RMSNorm (each row's rms over its HEAD channels, times ``w``) then rotary (the partner
    channel normed with the row's rms and ``wp``) of ``norm_rope_load``'s inputs, fp32."""
    if HAS_NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD + eps)  # [BLOCK_H]
        x = x * inv_rms[:, None] * w[None, :]
    if HAS_ROTARY:
        if HAS_NORM:
            xp = xp * inv_rms[:, None] * wp[None, :]
        x = x * cos[None, :] + xp * sin[None, :]
    return x


@triton.jit
def to_cache(
    x,  # [BLOCK_H, HEAD_PAD] fp32
    scale_ptr,
    offs_h,  # [BLOCK_H] KV heads
    offs_d,  # [HEAD_PAD]
    stride_sc_h,
    stride_sc_d,
    mask,  # [BLOCK_H, HEAD_PAD]
    DTYPE: tl.constexpr,  # the cache's element type
    QUANT: tl.constexpr,
):
    """``x`` in the cache dtype: one rounding, or int8 quantization (``x / scale`` rounded to
    nearest-even, clamped to +-127)."""
    if QUANT:
        sc = tl.load(
            scale_ptr + offs_h[:, None] * stride_sc_h + offs_d[None, :] * stride_sc_d,
            mask=mask,
            other=1.0,
        )  # [BLOCK_H, HEAD_PAD] fp32
        y = tl.math.div_rn(x, sc)
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        y = ((y + _RINT_MAGIC) - _RINT_MAGIC).to(tl.int8)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def store_cache_rows(dst, x, scale_ptr, offs_h, offs_d, stride_sc_h, stride_sc_d, mask,
                     QUANT: tl.constexpr):  # fmt: skip
    """Store ``x [BLOCK_H, HEAD_PAD]`` fp32 at ``dst`` (pointers) converted by ``to_cache``."""
    y = to_cache(x, scale_ptr, offs_h, offs_d, stride_sc_h, stride_sc_d, mask,
                 dst.dtype.element_ty, QUANT)  # fmt: skip
    tl.store(dst, y, mask=mask)


def pow2_q_rows(act_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the Triton tiers give Q power-of-two fp16 rows (``pow2_rows``): an int8 K cache
    with 16-bit activations (k_scale folded into Q first; a small ``q * k_scale`` never lands in
    fp16's subnormals, and the int8 K tiles enter fp16 dots). The one rule of GQA, paged
    attention and DSA (which also needs no ``query_dtype``)."""
    return cache_dtype == torch.int8 and act_dtype in (torch.float16, torch.bfloat16)


@triton.jit
def pow2_rows(x):
    """Rows of ``x [R, D]`` fp32 times ``2**(14 - e)``, ``e = floor(log2(max |row|))``, so each
    row's largest magnitude lies in ``[2**14, 2**15)`` (below fp16's 65504); returns
    ``(scaled [R, D], 2**(e - 14) [R])``. Both factors are built from exponent bits, so the
    scaling is exact. ``e`` is clamped to ``[-112, 127]`` (zero and fp32-subnormal rows; inf/NaN
    rows stay inf/NaN)."""
    amax = tl.max(tl.abs(x), 1)  # [R]
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # [R] floor(log2), normal amax
    e = tl.minimum(tl.maximum(e, -112), 127)
    up = ((141 - e) << 23).to(tl.float32, bitcast=True)  # [R] 2**(14 - e), exponent 14..253
    down = ((113 + e) << 23).to(tl.float32, bitcast=True)  # [R] 2**(e - 14), exponent 1..240
    return x * up[:, None], down


@triton.jit
def rotary_pos(pos_ptr, b, qpos, stride_pb, max_pos, HAS_POS: tl.constexpr):
    """The new token's rotary position (``position_ids[b, 0]`` or qpos), clamped into the
    rotary cache as the prologue kernels do (never a read outside it)."""
    if HAS_POS:
        pos = tl.load(pos_ptr + b * stride_pb).to(tl.int64)
    else:
        pos = qpos
    return tl.minimum(tl.maximum(pos, 0), max_pos - 1)


@triton.jit
def fused_q_k(
    xq_ptr, xk_ptr, qn_w_ptr, kn_w_ptr, cos_ptr, sin_ptr, ks_ptr, b, pos, kvh, heads, mask_h,
    stride_xqb, stride_xkb, stride_cos, stride_sin, stride_ks_h, stride_ks_d, eps,
    NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr, ROT_DIM: tl.constexpr, HAS_ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_QNORM: tl.constexpr, HAS_KNORM: tl.constexpr,
    K_QUANT: tl.constexpr, Q_POW2: tl.constexpr, Q_DTYPE: tl.constexpr,
    CACHE_DTYPE: tl.constexpr,
):  # fmt: skip
    """The prologue kernel's values for batch ``b``'s one new token, inside a split program:

    - ``q [M, HEAD_PAD]`` in Q_DTYPE of query heads ``heads [M]`` (rows with ``mask_h`` false
      read nothing and are zero): QK-norm + rotary in fp32, int8 K: ``* k_scale[kvh]``,
      ``Q_POW2``: each row times a power of two, one rounding; ``unscale [M]`` the inverse
      powers (ones without Q_POW2);
    - ``k [1, HEAD_PAD]`` of KV head ``kvh`` in CACHE_DTYPE: QK-norm + rotary, rounded (or
      int8-quantized) once.

    Every load of both is issued before any math (one memory round trip on the split kernel's
    critical path, ahead of its first tile)."""
    offs_d = tl.arange(0, HEAD_PAD)  # [HEAD_PAD]
    kv_head = kvh + tl.arange(0, 1)  # [1]
    xq = norm_rope_load(
        xq_ptr + b * stride_xqb, tl.where(mask_h, heads, NUM_HEADS), NUM_HEADS, qn_w_ptr,
        cos_ptr, sin_ptr, pos, stride_cos, stride_sin, HEAD, HEAD_PAD, ROT_DIM, HAS_QNORM,
        HAS_ROTARY, INTERLEAVED,
    )  # fmt: skip
    xk = norm_rope_load(
        xk_ptr + b * stride_xkb, kv_head, KV_HEADS, kn_w_ptr, cos_ptr, sin_ptr, pos,
        stride_cos, stride_sin, HEAD, HEAD_PAD, ROT_DIM, HAS_KNORM, HAS_ROTARY, INTERLEAVED,
    )  # fmt: skip
    if K_QUANT:
        ks = tl.load(ks_ptr + kvh * stride_ks_h + offs_d * stride_ks_d, mask=offs_d < HEAD,
                     other=0.0)  # fmt: skip
    x = norm_rope_math(xq[0], xq[1], xq[2], xq[3], xq[4], xq[5], eps, HEAD, HAS_QNORM,
                       HAS_ROTARY)  # fmt: skip
    if K_QUANT:  # fold the K scale into Q before its one rounding
        x = x * ks[None, :]
    if Q_POW2:
        x, unscale = pow2_rows(x)
    else:
        unscale = tl.full([x.shape[0]], 1.0, dtype=tl.float32)
    k = norm_rope_math(xk[0], xk[1], xk[2], xk[3], xk[4], xk[5], eps, HEAD, HAS_KNORM,
                       HAS_ROTARY)  # fmt: skip
    k = to_cache(k, ks_ptr, kv_head, offs_d, stride_ks_h, stride_ks_d, (offs_d < HEAD)[None, :],
                 CACHE_DTYPE, K_QUANT)  # fmt: skip
    return x.to(Q_DTYPE), unscale, k


@triton.jit
def fused_new_v(xv_ptr, vs_ptr, b, kvh, stride_xvb, stride_vs_h, stride_vs_d,
                HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, V_QUANT: tl.constexpr,
                CACHE_DTYPE: tl.constexpr):  # fmt: skip
    """The new token's ``v [1, HEAD_PAD]`` of KV head ``kvh``, rounded (or int8-quantized) once
    to the cache dtype."""
    offs_d = tl.arange(0, HEAD_PAD)  # [HEAD_PAD]
    kv_head = kvh + tl.arange(0, 1)  # [1]
    mask = (offs_d < HEAD)[None, :]  # [1, HEAD_PAD]
    v_src = xv_ptr + b * stride_xvb + kv_head[:, None] * HEAD + offs_d[None, :]
    v = tl.load(v_src, mask=mask, other=0.0).to(tl.float32)  # [1, HEAD_PAD]
    return to_cache(v, vs_ptr, kv_head, offs_d, stride_vs_h, stride_vs_d, mask, CACHE_DTYPE,
                    V_QUANT)  # fmt: skip


@triton.jit
def store_new_row(kc_row, vc_row, k_new, v_new, write, HEAD: tl.constexpr,
                  HEAD_PAD: tl.constexpr):  # fmt: skip
    """Append the new token's ``k_new, v_new [1, HEAD_PAD]`` at the cache row pointers
    ``kc_row / vc_row`` where ``write`` (scalar)."""
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_d < HEAD)[None, :] & write  # [1, HEAD_PAD]
    tl.store(kc_row + offs_d[None, :], k_new, mask=mask)
    tl.store(vc_row + offs_d[None, :], v_new, mask=mask)


@triton.jit
def new_row_logits(q, k_new, DOT_DTYPE: tl.constexpr):
    """``[M]`` fp32 raw dot products of the Q rows with the new row ``k_new [1, HEAD_PAD]``
    (cache dtype) with the tiles' operand roundings: both in DOT_DTYPE (int8: exact integers),
    fp32 products and sum."""
    kq = k_new.to(DOT_DTYPE).to(tl.float32)  # [1, HEAD_PAD]
    return tl.sum(q.to(DOT_DTYPE).to(tl.float32) * kq, 1)


@triton.jit
def fold_new_row(acc, m_i, l_i, weight, s_new, v_new, PV_DTYPE: tl.constexpr):
    """Fold the new token's row (log2-domain logits ``s_new [M]``, ``v_new [1, HEAD_PAD]`` in
    the cache dtype) into (acc [M, HEAD_PAD], m [M], l [M]) ``weight`` times (an int32 scalar,
    or [M]; 0: no change); P rounded to PV_DTYPE as in the tiles."""
    s = tl.where(weight > 0, s_new, float("-inf"))
    m_new = tl.maximum(m_i, s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe)  # [M], 0 when not a candidate
    l_i = l_i * alpha + p * weight
    vp = v_new.to(PV_DTYPE).to(tl.float32)  # [1, HEAD_PAD]
    pw = p.to(PV_DTYPE).to(tl.float32) * weight  # [M]
    acc = acc * alpha[:, None] + pw[:, None] * vp
    return acc, m_new, l_i


def fused_prologue_args(query, key, value, p, q_dtype, cache_dtype) -> dict:
    """Keyword arguments of a split kernel's fused-prologue inputs (``xq_ptr`` ... ``K_QUANT``,
    as ``gqa_prologue_kernel`` takes them) from a GQAParams / DSAParams ``p``; ``query`` None:
    the dummies of an unfused launch (the constexprs keep their defaults)."""
    if query is None:
        return dict(xq_ptr=None, xk_ptr=None, xv_ptr=None, qn_w_ptr=None, kn_w_ptr=None,
                    cos_ptr=None, sin_ptr=None, pos_ptr=None, ks_ptr=None, stride_xqb=0,
                    stride_xkb=0, stride_xvb=0, stride_pb=0, stride_cos=0, stride_sin=0,
                    stride_ks_h=0, stride_ks_d=0, max_pos=1, eps=0.0)  # fmt: skip
    n, kv, h = p.num_heads, p.kv_num_heads, p.head_size
    if key is None:  # packed QKV
        key = query[..., n * h : (n + kv) * h]
        value = query[..., (n + kv) * h :]
    cos, sin = p.cos_cache, p.sin_cache
    has_rot = p.do_rotary and cos is not None
    pos = p.position_ids
    quant_k = cache_dtype == torch.int8
    ks_h, ks_d = scale_strides(p.k_scale if quant_k else None)
    return dict(
        xq_ptr=query,
        xk_ptr=key,
        xv_ptr=value,
        qn_w_ptr=p.q_norm_weight,
        kn_w_ptr=p.k_norm_weight,
        cos_ptr=cos if has_rot else None,
        sin_ptr=sin if has_rot else None,
        pos_ptr=pos,
        ks_ptr=p.k_scale if quant_k else None,
        stride_xqb=query.stride(0),
        stride_xkb=key.stride(0),
        stride_xvb=value.stride(0),
        stride_pb=pos.stride(0) if pos is not None else 0,
        stride_cos=cos.stride(0) if has_rot else 0,
        stride_sin=sin.stride(0) if has_rot else 0,
        stride_ks_h=ks_h,
        stride_ks_d=ks_d,
        max_pos=cos.shape[0] if has_rot else 1,
        eps=p.qk_norm_epsilon,
        Q_DTYPE=TL_DTYPES[q_dtype],
        K_QUANT=quant_k,
        **rope_norm_flags(p),
    )


def rope_norm_flags(p) -> dict:
    """The rotary / QK-norm constexprs of the prologue kernels and the fused split kernels
    from a GQAParams / DSAParams ``p``."""
    has_rot = p.do_rotary and p.cos_cache is not None
    return dict(
        ROT_DIM=2 * p.cos_cache.shape[1] if has_rot else 0,
        HAS_ROTARY=has_rot,
        INTERLEAVED=p.rotary_interleaved,
        HAS_POS=p.position_ids is not None,
        HAS_QNORM=p.q_norm_weight is not None,
        HAS_KNORM=p.k_norm_weight is not None,
    )


def fuse_prologue(cfg: dict, seq_len: int, triton_prologue: bool) -> bool:
    """Whether the split kernel does the prologue's work (``cfg["FUSE_PROLOGUE"]``, a bool):
    only for one new token per sequence (S = 1) and inputs the Triton prologue handles; every
    split program then computes its query heads' Q (and the new K/V row, which one program
    appends), so the prologue launch goes away. Sets ``cfg["FUSE_PROLOGUE"]`` to the answer."""
    want = cfg_flag(cfg, "FUSE_PROLOGUE")
    cfg["FUSE_PROLOGUE"] = fuse = want and seq_len == 1 and triton_prologue
    return fuse
