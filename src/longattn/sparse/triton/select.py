"""Triton top-k block selection + emission of SparseAttentionIndexer: block scores -> positions.

``indexer_select_kernel`` grid: (rows,), one program per query row ``row = b*S + s``. It takes the
fp32 block scores ``[rows, NB]`` of the score kernel and writes the row's ``selected_indices`` and
``selected_counts`` exactly as the reference tier does (``emit_selection`` layout):

1. Row geometry from ``seqlens_k`` (as ``indexer_rows``): ``qpos``, ``n_complete`` visible complete
   blocks (0 for first-prompt padding rows), ``trail`` trailing tokens, ``k = min(kb, n_complete)``.
2. The row's visible scores (``c < n_complete``) are loaded once into registers ``[NB_PAD]`` and
   mapped to order-preserving int32 keys ``v >= 0`` (fp32 bits of a score >= +0.0; every NaN ->
   ``0x7F800001``, above +inf, as ``torch.sort`` orders NaN; -0.0 -> +0.0). Invisible: ``v = -1``.
3. The ``k`` best, ties to the lower block, in ascending block order, by one of three methods
   (``TOPK``, chosen on the host by the row width ``NB_PAD``; H200, ``benchmarks/results/
   select_ab_h200.json``, budget 2048: 3.4 vs 6.0 us at 512 blocks, 8.6 vs 7.6 at 2048, 15.5
   vs 10.9 at 4096):

   - ``TOPK`` (rows of up to ``TOPK_MAX_BLOCKS``): one int64 sort key per block, ``v << 32 |
     (NB_PAD - 1 - c)`` (distinct; larger = higher score or, at equal scores, lower block);
     ``tl.topk`` (a bitonic top-k network) returns the ``KB_PAD >= k`` largest, whose block ids
     (those past ``k`` replaced by a sentinel) ``tl.sort`` puts in ascending order, in registers.
   - radix (wider rows): radix select of the k-th largest key, ``RADIX_BITS`` bits per step
     (default 2); it starts below the bits shared by the largest key and a floor <= the k-th
     largest (the least maximum of KB_PAD >= k strided groups of blocks; a reduction along
     the groups and one max-min reduction), then each step counts ``v >= lo + d * 2**shift``
     for d = 1 .. 2**RADIX_BITS - 1 in ONE packed reduction (16-bit count fields, four per int64
     word; 2 bits: d = 1, 2, 3 in one word) and keeps the largest threshold still holding
     >= k keys; it stops as soon as exactly k keys are ``>= lo`` (then those are chosen, the
     usual exit). Otherwise lo is the k-th key and ties it: every key ``> lo``, then keys
     ``== lo`` in ascending block order until k are chosen (a count and a rank); an inclusive
     cumsum over the chosen flags gives each chosen block its slot; the block ids go to a
     per-row scratch row ``[kb]`` int32 (then a CTA barrier).
   - rank (``RANK_SELECT``; by default rows of ``RANK_DEFAULT_BLOCKS`` (4096 to 16384)
     blocks with a budget of <= ``RANK_MAX_KB_PAD`` blocks): the floor is the k-th largest of
     ``2 * KB_PAD`` strided group maxima (a ``[G, G]`` rank, ``_rank_bounds``: ~1.3 k keys lie
     above it); when at most ``RANK_CAP`` keys do, they are compacted in block order through
     the scratch row (``_compact``: a cumsum, a scatter, a CTA barrier, one read), ranked by
     one ``[CAP, CAP]`` comparison of distinct (key, place) pairs (``_desc_rank``), and the k
     of rank < k give their ids in registers (``_compact_ids``); rows of more candidates
     (ties) take the radix steps from that floor. H100, the select alone (B=1 S=1): 4096 blocks 5.6 -> 5.2 us,
     8192 8.6 -> 6.1, 16384 14.5 -> 9.2.
     The floor's group maxima may come with the scores instead (``RANK_FLOOR`` "tiles", the
     default when the launch gets them, ``tile_max``): the score kernel's programs then take
     tiles of 8-block runs strided over the row and write each row's largest key per tile
     (``TILE_MAX``); ``_tile_bounds`` folds them into ``2 * KB_PAD`` groups and ranks
     those, so the row is never reduced here (one small load beside the score loads).
4. Emission in ``BLOCK_O`` tiles: output ``j < k*r`` is ``ids[j // r] * r + j % r``, a register
   gather from ``ids [KB_PAD]`` (the radix method reads its scratch row back once), or, for
   radix tiles of ``WIDE_EMIT_BLOCKS`` or more, a scratch load; then the trailing block's
   ``trail`` positions ``n_complete*r + t``; then -1. ``count = k*r + trail``. (H200, session
   19, ``benchmarks/results/select_tail_h200.json``: the register gather, the one max-min
   reduction and the tie count only on ties: B=1 S=1 T=128K 7.01 -> 6.62 us at budget 2048,
   9.55 -> 8.44 at 8192; -1.3 to -5% at T=256K, where the 4096-wide tiles keep the scratch
   loads: a first run with the gather there lost 1-2%, ``score_prec_h200.json``. The radix
   floor start then took B=1 S=1 T=128K 6.77 -> 5.42 us and T=256K 9.30 -> 7.31 at budget
   2048, 8.32 -> 8.05 and 10.97 -> 9.86 at 8192; ``run2_rows`` of the same file.)

No host sync, grid from shapes only. Rows hold up to ``MAX_BLOCKS`` blocks in registers; beyond
that the caller keeps the torch top-k path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_utils import (
    cfg_flag,
    next_pow2,
    pdl_kwargs,
    release_dependents,
    sm_clock,
    wait_prior_grids,
)

MAX_BLOCKS = 16384  # NB_PAD bound of the in-register select (1M tokens at r = 64)
TOPK_MAX_BLOCKS = 1024  # rows up to this NB_PAD take the tl.topk method (see step 3)
_NAN_KEY = tl.constexpr(0x7F800001)  # every NaN score: above +inf (0x7F800000)


@triton.jit
def _order_keys(score, visible):
    """fp32 scores ``>= +0.0`` (or NaN) -> order-preserving int32 keys ``>= 0``; invisible: -1."""
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, 0, bits)  # -0.0 (and the impossible negatives) -> +0.0
    key = tl.where(score != score, _NAN_KEY, key)
    return tl.where(visible, key, -1)


@triton.jit
def _max_min(a_max, a_min, b_max, b_min):
    return tl.maximum(a_max, b_max), tl.minimum(a_min, b_min)


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _packed_counts(v, lo, step, WORD: tl.constexpr, NDIG: tl.constexpr):
    """int64 word ``WORD`` ``[NB_PAD]`` of the packed threshold counts: field ``f`` (16 bits)
    holds ``v >= lo + d * step`` for ``d = 4 * WORD + f + 1 <= NDIG``. (int32 words of two
    fields showed no consistent difference on the H200, within 4.4% either way, session 18.)"""
    packed = tl.zeros(v.shape, tl.int64)  # [NB_PAD]
    for f in tl.static_range(4):
        if 4 * WORD + f + 1 <= NDIG:
            t = lo + (4 * WORD + f + 1) * step
            packed = packed | ((v >= t).to(tl.int64) << (16 * f))
    return packed


@triton.jit
def _kth_largest(v, k, n_ge, vmax, floor, RADIX_BITS: tl.constexpr):
    """Radix select over the keys ``v [NB_PAD]`` (int32, >= 0 where counted, -1 elsewhere);
    ``vmax`` the largest key, ``floor >= 0`` a key at most the k-th largest; ``n_ge`` an upper
    bound of ``#(v >= floor)`` that is exact when it equals k. ``RADIX_BITS`` (2, 3 or 4) bits per
    step: each step counts ``v >= lo + d * 2**shift`` for the ``2**RADIX_BITS - 1`` digits d
    in ONE CTA reduction (counts <= MAX_BLOCKS in 16-bit fields, four per int64 word; two or
    four words reduce together as a tuple).

    Returns ``(lo, n_ge)``: ``n_ge = #(v >= lo) >= k`` and either ``n_ge == k`` (the top k are
    exactly the keys ``>= lo``) or ``lo`` is the k-th largest key (``#(v > lo) < k``)."""
    NDIG: tl.constexpr = (1 << RADIX_BITS) - 1  # thresholds per step
    NWORDS: tl.constexpr = (NDIG + 3) // 4  # int64 words of four 16-bit count fields
    # Start below the bits that every key in [floor, vmax] shares: the bits above the highest
    # bit ``d`` where floor and vmax differ. lo = that common prefix (<= floor, so at least k
    # keys are >= lo); the first digit covers bits d .. d - RADIX_BITS + 1. The k best keys lie
    # close below vmax, so this skips the leading steps (each a CTA-wide reduction).
    diff = vmax ^ floor
    # highest set bit of diff via its fp32 exponent (int -> fp32 rounds up at most one binade:
    # an over-estimate only costs one more step, the invariant still holds)
    d = (diff.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    d = tl.where(diff > 0, tl.minimum(d, 30), -1)
    low_bits = (tl.full([], 2, tl.int64) << d.to(tl.int64)) - 1  # bits d..0 (int64: d = 30)
    lo = tl.where(d >= 0, (vmax.to(tl.int64) & ~low_bits).to(tl.int32), vmax)
    lo = tl.maximum(lo, 0)  # no counted key (vmax = -1): lo = 0, nothing is chosen
    # d = -1 (all keys equal): no step. Near bit 0 the digit is clamped to shift 0 (its top
    # thresholds lie above vmax and count < k keys).
    shift = tl.where(d >= 0, tl.maximum(d - (RADIX_BITS - 1), 0), -1)
    # invariant: #(v >= lo) >= k and #(v >= lo + 2**RADIX_BITS * 2**shift) < k; thresholds
    # stay below lo + 2**(d + 1) <= 2**31 (no int32 overflow)
    while (n_ge > k) & (shift >= 0):
        step = 1 << shift
        if NWORDS == 1:
            w0 = tl.sum(_packed_counts(v, lo, step, 0, NDIG))
            w1 = w0
            w2 = w0
            w3 = w0
        elif NWORDS == 2:
            w0, w1 = tl.reduce(
                (_packed_counts(v, lo, step, 0, NDIG), _packed_counts(v, lo, step, 1, NDIG)),
                0, _add2)  # fmt: skip
            w2 = w0
            w3 = w0
        else:
            w0, w1, w2, w3 = tl.reduce(
                (_packed_counts(v, lo, step, 0, NDIG), _packed_counts(v, lo, step, 1, NDIG),
                 _packed_counts(v, lo, step, 2, NDIG), _packed_counts(v, lo, step, 3, NDIG)),
                0, _add4)  # fmt: skip
        new_lo = lo
        new_n = n_ge
        # counts fall with the digit: the largest digit still holding >= k keys wins
        for dig in tl.static_range(1, NDIG + 1):
            word = w0
            if (dig - 1) // 4 == 1:
                word = w1
            elif (dig - 1) // 4 == 2:
                word = w2
            elif (dig - 1) // 4 == 3:
                word = w3
            c = ((word >> (16 * ((dig - 1) % 4))) & 0xFFFF).to(tl.int32)
            new_lo = tl.where(c >= k, lo + dig * step, new_lo)
            new_n = tl.where(c >= k, c, new_n)
        lo = new_lo
        n_ge = new_n
        shift = tl.where(shift > 0, tl.maximum(shift - RADIX_BITS, 0), -1)
    return lo, n_ge


@triton.jit
def _chosen_topk(v, offs_c, k, NB_PAD: tl.constexpr, KB_PAD: tl.constexpr):
    """Block ids ``[KB_PAD]`` of the k best keys ``v [NB_PAD]``, ascending (ties: lower block),
    then the sentinel ``NB_PAD``."""
    key = (v.to(tl.int64) << 32) | (NB_PAD - 1 - offs_c).to(tl.int64)  # [NB_PAD] distinct
    top = tl.topk(key, KB_PAD)  # [KB_PAD] int64, descending
    slots = tl.arange(0, KB_PAD)  # [KB_PAD]
    ids = (NB_PAD - 1) - (top & 0xFFFFFFFF).to(tl.int32)  # [KB_PAD] block ids
    return tl.sort(tl.where(slots < k, ids, NB_PAD))  # [KB_PAD] the k chosen first


@triton.jit
def _radix_bounds(v, NB_PAD: tl.constexpr, G: tl.constexpr):
    """``(vmax, floor)`` of the keys ``v [NB_PAD]``: the largest key and a key at most the k-th
    largest, from the maxima of the ``G >= k`` strided groups ``c = g (mod G)``: when every
    group holds a counted key, ``G >= k`` distinct keys are ``>= floor`` = the least group
    maximum (a row of uniform scores: ~3 radix steps fewer); otherwise ``floor`` = 0. When
    every counted key is chosen (``k == n_complete``, so ``n_complete <= G``), a group is empty or
    each group holds one block and ``floor`` is the least key, so every key is ``>= lo``."""
    gmax = tl.max(tl.reshape(v, [NB_PAD // G, G]), 0)  # [G] group maxima (row-major reshape)
    vmax, floor = tl.reduce((gmax, gmax), 0, _max_min)  # one reduction over [G]
    return vmax, tl.maximum(floor, 0)  # an empty group (max -1): floor 0


@triton.jit
def _chosen_radix(v, k, n_complete, RADIX_BITS: tl.constexpr, NB_PAD: tl.constexpr,
                  KB_PAD: tl.constexpr, CLOCKS: tl.constexpr = False):  # fmt: skip
    """Flags ``[NB_PAD]`` of the k best keys ``v [NB_PAD]`` (ties: lower block) by radix
    select, and the SM clock after the bounds and after the radix steps (``CLOCKS``; else
    zeros)."""
    vmax, floor = _radix_bounds(v, NB_PAD, KB_PAD)
    t_bounds = tl.zeros([], tl.int64)
    t_radix = tl.zeros([], tl.int64)
    if CLOCKS:
        t_bounds = sm_clock(vmax)
    lo, n_ge = _kth_largest(v, k, tl.where(k > 0, n_complete, 0), vmax, floor, RADIX_BITS)
    if CLOCKS:
        t_radix = sm_clock(lo)
    return _chosen_from_lo(v, k, lo, n_ge), t_bounds, t_radix  # [NB_PAD], k of them


@triton.jit
def _chosen_from_lo(v, k, lo, n_ge):
    """Flags ``[NB_PAD]`` of the k best keys from ``_kth_largest``'s ``(lo, n_ge)``."""
    chosen = v >= lo  # [NB_PAD]: exactly the k best when n_ge == k (the usual exit)
    if n_ge > k:  # lo is the k-th key and ties it (n_ge may be a bound): lowest block ids first
        eq = v == lo  # [NB_PAD] (v = -1 never equals lo >= 0)
        need = k - tl.sum((v > lo).to(tl.int32))  # equal keys to take
        eq_rank = tl.cumsum(eq.to(tl.int32), axis=0)  # [NB_PAD] inclusive rank among equals
        chosen = (v > lo) | (eq & (eq_rank <= need))
    return chosen & (k > 0)  # [NB_PAD], k of them


@triton.jit
def _max2(a0, a1, b0, b1):
    return tl.maximum(a0, b0), tl.maximum(a1, b1)


@triton.jit
def _desc_rank(u):
    """Rank of each of the distinct keys ``u [N]`` in descending order: ``#(u_j > u_i)``, j
    along axis 0 of an ``[N, N]`` tile: triton 3.6's default tile layout puts a column's rows
    in one thread (then a few warps), so the sum runs in registers (along axis 1 it took five
    shuffle levels per row, sm_90, 8 warps)."""
    return tl.sum((u[:, None] > u[None, :]).to(tl.int32), axis=0)  # [N]


@triton.jit
def _kth_of_maxima(gmax, k, G: tl.constexpr):
    """``(vmax, floor)`` from the maxima ``gmax [G]`` (int32 keys, -1: empty) of G disjoint
    groups of a row's keys: the largest, and the k-th largest maximum (0 when fewer than k
    groups hold a key). The k groups of the best maxima each hold a key ``>= floor``, so
    ``floor`` is at most the k-th largest key."""
    g = tl.arange(0, G)  # [G]
    u = (gmax.to(tl.int64) << 16) | (G - 1 - g)  # [G] distinct: higher max, then lower group
    kth = tl.where(_desc_rank(u) == k - 1, gmax, -1)  # [G] the k-th largest maximum, else -1
    vmax, floor = tl.reduce((gmax, kth), 0, _max2)
    return vmax, tl.maximum(floor, 0)  # k = 0: no key is counted (floor 0 > v = -1)


@triton.jit
def _tile_bounds(tmax_row, n_tiles, k, NT: tl.constexpr, G: tl.constexpr):
    """``(vmax, floor)`` of the rank method from the score kernel's tile maxima (``RANK_FLOOR
    "tiles"``): ``tmax_row[:n_tiles]`` holds the largest key of each tile of blocks, runs of
    ``TILE_RUN`` (8) contiguous blocks strided over the row (``indexer_score_kernel``'s
    ``TILE_MAX``). Tiles ``p = g (mod G)`` fold into ``G`` groups (still disjoint, still
    spread over the row: a stretch of adjacent good blocks lands in many groups), and the
    floor is ``_rank_bounds``'s over those groups, without reducing the row here: the maxima
    come with the scores, in loads that do not wait for them."""
    if NT == G:  # no fold: triton loads the maxima in each layout the rank needs
        t = tl.arange(0, G)  # [G]
        return _kth_of_maxima(tl.load(tmax_row + t, mask=t < n_tiles, other=-1), k, G)
    t = tl.arange(0, NT // G)[:, None] * G + tl.arange(0, G)[None, :]  # [NT // G, G] tile ids
    tmax = tl.load(tmax_row + t, mask=t < n_tiles, other=-1)  # [NT // G, G] (-1: no key)
    return _kth_of_maxima(tl.max(tmax, 0), k, G)


@triton.jit
def _rank_bounds(v, k, NB_PAD: tl.constexpr, G: tl.constexpr):
    """``(vmax, floor)`` of the keys ``v [NB_PAD]`` for the rank method: the largest key and
    the k-th largest of the maxima of the ``G >= KB_PAD >= k`` strided groups ``c = g (mod
    G)``. The k groups of the best maxima each hold a key ``>= floor``, so ``floor`` is at most
    the k-th largest key (at least k groups hold a counted key: every group when
    ``n_complete > G``, else one per visible block). On distinct keys about 1.3 k keys are
    ``>= floor`` at G = 2 k (i.i.d. keys, 2048 / 4096 blocks: median 43, 99th percentile 55,
    max 64 of 2000 rows at k = 32), against ~3.8 k for the least of k group maxima."""
    gmax = tl.max(tl.reshape(v, [NB_PAD // G, G]), 0)  # [G] group maxima (-1: empty group)
    return _kth_of_maxima(gmax, k, G)


@triton.jit
def _max_max_min(a0, a1, a2, b0, b1, b2):
    return tl.maximum(a0, b0), tl.maximum(a1, b1), tl.minimum(a2, b2)


@triton.jit
def _cross_bounds(v, k, NB_PAD: tl.constexpr, C: tl.constexpr):
    """``(vmax, floor)`` of the keys ``v [NB_PAD]`` from one ``[R, C]`` view of the row (``R =
    NB_PAD // C`` contiguous groups as rows, ``C`` strided groups as columns) without a layout
    change (``RANK_FLOOR = "cross"``): a column maximum reached by the maxima of >= k rows has
    k distinct keys (those rows' maxima) at or above it, so the largest such column maximum is
    at most the k-th largest key; so is the least column maximum when ``C >= k``; the floor is
    the larger. Row and column maxima are reductions of the same tile, so the ``[R, C]``
    comparison needs no shared-memory conversion (``_rank_bounds``'s ``[G, G]`` rank needs the
    group maxima in a second layout). Keys above it on i.i.d. scores, k = 32, [64, 64] at 4096
    blocks: median 44, 99th percentile 58, max 67 of 2000 rows (rank floor: 43 / 54 / 61)."""
    tile = tl.reshape(v, [NB_PAD // C, C])  # [R, C] (row-major: row = c // C, column = c % C)
    colmax = tl.max(tile, 0)  # [C] strided group maxima (-1: empty)
    rowmax = tl.max(tile, 1)  # [R] contiguous group maxima
    reach = tl.sum((rowmax[:, None] >= colmax[None, :]).to(tl.int32), axis=0)  # [C] rows >= it
    vmax, best, least = tl.reduce((colmax, tl.where(reach >= k, colmax, -1), colmax), 0,
                                  _max_max_min)  # fmt: skip
    floor = tl.maximum(best, tl.where(k <= C, least, 0))
    return vmax, tl.maximum(floor, 0)  # k = 0: no key is counted (floor 0 > v = -1)


@triton.jit
def _compact(v, offs_c, floor, n_c, scratch_row, CAP: tl.constexpr):
    """The candidates ``v >= floor`` of the keys ``v [NB_PAD]`` (``n_c <= CAP`` of them),
    compacted in block order through ``scratch_row`` (a cumsum, one scatter, a CTA barrier, one
    read): ``[CAP]`` int64 ``v << 32 | (CAP - 1 - j) << 16 | c`` at place j (distinct; larger =
    higher key, then lower block), -1 at the empty places."""
    tl.static_assert(CAP < 32768 and v.shape[0] <= 65536, "compaction packing bounds")
    cand = v >= floor  # [NB_PAD] (v = -1 never: floor >= 0)
    place = tl.cumsum(cand.to(tl.int32), axis=0) - 1  # [NB_PAD] ascending block order
    key = (v.to(tl.int64) << 32) | ((CAP - 1 - place).to(tl.int64) << 16) | offs_c
    key = tl.where(cand, key, -1)  # [NB_PAD] (place < n_c <= CAP where cand)
    key = tl.reshape(key, key.shape, can_reorder=True)  # the scatter's layout (PACKED_SCATTER)
    scratch64 = scratch_row.to(tl.pointer_type(tl.int64))
    tl.store(scratch64 + (CAP - 1 - ((key >> 16) & 0xFFFF)), key, mask=key >= 0)
    tl.debug_barrier()  # the compacted row is read back by other threads of this program
    j = tl.arange(0, CAP)  # [CAP] candidate places
    return tl.load(scratch64 + j, mask=j < n_c, other=-1)  # [CAP] (L1: read in 2 layouts)


@triton.jit
def _compact_ids(chosen, u, KB_PAD: tl.constexpr):
    """Block ids ``[KB_PAD]`` of the ``chosen [CAP]`` compacted candidates ``u`` (``_compact``),
    ascending, then zeros: slots by a cumsum over ``[CAP]``, ids by a ``[CAP, KB_PAD]`` select
    (candidates along axis 0, as in ``_desc_rank``)."""
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # [CAP] ascending block order
    slot = tl.where(chosen, slot, KB_PAD)
    ids = tl.where(slot[:, None] == tl.arange(0, KB_PAD)[None, :],
                   (u & 0xFFFF).to(tl.int32)[:, None], 0)  # fmt: skip
    return tl.sum(ids, axis=0)  # [KB_PAD]


@triton.jit
def _scatter_chosen(chosen, offs_c, k, scratch_row, KB_PAD: tl.constexpr,
                    ONE_SCAN: tl.constexpr = True,
                    PACKED_SCATTER: tl.constexpr = True):  # fmt: skip
    """Write the ids of the k ``chosen [NB_PAD]`` blocks to ``scratch_row[:k]``, ascending; then
    a CTA barrier. ``ONE_SCAN``: the scatter's addresses and mask come from one slot tensor
    (non-chosen blocks get slot KB_PAD >= k); otherwise the mask is ``chosen & (slot < k)``,
    for which triton 3.6 computes the cumsum twice, in the scatter's layout and in the row's
    (sm_90, 8 warps: 2456 -> 1880 instructions and 117 -> 80 registers at 4096 blocks; 1616
    -> 1272, 56 -> 48 and 19 -> 17 CTA barriers at 2048). ``PACKED_SCATTER`` (with ONE_SCAN):
    triton 3.6 stores a data-dependent scatter in a one-value-per-thread layout and converted
    the row's 64-bit pointers and mask to it through shared memory; packed into one int32 per
    block, ``(slot << 16) | c``, the pairs take that layout by a reorder-reshape, which moves no
    data (sm_90, 8 warps, EMIT_2D: 4096 blocks 19 -> 13 CTA barriers, 1925 -> 1829
    instructions, shared memory 16 -> 1 KB; 2048 blocks 17 -> 13, 1313 -> 1233)."""
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # [NB_PAD] ascending block order
    if ONE_SCAN:
        slot = tl.where(chosen, slot, KB_PAD)  # (exactly k chosen: slots 0 .. k - 1)
        if PACKED_SCATTER:  # (slot, block) pairs in one int32: slot <= KB_PAD < 2**15, c < 2**16
            tl.static_assert(KB_PAD < 32768 and chosen.shape[0] <= 65536, "packed scatter bounds")
            pair = (slot << 16) | offs_c  # [NB_PAD]
            pair = tl.reshape(pair, pair.shape, can_reorder=True)  # any order: pairs stay whole
            slot = pair >> 16
            tl.store(scratch_row + slot, pair & 0xFFFF, mask=slot < k)
        else:
            tl.store(scratch_row + slot, offs_c, mask=slot < k)
    else:
        tl.store(scratch_row + slot, offs_c, mask=chosen & (slot < k))  # (exactly k chosen)
    tl.debug_barrier()  # the scratch row is read back by other threads of this program


@triton.jit
def _scratch_ids(scratch_row, k, KB_PAD: tl.constexpr):
    """The k chosen block ids ``[KB_PAD]`` that ``_scatter_chosen`` wrote (zeros past k), in one
    read."""
    slots = tl.arange(0, KB_PAD)  # [KB_PAD]
    return tl.load(scratch_row + slots, mask=slots < k, other=0, cache_modifier=".cg")


@triton.jit
def select_row(
    row,  # query row b * S + s (int64)
    score_ptr,  # [rows, NB] fp32 block scores (score kernel output), row stride stride_sr
    seqlens_ptr,  # [B] int32, total_len - 1
    scratch_ptr,  # [rows, max(kb, 1)] int32 workspace of the radix method: chosen block ids
    idx_ptr,  # [rows, max_selected] int32 out: selected_indices
    cnt_ptr,  # [rows] int32 out: selected_counts
    seq_len,
    num_blocks,
    stride_sr,
    compress_ratio,
    kb,  # token_budget // r
    scratch_stride,
    max_selected,
    NB_PAD: tl.constexpr,  # next power of two >= num_blocks
    KB_PAD: tl.constexpr,  # power of two >= min(kb, num_blocks), <= NB_PAD
    BLOCK_O: tl.constexpr,  # output positions per emission tile
    TOPK: tl.constexpr,  # select by tl.topk (else radix select + scratch)
    RADIX_BITS: tl.constexpr,  # bits per radix step (2, 3 or 4)
    IDS_IN_REGS: tl.constexpr,  # radix: emission gathers the ids from registers (else scratch)
    IS_FIRST_PROMPT: tl.constexpr,
    EMIT_R: tl.constexpr,  # > 0: compress_ratio (a power of two), 2-D emission (EMIT_2D)
    EARLY_SCORES: tl.constexpr = False,  # score loads independent of seqlens (cfg)
    clk_ptr=None,  # CLOCKS: [rows, CLOCK_MARKS] int64 out
    CLOCKS: tl.constexpr = False,  # phase marks of the SM clock (a profiling build)
    ONE_SCAN: tl.constexpr = True,  # radix: one cumsum for the scatter (cfg)
    PACKED_SCATTER: tl.constexpr = True,  # radix: the scatter's (slot, block) pairs packed (cfg)
    RANK_G: tl.constexpr = 0,  # rank method (RANK_CAP > 0): strided groups of its floor
    RANK_CAP: tl.constexpr = 0,  # > 0: rank method, rows of more candidates take radix steps
    RANK_CROSS: tl.constexpr = False,  # rank method: _cross_bounds' floor, RANK_G columns (cfg)
    tmax_ptr=None,  # RANK_TILES: [rows, n_tiles] int32 tile maxima of the score kernel
    tmax_stride=0,
    n_tiles=0,
    RANK_TILES: tl.constexpr = 0,  # > 0 (rank method): _tile_bounds' floor, RANK_G groups
):
    """Selection + emission of query row ``row`` (see the module docstring). ``CLOCKS``
    writes the SM clock (``%clock64``) at the phase marks of ``CLOCK_MARKS`` to ``clk_ptr[row]``
    (the radix marks stay 0 under ``TOPK``)."""
    t_start = tl.zeros([], tl.int64)
    if CLOCKS:
        t_start = sm_clock(row.to(tl.int32))
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
    if EARLY_SCORES:  # the whole row (kb = 0: none), not waiting for seqlens; masked below
        ld_mask = (offs_c < num_blocks) & (kb > 0)
    else:
        ld_mask = visible
    score = tl.load(score_ptr + row * stride_sr + offs_c, mask=ld_mask, other=0.0)  # [NB_PAD]
    v = _order_keys(score, visible)  # [NB_PAD] int32
    scratch_row = scratch_ptr + row * scratch_stride
    t_bounds = tl.zeros([], tl.int64)
    t_radix = tl.zeros([], tl.int64)
    t_chosen = tl.zeros([], tl.int64)
    IDS_REGS: tl.constexpr = TOPK or IDS_IN_REGS or RANK_CAP > 0  # ids [KB_PAD] in registers
    if TOPK:
        ids = _chosen_topk(v, offs_c, k, NB_PAD, KB_PAD)  # [KB_PAD]
    elif RANK_CAP > 0:  # radix-width rows: rank the few candidates above a tight floor
        if RANK_TILES > 0:
            vmax, floor = _tile_bounds(tmax_ptr + row * tmax_stride, n_tiles, k, RANK_TILES,
                                       RANK_G)  # fmt: skip
        elif RANK_CROSS:
            vmax, floor = _cross_bounds(v, k, NB_PAD, RANK_G)
        else:
            vmax, floor = _rank_bounds(v, k, NB_PAD, RANK_G)
        if CLOCKS:
            t_bounds = sm_clock(vmax)
        n_c = tl.sum((v >= floor).to(tl.int32))  # candidates (>= k)
        if CLOCKS:
            t_radix = sm_clock(n_c)
        if n_c <= RANK_CAP:
            u = _compact(v, offs_c, floor, n_c, scratch_row, RANK_CAP)  # [CAP] int64
            chosen_c = _desc_rank(u) < k  # [CAP] (n_c >= k; empty places rank last)
            ids = _compact_ids(chosen_c, u, KB_PAD)
        else:  # too many candidates (ties, adversarial rows): radix steps from the same floor
            lo, n_ge = _kth_largest(v, k, n_c, vmax, floor, RADIX_BITS)
            chosen = _chosen_from_lo(v, k, lo, n_ge)
            _scatter_chosen(chosen, offs_c, k, scratch_row, KB_PAD, ONE_SCAN, PACKED_SCATTER)
            ids = _scratch_ids(scratch_row, k, KB_PAD)
        if CLOCKS:
            t_chosen = sm_clock(k)  # the chosen ids in registers
    else:
        chosen, t_bounds, t_radix = _chosen_radix(v, k, n_complete, RADIX_BITS, NB_PAD, KB_PAD,
                                                  CLOCKS)  # fmt: skip
        _scatter_chosen(chosen, offs_c, k, scratch_row, KB_PAD, ONE_SCAN, PACKED_SCATTER)
        if CLOCKS:
            t_chosen = sm_clock(k)  # after the chosen ids' scatter and the CTA barrier
        if IDS_IN_REGS:  # one read of the row's k block ids; the emission tiles gather them
            ids = _scratch_ids(scratch_row, k, KB_PAD)

    # --- emission: chosen blocks' positions, trailing tokens, -1
    r = compress_ratio
    n_sel_tok = k * r
    tail_base = n_complete * r
    out_row = idx_ptr + row * max_selected
    j0 = tl.zeros([], tl.int32)
    if EMIT_R > 0:  # slots [0, KB_PAD * r) as one [KB_PAD, r] tile: no division, no gather
        # (names of their own: the loop below carries j / blk / t / val of another shape)
        slot2 = tl.arange(0, KB_PAD)[:, None]  # [KB_PAD, 1] chosen-block slot
        col2 = tl.arange(0, EMIT_R)[None, :]  # [1, EMIT_R] position within the block
        if IDS_REGS:
            blk2 = ids[:, None]  # [KB_PAD, 1]
        else:
            blk2 = tl.load(scratch_row + slot2, mask=slot2 < k, other=0, cache_modifier=".cg")
        j2 = slot2 * EMIT_R + col2  # [KB_PAD, EMIT_R] output slots
        t2 = j2 - n_sel_tok
        val2 = tl.where(slot2 < k, blk2 * EMIT_R + col2,
                        tl.where(t2 < trail, tail_base + t2, -1))  # fmt: skip
        tl.store(out_row + j2, val2, mask=j2 < max_selected)
        j0 += KB_PAD * EMIT_R  # the rest holds no chosen block: trailing tokens and -1
    while j0 < max_selected:  # a while loop: the interpreter takes no tensor range() bounds
        j = j0 + tl.arange(0, BLOCK_O)  # [BLOCK_O] output slots
        t = j - n_sel_tok
        if EMIT_R > 0:  # (j >= KB_PAD * r >= n_sel_tok here: no chosen block)
            val = tl.where(t < trail, tail_base + t, -1)
        else:
            sl = j // r
            in_sel = j < n_sel_tok
            if IDS_REGS:
                blk = tl.gather(ids, tl.minimum(sl, KB_PAD - 1), 0)  # [BLOCK_O]
            else:  # one wide tile: its scratch loads are one round trip anyway
                blk = tl.load(scratch_row + sl, mask=in_sel & (j < max_selected), other=0,
                              cache_modifier=".cg")  # fmt: skip
            val = tl.where(in_sel, blk * r + (j - sl * r), tl.where(t < trail, tail_base + t, -1))
        tl.store(out_row + j, val, mask=j < max_selected)
        j0 += BLOCK_O
    tl.store(cnt_ptr + row, n_sel_tok + trail)
    if CLOCKS:  # CLOCK_MARKS order
        t_end = sm_clock(k)
        marks = clk_ptr + row * _CLOCK_MARKS
        tl.store(marks, t_start)
        tl.store(marks + 1, t_bounds)
        tl.store(marks + 2, t_radix)
        tl.store(marks + 3, t_chosen)
        tl.store(marks + 4, t_end)


@triton.jit
def indexer_select_kernel(
    score_ptr, seqlens_ptr, scratch_ptr, idx_ptr, cnt_ptr, seq_len, num_blocks, stride_sr,
    compress_ratio, kb, scratch_stride, max_selected,
    NB_PAD: tl.constexpr, KB_PAD: tl.constexpr, BLOCK_O: tl.constexpr, TOPK: tl.constexpr,
    RADIX_BITS: tl.constexpr, IDS_IN_REGS: tl.constexpr, IS_FIRST_PROMPT: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch
    EMIT_R: tl.constexpr = 0, EARLY_SCORES: tl.constexpr = False, TRIGGER: tl.constexpr = False,
    clk_ptr=None, CLOCKS: tl.constexpr = False, ONE_SCAN: tl.constexpr = True,
    PACKED_SCATTER: tl.constexpr = True, RANK_G: tl.constexpr = 0, RANK_CAP: tl.constexpr = 0,
    RANK_CROSS: tl.constexpr = False, tmax_ptr=None, tmax_stride=0, n_tiles=0,
    RANK_TILES: tl.constexpr = 0,
):  # fmt: skip
    """Grid ``(rows,)`` of ``select_row`` (its arguments, documented there)."""
    wait_prior_grids(PDL)  # first: the previous grid's writes are visible
    release_dependents(TRIGGER)
    select_row(
        tl.program_id(0).to(tl.int64), score_ptr, seqlens_ptr, scratch_ptr, idx_ptr, cnt_ptr,
        seq_len, num_blocks, stride_sr, compress_ratio, kb, scratch_stride, max_selected, NB_PAD,
        KB_PAD, BLOCK_O, TOPK, RADIX_BITS, IDS_IN_REGS, IS_FIRST_PROMPT, EMIT_R, EARLY_SCORES,
        clk_ptr, CLOCKS, ONE_SCAN, PACKED_SCATTER, RANK_G, RANK_CAP, RANK_CROSS, tmax_ptr,
        tmax_stride, n_tiles, RANK_TILES,
    )  # fmt: skip


# Defaults of ``indexer_select``'s ``cfg`` (``benchmarks/tune_indexer.py``): 2 radix bits beat
# 3 and 4 at every shape (H200, ``tune_select_h200.json``); EMIT_2D with 1024-wide tail tiles
# beat the 1-D emission at all 6 shapes (H100 session 21: B=1 S=1 T=128K 5.62 -> 5.29 us, 256K
# 7.64 (4096-wide 1-D) -> 7.53; ``tune_select_emit2d_h100.json``)
# EARLY_SCORES None: on for rows of a subsequent prompt or decode step (they see at least the
# past's blocks: loading the whole row costs little), off for a first prompt (its early rows see
# few blocks); H100 session 28 in the layer's "early" options (``_triton_utils.PDL_EARLY_TRIGGER``)
# ONE_SCAN (session 29 on sm_90 SASS, ``_scatter_chosen``): one cumsum instead of two for the
# radix method's scatter; same selections. Timed in session 30 (H100, bench_sparse layer
# variant two_scan): layer op 17.0 vs 17.7 us at B=1 S=1 T=128K, 19.1 vs 20.3 at 256K
# (sparse_layer_ab_session30_h100.json)
# PACKED_SCATTER (session 30, ``_scatter_chosen``): the scatter's layout change as a free
# register reorder of packed (slot, block) pairs; H100, select alone chained B=1 T=128K / 256K
# 4.51 -> 4.19 / 5.89 -> 5.22 us (``select_phases_packed_session30_h100.json``)
# RANK_SELECT (session 31, ``_rank_bounds`` / ``_compact`` / ``_desc_rank``): the candidates
# above the k-th largest of 2 * KB_PAD group maxima, compacted and ranked, instead of the radix
# steps; None: at the measured row widths RANK_DEFAULT_BLOCKS (NB_PAD), budgets <= RANK_MAX_KB_PAD.
# H100 (two same-process runs, select_{rank,compact}_session31_h100.json), B=1 S=1, select
# alone chained: 4096 blocks 5.63 -> 5.14 / 5.18 us (B=4 5.86 / 6.06 -> 5.16 / 5.19), layer op
# 18.02-18.05 / 18.36-18.49 -> 17.91 / 17.94; 2048 blocks lost (4.35 / 4.14 -> 4.49 / 4.5, layer
# +0.3 us). RANK_CAP_MULT * KB_PAD candidates at most (2: 1 us faster than 4 at 4096 blocks)
SELECT_DEFAULTS = dict(RADIX_BITS=2, EMIT_2D=True, EARLY_SCORES=None, ONE_SCAN=True,
                       PACKED_SCATTER=True, RANK_SELECT=None, RANK_CAP_MULT=2,
                       RANK_FLOOR=None)  # fmt: skip
# RANK_FLOOR "cross" (session 31, SASS only, not timed): ``_cross_bounds`` instead of the
# [G, G] rank of the group maxima (``_rank_bounds``, ~2.2K cycles on the H100). "tiles"
# (session 32): the score kernel's tile maxima (``_tile_bounds``): the row is not reduced in
# the select at all. None: "tiles" when the launch is given usable tile maxima (at least
# 2 * KB_PAD tiles, at most RANK_MAX_TILES), else "groups". The tile maxima are folded into
# 2 * KB_PAD groups (sm_90, 4096 blocks, 128 tiles: 2712 instructions, 38 CTA barriers); ranked
# as they are (RANK_TILE_FOLD off, a [128, 128] comparison: 3312 instructions, 33 barriers) lost
# on the H100 (select 5.13 vs 3.98 us, layer op 18.36 vs 17.0-17.2 us at 256K): removed
# RANK_SELECT None: the row widths (NB_PAD) where the rank method was timed faster; 2048 lost.
# 8192 / 16384 (16 warps; H100 session 35, select alone chained, groups floor, B=1 S=1, 512K /
# 1M tokens: 8.64 -> 6.13 us / 14.52 -> 9.18; select_rank_wide_session35_h100.json)
RANK_DEFAULT_BLOCKS = (4096, 8192, 16384)
# ... and with the tiles floor (session 32, H100, select alone B=1 S=1 at 2048 blocks: 4.11-4.31
# (radix steps) -> 3.45 us; layer op 16.68-16.87 -> 16.44 us, B=4 27.46-27.94 -> 27.18). Also
# the widths where the default takes the tiles floor (``wants_tile_max``): 8192 / 16384 keep
# the groups floor they were timed with
RANK_TILE_BLOCKS = (2048, 4096)
_HOST_KEYS = ("EMIT_2D", "RANK_SELECT", "RANK_CAP_MULT", "RANK_FLOOR")
RANK_MAX_KB_PAD = 32  # larger budgets keep the radix steps (the rank tile grows as k^2)
RANK_MAX_TILES = 1024  # tile maxima per row that _tile_bounds folds into 2 * KB_PAD groups
RANK_FLOORS = ("groups", "cross", "tiles")
# ``clocks`` of ``select_launch_args`` (a profiling build): the SM clock at the row's start,
# after the score loads + radix bounds, after the radix steps, after the chosen ids' scatter
# + CTA barrier, and after the emission's last store (the radix marks stay 0 under TOPK)
CLOCK_MARKS = 5
_CLOCK_MARKS = tl.constexpr(CLOCK_MARKS)  # (the kernels' view of it)
WIDE_EMIT_BLOCKS = 4096  # rows of at least this many blocks (NB_PAD) emit in 4096-wide tiles


def select_config(cfg: dict | None, nb_pad: int, interpret: bool) -> dict:
    """The select launch's tunables: ``RADIX_BITS`` (2, 3 or 4 bits per radix step),
    ``EMIT_2D`` (the chosen blocks' positions as one 2-D tile, see ``emit_ratio``), ``BLOCK_O``
    (output positions per 1-D emission tile, a power of two >= 16; 1024, or 4096 from
    ``WIDE_EMIT_BLOCKS`` blocks on without EMIT_2D: one tile issues every scratch load at once,
    H200: -4 to -10% at 256K tokens), ``ONE_SCAN`` and ``PACKED_SCATTER`` (see
    ``_scatter_chosen``) and ``num_warps``; ``cfg`` overrides the defaults
    (``SELECT_DEFAULTS``, ``select_num_warps``); ``RANK_SELECT`` and ``RANK_CAP_MULT`` (see
    ``rank_geometry``)."""
    out = dict(SELECT_DEFAULTS, num_warps=select_num_warps(nb_pad))
    out.update(cfg or {})
    if "BLOCK_O" not in out:
        wide = nb_pad >= WIDE_EMIT_BLOCKS and not out["EMIT_2D"]
        out["BLOCK_O"] = 256 if interpret else (4096 if wide else 1024)
    unknown = set(out) - {"RADIX_BITS", "BLOCK_O", "num_warps", "EMIT_2D", "EARLY_SCORES",
                          "ONE_SCAN", "PACKED_SCATTER", "RANK_SELECT",
                          "RANK_CAP_MULT", "RANK_FLOOR"}  # fmt: skip
    if unknown:
        raise ValueError(f"select cfg: unknown keys {sorted(unknown)}")
    if out["RADIX_BITS"] not in (2, 3, 4):
        raise ValueError(f"select cfg['RADIX_BITS'] must be 2, 3 or 4, got {out['RADIX_BITS']}")
    bo = out["BLOCK_O"]
    if not isinstance(bo, int) or bo < 16 or bo & (bo - 1):
        raise ValueError(f"select cfg['BLOCK_O'] must be a power of two >= 16, got {bo}")
    cfg_flag(out, "EMIT_2D", what="select cfg")
    cfg_flag(out, "EARLY_SCORES", None, allow_none=True, what="select cfg")
    cfg_flag(out, "ONE_SCAN", True, what="select cfg")
    cfg_flag(out, "PACKED_SCATTER", True, what="select cfg")
    cfg_flag(out, "RANK_SELECT", None, allow_none=True, what="select cfg")
    if out["RANK_CAP_MULT"] not in (1, 2, 4, 8) or isinstance(out["RANK_CAP_MULT"], bool):
        raise ValueError(f"select cfg['RANK_CAP_MULT'] must be 1, 2, 4 or 8, got "
                         f"{out['RANK_CAP_MULT']!r}")  # fmt: skip
    if out["RANK_FLOOR"] not in (None, *RANK_FLOORS):
        raise ValueError(f"select cfg['RANK_FLOOR'] must be one of {RANK_FLOORS} or None, got "
                         f"{out['RANK_FLOOR']!r}")  # fmt: skip
    return out


def _rank_on(cfg: dict, topk: bool, kb_pad: int, nb_pad: int, tiles: bool) -> bool:
    """Whether the rank method runs (``tiles``: with the tile maxima floor)."""
    on = cfg["RANK_SELECT"]
    if on is None:
        on = nb_pad in RANK_DEFAULT_BLOCKS or (tiles and nb_pad in RANK_TILE_BLOCKS)
    return bool(on) and not topk and kb_pad <= RANK_MAX_KB_PAD


def tiles_usable(n_tiles: int, kb_pad: int) -> bool:
    """Whether ``n_tiles`` tile maxima per row give the rank method its floor: at least
    ``2 * KB_PAD`` (``_tile_bounds`` folds them into that many groups: the k-th of ``2 k``
    maxima leaves ~1.3 k candidates), at most ``RANK_MAX_TILES`` (loads per thread)."""
    return 2 * kb_pad <= n_tiles <= RANK_MAX_TILES


def rank_geometry(
    cfg: dict, topk: bool, kb_pad: int, nb_pad: int, n_tiles: int = 0
) -> tuple[int, int, bool, int]:
    """``(RANK_G, RANK_CAP, RANK_CROSS, RANK_TILES)`` of the select launch for ``cfg``
    (``select_config``'s output) and ``n_tiles`` tile maxima per row given to it (0: none):
    ``(0, 0, False, 0)`` (the radix steps) unless the rank method applies: a radix-width row,
    ``KB_PAD <= RANK_MAX_KB_PAD``, and ``cfg["RANK_SELECT"]`` True, or None with ``NB_PAD in
    RANK_DEFAULT_BLOCKS``. Then ``cfg["RANK_CAP_MULT"] * KB_PAD`` candidates (at most the row)
    and the floor (``RANK_FLOOR``; None: "tiles" when ``tiles_usable``, else "groups"; the
    default also runs the rank method at ``RANK_TILE_BLOCKS`` with the tiles floor):
    "groups", ``2 * KB_PAD`` strided groups (``_rank_bounds``); "cross", ``NB_PAD // (2 *
    KB_PAD)`` columns of ``2 * KB_PAD`` rows (``_cross_bounds``); "tiles", the tile maxima
    (``_tile_bounds``: ``RANK_TILES`` = their power-of-two width, folded into ``RANK_G = 2 *
    KB_PAD`` groups). An explicit "tiles" without usable tile maxima is a ValueError."""
    floor = cfg["RANK_FLOOR"]
    if floor is None:
        floor = "tiles" if tiles_usable(n_tiles, kb_pad) else "groups"
    if not _rank_on(cfg, topk, kb_pad, nb_pad, floor == "tiles"):
        return 0, 0, False, 0
    cap = max(kb_pad, min(cfg["RANK_CAP_MULT"] * kb_pad, nb_pad))
    if floor == "tiles":
        if not tiles_usable(n_tiles, kb_pad):
            raise ValueError(f"select cfg['RANK_FLOOR'] = 'tiles' needs 2 * KB_PAD = "
                             f"{2 * kb_pad} to {RANK_MAX_TILES} tile maxima per row, got "
                             f"{n_tiles}")  # fmt: skip
        nt = next_pow2(n_tiles)
        return 2 * kb_pad, cap, False, nt
    if floor == "cross":
        return max(1, nb_pad // (2 * kb_pad)), cap, True, 0
    return min(2 * kb_pad, nb_pad), cap, False, 0


def select_pads(num_blocks: int, kb: int) -> tuple[int, int]:
    """``(NB_PAD, KB_PAD)`` of a select launch over rows of ``num_blocks`` blocks choosing up
    to ``kb`` of them: the row tile (a power of two >= 16) and the chosen-id tile (a power of
    two >= 2, at most the row)."""
    nb_pad = max(16, next_pow2(max(num_blocks, 1)))
    return nb_pad, min(max(2, next_pow2(kb)), nb_pad)


# The default floor takes the score launch's tile maxima for launches of at most this many
# rows (B * S). H100, same process (session 34, T=256K, 4096 blocks): the maxima cost the score
# launch +0.1 us at B=1 S=1, +1.15 at B=1 S=8 (8 rows) and +4.4 at B=4 S=8 (32 rows;
# score_tiles_session34_h100.json); the layer op with them vs the groups floor: 16.88 vs
# 18.11 us (B=1 S=1), 43.73 vs 45.54 (B=1 S=8), 29.64 vs 30.81 (B=4 S=1), but 125.95 vs
# 121.57 (B=4 S=8; sparse_layer_floors_session34_h100.json).
TILE_MAX_ROWS = 8


def wants_tile_max(num_blocks: int, token_budget: int, compress_ratio: int,
                   cfg: dict | None = None, rows: int = 1) -> int:  # fmt: skip
    """The ``tile_max`` argument of the score launch (``indexer_scores_and_tiles``) of
    ``rows`` (B * S) rows whose select may take the tile maxima as its floor: the least tile
    count it would use (``2 * KB_PAD``), or 0 when the rank method with that floor cannot
    apply (by ``cfg``, the row width, the budget) or, with the default floor (``RANK_FLOOR``
    None), for more than ``TILE_MAX_ROWS`` rows, and with the default method (``RANK_SELECT``
    None) at row widths outside ``RANK_TILE_BLOCKS`` (8192 / 16384 blocks: the rank method
    was timed there with the groups floor only)."""
    kb = token_budget // compress_ratio
    nb_pad, kb_pad = select_pads(num_blocks, kb)
    tune = select_config(cfg, nb_pad, interpret=False)
    if (
        kb == 0
        or num_blocks == 0
        or nb_pad > MAX_BLOCKS
        or tune["RANK_FLOOR"] not in (None, "tiles")
        or (
            tune["RANK_FLOOR"] is None  # the default floor: tiles only where timed
            and (
                rows > TILE_MAX_ROWS
                or (tune["RANK_SELECT"] is None and nb_pad not in RANK_TILE_BLOCKS)
            )
        )  # fmt: skip
    ):
        return 0
    return 2 * kb_pad if _rank_on(tune, nb_pad <= TOPK_MAX_BLOCKS, kb_pad, nb_pad, True) else 0


EMIT_2D_MAX = 16384  # KB_PAD * r bound of the 2-D emission tile (64 values per thread at 8 warps)


def emit_ratio(cfg: dict, compress_ratio: int, kb_pad: int) -> int:
    """``EMIT_R`` of the select launch: ``compress_ratio`` when ``cfg["EMIT_2D"]`` asks for
    the 2-D emission and it applies (a power-of-two ratio, a ``[KB_PAD, r]`` tile of at most
    EMIT_2D_MAX positions), else 0 (1-D tiles: a division and a gather per position)."""
    r = compress_ratio
    ok = cfg.get("EMIT_2D", False) and r > 0 and r & (r - 1) == 0 and kb_pad * r <= EMIT_2D_MAX
    return r if ok else 0


def select_num_warps(nb_pad: int) -> int:
    if nb_pad <= 1024:
        return 4
    return 8 if nb_pad <= 4096 else 16


def indexer_select(
    scores: torch.Tensor | None, seqlens_k: torch.Tensor, **kw
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k blocks + emission from block scores, in one kernel: ``selected_indices [B*S,
    token_budget + r - 1]`` int32, ``selected_counts [B*S]`` int32. Arguments: those of
    ``select_launch_args``."""
    idx, cnt, args = select_launch_args(scores, seqlens_k, **kw)
    if idx.shape[0]:
        indexer_select_kernel[(idx.shape[0],)](**pdl_kwargs(seqlens_k, trigger=True), **args)
    return idx, cnt


def select_launch_args(
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
    cfg: dict | None = None,
    clocks: torch.Tensor | None = None,
    tile_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(selected_indices, selected_counts, kwargs)``: ``indexer_select``'s outputs (not yet
    written) and the keywords of ``indexer_select_kernel`` (all but ``PDL``; ``num_warps``
    included) that write them, one program per row (``B * S`` rows; none when 0).

    Args:
        scores: ``[B*S, num_blocks]`` fp32 block scores (``>= 0`` or NaN where visible; other
            entries are never read); None when no block can be chosen (``token_budget <
            compress_ratio`` or ``num_blocks == 0``).
        seqlens_k: ``[B]`` int32, total length minus one.
        empty: allocator ``(shape, *, dtype, device)`` of the outputs and the scratch.
        cfg: tunables (``select_config``); None: the defaults.
        clocks: ``[B*S, CLOCK_MARKS]`` int64 on ``seqlens_k``'s device: the profiling build (``CLOCKS``)
            writes each row's phase marks there (``indexer_select_kernel`` only; benchmarks).
        tile_max: ``[B*S, n_tiles]`` int32, the score kernel's tile maxima of ``scores``
            (``indexer.indexer_scores_and_tiles``; last dim contiguous): the rank method's floor
            when ``rank_geometry`` takes them. None: the select reduces the row itself.
    """
    r = compress_ratio
    kb = token_budget // r
    rows = seqlens_k.shape[0] * seq_len
    nb_pad = select_pads(num_blocks, kb)[0]
    tune = select_config(cfg, nb_pad, interpret)
    max_selected = token_budget + r - 1
    dev = seqlens_k.device
    if nb_pad > MAX_BLOCKS:
        raise ValueError(f"indexer_select supports up to {MAX_BLOCKS} blocks, got {num_blocks}")
    idx = empty((rows, max_selected), dtype=torch.int32, device=dev)
    cnt = empty((rows,), dtype=torch.int32, device=dev)
    if rows == 0:
        return idx, cnt, {}
    if scores is None or kb == 0 or num_blocks == 0:  # k = 0: no score is read
        scores, kb, stride = torch.zeros(1, dtype=torch.float32, device=dev), 0, 0
    else:
        stride = scores.stride(0)
    topk = nb_pad <= TOPK_MAX_BLOCKS
    kb_pad = select_pads(num_blocks, kb)[1]  # (kb is 0 now when no score is read)
    tune = dict(tune)
    n_tiles = 0
    if tile_max is not None and kb > 0:
        if (tile_max.dim() != 2 or tile_max.shape[0] != rows or tile_max.dtype != torch.int32
                or tile_max.device != dev or tile_max.stride(1) != 1):  # fmt: skip
            raise ValueError(f"tile_max must be [{rows}, n_tiles] int32 on {dev} with a "
                             f"contiguous last dim, got {list(tile_max.shape)} "
                             f"{tile_max.dtype} on {tile_max.device}")  # fmt: skip
        n_tiles = tile_max.shape[1]
    rank_g, rank_cap, rank_cross, rank_tiles = rank_geometry(tune, topk, kb_pad, nb_pad, n_tiles)
    # radix: the chosen ids (int32 [kb]); rank: also the candidates (int64 [RANK_CAP])
    width = max(kb, 2 * rank_cap, 1)
    scratch = idx if topk else empty((rows, width + width % 2), dtype=torch.int32, device=dev)
    emit_r = emit_ratio(tune, r, kb_pad)
    for key in _HOST_KEYS:  # decided on the host above, not kernel arguments
        tune.pop(key)
    if tune.get("EARLY_SCORES") is None:
        tune["EARLY_SCORES"] = not is_first_prompt
    args = dict(
        score_ptr=scores,
        seqlens_ptr=seqlens_k,
        scratch_ptr=scratch,
        idx_ptr=idx,
        cnt_ptr=cnt,
        seq_len=seq_len,
        num_blocks=num_blocks,
        stride_sr=stride,
        compress_ratio=r,
        kb=kb,
        scratch_stride=scratch.stride(0),
        max_selected=max_selected,
        NB_PAD=nb_pad,
        KB_PAD=kb_pad,
        TOPK=topk,
        IDS_IN_REGS=tune["BLOCK_O"] < WIDE_EMIT_BLOCKS,
        IS_FIRST_PROMPT=is_first_prompt,
        EMIT_R=emit_r,
        RANK_G=rank_g,
        RANK_CAP=rank_cap,
        RANK_CROSS=rank_cross,
        **tune,
    )
    if rank_tiles:
        args.update(tmax_ptr=tile_max, tmax_stride=tile_max.stride(0), n_tiles=n_tiles,
                    RANK_TILES=rank_tiles)  # fmt: skip
    if clocks is not None:
        if (clocks.shape != (rows, CLOCK_MARKS) or clocks.dtype != torch.int64
                or clocks.device != dev):  # fmt: skip
            raise ValueError(f"clocks must be [{rows}, {CLOCK_MARKS}] int64 on {dev}, got "
                             f"{list(clocks.shape)} {clocks.dtype} on {clocks.device}")  # fmt: skip
        args.update(clk_ptr=clocks, CLOCKS=True)
    return idx, cnt, args
