"""Triton SparseAttentionIndexer: block scores in one kernel, top-k + emission in a second one.

``indexer_score_kernel`` grid: (cdiv(NB, BLOCK_B), cdiv(S, S_TILE), B). A program loads one
``[BLOCK_B, DI]`` tile of block keys (fp32) once and scores it against the indexer query rows
``(s, h)`` of ``S_TILE <= BLOCK_S`` new tokens of its sequence, ``BLOCK_R`` rows per ``tl.dot``:

    D[(s, h), c] = q[s, h] . k[c]                  (exact fp32 dot, ``ieee``)
    score[s, c] = scale * sum_h relu(D[(s, h), c])  (the head sum as a 0/1 matrix dot, fp32)

Blocks that are not complete and visible to the row (``c >= (qpos + 1) // r``; padding rows:
all) get ``-inf``; ``-0.0`` becomes ``+0.0``. The kernel writes either

- the fp32 scores ``[B*S, NB]`` (``OUT_KEYS=False``), which ``select.indexer_select_kernel``
  turns into ``selected_indices`` / ``selected_counts`` in one more launch (radix top-k with the
  reference's tie rule + emission; rows of up to ``select.MAX_BLOCKS`` blocks); or
- (``OUT_KEYS=True``, the fallback beyond that) one int64 **sort key** per (row, block):
  ``ordered_bits(score) << 32 | (NB - 1 - c)``, where ``ordered_bits`` maps fp32 to int32
  monotonically. Keys are distinct, and a larger key is a higher score or, at equal scores, a
  lower block index: ``torch.topk`` over the keys reproduces the reference's stable descending
  sort exactly; the chosen blocks are re-sorted ascending and expanded to token positions by the
  shared ``emit_selection`` (sync-free torch, ~15 small kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_utils import (
    cdiv,
    device_sms,
    next_pow2,
    pdl_kwargs,
    release_dependents,
    wait_prior_grids,
)
from ..._triton_utils import interpret as _interpret
from .._shared import emit_selection, indexer_rows
from .select import MAX_BLOCKS, _order_keys, indexer_select, select_pads, wants_tile_max

_empty = torch.empty  # buffers of this tier (tests poison them)


@triton.jit
def _dot_split3(a, b, acc_hi, acc_lo):
    """``a @ b`` for bf16 ``a [M, K]`` and fp32 ``b [K, N]`` added to a two-part accumulator:
    ``b`` is split exactly into three bf16 parts (``b = hi + mid + lo``, 8 + 8 + 8 significand
    bits), every product of bf16 values is exact in fp32, and the small parts' products sum in
    their own fp32 accumulator ``acc_lo`` (so a later chunk's ``lo`` is not added to a large
    running sum); the result is ``acc_hi + acc_lo``, the only roundings are fp32 additions."""
    hi = b.to(tl.bfloat16)
    rest = b - hi.to(tl.float32)  # exact
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)  # exact
    acc_lo = tl.dot(a, lo, acc_lo)
    acc_lo = tl.dot(a, mid, acc_lo)
    return tl.dot(a, hi, acc_hi), acc_lo


@triton.jit
def indexer_score_kernel(
    q_ptr,  # [B, S, NI * DI] float, last dim contiguous
    k_ptr,  # [B, NB, DI] float block keys, last dim contiguous
    seqlens_ptr,  # [B] int32, total_len - 1
    out_ptr,  # [B*S, NB] out: int64 sort keys (OUT_KEYS) or fp32 scores
    seq_len,
    num_blocks,
    stride_qb,
    stride_qs,
    stride_kb,
    stride_kn,
    scale,
    compress_ratio,
    NI: tl.constexpr,
    DI: tl.constexpr,
    DI_PAD: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_S: tl.constexpr,  # the head-sum dot's M (>= 16): rows a program could hold
    S_TILE: tl.constexpr,  # rows per program (<= BLOCK_S): program j scores rows j * S_TILE...
    BLOCK_R: tl.constexpr,  # (row, head) pairs per dot
    BLOCK_D: tl.constexpr,  # channels per dot step
    IS_FIRST_PROMPT: tl.constexpr,
    OUT_KEYS: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch
    DOT_PREC: tl.constexpr = "ieee",  # both dots: "ieee" (fp32 FMA), "bf16x6" or "split3" (MMA)
    TRIGGER: tl.constexpr = False,  # the next grid may launch once this one runs
    tmax_ptr=None,  # TILE_MAX: [B*S, cdiv(NB, BLOCK_B)] int32 out, row stride tmax_stride
    tmax_stride=0,
    TILE_MAX: tl.constexpr = False,  # strided tiles; each row's largest select key in its tile
):
    wait_prior_grids(PDL)  # first: the previous grid's writes are visible
    release_dependents(TRIGGER)
    pid_b = tl.program_id(0)
    s0 = tl.program_id(1) * S_TILE
    b = tl.program_id(2).to(tl.int64)
    # issued before the dots (not after them: one dependent round trip less at the end)
    total_len = tl.load(seqlens_ptr + b).to(tl.int64) + 1
    if TILE_MAX:  # runs of TILE_RUN blocks strided by the programs: the select's floor groups
        i = tl.arange(0, BLOCK_B)  # [BLOCK_B]
        run = pid_b + (i // _TILE_RUN) * tl.num_programs(0)  # [BLOCK_B] run ids
        offs_c = run * _TILE_RUN + i % _TILE_RUN  # [BLOCK_B] block ids
    else:
        offs_c = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)  # [BLOCK_B] block ids
    mask_c = offs_c < num_blocks
    k_rows = k_ptr + b * stride_kb + offs_c.to(tl.int64)[:, None] * stride_kn  # [BLOCK_B, 1]
    offs_s = tl.arange(0, BLOCK_S)  # [BLOCK_S] local query rows
    acc = tl.zeros([BLOCK_S, BLOCK_B], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_S, BLOCK_B], dtype=tl.float32)  # split3: the small parts' sums
    for r0 in range(0, S_TILE * NI, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)  # [BLOCK_R] (row, head) pairs, r = s_local*NI + h
        s_loc = offs_r // NI
        hh = offs_r % NI
        r_ok = (offs_r < S_TILE * NI) & (s0 + s_loc < seq_len)
        q_rows = q_ptr + b * stride_qb + (s0 + s_loc).to(tl.int64)[:, None] * stride_qs
        q_rows = q_rows + (hh * DI)[:, None]  # [BLOCK_R, 1]
        dots = tl.zeros([BLOCK_R, BLOCK_B], dtype=tl.float32)
        dots_lo = tl.zeros([BLOCK_R, BLOCK_B], dtype=tl.float32)  # split3
        # DI in chunks of BLOCK_D keeps the fp32 FMA dot's operands in registers; the key
        # chunks are read from DRAM by the first row chunk (a decode step has one), then L1/L2
        for d0 in tl.static_range(0, DI_PAD, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)  # [BLOCK_D]
            mask_d = offs_d < DI
            kt = tl.load(k_rows + offs_d[None, :], mask=mask_c[:, None] & mask_d[None, :],
                         other=0.0).to(tl.float32)  # [BLOCK_B, BLOCK_D]  # fmt: skip
            q = tl.load(q_rows + offs_d[None, :], mask=r_ok[:, None] & mask_d[None, :],
                        other=0.0)  # [BLOCK_R, BLOCK_D]  # fmt: skip
            if DOT_PREC == "split3":  # q is bf16: three exact bf16 products per key part
                dots, dots_lo = _dot_split3(q, tl.trans(kt), dots, dots_lo)  # [BLOCK_R, BLOCK_B]
            else:
                dots += tl.dot(q.to(tl.float32), tl.trans(kt), input_precision=DOT_PREC)
        if DOT_PREC == "split3":
            dots += dots_lo
        dots = tl.maximum(dots, 0.0)  # [BLOCK_R, BLOCK_B]
        sel = (s_loc[None, :] == offs_s[:, None]) & r_ok[None, :]  # [BLOCK_S, BLOCK_R]
        if DOT_PREC == "split3":
            acc, acc_lo = _dot_split3(sel.to(tl.bfloat16), dots, acc, acc_lo)
        else:
            acc += tl.dot(sel.to(tl.float32), dots, input_precision=DOT_PREC)
    if DOT_PREC == "split3":
        acc += acc_lo  # [BLOCK_S, BLOCK_B]

    srow = s0 + offs_s  # [BLOCK_S] new-token index
    if IS_FIRST_PROMPT:
        qpos = srow.to(tl.int64)
    else:
        qpos = total_len - seq_len + srow
    real = (qpos >= 0) & (qpos < total_len)
    n_complete = tl.where(real, (qpos + 1) // compress_ratio, 0)  # [BLOCK_S]
    visible = offs_c[None, :].to(tl.int64) < n_complete[:, None]  # [BLOCK_S, BLOCK_B]
    score = acc * scale + 0.0  # + 0.0 turns -0.0 into +0.0 (equal scores, equal keys)
    score = tl.where(visible, score, float("-inf"))
    out_rows = (b * seq_len + srow).to(tl.int64)
    dst = out_ptr + out_rows[:, None] * num_blocks + offs_c[None, :]
    if OUT_KEYS:
        bits = score.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone in the fp32 value
        tie = (num_blocks - 1 - offs_c).to(tl.int64)  # lower block -> larger key
        val = (ordered.to(tl.int64) << 32) | tie[None, :]  # the sort key
    else:
        val = score
    row_ok = (offs_s < S_TILE) & (srow < seq_len)  # [BLOCK_S]
    tl.store(dst, val, mask=row_ok[:, None] & mask_c[None, :])
    if TILE_MAX:  # the select's rank floor (select._tile_bounds): the largest key of the tile
        keys = _order_keys(score, visible & mask_c[None, :])  # [BLOCK_S, BLOCK_B] (-1: none)
        tl.store(tmax_ptr + out_rows * tmax_stride + pid_b, tl.max(keys, 1), mask=row_ok)


BLOCK_S = 16  # query rows (new tokens) per score program (>= 16: the head-sum dot's M)
# TILE_MAX tiles: runs of this many contiguous blocks, strided (run q in tile q mod programs).
# Runs of 8 fp32 scores are whole 32-byte sectors; fully strided tiles (runs of 1) cost the
# score launch +0.3 us at B=1 S=1 and +1.8 / +3.1 us at B=1 / 4 S=8 T=256K in 4-byte stores
# (H100, session 32)
TILE_RUN = 8
_TILE_RUN = tl.constexpr(TILE_RUN)
# ``DOT_PREC`` of the score dots: fp32 FMA; fp32 operands split into three bf16 parts each
# with the six largest partial products on tensor cores (triton's bf16x6: the dropped terms are
# ~2**-24 of each product); or a bf16 query against the fp32 operand's exact three-part split
# (``_dot_split3``: exact products)
DOT_PRECISIONS = ("ieee", "bf16x6", "split3")


def score_config(b: int, s: int, ni: int, num_blocks: int, num_sms: int, interpret: bool) -> dict:
    """(BLOCK_B, BLOCK_R, BLOCK_D, num_warps) of the score kernel; a config may also carry
    ``S_TILE`` (rows per program, default ``min(16, S)``; ``benchmarks/tune_indexer.py`` sweeps
    1 / 2 / 4 at S = 8: one row per program is the S = 1 kernel on S times the programs).

    A decode step's scores are a small, latency-bound job (T = 128K: 2K blocks, 1 MB of fp32
    keys), so the key tile is the smallest that keeps the grid within one wave: BLOCK_B = the
    smallest of 16/32/64 with ``cdiv(NB, BLOCK_B) * cdiv(S, 16) * B <= num_sms``. H200 sweep
    (``benchmarks/tune_indexer.py``, NI = 16, DI = 128, T = 128K, graph of 16 layers): B=1 S=1
    4.5 us (was 12.0 with a fixed 64-block tile), B=4 S=1 9.5 (13.9), B=1 S=8 18.7 (42.2),
    B=4 S=8 40.6 (43.6). One new token's 16 (row, head) pairs fit one 16-row dot with the whole
    DI per step (``min(S, 16) * NI <= 16`` rows); more rows take 32-row dots over 32-channel
    steps with 2 warps. Decode steps of 2..16 new tokens (speculative / multi-token decode)
    score ``S_TILE = max(1, 32 // NI)`` rows per program, one 32-row dot of (row, head) pairs,
    on S / S_TILE times the programs (H200, T = 128K, NI = 16, S = 8, session 18,
    ``benchmarks/results/tune_indexer_s8_h200.json``: B=1 17.9 -> 10.9 us, B=4 39.5 -> 25.0).

    Both dots run on tensor cores (``DOT_PREC``, H200, session 19): ``split3`` takes the bf16
    index query as is and splits the fp32 operand exactly into three bf16 parts, so every
    product is exact and only fp32 additions round (``_dot_split3``); ``bf16x6`` (triton's
    split of both operands) is the fallback for fp16 / fp32 queries. fp32 FMA -> bf16x6 ->
    split3 (``benchmarks/results/score_split3_h200.json``, a CUDA graph of 16 layers): B=1
    S=1 T=128K 4.10 -> 3.97 -> 2.36 us, T=256K 6.66 -> 3.53 -> 2.64; B=4 S=1 8.69 -> 5.37 ->
    3.97 / 14.66 -> 7.50 -> 5.69; B=1 S=8 T=128K 11.12 -> 6.32 -> 4.38; B=4 S=8 24.92 -> 12.36
    -> 12.08 / 48.47 -> 23.11 -> 18.41 (T=128K / 256K). The max error against an fp64 score
    was at most the FMA dots' at 10 of 11 shapes and 1.9x it at B=1 S=8 T=256K (4.8e-6 vs
    2.5e-6 relative, on a score near zero). With split3 one new token's programs take
    32-block tiles at any grid size (first sweep, T=128K, B=1: 2.47 us vs 3.04 with 16 and 3.29
    with 64; B=4: 4.06 vs 4.54 with 64), and 2..16 new tokens 4 warps (B=4 S=8: 8.61 vs 9.88 us
    with 2); prefill rows keep 2 warps (not re-tuned)."""
    if interpret:
        return dict(BLOCK_B=16, BLOCK_R=16, BLOCK_D=16, num_warps=4)
    small = min(s, BLOCK_S) * ni <= 16  # one 16-row dot holds the program's (row, head) pairs
    if small:
        return dict(BLOCK_B=32, BLOCK_R=16, BLOCK_D=128, num_warps=4, DOT_PREC="split3")
    s_tile = max(1, min(s, 32 // ni)) if 1 < s <= BLOCK_S else min(s, BLOCK_S)
    s_tiles = cdiv(max(s, 1), s_tile)
    block_b = 64
    for cand in (16, 32):
        if cdiv(num_blocks, cand) * s_tiles * b <= num_sms:
            block_b = cand
            break
    return dict(BLOCK_B=block_b, BLOCK_R=32, BLOCK_D=32, num_warps=4 if s <= BLOCK_S else 2,
                S_TILE=s_tile, DOT_PREC="split3")  # fmt: skip


def _score_launch(index_query, index_block_keys, seqlens_k, *, num_index_heads, compress_ratio,
                  scale, is_first_prompt, out_keys, cfg=None, tile_max=0):  # fmt: skip
    """``(out, tile maxima or None)``: see ``indexer_scores``."""
    b, s, dq = index_query.shape
    nb, di = index_block_keys.shape[1:]
    dtype = torch.int64 if out_keys else torch.float32
    out = _empty((b * s, nb), dtype=dtype, device=index_query.device)
    if out.numel() == 0:
        return out, None
    if cfg is None:
        cfg = score_config(b, s, num_index_heads, nb, device_sms(index_query), _interpret())
    cfg = dict(cfg)
    di_pad = max(16, next_pow2(di))
    cfg["BLOCK_D"] = min(cfg["BLOCK_D"], di_pad)
    s_tile = cfg.pop("S_TILE", None) or min(BLOCK_S, s)  # rows per program
    if not 1 <= s_tile <= BLOCK_S:
        raise ValueError(f"cfg['S_TILE'] must be in [1, {BLOCK_S}], got {s_tile}")
    prec = cfg.get("DOT_PREC", "ieee")
    if prec not in DOT_PRECISIONS:
        raise ValueError(f"cfg['DOT_PREC'] must be one of {DOT_PRECISIONS}, got {prec!r}")
    if _interpret():
        cfg["DOT_PREC"] = "ieee"  # the interpreter's dot is fp32 numpy (and takes no bf16x6)
    elif prec == "split3" and index_query.dtype != torch.bfloat16:
        cfg["DOT_PREC"] = "bf16x6"  # split3 takes the query as exact bf16 values
    grid = (cdiv(nb, cfg["BLOCK_B"]), cdiv(s, s_tile), b)
    tmax = None
    if tile_max and grid[0] >= tile_max:  # enough tiles for the select's floor
        if cfg["BLOCK_B"] % TILE_RUN:
            raise ValueError(f"tile maxima need BLOCK_B a multiple of {TILE_RUN}, got "
                             f"{cfg['BLOCK_B']}")  # fmt: skip
        tmax = _empty((b * s, grid[0]), dtype=torch.int32, device=index_query.device)
        cfg.update(tmax_ptr=tmax, tmax_stride=tmax.stride(0), TILE_MAX=True)
    indexer_score_kernel[grid](
        **pdl_kwargs(index_query, trigger=True),
        q_ptr=index_query,
        k_ptr=index_block_keys,
        seqlens_ptr=seqlens_k,
        out_ptr=out,
        seq_len=s,
        num_blocks=nb,
        stride_qb=index_query.stride(0),
        stride_qs=index_query.stride(1),
        stride_kb=index_block_keys.stride(0),
        stride_kn=index_block_keys.stride(1),
        scale=scale,
        compress_ratio=compress_ratio,
        NI=num_index_heads,
        DI=di,
        DI_PAD=di_pad,
        BLOCK_S=BLOCK_S,
        S_TILE=s_tile,
        IS_FIRST_PROMPT=is_first_prompt,
        OUT_KEYS=out_keys,
        **cfg,
    )
    return out, tmax


def indexer_sort_keys(index_query, index_block_keys, seqlens_k, *, num_index_heads, compress_ratio,
                      scale, is_first_prompt, cfg=None) -> torch.Tensor:  # fmt: skip
    """The kernel's int64 sort keys ``[B*S, NB]`` (see the module docstring)."""
    return _score_launch(index_query, index_block_keys, seqlens_k, num_index_heads=num_index_heads,
                         compress_ratio=compress_ratio, scale=scale,
                         is_first_prompt=is_first_prompt, out_keys=True, cfg=cfg)[0]  # fmt: skip


def indexer_scores(index_query, index_block_keys, seqlens_k, *, num_index_heads, compress_ratio,
                   scale, is_first_prompt, cfg=None) -> torch.Tensor:  # fmt: skip
    """The kernel's fp32 block scores ``[B*S, NB]`` (``-inf`` where not visible)."""
    return indexer_scores_and_tiles(index_query, index_block_keys, seqlens_k,
                                    num_index_heads=num_index_heads,
                                    compress_ratio=compress_ratio, scale=scale,
                                    is_first_prompt=is_first_prompt, cfg=cfg)[0]  # fmt: skip


def indexer_scores_and_tiles(index_query, index_block_keys, seqlens_k, *, num_index_heads,
                             compress_ratio, scale, is_first_prompt, cfg=None,
                             tile_max=0):  # fmt: skip
    """``(scores, tile maxima)`` of one score launch: the fp32 block scores of
    ``indexer_scores`` and, when the launch has at least ``tile_max > 0`` programs per row
    (``select.wants_tile_max``), ``[B*S, n_tiles = cdiv(NB, BLOCK_B)]`` int32:
    for each row and tile ``p`` (one score program's ``BLOCK_B`` blocks: the runs of
    ``TILE_RUN`` contiguous blocks ``c // TILE_RUN = p (mod n_tiles)``) the largest of the
    select's order keys (``select._order_keys``) of its visible blocks, -1 where it has none
    (``select_launch_args(tile_max=...)``: the rank method's floor); else None. The scores
    are the same either way (a strided tile scores each block as a contiguous one does)."""
    return _score_launch(index_query, index_block_keys, seqlens_k,
                         num_index_heads=num_index_heads, compress_ratio=compress_ratio,
                         scale=scale, is_first_prompt=is_first_prompt, out_keys=False, cfg=cfg,
                         tile_max=tile_max)  # fmt: skip


def scores_for_select(index_query, index_block_keys, seqlens_k, *, num_index_heads,
                      compress_ratio, token_budget, scale, is_first_prompt, cfg=None):  # fmt: skip
    """``(scores, tile maxima)`` for ``select.select_launch_args``: one score launch, with the
    tile maxima where the select's rank floor takes them (``select.wants_tile_max``; see
    ``indexer_scores_and_tiles``); ``(None, None)`` when no block can be chosen
    (``token_budget < compress_ratio`` or no blocks: no score is read)."""
    nb = index_block_keys.shape[1]
    if token_budget // compress_ratio == 0 or nb == 0:
        return None, None
    return indexer_scores_and_tiles(
        index_query, index_block_keys, seqlens_k, num_index_heads=num_index_heads,
        compress_ratio=compress_ratio, scale=scale, is_first_prompt=is_first_prompt, cfg=cfg,
        tile_max=wants_tile_max(nb, token_budget, compress_ratio,
                                rows=index_query.shape[0] * index_query.shape[1]),
    )  # fmt: skip


def select_supported(num_blocks: int) -> bool:
    """Whether ``select.indexer_select_kernel`` holds a row of ``num_blocks`` blocks."""
    return select_pads(num_blocks, 0)[0] <= MAX_BLOCKS


def indexer_triton(
    index_query: torch.Tensor,
    index_block_keys: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    num_index_heads: int,
    compress_ratio: int,
    token_budget: int,
    scale: float,
    is_first_prompt: bool,
    cfg: dict | None = None,
    fused_select: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton SparseAttentionIndexer tier; same selection as the reference, no host sync.

    index_query ``[B, S, NI*DI]`` float; index_block_keys ``[B, NB, DI]`` float (read in fp32);
    seqlens_k ``[B]`` int32. Returns ``selected_indices [B*S, token_budget + r - 1]`` int32 and
    ``selected_counts [B*S]`` int32 (layout of ``emit_selection``).

    Two launches (scores, then ``select.indexer_select_kernel``) when the rows fit the select
    kernel (``NB <= select.MAX_BLOCKS``) and ``fused_select``; otherwise the score kernel's sort
    keys + torch top-k + ``emit_selection``.
    """
    s = index_query.shape[1]
    nb = index_block_keys.shape[1]
    r = compress_ratio
    kb = token_budget // r
    kw = dict(num_index_heads=num_index_heads, compress_ratio=r, scale=scale,
              is_first_prompt=is_first_prompt, cfg=cfg)  # fmt: skip
    if fused_select and select_supported(nb):
        scores, tmax = scores_for_select(index_query, index_block_keys, seqlens_k,
                                         token_budget=token_budget, **kw)  # fmt: skip
        return indexer_select(scores, seqlens_k, seq_len=s, num_blocks=nb, compress_ratio=r,
                              token_budget=token_budget, is_first_prompt=is_first_prompt,
                              interpret=_interpret(), empty=_empty, tile_max=tmax)  # fmt: skip
    # fallback (rows of more than select.MAX_BLOCKS blocks): torch top-k over the sort keys
    rows = indexer_rows(seqlens_k, s, is_first_prompt, r, nb)
    n_sel = torch.clamp(rows.n_complete, max=kb)
    n_rows = rows.qpos.shape[0]
    kk = min(kb, nb)
    blocks = torch.full((n_rows, kb), nb, dtype=torch.int64, device=index_query.device)
    if kk > 0 and n_rows > 0:
        keys = indexer_sort_keys(index_query, index_block_keys, seqlens_k, **kw)
        top = keys.topk(kk, dim=1, sorted=False).values  # [R, kk]: the kk largest keys
        ids = (nb - 1) - (top & 0xFFFFFFFF)  # block ids
        # visible blocks outrank invisible ones, so the top kk hold the n_sel chosen blocks
        # exactly when they are visible (id < n_complete); the rest become the sentinel nb
        chosen = ids < rows.n_complete[:, None]
        blocks[:, :kk] = torch.where(chosen, ids, nb).sort(dim=1).values
    return emit_selection(blocks, n_sel, rows, compress_ratio=r, max_selected=token_budget + r - 1)
