"""Host side of the Triton PagedAttention tier: prologue, then the decode and prefill launches of
the paged attention kernel (each followed by its merge when it can split).

No host synchronization (CUDA-graph capturable): grids and buffers are sized from shapes only
(tokens, B, KV, the SM count); which sequence is decode or prefill, how many query tiles and key
splits each gets, is worked out inside the kernels (``_schedule``).

Launches per call: the prologue; the decode launch (sequences with ``1 <= S_b <= DEC_TOK``,
DEC_TOK = ROWS_D // group new tokens, ROWS_D = 16 rows for group <= 16) and its merge; the
prefill launch (``S_b > DEC_TOK``, 128-row tiles) when ``tokens > DEC_TOK``, and its merge when
the batch is small enough for prefill tiles to be split too.

Dot dtype (as the GQA tier): fp16 with an fp16 cache; fp16 with an int8 cache and 16-bit
activations, Q rows scaled by powers of two that the attention kernel undoes on the fp32 dot
products (``_triton_prologue.pow2_q_rows``; ``q_scale``); else the activation dtype. fp32
activations use exact fp32 dots (``input_precision="ieee"``).
"""

from __future__ import annotations

import torch

from ..._triton_prologue import pow2_q_rows
from ..._triton_utils import TL_DTYPES as _TL_DTYPES
from ..._triton_utils import cdiv, cfg_flag, int8_pairs_ok, next_pow2, pdl_kwargs
from ..._triton_utils import device_sms as _device_sms
from ..._triton_utils import interpret as _interpret
from ..._triton_utils import scale_strides as _scale_strides
from ...gqa.triton._core import LOG2E
from ...gqa.triton.prefill import prefill_config
from .._params import PagedParams
from .attention import paged_attn_kernel, paged_merge_kernel
from .prologue import paged_prologue_kernel

SUPPORTED_HEADS = (16, 32, 64, 128, 256)  # power-of-two head sizes
WAVES = 4  # programs per SM the split budget aims for
DECODE_ITEMS_PER_SEQ = 8  # decode split budget at least this many items per sequence
INT8_TARGET_WAVES = 4  # int8 caches: the decode split budget covers this many times the SMs
MAX_DECODE_EXTRA = 4096  # cap of that budget (fp32 partials: extra x KV x ROWS x H floats)

_empty = torch.empty  # every buffer of this tier is allocated here (tests poison it with NaN)


def dot_dtype_for(act_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    if cache_dtype == torch.float16 or pow2_q_rows(act_dtype, cache_dtype):
        return torch.float16
    return act_dtype


def is_power_of_two(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def unsupported_reason(head_size: int, block_size: int, act_dtype: torch.dtype) -> str | None:
    """Why this tier cannot take the inputs (None when it can); shapes/dtypes only."""
    if head_size not in SUPPORTED_HEADS:
        return f"head_size {head_size} not in {SUPPORTED_HEADS}"
    if not is_power_of_two(block_size):
        return (
            f"block_size {block_size} is not a power of two (the triton paged kernels need one; "
            "the chunked tier takes any block_size)"
        )
    if act_dtype not in _TL_DTYPES:
        return f"activation dtype {act_dtype} not in {tuple(_TL_DTYPES)}"
    return None


def _logit_scalars(p: PagedParams) -> tuple[float, float]:
    """(qk_scale, softcap_mult) of ``_core.scores``."""
    if p.softcap > 0:
        return p.scale / p.softcap, p.softcap * LOG2E
    return p.scale * LOG2E, 0.0


def _prologue_block_heads(num_heads: int, kv_heads: int, head: int) -> tuple[int, int]:
    head_pad = next_pow2(head)
    block_h = max(1, min(next_pow2(max(num_heads, kv_heads)), 2048 // head_pad))
    return block_h, 4 if block_h * head_pad <= 2048 else 8


def run_prologue(query, key, value, key_cache, value_cache, cu, past, table, p, q_rot,
                 q_scale=None):  # fmt: skip
    """QK-norm + rotary of Q (-> q_rot [tokens, N, H]) and new K; K/V written to their slots.
    ``q_scale [tokens, N]`` fp32 (``pow2_q_rows``, fp16 q_rot): receives each Q row's inverse
    power of two (see ``prologue``); None: Q is rounded to q_rot's dtype unscaled."""
    tokens = query.shape[0]
    n, kv, h = p.num_heads, p.kv_num_heads, p.head_size
    block_h, num_warps = _prologue_block_heads(n, kv, h)
    cos, sin = p.cos_cache, p.sin_cache
    has_rot = p.do_rotary and cos is not None
    quant_k = key_cache.dtype == torch.int8
    quant_v = value_cache.dtype == torch.int8
    ks_h, ks_d = _scale_strides(p.k_scale if quant_k else None)
    vs_h, vs_d = _scale_strides(p.v_scale if quant_v else None)
    batch = past.shape[0]
    grid = (tokens, cdiv(n, block_h) + cdiv(kv, block_h))
    paged_prologue_kernel[grid](
        **pdl_kwargs(query),
        q_ptr=query,
        k_ptr=key,
        v_ptr=value,
        qn_w_ptr=p.q_norm_weight if p.q_norm_weight is not None else query,
        kn_w_ptr=p.k_norm_weight if p.k_norm_weight is not None else query,
        cos_ptr=cos if has_rot else query,
        sin_ptr=sin if has_rot else query,
        cu_ptr=cu,
        past_ptr=past,
        table_ptr=table,
        qout_ptr=q_rot,
        kc_ptr=key_cache,
        vc_ptr=value_cache,
        ks_ptr=p.k_scale if quant_k else q_rot,
        vs_ptr=p.v_scale if quant_v else q_rot,
        qs_ptr=q_scale if q_scale is not None else q_rot,
        batch=batch,
        max_blocks=table.shape[1],
        num_blocks=key_cache.shape[0],
        max_pos=cos.shape[0] if has_rot else 1,
        stride_q=query.stride(0),
        stride_k=key.stride(0),
        stride_v=value.stride(0),
        stride_table=table.stride(0),
        stride_ks_h=ks_h,
        stride_ks_d=ks_d,
        stride_vs_h=vs_h,
        stride_vs_d=vs_d,
        stride_cos=cos.stride(0) if has_rot else 0,
        stride_sin=sin.stride(0) if has_rot else 0,
        eps=p.qk_norm_epsilon,
        NUM_HEADS=n,
        KV_HEADS=kv,
        GROUP=n // kv,
        HEAD=h,
        HEAD_PAD=next_pow2(h),
        BLOCK_H=block_h,
        BLOCK_SIZE=key_cache.shape[1],
        B_PAD=max(2, next_pow2(batch)),
        ROT_DIM=2 * cos.shape[1] if has_rot else 0,
        HAS_ROTARY=has_rot,
        INTERLEAVED=p.rotary_interleaved,
        HAS_QNORM=p.q_norm_weight is not None,
        HAS_KNORM=p.k_norm_weight is not None,
        K_QUANT=quant_k,
        V_QUANT=quant_v,
        Q_POW2=q_scale is not None,
        num_warps=num_warps,
    )


def decode_config(head: int, dot_dtype, cache_dtype, interpret: bool) -> dict:
    """(BLOCK_N, num_warps, num_stages) of the decode launch (16-row tiles).

    Chosen from sm_90 compiles (ptxas resource usage, no spills): H <= 128 with BLOCK_N = 64
    needs 8 warps when a tile gathers rows of several blocks (block_size < 64); H = 256 takes
    BLOCK_N = 32. int8 caches keep BLOCK_N = 64 (128 spills) at 4 warps: H100, ragged T
    1K..64K, block 64, us (8 warps, 3 stages = the 16-bit build; 4 warps, 3 stages): B=8 448.0;
    388.0, B=64 2265.6; 1943.2 (4 warps 4 stages 425.6 / 1969.5; BLOCK_N 128 8 warps 477.7 /
    3131.6; BLOCK_N 32 460.7 / 2070.3; ``paged_int8_tune_h100.json``)."""
    if interpret:
        return dict(BLOCK_N=16, num_warps=4, num_stages=1)
    if dot_dtype.itemsize == 4:
        return dict(BLOCK_N=32, num_warps=4, num_stages=2)
    if cache_dtype == torch.int8 and head <= 128:
        return dict(BLOCK_N=64, num_warps=4, num_stages=3)
    if head <= 128:
        return dict(BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_N=32, num_warps=8, num_stages=3)


def launch_shapes(p: PagedParams, cache_dtype, dot_dtype, block_size: int, *, decode_cfg=None,
                  prefill_cfg=None):  # fmt: skip
    """Tile shapes of the two launches: {"decode"|"prefill": (ROWS, TOK_M, cfg)}.

    The default prefill KV tile stays inside one block when block_size >= 32 (affine addresses;
    a 128-key tile gathering 64-row blocks spilled 5x more registers on sm_90)."""
    group = p.group
    interp = _interpret()
    cfg_d = dict(decode_cfg or decode_config(p.head_size, dot_dtype, cache_dtype, interp))
    if decode_cfg is None and not interp and cache_dtype == torch.int8 and block_size < 64:
        # the int8 build's 4 warps were timed on 64-row blocks; tiles that gather several
        # blocks keep the 8 warps every H <= 128 build had (see decode_config)
        cfg_d["num_warps"] = max(cfg_d["num_warps"], 8)
    rows_d = max(16, next_pow2(group))
    cfg_p = dict(prefill_cfg or prefill_config(p.head_size, dot_dtype, interp))
    if prefill_cfg is None and 32 <= block_size < cfg_p["BLOCK_N"]:
        cfg_p["BLOCK_N"] = block_size
    rows_p = max(cfg_p.pop("BLOCK_M", 128), rows_d)
    return {"decode": (rows_d, rows_d // group, cfg_d), "prefill": (rows_p, rows_p // group, cfg_p)}


def run_attention(q_rot, q_scale, key_cache, value_cache, cu, past, table, p, out, *, flavor,
                  rows, tok_m, dec_tok, cfg, extra, min_chunk=None, grid_items):  # fmt: skip
    """One launch of the paged attention kernel over ``flavor``'s sequences (+ its merge).
    ``q_scale [tokens, N]`` fp32: the inverse power of two of each Q row (None: unscaled)."""
    n, kv, h = p.num_heads, p.kv_num_heads, p.head_size
    batch = past.shape[0]
    cfg = dict(cfg)
    # V_PAIRS (an option, off): an int8 V cache (fp16 P.V dot) read as int16 channel pairs;
    # I8_I2F (off): int8 tiles converted by I2F (the build before session 44, for A/Bs)
    v_pairs = cfg_flag(cfg, "V_PAIRS", False, what="paged cfg")
    cfg["V_PAIRS"] = v_pairs and int8_pairs_ok(value_cache, q_rot.dtype == torch.float16)
    cfg["I8_I2F"] = cfg_flag(cfg, "I8_I2F", False, what="paged cfg")
    block_n = cfg["BLOCK_N"]
    min_chunk = min_chunk or 4 * block_n
    dev = q_rot.device
    o_part = _empty((max(extra, 1), kv, rows, h), dtype=torch.float32, device=dev)
    lse_part = _empty((max(extra, 1), kv, rows), dtype=torch.float32, device=dev)
    quant_v = value_cache.dtype == torch.int8
    vs_h, vs_d = _scale_strides(p.v_scale if quant_v else None)
    qk_scale, softcap_mult = _logit_scalars(p)
    has_sink = p.head_sink is not None or p.smooth_softmax
    dot = q_rot.dtype
    common = dict(
        cu_ptr=cu, past_ptr=past, sink_ptr=p.head_sink if p.head_sink is not None else q_rot,
        vs_ptr=p.v_scale if quant_v else q_rot, batch=batch, tokens=q_rot.shape[0],
        window=max(p.local_window_size, 0), extra=extra, min_chunk=min_chunk,
        stride_vs_h=vs_h, stride_vs_d=vs_d, NUM_HEADS=n, KV_HEADS=kv, GROUP=p.group, HEAD=h,
        ROWS=rows, TOK_M=tok_m, DEC_TOK=dec_tok, IS_DECODE=flavor == "decode",
        B_PAD=max(2, next_pow2(batch)), HAS_WINDOW=p.local_window_size > 0,
        HAS_SINK=has_sink, SINK_FROM_PTR=p.head_sink is not None, HAS_VSCALE=quant_v,
    )  # fmt: skip
    paged_attn_kernel[(grid_items, kv)](
        **pdl_kwargs(q_rot),
        q_ptr=q_rot, kc_ptr=key_cache, vc_ptr=value_cache, o_ptr=out, o_part_ptr=o_part,
        lse_part_ptr=lse_part, table_ptr=table,
        qs_ptr=q_scale if q_scale is not None else q_rot, max_blocks=table.shape[1],
        num_blocks=key_cache.shape[0], stride_table=table.stride(0), qk_scale=qk_scale,
        softcap_mult=softcap_mult, BLOCK_SIZE=key_cache.shape[1],
        HAS_SOFTCAP=p.softcap > 0, HAS_QSCALE=q_scale is not None, DOT_DTYPE=_TL_DTYPES[dot],
        DOT_PREC="ieee" if dot == torch.float32 else "tf32", INTERPRET=_interpret(),
        **common, **cfg,
    )  # fmt: skip
    if extra >= 2:  # at most extra // 2 query tiles are split (>= 2 items each)
        paged_merge_kernel[(extra // 2, kv)](
            o_part_ptr=o_part,
            lse_part_ptr=lse_part,
            o_ptr=out,
            INTERPRET=_interpret(),
            **common,
            num_warps=4,
        )


def paged_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    past_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    p: PagedParams,
    *,
    decode_cfg: dict | None = None,
    prefill_cfg: dict | None = None,
    decode_splits: int | None = None,
    prefill_splits: int | None = None,
    min_chunk: int | None = None,
) -> torch.Tensor:
    """Triton PagedAttention tier (contract in ``paged/_params.py``; same call as the chunked
    tier).

    query: [tokens, N*H]; key/value: [tokens, KV*H] (views of a packed query allowed, last dim
    contiguous); key_cache/value_cache: [num_blocks, block_size, KV, H] contiguous (activation
    dtype, fp16, or int8 with ``p.k_scale``/``p.v_scale``), the new tokens' slots written in
    place; cu_seqlens int32 [B+1], past_seqlens int32 [B], block_table int32 [B, max_blocks].
    Returns output [tokens, N*H] in query's dtype. ``block_size`` must be a power of two and H
    one of ``SUPPORTED_HEADS``.

    Tuning hooks (benchmarks/tests): ``decode_cfg``/``prefill_cfg`` (BLOCK_N, num_warps,
    num_stages; prefill also BLOCK_M = tile rows), ``decode_splits``/``prefill_splits`` (the
    split budget ``extra`` of ``_schedule``; default fills the SMs ~4 programs deep),
    ``min_chunk`` (keys per split at least; default 4 * BLOCK_N).
    """
    tokens = query.shape[0]
    n, kv, h = p.num_heads, p.kv_num_heads, p.head_size
    bs = key_cache.shape[1]
    why = unsupported_reason(h, bs, query.dtype)
    if why is not None:
        raise ValueError(f"paged_attention_triton: {why}")
    out = _empty((tokens, n * h), dtype=query.dtype, device=query.device)
    if tokens == 0:
        return out
    dot = dot_dtype_for(query.dtype, key_cache.dtype)
    q_rot = _empty((tokens, n, h), dtype=dot, device=query.device)
    q_scale = None
    if pow2_q_rows(query.dtype, key_cache.dtype):
        q_scale = _empty((tokens, n), dtype=torch.float32, device=query.device)
    run_prologue(query, key, value, key_cache, value_cache, cu_seqlens, past_seqlens,
                 block_table, p, q_rot, q_scale)  # fmt: skip
    shapes = launch_shapes(p, key_cache.dtype, dot, bs, decode_cfg=decode_cfg,
                           prefill_cfg=prefill_cfg)  # fmt: skip
    batch = past_seqlens.shape[0]
    target = cdiv(WAVES * _device_sms(query), kv)  # items that fill the SMs
    args = (q_rot, q_scale, key_cache, value_cache, cu_seqlens, past_seqlens, block_table, p, out)
    rows_d, tok_d, cfg_d = shapes["decode"]
    # Ragged decode batches balance better with more, smaller items than "fill the SMs" gives:
    # H200, ragged T 1K..64K, bs 64: B=64 2654 us at the SM target (66 items/KV head) vs 2203 us
    # at 528 (4.27 TB/s, 1.04x contiguous GQA); B=8 best at 66 (379 us; 450 us at 528).
    # int8 tiles are instruction-issue bound (as GQA's): more, shorter items pay; H100, same
    # batches, 4 warps: B=8 360.0 us at 264 items/KV head vs 388.0 at 66 (B=64: 512 items
    # 1943.2, 2048 2054.1; paged_int8_tune_h100.json)
    target_d = INT8_TARGET_WAVES * target if key_cache.dtype == torch.int8 else target
    if decode_splits is None:
        extra_d = max(target_d, min(DECODE_ITEMS_PER_SEQ * batch, MAX_DECODE_EXTRA))
    else:
        extra_d = decode_splits
    run_attention(*args, flavor="decode", rows=rows_d, tok_m=tok_d, dec_tok=tok_d, cfg=cfg_d,
                  extra=extra_d, min_chunk=min_chunk,
                  grid_items=min(batch, tokens) + extra_d)  # fmt: skip
    if tokens > tok_d:  # some sequence may have more than DEC_TOK new tokens
        rows_p, tok_p, cfg_p = shapes["prefill"]
        tiles = cdiv(tokens, tok_p) + min(batch, tokens // (tok_d + 1))
        extra_p = max(0, target - tiles) if prefill_splits is None else prefill_splits
        run_attention(*args, flavor="prefill", rows=rows_p, tok_m=tok_p, dec_tok=tok_d,
                      cfg=cfg_p, extra=extra_p, min_chunk=min_chunk,
                      grid_items=tiles + extra_p)  # fmt: skip
    return out
