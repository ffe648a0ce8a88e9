"""Log-sum-exp merge of split-K attention partials, shared by the GQA and DSA decode tiers.

``merge_splits_kernel`` grid: (R * N, cdiv(HEAD, BLOCK_D)), one program per (row, head) and
channel tile. A split kernel wrote, for every row ``r``, head ``n`` and split ``p``:

- ``o_part [R, N, splits, HEAD]`` fp32, the split's output normalized over the split;
- ``lse_part [R, N, splits]`` fp32, the split's log-sum-exp in the log2 domain (-inf if empty).

The merge loads every split of its channel tile at once (``[SPLITS_PAD, BLOCK_D]``, no serial
loop over the splits), weights them by ``exp2(lse - max)``, adds the sink (``head_sink`` or the
``smooth_softmax`` zero logit) to the denominator exactly once, and rounds to the output dtype
once. A row with nothing valid gives zeros (with or without a sink). ``BLOCK_D`` keeps the tile
at <= 8K fp32 values (64 registers per thread at 4 warps): a whole-head tile of 256 splits x 256
channels would be 64K values per program and spill.

``merge_if_last`` is the same merge inside a split kernel (``FUSE_MERGE``): every program of a
group of rows (one sequence's KV head) takes a ticket from an int32 counter after writing its
partials (a GPU-scope fence, a CTA barrier, one ``acq_rel`` atomic add); the program that draws
the last ticket merges the group's rows, as ``[R_PAD, SPLITS_PAD, BLOCK_D]`` tiles, so the merge
launch goes away. The counters must be zero before the split kernel runs (the launcher has the
prologue kernel zero them: no state survives a call).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import cdiv, gpu_fence, next_pow2, pdl_kwargs, wait_prior_grids

MERGE_TILE = 8192  # fp32 values per program's [SPLITS_PAD, BLOCK_D] tile


@triton.jit
def _split_weights(lse, sink2, AXIS: tl.constexpr, HAS_SINK: tl.constexpr):
    """``(w, inv)`` of log2-domain split log-sum-exps ``lse`` along ``AXIS``: the weights
    ``exp2(lse - m)`` (0 for empty splits) and ``1 / den`` with that axis kept as size 1 (0 for
    a row with nothing); ``HAS_SINK``: the sink logit ``sink2`` (broadcastable to the reduced
    shape) joins the max and the denominator exactly once."""
    m = tl.max(lse, AXIS, keep_dims=True)
    if HAS_SINK:
        m = tl.maximum(m, sink2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    den = tl.sum(w, AXIS, keep_dims=True)
    if HAS_SINK:
        den = den + tl.exp2(sink2 - m_safe)  # the sink, exactly once
    return w, tl.where(den > 0.0, 1.0 / tl.where(den > 0.0, den, 1.0), 0.0)


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
):
    wait_prior_grids(PDL)  # first: the previous grid's writes are visible
    rn = tl.program_id(0).to(tl.int64)  # r * N + n
    offs_p = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask_p = offs_p < num_splits
    mask_d = offs_d < HEAD
    lse = tl.load(lse_part_ptr + rn * num_splits + offs_p, mask=mask_p, other=float("-inf"))
    o_ptrs = o_part_ptr + (rn * num_splits + offs_p)[:, None] * HEAD + offs_d[None, :]
    o = tl.load(o_ptrs, mask=mask_p[:, None] & mask_d[None, :], other=0.0)  # [SPLITS_PAD, BLOCK_D]
    sink2 = 0.0  # the smooth_softmax zero logit
    if SINK_FROM_PTR:
        sink2 = tl.load(sink_ptr + rn % NUM_HEADS).to(tl.float32) * 1.4426950408889634
    w, inv = _split_weights(lse, sink2, 0, HAS_SINK)  # [SPLITS_PAD], [1]
    out = tl.sum(o * w[:, None], 0) * inv  # [BLOCK_D]
    tl.store(o_ptr + rn * HEAD + offs_d, out.to(o_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _merge_rows(
    o_part_ptr, lse_part_ptr, sink_ptr, o_ptr, rn0, num_splits,
    NUM_HEADS: tl.constexpr, HEAD: tl.constexpr, ROWS: tl.constexpr, R_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINK: tl.constexpr,
    SINK_FROM_PTR: tl.constexpr,
):  # fmt: skip
    """``merge_splits_kernel``'s math for the ROWS consecutive (row, head) indices ``rn0 ..``
    (int64), every split of a row at once: ``[R_PAD, SPLITS_PAD]`` weights, then channel
    tiles ``[R_PAD, SPLITS_PAD, BLOCK_D]``. Partials are read through L2 (``.cg``: other SMs
    wrote them during this kernel)."""
    offs_r = tl.arange(0, R_PAD)  # [R_PAD]
    offs_p = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    rn = rn0 + offs_r  # [R_PAD]
    mask_r = offs_r < ROWS
    mask_rp = mask_r[:, None] & (offs_p < num_splits)[None, :]  # [R_PAD, SPLITS_PAD]
    part = rn[:, None] * num_splits + offs_p[None, :]  # [R_PAD, SPLITS_PAD]
    lse = tl.load(lse_part_ptr + part, mask=mask_rp, other=float("-inf"), cache_modifier=".cg")
    sink2 = 0.0  # the smooth_softmax zero logit
    if SINK_FROM_PTR:
        sink2 = tl.load(sink_ptr + rn % NUM_HEADS, mask=mask_r, other=0.0).to(tl.float32)
        sink2 = (sink2 * 1.4426950408889634)[:, None]  # [R_PAD, 1]
    w, inv = _split_weights(lse, sink2, 1, HAS_SINK)  # [R_PAD, SPLITS_PAD], [R_PAD, 1]
    for d0 in tl.static_range(0, HEAD, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)  # [BLOCK_D]
        o_ptrs = o_part_ptr + part[:, :, None] * HEAD + offs_d[None, None, :]
        mask_d = offs_d < HEAD
        o = tl.load(o_ptrs, mask=mask_rp[:, :, None] & mask_d[None, None, :], other=0.0,
                    cache_modifier=".cg")  # [R_PAD, SPLITS_PAD, BLOCK_D]  # fmt: skip
        out = tl.sum(o * w[:, :, None], 1) * inv  # [R_PAD, BLOCK_D]
        dst = o_ptr + rn[:, None] * HEAD + offs_d[None, :]
        tl.store(dst, out.to(o_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :])


@triton.jit
def merge_if_last(
    ticket_ptr, num_splits, o_part_ptr, lse_part_ptr, sink_ptr, o_ptr, rn0,
    NUM_HEADS: tl.constexpr, HEAD: tl.constexpr, ROWS: tl.constexpr, R_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINK: tl.constexpr,
    SINK_FROM_PTR: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Call after a split program's partial stores: it takes a ticket from ``ticket_ptr``
    (int32, zero before the kernel; ``num_splits`` programs share it) and, if it drew the last
    one, merges rows ``rn0 .. rn0 + ROWS - 1`` (see ``_merge_rows``) into ``o_ptr``."""
    gpu_fence(INTERPRET)  # this thread's partial stores come before the ticket ...
    tl.debug_barrier()  # ... and so do every other thread's
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == num_splits - 1:  # every other split has stored its partials
        gpu_fence(INTERPRET)
        _merge_rows(o_part_ptr, lse_part_ptr, sink_ptr, o_ptr, rn0, num_splits, NUM_HEADS, HEAD,
                    ROWS, R_PAD, SPLITS_PAD, BLOCK_D, HAS_SINK, SINK_FROM_PTR)  # fmt: skip


FUSED_MERGE_TILES = 2  # channel tiles of MERGE_TILE values a fused merge may take


def fused_merge_shape(rows: int, splits: int, head: int) -> dict | None:
    """Constexprs (``R_PAD``, ``SPLITS_PAD``, ``BLOCK_D``) of ``merge_if_last`` for a group of
    ``rows`` rows merging ``splits`` splits of ``head`` channels, tiles of <= MERGE_TILE
    values; None when the group is too large for one program: more than FUSED_MERGE_TILES
    such tiles (each a dependent L2 round trip of one program, where the merge kernel spreads
    them over many), and the merge kernel runs."""
    r_pad, s_pad = next_pow2(max(rows, 1)), next_pow2(max(splits, 1))
    head_pad = max(16, next_pow2(head))
    if r_pad * s_pad * head_pad > FUSED_MERGE_TILES * MERGE_TILE:
        return None
    block_d = max(16, min(head_pad, MERGE_TILE // (r_pad * s_pad)))
    return dict(R_PAD=r_pad, SPLITS_PAD=s_pad, BLOCK_D=block_d)


def merge_block_d(head: int, splits_pad: int) -> int:
    """Channels per merge program: the ``[SPLITS_PAD, BLOCK_D]`` tile stays <= MERGE_TILE."""
    head_pad = max(16, next_pow2(head))
    return max(16, min(head_pad, MERGE_TILE // splits_pad))


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
    block_d = merge_block_d(head, splits_pad)
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
        num_warps=4,
    )
