"""Log-sum-exp merge of split-K attention partials, shared by the GQA and DSA decode tiers.

``merge_splits_kernel`` grid: (R * N, cdiv(HEAD, BLOCK_D)), one program per (row, head) and
channel tile. A split kernel wrote, for every row ``r``, head ``n`` and split ``p``:

- ``o_part [R, N, splits, HEAD]`` fp32, the split's output normalized over the split;
- ``lse_part [R, N, splits]`` fp32, the split's log-sum-exp in the log2 domain (-inf if empty;
  then its ``o_part`` may be unwritten: never used, see ``MERGE_EARLY_O``).

The merge loads every split of its channel tile at once (``[SPLITS_PAD, BLOCK_D]``, no serial
loop over the splits), weights them by ``exp2(lse - max)``, adds the sink (``head_sink`` or the
``smooth_softmax`` zero logit) to the denominator exactly once, and rounds to the output dtype
once. A row with nothing valid gives zeros (with or without a sink). ``BLOCK_D`` keeps the tile
at <= 8K fp32 values (64 registers per thread at 4 warps): a whole-head tile of 256 splits x 256
channels would be 64K values per program and spill.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import cdiv, next_pow2, pdl_kwargs, wait_prior_grids

MERGE_TILE = 8192  # fp32 values per program's [SPLITS_PAD, BLOCK_D] tile
# o_part tiles loaded together with the lse row instead of after it (masked by the lse): one
# dependent L2 round trip less per merge; the empty slots' values are replaced by zeros. On
# since session 28 as part of the sparse layer's measured "early" options (H100,
# ``sparse_early_trigger_ab_h100.json``); GQA decode alone: neutral (``gqa_merge_early_o_ab_h100``).
MERGE_EARLY_O = True
# From this many split slots (SPLITS_PAD) on, up to MERGE_WARP_TILE // 16, merge programs of
# ONE warp with [SPLITS_PAD, MERGE_WARP_TILE // SPLITS_PAD] tiles, so the reductions over the
# split axis stay in the warp (sm_90, H=256: 128 slots 14 -> 2 CTA barriers, 64 slots 10 -> 2;
# from 32 slots down the 4-warp tiles take <= 4 barriers and fewer instructions). None: off.
# Default since session 30 (H100, two same-process runs, bench_sparse layer variant merge_1w,
# sparse_layer_{ab,hist_merge1w}_session30_h100.json): the DSA op chained (66 slots at B=1
# S=1, budget 2048) 12.3-12.4 -> 12.0-12.1 us at B=1, 22.2-22.3 -> 21.2-21.3 at B=4; the
# layer op at B=4 S=1 T=128K / 256K 28.4-29.0 -> 27.7-27.8 / 31.9-32.6 -> 30.7-31.2. GQA
# decode (bf16 (32, 8) H=128, B=1/8/17/32, T=4K-128K) within 0.3% either way
# (gqa_merge_one_warp_ab_session30_h100.json).
MERGE_ONE_WARP_FROM = 64
MERGE_WARP_TILE = 2048  # fp32 values per one-warp program (64 registers per thread)


@triton.jit
def merge_splits_kernel(
    o_part_ptr,  # [R, N, num_splits, HEAD] fp32, contiguous
    lse_part_ptr,  # [R, N, num_splits] fp32 (log2 domain), contiguous
    sink_ptr,  # [N] (SINK_FROM_PTR)
    o_ptr,  # [R, N, HEAD] output dtype, contiguous
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,  # channels per program
    HAS_SINK: tl.constexpr,
    SINK_FROM_PTR: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch
    EARLY_O: tl.constexpr = False,  # o_part loads do not wait for lse (see MERGE_EARLY_O)
):
    wait_prior_grids(PDL)  # first: the previous grid's writes are visible
    rn = tl.program_id(0).to(tl.int64)  # r * N + n
    offs_p = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask_p = offs_p < num_splits
    mask_d = offs_d < HEAD
    lse = tl.load(lse_part_ptr + rn * num_splits + offs_p, mask=mask_p, other=float("-inf"))
    o_ptrs = o_part_ptr + (rn * num_splits + offs_p)[:, None] * HEAD + offs_d[None, :]
    # an empty slot (lse -inf) may hold an unwritten o_part: never used
    full = mask_p & (lse > float("-inf"))  # [SPLITS_PAD]
    if EARLY_O:  # every slot loaded with the lse (no dependent round trip), then selected
        o = tl.load(o_ptrs, mask=mask_p[:, None] & mask_d[None, :], other=0.0)
        o = tl.where(full[:, None], o, 0.0)  # [SPLITS_PAD, BLOCK_D] (garbage / NaN -> 0)
    else:  # an empty slot is not read
        o = tl.load(o_ptrs, mask=full[:, None] & mask_d[None, :], other=0.0)
    m = tl.max(lse, 0)
    if HAS_SINK:
        if SINK_FROM_PTR:
            sink2 = tl.load(sink_ptr + rn % NUM_HEADS).to(tl.float32) * 1.4426950408889634
        else:
            sink2 = 0.0
        m = tl.maximum(m, sink2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # [SPLITS_PAD], 0 for empty splits
    den = tl.sum(w, 0)
    if HAS_SINK:
        den = den + tl.exp2(sink2 - m_safe)  # the sink, exactly once
    out = tl.sum(o * w[:, None], 0)  # [BLOCK_D]
    out = out * tl.where(den > 0.0, 1.0 / tl.where(den > 0.0, den, 1.0), 0.0)
    tl.store(o_ptr + rn * HEAD + offs_d, out.to(o_ptr.dtype.element_ty), mask=mask_d)


def merge_launch(head: int, splits_pad: int) -> tuple[int, int]:
    """``(BLOCK_D, num_warps)`` of the merge programs: 4 warps and tiles of <= MERGE_TILE
    values, or one warp and <= MERGE_WARP_TILE from ``MERGE_ONE_WARP_FROM`` slots on, up to
    MERGE_WARP_TILE // 16 slots (a 16-channel tile of more slots would overflow the warp's
    registers: there the 4-warp tiles stay)."""
    head_pad = max(16, next_pow2(head))
    one_warp = (MERGE_ONE_WARP_FROM is not None
                and MERGE_ONE_WARP_FROM <= splits_pad <= MERGE_WARP_TILE // 16)  # fmt: skip
    tile, warps = (MERGE_WARP_TILE, 1) if one_warp else (MERGE_TILE, 4)
    return max(16, min(head_pad, tile // splits_pad)), warps


def merge_splits(
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    out: torch.Tensor,
    *,
    num_heads: int,
    head_sink: torch.Tensor | None,
    smooth_softmax: bool,
) -> None:
    """Merge ``o_part [..., N, splits, HEAD]`` / ``lse_part [..., N, splits]`` (fp32,
    contiguous) into ``out`` (contiguous, ``[..., N * HEAD]`` elements in (row, head, channel)
    order), in place."""
    splits, head = o_part.shape[-2:]
    rows_n = out.numel() // max(head, 1)
    if rows_n == 0:
        return
    splits_pad = next_pow2(max(splits, 1))  # no split: zeros (den = 0)
    block_d, warps = merge_launch(head, splits_pad)
    merge_splits_kernel[(rows_n, cdiv(head, block_d))](
        **pdl_kwargs(o_part),
        o_part_ptr=o_part,
        lse_part_ptr=lse_part,
        sink_ptr=head_sink if head_sink is not None else lse_part,
        o_ptr=out,
        num_splits=splits,
        NUM_HEADS=num_heads,
        HEAD=head,
        SPLITS_PAD=splits_pad,
        BLOCK_D=block_d,
        HAS_SINK=head_sink is not None or smooth_softmax,
        SINK_FROM_PTR=head_sink is not None,
        EARLY_O=MERGE_EARLY_O,
        num_warps=warps,
    )
