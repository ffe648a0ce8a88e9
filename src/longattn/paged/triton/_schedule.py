"""In-kernel, host-free work scheduling of the paged attention kernels.

A launch covers one *class* of sequences of the varlen batch: "decode" sequences (``1 <= S_b <=
DEC_TOK`` new tokens, one small query tile each) or "prefill" sequences (``S_b > DEC_TOK``). A
sequence ``b`` of the class has ``qblocks_b = cdiv(S_b, TOK_M)`` query tiles and each tile is
split into ``splits_b`` slices of its key range, so the sequence owns ``qblocks_b * splits_b``
consecutive *items*; program ``pid`` of the launch takes item ``pid``.

The splits come from a budget ``extra`` (host-chosen): with ``span_b`` the keys sequence ``b``
can see and ``work = sum_b qblocks_b * span_b``,

    splits_b = max(1, min(extra * span_b // work, cdiv(span_b, min_chunk)))

so that ``sum_b qblocks_b * splits_b <= sum_b qblocks_b + extra`` (the host sizes the grid with a
bound of the first sum plus ``extra``), and the items of split sequences (``splits_b >= 2``, the
ones that write fp32 partials) number at most ``extra`` (the partial buffer's size), in at most
``extra // 2`` split query tiles (the merge grid).

Every program recomputes this from ``cu_seqlens`` / ``past_seqlens`` (``[B_PAD]`` vectors, a
cumulative sum): no host synchronization, no extra launch, no table in memory.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pick(vec, offs, b):
    """``vec[b]`` of a ``[B_PAD]`` vector as a scalar (0 when ``b`` is out of range)."""
    return tl.sum(tl.where(offs == b, vec, 0), 0)


@triton.jit
def sequence_of_token(cu_ptr, t, batch, B_PAD: tl.constexpr):
    """The sequence ``b`` with ``cu[b] <= t < cu[b + 1]`` (``batch`` when there is none)."""
    offs = tl.arange(0, B_PAD)  # [B_PAD]
    ends = tl.load(cu_ptr + 1 + offs, mask=offs < batch, other=2147483647)  # cu[b + 1]
    return tl.sum((ends <= t).to(tl.int32), 0)


@triton.jit
def schedule(
    cu_ptr,  # [B + 1] int32
    past_ptr,  # [B] int32
    batch,
    window,
    extra,  # split budget (items beyond one per query tile)
    min_chunk,  # keys per split at least
    B_PAD: tl.constexpr,
    TOK_M: tl.constexpr,  # new tokens per query tile
    DEC_TOK: tl.constexpr,  # class boundary: decode sequences have 1 <= S_b <= DEC_TOK
    IS_DECODE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Per-sequence ``[B_PAD]`` vectors of the launch's schedule (see the module docstring):
    (cu0, new, past, qblocks, splits, item_end, pslot_end, mq_end), the ``*_end`` inclusive
    prefix sums of items, partial slots and split query tiles."""
    offs = tl.arange(0, B_PAD)  # [B_PAD]
    ok = offs < batch
    cu0 = tl.load(cu_ptr + offs, mask=ok, other=0)
    cu1 = tl.load(cu_ptr + 1 + offs, mask=ok, other=0)
    past = tl.maximum(tl.load(past_ptr + offs, mask=ok, other=0), 0)
    new = tl.maximum(cu1 - cu0, 0)
    if IS_DECODE:
        member = ok & (new > 0) & (new <= DEC_TOK)
    else:
        member = ok & (new > DEC_TOK)
    qblocks = tl.where(member, (new + TOK_M - 1) // TOK_M, 0)  # [B_PAD]
    total = past + new
    if HAS_WINDOW:
        span = total - tl.maximum(past - window + 1, 0)
    else:
        span = total
    span = tl.maximum(span, 1).to(tl.int64)
    work = tl.maximum(tl.sum(qblocks.to(tl.int64) * span, 0), 1)
    splits = (extra * span) // work
    splits = tl.minimum(splits, (span + min_chunk - 1) // min_chunk)
    splits = tl.maximum(splits, 1).to(tl.int32)  # [B_PAD]
    items = qblocks * splits
    item_end = tl.cumsum(items, 0)
    is_split = splits > 1
    pslot_end = tl.cumsum(tl.where(is_split, items, 0), 0)
    mq_end = tl.cumsum(tl.where(is_split, qblocks, 0), 0)
    return cu0, new, past, qblocks, splits, item_end, pslot_end, mq_end
