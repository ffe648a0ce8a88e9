"""Triton top-k block selection + emission of SparseAttentionIndexer: block scores -> positions.

``indexer_select_kernel`` grid: (rows,), one program per query row ``row = b*S + s``. It takes the
fp32 block scores ``[rows, NB]`` of the score kernel and writes the row's ``selected_indices`` and
``selected_counts`` exactly as the reference tier does (``emit_selection`` layout):

1. Row geometry from ``seqlens_k`` (as ``indexer_rows``): ``qpos``, ``n_complete`` visible complete
   blocks (0 for first-prompt padding rows), ``trail`` trailing tokens, ``k = min(kb, n_complete)``.
2. The row's visible scores (``c < n_complete``) are loaded once into registers ``[NB_PAD]`` and
   mapped to order-preserving int32 keys ``v >= 0`` (fp32 bits of a score >= +0.0; every NaN ->
   ``0x7F800001``, above +inf, as ``torch.sort`` orders NaN; -0.0 -> +0.0). Invisible: ``v = -1``.
3. One int64 sort key per block, ``v << 32 | (NB_PAD - 1 - c)``: keys are distinct, and a larger
   key is a higher score or, at equal scores, a lower block (the reference's stable sort).
   ``tl.topk`` (a bitonic top-k network in registers and shared memory; no data-dependent loop,
   no CTA-wide scan) returns the ``KB_PAD >= k`` largest; their block ids, the ones past ``k``
   replaced by a sentinel, are sorted ascending (``tl.sort`` of ``KB_PAD`` ints).
4. Emission in ``BLOCK_O`` tiles: output ``j < k*r`` is ``ids[j // r] * r + j % r`` (a register
   gather); then the trailing block's ``trail`` positions ``n_complete*r + t``; then -1.
   ``count = k*r + trail``.

No host sync, grid from shapes only. Rows hold up to ``MAX_BLOCKS`` blocks in registers; beyond
that the caller keeps the torch top-k path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_utils import next_pow2, pdl_kwargs, wait_prior_grids

MAX_BLOCKS = 16384  # NB_PAD bound of the in-register select (1M tokens at r = 64)
_NAN_KEY = tl.constexpr(0x7F800001)  # every NaN score: above +inf (0x7F800000)


@triton.jit
def _order_keys(score, visible):
    """fp32 scores ``>= +0.0`` (or NaN) -> order-preserving int32 keys ``>= 0``; invisible: -1."""
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, 0, bits)  # -0.0 (and the impossible negatives) -> +0.0
    key = tl.where(score != score, _NAN_KEY, key)
    return tl.where(visible, key, -1)


@triton.jit
def indexer_select_kernel(
    score_ptr,  # [rows, NB] fp32 block scores (score kernel output), row stride stride_sr
    seqlens_ptr,  # [B] int32, total_len - 1
    idx_ptr,  # [rows, max_selected] int32 out: selected_indices
    cnt_ptr,  # [rows] int32 out: selected_counts
    seq_len,
    num_blocks,
    stride_sr,
    compress_ratio,
    kb,  # token_budget // r
    max_selected,
    NB_PAD: tl.constexpr,  # next power of two >= num_blocks
    KB_PAD: tl.constexpr,  # power of two >= min(kb, num_blocks), <= NB_PAD
    BLOCK_O: tl.constexpr,  # output positions per emission tile
    IS_FIRST_PROMPT: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    wait_prior_grids(PDL)  # first: the previous grid's writes are visible
    row = tl.program_id(0).to(tl.int64)
    b = row // seq_len
    s = row % seq_len
    total_len = tl.load(seqlens_ptr + b).to(tl.int64) + 1
    if IS_FIRST_PROMPT:
        qpos = s
    else:
        qpos = total_len - seq_len + s
    real = (qpos >= 0) & (qpos < total_len)
    n_vis = tl.where(real, qpos + 1, 0)  # tokens at positions <= qpos
    n_complete = tl.minimum(n_vis // compress_ratio, num_blocks)
    trail = tl.minimum(n_vis - n_complete * compress_ratio, compress_ratio - 1).to(tl.int32)
    n_complete = n_complete.to(tl.int32)
    k = tl.minimum(n_complete, kb)  # blocks to choose (int32 scalar, <= KB_PAD)

    # --- select: the k best visible blocks, ties to the lower index, in ascending block order
    offs_c = tl.arange(0, NB_PAD)  # [NB_PAD] block ids
    visible = (offs_c < n_complete) & (k > 0)
    score = tl.load(score_ptr + row * stride_sr + offs_c, mask=visible, other=0.0)  # [NB_PAD]
    v = _order_keys(score, visible)  # [NB_PAD] int32
    key = (v.to(tl.int64) << 32) | (NB_PAD - 1 - offs_c).to(tl.int64)  # [NB_PAD] distinct
    top = tl.topk(key, KB_PAD)  # [KB_PAD] int64, descending
    slots = tl.arange(0, KB_PAD)  # [KB_PAD]
    ids = (NB_PAD - 1) - (top & 0xFFFFFFFF).to(tl.int32)  # [KB_PAD] block ids
    ids = tl.sort(tl.where(slots < k, ids, NB_PAD))  # [KB_PAD] the k chosen first, ascending

    # --- emission: chosen blocks' positions, trailing tokens, -1
    r = compress_ratio
    n_sel_tok = k * r
    tail_base = n_complete * r
    out_row = idx_ptr + row * max_selected
    j0 = tl.zeros([], tl.int32)
    while j0 < max_selected:  # a while loop: the interpreter takes no tensor range() bounds
        j = j0 + tl.arange(0, BLOCK_O)  # [BLOCK_O] output slots
        sl = j // r
        in_sel = j < n_sel_tok
        blk = tl.gather(ids, tl.minimum(sl, KB_PAD - 1), 0)  # [BLOCK_O]
        t = j - n_sel_tok
        val = tl.where(in_sel, blk * r + (j - sl * r), tl.where(t < trail, tail_base + t, -1))
        tl.store(out_row + j, val, mask=j < max_selected)
        j0 += BLOCK_O
    tl.store(cnt_ptr + row, n_sel_tok + trail)


def select_num_warps(nb_pad: int) -> int:
    if nb_pad <= 1024:
        return 4
    return 8 if nb_pad <= 4096 else 16


def indexer_select(
    scores: torch.Tensor | None,
    seqlens_k: torch.Tensor,
    *,
    seq_len: int,
    num_blocks: int,
    compress_ratio: int,
    token_budget: int,
    is_first_prompt: bool,
    interpret: bool = False,
    empty=torch.empty,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k blocks + emission from block scores, in one kernel.

    Args:
        scores: ``[B*S, num_blocks]`` fp32 block scores (``>= 0`` or NaN where visible; other
            entries are never read); None when no block can be chosen (``token_budget <
            compress_ratio`` or ``num_blocks == 0``).
        seqlens_k: ``[B]`` int32, total length minus one.
        empty: allocator ``(shape, *, dtype, device)`` of the outputs.

    Returns:
        ``selected_indices [B*S, token_budget + r - 1]`` int32, ``selected_counts [B*S]`` int32.
    """
    r = compress_ratio
    kb = token_budget // r
    rows = seqlens_k.shape[0] * seq_len
    max_selected = token_budget + r - 1
    dev = seqlens_k.device
    nb_pad = max(16, next_pow2(max(num_blocks, 1)))
    if nb_pad > MAX_BLOCKS:
        raise ValueError(f"indexer_select supports up to {MAX_BLOCKS} blocks, got {num_blocks}")
    idx = empty((rows, max_selected), dtype=torch.int32, device=dev)
    cnt = empty((rows,), dtype=torch.int32, device=dev)
    if rows == 0:
        return idx, cnt
    if scores is None or kb == 0 or num_blocks == 0:  # k = 0: no score is read
        scores, kb, stride = torch.zeros(1, dtype=torch.float32, device=dev), 0, 0
    else:
        stride = scores.stride(0)
    indexer_select_kernel[(rows,)](
        **pdl_kwargs(seqlens_k),
        score_ptr=scores,
        seqlens_ptr=seqlens_k,
        idx_ptr=idx,
        cnt_ptr=cnt,
        seq_len=seq_len,
        num_blocks=num_blocks,
        stride_sr=stride,
        compress_ratio=r,
        kb=kb,
        max_selected=max_selected,
        NB_PAD=nb_pad,
        KB_PAD=min(max(2, next_pow2(kb)), nb_pad),
        BLOCK_O=256 if interpret else 1024,
        IS_FIRST_PROMPT=is_first_prompt,
        num_warps=select_num_warps(nb_pad),
    )
    return idx, cnt
