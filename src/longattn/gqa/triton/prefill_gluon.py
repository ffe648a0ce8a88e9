"""Warp-specialized GQA prefill for sm_90 in Gluon (triton.experimental.gluon).

Same math as ``prefill.gqa_prefill_kernel`` for the plain case (16-bit cache in the dot dtype,
no bias, no int8 / per-row Q scale), laid out the way FlashAttention-3 runs on Hopper:

- a work item is 128 query rows of one head; three partitions share a CTA: two consumer
  warpgroups (64 rows each: QK^T wgmma, softmax, PV wgmma with P from registers) and one
  producer warp that issues every TMA load (a work item's two Q tiles, then its K and V tiles
  into a ring of ``STAGES`` shared-memory slots guarded by ready / empty mbarriers). The
  consumers run independently, so the warp schedulers overlap one warpgroup's softmax with the
  other's GEMMs;
- persistent, dynamically scheduled: one CTA per SM; the producer claims each next work item
  from a per-call counter (atomic tickets, ``_claim``) and hands it to the consumers through
  shared memory (``_publish`` / ``_take``). Items go in ``_item_head``'s ORDER 2: a KV head's
  row blocks heaviest first, with its GROUP query heads interleaved, so CTAs that run together
  share one KV head's K/V in L2 and the last items are light. With ``Q_SLOTS = 2`` (H <= 128,
  and H = 256 for items of <= ``launch.GLUON_SHORT_TOTAL`` keys) the producer loads item
  k+1's Q and K/V while the consumers work on item k, so the K/V ring never drains between
  items (the static schedule CTA c: c, c + G, ... and one CTA per item remain as flags);
- K and V have separate rings (``STAGES`` / ``V_STAGES`` slots, each with ready / empty
  barriers); with ``EARLY_K_RELEASE`` a K slot is refilled once both QK^T read it, which lets
  H = 256 hold 2 Q pairs + 2 K + 1 V slot (224 KiB) for short items;
- no tile reads a cache row at or past the sequence's length (those rows may hold NaN
  garbage; 0 * NaN would poison the PV product): the last tile of a range is shifted back to
  end at the range's end, and the columns it shares with the previous tile are masked (rows
  before 0 are zero-filled by TMA);
- the causal / window / duplicate-column mask is applied only on tiles that need it;
- output rows leave through the item's freed Q tile (``EPILOGUE_SMEM``), by 16-byte stores or
  one TMA store per 64-row tile (``EPILOGUE_TMA``);
- ``OVERLAP`` (H = 128 past ``launch.GLUON_OVERLAP_MIN_TOTAL`` keys, with ``EARLY_K_RELEASE``):
  FA3's intra-warpgroup overlap, tile j's softmax while tile j-1's P.V runs
  (``_attend_overlapped``); session 39, H100: -1.4 to -5.5% at S = 8K / 32K, +3-4% at 2K.
  ``CROSS_ITEM`` (with it at H = 128) carries that overlap across work items: the next
  item's first softmax runs during this item's last P.V (``_consumer_crossed``); session 40,
  H100: a further -0 to -3% at S = 8K / 16K / 32K (five runs).

Measured (same process, ``benchmarks/results/prefill_gluon_ab{1..6}_h200.json``): the dynamic
ORDER-2 schedule with 2 Q slots is 3-11% faster than the static row-block-major one. Not kept
then (session 13, the static schedule): FA3's intra-warpgroup overlap (2-9% slower; retried as
``OVERLAP`` in session 39, above) and inter-warpgroup ping-pong (3-13% slower), per-CTA
device-side descriptors bounded by the sequence length (slower in 5 of 6 shapes), three
consumer warpgroups with BLOCK_N 64 (-5 to +2%), BLOCK_N 32 at H = 256 (-16 to -19%), 3 stages
at H = 128 (0 to -9%), Q as the register A operand of QK^T (8-9% slower at H = 128, and its
output was wrong; not debugged). Session 37
(H100, ``prefill_gluon_options_session37_h100.json``; the code is commit 7b041de): an item's
first K/V tiles before the wait for its Q slot, the first warpgroup skipping the diagonal tile
past its rows (BLOCK_N 64), ORDER 2 over windows of KV heads (a lighter tail), and Q freed after
the last QK^T (4-byte stores): none beyond the run's noise.

Grid: (G,) with G <= cdiv(S, 128) * B * N. Gluon has no interpreter:
the kernel is checked on the GPU against the fp64 reference, and its sm_90 compile in CI
(``tests/test_sass.py``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ._core import (
    add_sink,
    load_total_len,
    new_row_span,
    normalize,
    prefill_key_range,
    softcap_log2,
)

ROWS_PER_WG = gl.constexpr(64)  # query rows per consumer warpgroup (wgmma M = 64, 4 warps)
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.constexpr_function
def _wgmma_layout(n):
    """Register layout of a 64-row wgmma result with n columns, one warpgroup (4 warps)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _turn_of(wg, pingpong):
    """A consumer's ``TURN`` (see ``_turn_wait``): its warpgroup with PINGPONG, else -1."""
    return wg if pingpong else -1


@gluon.constexpr_function
def _row_store_layout(head):
    """Blocked layout of a [64, head] 16-bit output tile for 16-byte row-contiguous stores, one
    warpgroup (4 warps)."""
    tpc = min(32, head // 8)
    return gl.BlockedLayout([1, 8], [32 // tpc, tpc], [4, 1], [1, 0])


@gluon.jit
def _item_head(w, n_bn, n_m, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr,
               ORDER: gl.constexpr):  # fmt: skip
    """Work item ``w`` as (b, n, m0): rows [m0, m0 + 128) of head n of sequence b
    (n_bn = B * N, n_m = cdiv(S, 128)). Every order takes a head's row blocks heaviest (last)
    first. ORDER 0: every (b, n)'s last row block, then every one's block before, ...;
    1: every row block of head (0, 0), then of (0, 1), ...; 2: as 1, with the GROUP heads of
    one KV head interleaved (their items at row block m are adjacent). With 1 and 2, CTAs that
    run together read one KV head's K/V, which stays in L2, and the last items are light."""
    if ORDER == 0:
        pid_m = n_m - 1 - w // n_bn
        pid_bn = w % n_bn
    elif ORDER == 1:
        pid_m = n_m - 1 - w % n_m
        pid_bn = w // n_m
    else:
        per_kv = n_m * GROUP
        pid_m = n_m - 1 - (w % per_kv) // GROUP
        pid_bn = (w // per_kv) * GROUP + w % GROUP
    return pid_bn // NUM_HEADS, pid_bn % NUM_HEADS, pid_m * (2 * ROWS_PER_WG)


@gluon.jit
def _item_keys(total_len, m0, seq_len, window, BLOCK_N: gl.constexpr,
               IS_FIRST_PROMPT: gl.constexpr, HAS_WINDOW: gl.constexpr):  # fmt: skip
    """(offset, rows_valid, kv_lo, kv_hi, n_tiles) of the row block at m0 of a sequence of
    total_len tokens: its keys [kv_lo, kv_hi) in n_tiles tiles."""
    offset, rows_valid = new_row_span(total_len, seq_len, IS_FIRST_PROMPT)
    q_lo, q_hi, kv_lo, kv_hi = prefill_key_range(offset, rows_valid, total_len, m0, window,
                                                 2 * ROWS_PER_WG, HAS_WINDOW)  # fmt: skip
    return offset, rows_valid, kv_lo, kv_hi, gl.cdiv(kv_hi - kv_lo, BLOCK_N)


@gluon.jit
def _claim(w, counter_ptr, DYNAMIC: gl.constexpr):
    """The producer's next work item after ``w``: the next ticket of the launch's counter
    (DYNAMIC: the first CTA to get free takes the next item), else ``w + grid``."""
    if DYNAMIC:
        w = gl.atomic_add(counter_ptr, 1, sem="relaxed")
    else:
        w = w + gl.num_programs(0)
    return w


@gluon.jit
def _publish(info, b, n, m0, total_len, num_warps: gl.constexpr):
    """Producer: the item's (b, n, m0, total_len) into shared ``info`` [4] for the consumers
    (read after they wait on q_bar, whose arrival follows this store); b = -1: no more items."""
    idx = gl.arange(0, 4, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
    info.store(gl.where(idx == 0, b, gl.where(idx == 1, n, gl.where(idx == 2, m0, total_len))))
    gl.thread_barrier()  # every lane's store before the (one-lane) mbarrier arrival


@gluon.jit
def _field(vals, idx, k: gl.constexpr):
    return gl.sum(gl.where(idx == k, vals, 0), 0)


@gluon.jit
def _take(info, q_bar, item, Q_SLOTS: gl.constexpr, num_warps: gl.constexpr):
    """Consumer: wait for this CTA's item number ``item`` (Q slot ``item % Q_SLOTS``) and
    read its (b, n, m0, total_len)."""
    qs = item % Q_SLOTS
    mbarrier.wait(q_bar.index(qs), (item // Q_SLOTS) & 1)
    idx = gl.arange(0, 4, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
    vals = info.index(qs).load(idx.type.layout)
    return _field(vals, idx, 0), _field(vals, idx, 1), _field(vals, idx, 2), _field(vals, idx, 3)


@gluon.jit
def _tile_start(j, kv_lo, kv_hi, n_tiles, BLOCK_N: gl.constexpr):
    """First key row of tile j; the last tile ends at kv_hi (it may start before 0: TMA
    zero-fills those rows)."""
    return gl.where(j == n_tiles - 1, kv_hi - BLOCK_N, kv_lo + j * BLOCK_N)


@gluon.jit
def _load_tile(desc, coord, ring, ready, empty, it, SLOTS: gl.constexpr):
    """Producer: the ring's tile number ``it`` (slot ``it % SLOTS``, [BLOCK_N, HEAD]) by TMA
    from ``desc`` at ``coord``, once both consumers released the slot's previous tile."""
    slot = it % SLOTS
    mbarrier.wait(empty.index(slot), ((it // SLOTS) & 1) ^ 1)  # fresh: passes at once
    mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
    dst = ring.index(slot).reshape(desc.block_type.shape)  # [1, 1, BLOCK_N, HEAD] view
    tma.async_copy_global_to_shared(desc, coord, ready.index(slot), dst)


@gluon.jit
def _producer(
    q_desc, k_desc, v_desc, seqlens_ptr, counter_ptr, max_total, seq_len, window, n_bn, n_m,
    q_smem, k_smem, v_smem, info, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
    NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, V_STAGES: gl.constexpr, Q_SLOTS: gl.constexpr,
    IS_FIRST_PROMPT: gl.constexpr, HAS_WINDOW: gl.constexpr, ORDER: gl.constexpr,
    DYNAMIC: gl.constexpr,
):  # fmt: skip
    """One warp: per work item (claimed by ``_claim``), its (b, n, m0, total_len) for the consumers
    and its two Q tiles (once both consumers released the previous item's), then K tile j
    into K ring slot ``it % STAGES`` and V tile j into V ring slot ``it % V_STAGES`` (``it``
    counts tiles across items), each once both consumers released the slot's previous tile.
    Past the last item, b = -1 tells the consumers to stop."""
    it = 0
    item = 0
    w = _claim(gl.program_id(0) - gl.num_programs(0), counter_ptr, DYNAMIC)
    while w < n_bn * n_m:
        b, n, m0 = _item_head(w, n_bn, n_m, NUM_HEADS, GROUP, ORDER)
        total_len = load_total_len(seqlens_ptr, b, max_total)
        offset, rows_valid, kv_lo, kv_hi, n_tiles = _item_keys(
            total_len, m0, seq_len, window, BLOCK_N, IS_FIRST_PROMPT, HAS_WINDOW)  # fmt: skip
        kvh = n // GROUP
        q_row = b * seq_len + m0
        qs = item % Q_SLOTS
        mbarrier.wait(q_empty.index(qs), ((item // Q_SLOTS) & 1) ^ 1)  # fresh: passes at once
        _publish(info.index(qs), b, n, m0, total_len, 1)
        mbarrier.expect(q_bar.index(qs), 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, n * HEAD], q_bar.index(qs),
                                        q_smem.index(2 * qs))  # fmt: skip
        tma.async_copy_global_to_shared(q_desc, [q_row + ROWS_PER_WG, n * HEAD],
                                        q_bar.index(qs), q_smem.index(2 * qs + 1))  # fmt: skip
        for j in range(n_tiles):
            start = _tile_start(j, kv_lo, kv_hi, n_tiles, BLOCK_N)
            _load_tile(k_desc, [b, kvh, start, 0], k_smem, k_ready, k_empty, it, STAGES)
            _load_tile(v_desc, [b, kvh, start, 0], v_smem, v_ready, v_empty, it, V_STAGES)
            it += 1
        item += 1
        w = _claim(w, counter_ptr, DYNAMIC)
    qs = item % Q_SLOTS
    mbarrier.wait(q_empty.index(qs), ((item // Q_SLOTS) & 1) ^ 1)
    _publish(info.index(qs), -1, 0, 0, 0, 1)  # no more items
    mbarrier.arrive(q_bar.index(qs), count=1)


@gluon.jit
def _logits(qk, start, lo, qpos, r_lo, r_hi, window, qk_scale, softcap_mult, last,
            s_layout: gl.constexpr, BLOCK_N: gl.constexpr, HAS_WINDOW: gl.constexpr,
            HAS_SOFTCAP: gl.constexpr):  # fmt: skip
    """Masked logits of one tile as ``(s [64, BLOCK_N] fp32, unit)``; ``s * unit`` is the
    log2-domain logit (-inf where hidden). Keys ``< lo`` (the part of a shifted last tile that
    the previous tile covered) are hidden too. The mask is built only on the last tile, tiles
    crossing the diagonal of rows [r_lo, r_hi], and tiles below the window's edge."""
    if HAS_SOFTCAP:
        s = softcap_log2(qk, qk_scale, softcap_mult)
        unit = 1.0
    else:
        s = qk
        unit = qk_scale
    need = last | (start + BLOCK_N - 1 > r_lo)
    if HAS_WINDOW:
        need = need | (start <= r_hi - window)
    if need:
        offs_n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        cols = gl.expand_dims(offs_n, 0)  # [1, BLOCK_N]
        rows = gl.expand_dims(qpos, 1)  # [64, 1]
        # row r sees keys [first, r]: first = lo, or the window's edge where that is later
        if HAS_WINDOW:
            first = gl.maximum(rows - window + 1, lo)  # [64, 1]
        else:
            first = lo
        # one unsigned compare per logit (cols - first wraps where cols < first)
        span = gl.maximum(rows + 1 - first, 0).to(gl.uint32, bitcast=True)  # [64, 1] visible
        seen = (cols - first).to(gl.uint32, bitcast=True) < span
        s = gl.where(seen, s, float("-inf"))
    return s, unit


# LAZY_RESCALE: a row's running max moves only when a tile raises it by more than this (log2
# units), so the weights stay <= 2^8 (fine in fp32 sums and in a bf16 / fp16 P)
LAZY_MAX_LOG2 = gl.constexpr(8.0)


@gluon.jit
def _softmax_step(s, unit, m_i, l_i, LAZY: gl.constexpr = False):
    """One tile of the online softmax: ``(p [64, BLOCK_N], alpha [64], m [64], l [64])`` from the
    masked logits ``s`` (``s * unit`` in the log2 domain) and the running max / denominator.
    LAZY (``LAZY_RESCALE``): a row keeps its max (alpha exactly 1) unless the tile raises it
    by more than ``LAZY_MAX_LOG2``: the weights are relative to a max that is stale by at
    most that, which the final ``acc / l`` cancels (FlashAttention-4's conditional rescale)."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * unit)  # [64]
    if LAZY:
        m_new = gl.where(m_new > m_i + LAZY_MAX_LOG2, m_new, m_i)  # -inf -> finite: moves
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet
    alpha = gl.exp2(m_i - m_safe)
    if LAZY:  # exactly 1 where the max stayed (what _rescale_acc's vote tests), whatever ex2 gives
        alpha = gl.where(m_new == m_i, 1.0, alpha)
    p = gl.exp2(s * unit - gl.expand_dims(m_safe, 1))  # [64, BLOCK_N]: one FMA + exp2
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.constexpr_function
def _lazy_rescale_ptx(n):
    """PTX of ``_rescale_acc`` on a thread's n accumulator elements: outputs $0..$n-1, inputs
    acc $n..$2n-1, their rows' alpha $2n..$3n-1 and the warp's flag (element 0's, $3n). One
    warp-uniform branch: n multiplies, or none (the copies coalesce away in ptxas)."""
    uid = "${:uid}"  # a label per inline-asm instance
    lines = ["{", ".reg .pred p;", f"setp.ne.s32 p, ${3 * n}, 0;", f"@!p bra.uni SKIP{uid};"]
    lines += [f"mul.f32 ${i}, ${n + i}, ${2 * n + i};" for i in range(n)]
    lines += [f"bra.uni DONE{uid};", f"SKIP{uid}:"]
    lines += [f"mov.b32 ${i}, ${n + i};" for i in range(n)]
    return "\n".join(lines + [f"DONE{uid}:", "}"])


@gluon.constexpr_function
def _lazy_rescale_constraints(n):
    return ",".join(["=f"] * n + ["f"] * (2 * n) + ["r"] * n)


@gluon.jit
def _warp_any(flag):
    """[64] int32 in the accumulator's row layout (two rows per thread): 1 on every row of a
    warp where any of the warp's 16 rows has ``flag`` set (``vote.sync.any``), else 0."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred a, b; setp.ne.s32 a, $2, 0; setp.ne.s32 b, $3, 0; or.pred a, a, b; "
        "vote.sync.any.pred a, a, 0xffffffff; selp.s32 $0, 1, 0, a; mov.b32 $1, $0; }",
        "=r,=r,r,r", [flag], dtype=gl.int32, is_pure=True, pack=2)  # fmt: skip


@gluon.jit
def _rescale_acc(acc, alpha, HEAD: gl.constexpr, LAZY: gl.constexpr):
    """``acc * alpha`` per row (acc [64, HEAD] fp32, alpha [64]). LAZY: each warp skips its
    HEAD / 2 multiplies per thread where all of its 16 rows have alpha == 1 (``_softmax_step``
    with LAZY keeps most rows' max), by one warp-uniform branch in PTX (``_warp_any``): a
    Triton ``if`` takes a program-wide scalar, which would cost a warpgroup reduction."""
    row_o: gl.constexpr = gl.SliceLayout(1, _wgmma_layout(HEAD))
    a_row = gl.convert_layout(alpha, row_o)  # [64]
    if not LAZY:
        return acc * gl.expand_dims(a_row, 1)
    need = _warp_any((a_row != 1.0).to(gl.int32))  # [64], uniform per warp
    a_full = gl.broadcast(gl.expand_dims(a_row, 1), acc)[0]  # [64, HEAD]
    need_full = gl.broadcast(gl.expand_dims(need, 1), acc)[0]  # [64, HEAD]
    PACK: gl.constexpr = HEAD // 2  # a thread's accumulator elements (wgmma layout, 4 warps)
    return gl.inline_asm_elementwise(
        _lazy_rescale_ptx(PACK), _lazy_rescale_constraints(PACK), [acc, a_full, need_full],
        dtype=gl.float32, is_pure=True, pack=PACK)  # fmt: skip


@gluon.constexpr_function
def _turn_ptx(op, barrier):
    """PTX of a named-barrier ``op`` (sync / arrive) on ``barrier`` for both consumers' 256
    threads."""
    return f"bar.{op} {barrier}, 256;"


@gluon.jit
def _turn_wait(TURN: gl.constexpr):
    """PINGPONG (``TURN`` = the consumer's warpgroup, -1 off): wait until the other consumer
    has issued its last wgmma group (named barrier 14 + TURN; Triton's own use lower ids)."""
    if TURN >= 0:
        gl.inline_asm_elementwise(_turn_ptx("sync", 14 + TURN), "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _turn_pass(TURN: gl.constexpr):
    """PINGPONG: this consumer's wgmma group is issued; the other consumer may issue its own
    (``bar.arrive`` on the other warpgroup's barrier, 15 - TURN; see ``_turn_wait``)."""
    if TURN >= 0:
        gl.inline_asm_elementwise(_turn_ptx("arrive", 15 - TURN), "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _attend_init(HEAD: gl.constexpr, BLOCK_N: gl.constexpr):
    """A warpgroup's empty online-softmax state: (acc [64, HEAD] fp32 zeros, m [64] -inf,
    l [64] zeros, and the [64, BLOCK_N] zeros that QK^T's wgmma takes as its accumulator)."""
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)  # [64, BLOCK_N] logits
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    acc = gl.zeros([ROWS_PER_WG, HEAD], gl.float32, layout=_wgmma_layout(HEAD))  # [64, HEAD]
    m_i = gl.full([ROWS_PER_WG], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([ROWS_PER_WG], gl.float32, layout=row_s)
    s_zero = gl.zeros([ROWS_PER_WG, BLOCK_N], gl.float32, layout=s_layout)
    return acc, m_i, l_i, s_zero


@gluon.jit
def _qk_tile(q, k_smem, k_ready, k_empty, it, s_zero, STAGES: gl.constexpr,
             EARLY_K_RELEASE: gl.constexpr, TURN: gl.constexpr = -1,
             TAKE: gl.constexpr = True):  # fmt: skip
    """QK^T of the K ring's tile ``it`` alone (issued and waited for): [64, BLOCK_N] fp32; with
    EARLY_K_RELEASE its slot is released at once. TURN: issued in turn (``_turn_wait``; TAKE
    False: the caller holds the turn already), which passes once it is issued."""
    ks = it % STAGES
    mbarrier.wait(k_ready.index(ks), (it // STAGES) & 1)
    if TAKE:
        _turn_wait(TURN)
    qk = warpgroup_mma(q, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False,
                       is_async=True)  # fmt: skip
    _turn_pass(TURN)
    qk = warpgroup_mma_wait(0, deps=(qk,))  # [64, BLOCK_N] fp32
    if EARLY_K_RELEASE:
        mbarrier.arrive(k_empty.index(ks), count=1)
    return qk


@gluon.jit
def _release_kv(k_empty, v_empty, it, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
                EARLY_K_RELEASE: gl.constexpr):  # fmt: skip
    """Tile ``it``'s P.V is done: its V slot is free, and its K slot too unless EARLY_K_RELEASE
    freed that after QK^T."""
    mbarrier.arrive(v_empty.index(it % V_STAGES), count=1)
    if not EARLY_K_RELEASE:
        mbarrier.arrive(k_empty.index(it % STAGES), count=1)


@gluon.jit
def _pv_tile(
    acc, p, alpha, v_smem, v_ready, v_empty, k_empty, it, HEAD: gl.constexpr,
    STAGES: gl.constexpr, V_STAGES: gl.constexpr, EARLY_K_RELEASE: gl.constexpr,
    TURN: gl.constexpr = -1, GIVE: gl.constexpr = True, LAZY: gl.constexpr = False,
):  # fmt: skip
    """``acc * alpha + P.V`` of tile ``it`` (issued and waited for; P [64, BLOCK_N] from
    registers), then its slots released (``_release_kv``): acc [64, HEAD] fp32. TURN: issued
    in turn (``_turn_wait``), which passes once it is issued (GIVE False: the caller keeps it
    for its next wgmma group). LAZY: the rescale by ``_rescale_acc``'s per-warp skip."""
    o_layout: gl.constexpr = _wgmma_layout(HEAD)  # [64, HEAD] accumulator
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    vs = it % V_STAGES
    acc = _rescale_acc(acc, alpha, HEAD, LAZY)
    p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)  # registers: wgmma A operand
    mbarrier.wait(v_ready.index(vs), (it // V_STAGES) & 1)
    _turn_wait(TURN)
    acc = warpgroup_mma(p_op, v_smem.index(vs), acc, is_async=True)
    if GIVE:
        _turn_pass(TURN)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    _release_kv(k_empty, v_empty, it, STAGES, V_STAGES, EARLY_K_RELEASE)
    return acc


@gluon.jit
def _attend(
    it, q, qpos, r_lo, r_hi, kv_lo, kv_hi, n_tiles, window, qk_scale,
    softcap_mult, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
    HEAD: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
    EARLY_K_RELEASE: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    OVERLAP: gl.constexpr, TURN: gl.constexpr, LAZY: gl.constexpr = False,
):  # fmt: skip
    """Online softmax of one warpgroup's 64 rows over the item's n_tiles K/V tiles (ring
    slots from tile counter ``it``): returns (acc [64, HEAD] fp32, m [64], l [64], it).
    EARLY_K_RELEASE: a K slot is released right after its QK^T (else with the V slot, after
    P.V), so the producer refills it during the softmax and P.V. OVERLAP (FA3's intra-warpgroup
    overlap): tile j's QK^T and tile j-1's P.V are issued back to back, and tile j's softmax
    runs while that P.V is on the tensor cores (``_attend_overlapped``). TURN (PINGPONG): the
    two consumers take turns to issue their wgmma groups; here (FA3's schedule without the
    overlap) a turn is tile j's P.V and tile j + 1's QK^T, so one consumer's softmax runs while
    the other's two wgmmas hold the tensor cores. LAZY (``LAZY_RESCALE``, this plain loop
    only): the running max moves only by more than ``LAZY_MAX_LOG2`` and a warp skips the
    accumulator's rescale where none of its rows moved (``_rescale_acc``)."""
    if OVERLAP:
        return _attend_overlapped(
            it, q, qpos, r_lo, r_hi, kv_lo, kv_hi, n_tiles, window, qk_scale, softcap_mult,
            k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, HEAD, BLOCK_N, STAGES,
            V_STAGES, EARLY_K_RELEASE, HAS_WINDOW, HAS_SOFTCAP, TURN)  # fmt: skip
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)  # [64, BLOCK_N] logits
    acc, m_i, l_i, s_zero = _attend_init(HEAD, BLOCK_N)
    _turn_wait(TURN)  # the first QK^T's turn (an item without tiles passes it on below)
    for j in range(n_tiles):
        start = _tile_start(j, kv_lo, kv_hi, n_tiles, BLOCK_N)
        qk = _qk_tile(q, k_smem, k_ready, k_empty, it, s_zero, STAGES, EARLY_K_RELEASE, TURN,
                      False)  # fmt: skip
        s, unit = _logits(qk, start, kv_lo + j * BLOCK_N, qpos, r_lo, r_hi, window, qk_scale,
                          softcap_mult, j == n_tiles - 1, s_layout, BLOCK_N, HAS_WINDOW,
                          HAS_SOFTCAP)  # fmt: skip
        p, alpha, m_i, l_i = _softmax_step(s, unit, m_i, l_i, LAZY)
        acc = _pv_tile(acc, p, alpha, v_smem, v_ready, v_empty, k_empty, it, HEAD, STAGES,
                       V_STAGES, EARLY_K_RELEASE, TURN, False, LAZY)  # fmt: skip
        it += 1
    _turn_pass(TURN)
    return acc, m_i, l_i, it


@gluon.jit
def _attend_overlapped(
    it, q, qpos, r_lo, r_hi, kv_lo, kv_hi, n_tiles, window, qk_scale,
    softcap_mult, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
    HEAD: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
    EARLY_K_RELEASE: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    TURN: gl.constexpr,
):  # fmt: skip
    """``_attend`` with tile j's QK^T issued before tile j-1's P.V, and tile j's logits and
    softmax computed while that P.V runs (``_overlap_tiles``); the last tile's P.V follows."""
    acc, m_i, l_i, s_zero = _attend_init(HEAD, BLOCK_N)
    if n_tiles > 0:
        # tile 0: QK^T and softmax (its P.V is issued with tile 1's QK^T)
        qk = _qk_tile(q, k_smem, k_ready, k_empty, it, s_zero, STAGES, EARLY_K_RELEASE, TURN)
        p, alpha, m_i, l_i = _first_softmax(qk, m_i, l_i, r_lo, kv_lo, kv_hi, n_tiles, window,
                                            qk_scale, softcap_mult, BLOCK_N, HAS_WINDOW,
                                            HAS_SOFTCAP)  # fmt: skip
        acc, p, alpha, m_i, l_i, it = _overlap_tiles(
            acc, p, alpha, m_i, l_i, s_zero, it, q, qpos, r_lo, r_hi, kv_lo, kv_hi, n_tiles,
            window, qk_scale, softcap_mult, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
            HEAD, BLOCK_N, STAGES, V_STAGES, EARLY_K_RELEASE, HAS_WINDOW, HAS_SOFTCAP,
            TURN)  # fmt: skip
        # the last tile's P.V
        acc = _pv_tile(acc, p, alpha, v_smem, v_ready, v_empty, k_empty, it, HEAD, STAGES,
                       V_STAGES, EARLY_K_RELEASE, TURN)  # fmt: skip
        it += 1
    return acc, m_i, l_i, it


@gluon.jit
def _overlap_tiles(
    acc, p, alpha, m_i, l_i, s_zero, it, q, qpos, r_lo, r_hi, kv_lo, kv_hi, n_tiles, window,
    qk_scale, softcap_mult, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
    HEAD: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
    EARLY_K_RELEASE: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    TURN: gl.constexpr,
):  # fmt: skip
    """Tiles 1 .. n_tiles - 1 of an item whose tile 0 (ring tile ``it``) is softmaxed (weights
    ``p``, rescale ``alpha``) but not yet multiplied by V: each step issues tile j's QK^T and
    tile j-1's P.V back to back, waits for the QK^T only (wgmma groups complete in order), and
    computes tile j's logits and softmax while that P.V runs. Returns the state with the last
    tile's P.V pending: (acc, p, alpha, m, l, it) with ``it`` that tile's ring counter.
    TURN (PINGPONG): each step's two wgmmas are issued in turn with the other consumer's, so
    one consumer's softmax runs while the other's wgmmas hold the tensor cores."""
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)  # [64, BLOCK_N] logits
    o_layout: gl.constexpr = _wgmma_layout(HEAD)  # [64, HEAD] accumulator
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    p_dtype: gl.constexpr = p.dtype  # fp32, or the dot dtype (rounded where it was computed)
    for j in range(1, n_tiles):
        prev = it  # tile j-1's ring counter
        it += 1
        ks = it % STAGES
        vs = prev % V_STAGES
        start = _tile_start(j, kv_lo, kv_hi, n_tiles, BLOCK_N)
        p_op = gl.convert_layout(p.to(k_smem.dtype), p_layout)  # tile j-1's weights
        acc = _rescale_acc(acc, alpha, HEAD, False)
        mbarrier.wait(k_ready.index(ks), (it // STAGES) & 1)
        _turn_wait(TURN)
        qk = warpgroup_mma(q, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)  # fmt: skip
        mbarrier.wait(v_ready.index(vs), (prev // V_STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(vs), acc, is_async=True)
        _turn_pass(TURN)
        qk = warpgroup_mma_wait(1, deps=(qk,))  # QK^T(j) done; P.V(j-1) may still run
        if EARLY_K_RELEASE:
            mbarrier.arrive(k_empty.index(ks), count=1)
        s, unit = _logits(qk, start, kv_lo + j * BLOCK_N, qpos, r_lo, r_hi, window,
                          qk_scale, softcap_mult, j == n_tiles - 1, s_layout, BLOCK_N,
                          HAS_WINDOW, HAS_SOFTCAP)  # fmt: skip
        p, alpha, m_i, l_i = _softmax_step(s, unit, m_i, l_i)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        # a 16-bit P is rounded once the P.V is done: ptxas serializes the wgmmas (C7513) where
        # a later wgmma's register operand is written while one is in flight
        p = p.to(p_dtype)
        _release_kv(k_empty, v_empty, prev, STAGES, V_STAGES, EARLY_K_RELEASE)
    return acc, p, alpha, m_i, l_i, it


@gluon.jit
def _q_as_output(q_tile, dtype: gl.constexpr):
    """A consumer's freed [64, HEAD] Q tile viewed as an output tile of ``dtype`` (same width)."""
    return q_tile._reinterpret(dtype, [ROWS_PER_WG, q_tile.shape[1]], q_tile.layout)


@gluon.jit
def _epilogue(
    acc, m_i, l_i, b, n, r0, rows_valid, qs, o_ptr, o_desc, sink_ptr, stride_ob, stride_os,
    seq_len, q_smem, q_empty, WG: gl.constexpr, HEAD: gl.constexpr, HAS_SINK: gl.constexpr,
    SINK_FROM_PTR: gl.constexpr, EPILOGUE_SMEM: gl.constexpr, EPILOGUE_TMA: gl.constexpr,
):  # fmt: skip
    """A warpgroup's 64 finished rows (acc [64, HEAD] fp32, m / l [64] in the logits' row
    layout) of head n, rows [r0, r0 + 64) of sequence b: sink, normalization, padding rows
    (>= rows_valid) zeroed, stored to ``o_ptr``; the item's Q tile (Q slot ``qs``) is released
    (EPILOGUE_SMEM: after the rows passed through it, see ``_consumer``)."""
    o_layout: gl.constexpr = _wgmma_layout(HEAD)  # [64, HEAD] accumulator
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    if not EPILOGUE_SMEM:
        mbarrier.arrive(q_empty.index(qs), count=1)  # this warpgroup's Q tile is free
    m_i = gl.convert_layout(m_i, row_o)  # the accumulator's rows
    l_i = gl.convert_layout(l_i, row_o)
    if HAS_SINK:
        if SINK_FROM_PTR:
            sink2 = gl.load(sink_ptr + n).to(gl.float32) * LOG2E
        else:
            sink2 = 0.0
        acc, m_i, l_i = add_sink(acc, m_i, l_i, sink2)
    acc = normalize(acc, l_i)
    rows = r0 + gl.arange(0, ROWS_PER_WG, layout=row_o)  # [64] new-token index
    acc = gl.where(gl.expand_dims(rows < rows_valid, 1), acc, 0.0)  # padding rows -> 0
    o_tile = acc.to(o_ptr.dtype.element_ty)
    if EPILOGUE_TMA:  # through the free Q tile, one bulk copy to global memory
        o_smem = _q_as_output(q_smem.index(2 * qs + WG), o_ptr.dtype.element_ty)
        o_smem.store(o_tile)
        fence_async_shared()  # the generic-proxy stores before the copy engine reads
        gl.thread_barrier()
        tma.async_copy_shared_to_global(o_desc, [b, r0, n * HEAD],
                                        o_smem.reshape(o_desc.block_type.shape))  # fmt: skip
        tma.store_wait(0)  # the tile was read: the producer may refill it
        gl.thread_barrier()
        mbarrier.arrive(q_empty.index(qs), count=1)
    else:
        if EPILOGUE_SMEM:  # through the free Q tile: 16-byte row-contiguous global stores
            st_layout: gl.constexpr = _row_store_layout(HEAD)
            o_smem = _q_as_output(q_smem.index(2 * qs + WG), o_ptr.dtype.element_ty)
            o_smem.store(o_tile)
            gl.thread_barrier()
            o_tile = o_smem.load(st_layout)  # [64, HEAD]
            gl.thread_barrier()  # every lane read the tile before the producer may refill it
            mbarrier.arrive(q_empty.index(qs), count=1)
            rows = r0 + gl.arange(0, ROWS_PER_WG, layout=gl.SliceLayout(1, st_layout))
            cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, st_layout))
        else:
            cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = (
            o_ptr
            + b.to(gl.int64) * stride_ob
            + gl.expand_dims(rows.to(gl.int64) * stride_os, 1)
            + n * HEAD
            + gl.expand_dims(cols, 0)
        )
        gl.store(o_ptrs, o_tile, mask=gl.expand_dims(rows < seq_len, 1))


@gluon.jit
def _consumer(
    WG: gl.constexpr, o_ptr, o_desc, sink_ptr, stride_ob, stride_os, seq_len, window, qk_scale,
    softcap_mult, q_smem, k_smem, v_smem, info, q_bar, q_empty, k_ready, v_ready, k_empty,
    v_empty, NUM_HEADS: gl.constexpr, HEAD: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, V_STAGES: gl.constexpr, EARLY_K_RELEASE: gl.constexpr,
    Q_SLOTS: gl.constexpr, IS_FIRST_PROMPT: gl.constexpr, HAS_WINDOW: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr, HAS_SINK: gl.constexpr, SINK_FROM_PTR: gl.constexpr,
    EPILOGUE_SMEM: gl.constexpr, EPILOGUE_TMA: gl.constexpr, OVERLAP: gl.constexpr,
    CROSS_ITEM: gl.constexpr, PINGPONG: gl.constexpr, LAZY_RESCALE: gl.constexpr,
):  # fmt: skip
    """Per work item (as the producer published it), rows [m0 + 64 WG, m0 + 64 WG + 64): the
    online softmax over its K/V tiles, then the normalized rows to ``o_ptr`` (while the
    producer loads the next item); EPILOGUE_SMEM: the rows pass through the item's Q tile
    (released after) to leave as 16-byte row-contiguous stores instead of the accumulator
    layout's 4-byte ones; EPILOGUE_TMA (with EPILOGUE_SMEM): one TMA bulk store of the tile
    (``o_desc``, rows past the sequence clipped by the descriptor) instead of per-thread
    stores; the Q tile is released once the copy engine has read it. CROSS_ITEM (with OVERLAP
    and 2 Q slots): the overlapped loop carried across items, the next item's first softmax
    during this item's last P.V (``_consumer_crossed``). PINGPONG (FA3's inter-warpgroup
    schedule): the two consumers take turns to issue their wgmma groups
    (``_turn_wait``), consumer 0 first; both issue the same number of groups (the same items
    and tiles), and consumer 0 takes the turn that consumer 1's last group passes it at the
    end, so every named-barrier arrival is matched."""
    TURN: gl.constexpr = _turn_of(WG, PINGPONG)
    if TURN == 1:
        _turn_pass(TURN)  # consumer 0 goes first
    if CROSS_ITEM:
        _consumer_crossed(
            WG, o_ptr, o_desc, sink_ptr, stride_ob, stride_os, seq_len, window, qk_scale,
            softcap_mult, q_smem, k_smem, v_smem, info, q_bar, q_empty, k_ready, v_ready, k_empty,
            v_empty, HEAD, BLOCK_N, STAGES, V_STAGES, EARLY_K_RELEASE, Q_SLOTS, IS_FIRST_PROMPT,
            HAS_WINDOW, HAS_SOFTCAP, HAS_SINK, SINK_FROM_PTR, EPILOGUE_SMEM, EPILOGUE_TMA,
            TURN)  # fmt: skip
    else:  # one item after another: its tiles (``_attend``), then its epilogue
        s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)  # [64, BLOCK_N] logits
        it = 0
        item = 0
        b, n, m0, total_len = _take(info, q_bar, item, Q_SLOTS, 4)
        while b >= 0:
            offset, rows_valid, kv_lo, kv_hi, n_tiles = _item_keys(
                total_len, m0, seq_len, window, BLOCK_N, IS_FIRST_PROMPT, HAS_WINDOW)  # fmt: skip
            r0 = m0 + WG * ROWS_PER_WG
            qpos = offset + r0 + gl.arange(0, ROWS_PER_WG, layout=gl.SliceLayout(1, s_layout))
            qs = item % Q_SLOTS
            acc, m_i, l_i, it = _attend(
                it, q_smem.index(2 * qs + WG), qpos, offset + r0, offset + r0 + ROWS_PER_WG - 1,
                kv_lo, kv_hi, n_tiles, window, qk_scale, softcap_mult, k_smem, v_smem, k_ready,
                v_ready, k_empty, v_empty, HEAD, BLOCK_N, STAGES, V_STAGES, EARLY_K_RELEASE,
                HAS_WINDOW, HAS_SOFTCAP, OVERLAP, TURN, LAZY_RESCALE)  # fmt: skip
            _epilogue(acc, m_i, l_i, b, n, r0, rows_valid, qs, o_ptr, o_desc, sink_ptr, stride_ob,
                      stride_os, seq_len, q_smem, q_empty, WG, HEAD, HAS_SINK, SINK_FROM_PTR,
                      EPILOGUE_SMEM, EPILOGUE_TMA)  # fmt: skip
            item += 1
            b, n, m0, total_len = _take(info, q_bar, item, Q_SLOTS, 4)
    if TURN == 0:
        _turn_wait(TURN)  # consumer 1's last pass


@gluon.jit
def _first_softmax(
    qk, m_i, l_i, r_lo, kv_lo, kv_hi, n_tiles, window, qk_scale, softcap_mult,
    BLOCK_N: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
):  # fmt: skip
    """``_softmax_step`` of an item's first tile from its QK^T ``qk`` [64, BLOCK_N], for the
    warpgroup's rows [r_lo, r_lo + 64) over the item's keys [kv_lo, kv_hi) in n_tiles tiles;
    m / l: the fresh state (-inf, 0). Returns (p, alpha, m, l)."""
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)  # [64, BLOCK_N] logits
    qpos = r_lo + gl.arange(0, ROWS_PER_WG, layout=gl.SliceLayout(1, s_layout))  # [64]
    s, unit = _logits(qk, _tile_start(0, kv_lo, kv_hi, n_tiles, BLOCK_N), kv_lo, qpos, r_lo,
                      r_lo + ROWS_PER_WG - 1, window, qk_scale, softcap_mult, n_tiles == 1,
                      s_layout, BLOCK_N, HAS_WINDOW, HAS_SOFTCAP)  # fmt: skip
    return _softmax_step(s, unit, m_i, l_i)


@gluon.jit
def _consumer_crossed(
    WG: gl.constexpr, o_ptr, o_desc, sink_ptr, stride_ob, stride_os, seq_len, window, qk_scale,
    softcap_mult, q_smem, k_smem, v_smem, info, q_bar, q_empty, k_ready, v_ready, k_empty,
    v_empty, HEAD: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    V_STAGES: gl.constexpr, EARLY_K_RELEASE: gl.constexpr, Q_SLOTS: gl.constexpr,
    IS_FIRST_PROMPT: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    HAS_SINK: gl.constexpr, SINK_FROM_PTR: gl.constexpr, EPILOGUE_SMEM: gl.constexpr,
    EPILOGUE_TMA: gl.constexpr, TURN: gl.constexpr,
):  # fmt: skip
    """``_consumer`` with the overlapped loop (``_overlap_tiles``) carried across items
    (CROSS_ITEM): at an item's end the next item's first QK^T and this item's last P.V are
    issued back to back (as ``_overlap_tiles`` does within an item), the next item's first
    logits and softmax run while that P.V is on the tensor cores, then this item's epilogue;
    the next item enters ``_overlap_tiles`` with its first tile's weights (16-bit, rounded
    after the P.V: see there) pending. Both wgmmas are issued even without a tile to read
    (an item without keys, or no next item): ptxas serializes every wgmma of the kernel when
    one is issued and waited for in different branches. Then the P.V reads whatever V slot
    (its result is replaced by zeros) and the QK^T whatever K slot (its softmax is discarded);
    only the ready waits and slot releases are skipped. Needs Q_SLOTS = 2 (the next item's Q
    is read before this item's epilogue frees its own slot)."""
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)  # [64, BLOCK_N] logits
    o_layout: gl.constexpr = _wgmma_layout(HEAD)  # [64, HEAD] accumulator
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = k_smem.dtype
    it = 0  # ring counter of the current item's first tile
    item = 0
    acc, m_i, l_i, s_zero = _attend_init(HEAD, BLOCK_N)
    b, n, m0, total_len = _take(info, q_bar, item, Q_SLOTS, 4)
    offset, rows_valid, kv_lo, kv_hi, n_tiles = _item_keys(
        total_len, m0, seq_len, window, BLOCK_N, IS_FIRST_PROMPT, HAS_WINDOW)  # fmt: skip
    has_next = (b >= 0) & (n_tiles > 0)
    if has_next:
        mbarrier.wait(k_ready.index(0), 0)
    _turn_wait(TURN)
    qk = warpgroup_mma(q_smem.index(WG), k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                       is_async=True)  # fmt: skip
    _turn_pass(TURN)
    qk = warpgroup_mma_wait(0, deps=(qk,))
    if EARLY_K_RELEASE:
        if has_next:
            mbarrier.arrive(k_empty.index(0), count=1)
    p = s_zero.to(dtype)
    alpha = l_i
    if has_next:
        p, alpha, m_i, l_i = _first_softmax(
            qk, m_i, l_i, offset + m0 + WG * ROWS_PER_WG, kv_lo, kv_hi, n_tiles, window, qk_scale,
            softcap_mult, BLOCK_N, HAS_WINDOW, HAS_SOFTCAP)  # fmt: skip
        p = p.to(dtype)
    while b >= 0:
        r0 = m0 + WG * ROWS_PER_WG
        r_lo = offset + r0
        qpos = r_lo + gl.arange(0, ROWS_PER_WG, layout=row_s)  # [64]
        qs = item % Q_SLOTS
        acc = gl.zeros_like(acc)
        if n_tiles > 0:
            acc, p, alpha, m_i, l_i, it = _overlap_tiles(
                acc, p, alpha, m_i, l_i, s_zero, it, q_smem.index(2 * qs + WG), qpos, r_lo,
                r_lo + ROWS_PER_WG - 1, kv_lo, kv_hi, n_tiles, window, qk_scale, softcap_mult,
                k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, HEAD, BLOCK_N, STAGES,
                V_STAGES, EARLY_K_RELEASE, HAS_WINDOW, HAS_SOFTCAP, TURN)  # fmt: skip
            p = p.to(dtype)
        item += 1
        b2, n2, m02, total2 = _take(info, q_bar, item, Q_SLOTS, 4)
        offset2, rows_valid2, kv_lo2, kv_hi2, n_tiles2 = _item_keys(
            total2, m02, seq_len, window, BLOCK_N, IS_FIRST_PROMPT, HAS_WINDOW)  # fmt: skip
        has_next = (b2 >= 0) & (n_tiles2 > 0)
        has_pv = kv_hi > kv_lo  # n_tiles > 0 (not reused: its predicate would stay live)
        nxt = it + has_pv.to(gl.int32)
        vs = it % V_STAGES
        p_op = gl.convert_layout(p, p_layout)
        acc = _rescale_acc(acc, alpha, HEAD, False)
        ks = nxt % STAGES
        if has_next:
            mbarrier.wait(k_ready.index(ks), (nxt // STAGES) & 1)
        _turn_wait(TURN)
        qk = warpgroup_mma(q_smem.index(2 * (item % Q_SLOTS) + WG),
                           k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)  # fmt: skip
        if has_pv:
            mbarrier.wait(v_ready.index(vs), (it // V_STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(vs), acc, is_async=True)
        _turn_pass(TURN)
        qk = warpgroup_mma_wait(1, deps=(qk,))
        if EARLY_K_RELEASE:
            if has_next:
                mbarrier.arrive(k_empty.index(ks), count=1)
        # the next item's first softmax (computed without a next item too, then discarded)
        p2, alpha2, m2, l2 = _first_softmax(
            qk, gl.full_like(m_i, float("-inf")), gl.zeros_like(l_i),
            offset2 + m02 + WG * ROWS_PER_WG, kv_lo2, kv_hi2, n_tiles2, window, qk_scale,
            softcap_mult, BLOCK_N, HAS_WINDOW, HAS_SOFTCAP)  # fmt: skip
        m2 = gl.where(has_next, m2, float("-inf"))
        l2 = gl.where(has_next, l2, 0.0)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        p2 = gl.where(has_next, p2, 0.0).to(dtype)
        if has_pv:
            _release_kv(k_empty, v_empty, it, STAGES, V_STAGES, EARLY_K_RELEASE)
        else:
            acc = gl.zeros_like(acc)
        it = nxt
        _epilogue(acc, m_i, l_i, b, n, r0, rows_valid, qs, o_ptr, o_desc, sink_ptr, stride_ob,
                  stride_os, seq_len, q_smem, q_empty, WG, HEAD, HAS_SINK, SINK_FROM_PTR,
                  EPILOGUE_SMEM, EPILOGUE_TMA)  # fmt: skip
        p, alpha, m_i, l_i = p2, alpha2, m2, l2
        b, n, m0, total_len = b2, n2, m02, total2
        offset, rows_valid, kv_lo, kv_hi, n_tiles = offset2, rows_valid2, kv_lo2, kv_hi2, n_tiles2


@gluon.jit
def gqa_prefill_gluon_kernel(
    q_desc,  # [B * S, N * HEAD] rotated Q (contiguous, dot dtype), block [64, HEAD]
    k_desc,  # [B, KV, C, HEAD] cache (dot dtype), block [1, 1, BLOCK_N, HEAD]
    v_desc,
    o_ptr,  # [B, S, N * HEAD] output (stride 1 along the last axis)
    o_desc,  # EPILOGUE_TMA: o_ptr's [B, S, N * HEAD] descriptor, block [1, 64, HEAD]
    seqlens_ptr,  # [B] int32, total_len - 1
    sink_ptr,  # [N]
    counter_ptr,  # [1] int32, zero at launch (DYNAMIC: the work-item tickets)
    max_total,
    seq_len,
    window,
    n_bn,  # B * N
    stride_ob,
    stride_os,
    qk_scale,  # scale * log2(e), or scale / softcap with softcap
    softcap_mult,
    NUM_HEADS: gl.constexpr,
    GROUP: gl.constexpr,
    HEAD: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,  # K ring slots
    V_STAGES: gl.constexpr,  # V ring slots
    EARLY_K_RELEASE: gl.constexpr,  # K slot free after QK^T (see _attend)
    Q_SLOTS: gl.constexpr,  # Q tile pairs: 2 lets the producer load item k+1 during item k
    IS_FIRST_PROMPT: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr,
    HAS_SINK: gl.constexpr,
    SINK_FROM_PTR: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    ORDER: gl.constexpr,  # work order: 0 row blocks, 1 heads, 2 KV groups (see _item_head)
    DYNAMIC: gl.constexpr,  # items claimed from counter_ptr (else CTA c takes c, c + G, ...)
    EPILOGUE_SMEM: gl.constexpr,  # output rows through shared memory (see _consumer)
    EPILOGUE_TMA: gl.constexpr,  # ... and out by one TMA store (see _consumer)
    OVERLAP: gl.constexpr = False,  # softmax of tile j during P.V of tile j-1 (see _attend)
    CROSS_ITEM: gl.constexpr = False,  # OVERLAP carried across items (_consumer_crossed)
    PINGPONG: gl.constexpr = False,  # the consumers alternate wgmma issue (_consumer)
    LAZY_RESCALE: gl.constexpr = False,  # plain loop: per-warp skip of acc's rescale (_attend)
):
    n_m = gl.cdiv(seq_len, 2 * ROWS_PER_WG)
    dtype: gl.constexpr = q_desc.dtype
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_SLOTS, ROWS_PER_WG, HEAD], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [V_STAGES, BLOCK_N, HEAD], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    info = gl.allocate_shared_memory(gl.int32, [Q_SLOTS, 4],
                                     gl.SwizzledSharedLayout(1, 1, 1, [0]))  # fmt: skip
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_SLOTS):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # both consumers release the Q tiles
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a slot
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    # fmt: off
    gl.warp_specialize(
        [
            (_consumer, (0, o_ptr, o_desc, sink_ptr, stride_ob, stride_os, seq_len, window, qk_scale,
                         softcap_mult, q_smem, k_smem, v_smem, info, q_bar, q_empty, k_ready,
                         v_ready, k_empty, v_empty, NUM_HEADS, HEAD, BLOCK_N, STAGES, V_STAGES,
                         EARLY_K_RELEASE, Q_SLOTS, IS_FIRST_PROMPT, HAS_WINDOW, HAS_SOFTCAP,
                         HAS_SINK, SINK_FROM_PTR, EPILOGUE_SMEM, EPILOGUE_TMA, OVERLAP,
                         CROSS_ITEM, PINGPONG, LAZY_RESCALE)),
            (_consumer, (1, o_ptr, o_desc, sink_ptr, stride_ob, stride_os, seq_len, window, qk_scale,
                         softcap_mult, q_smem, k_smem, v_smem, info, q_bar, q_empty, k_ready,
                         v_ready, k_empty, v_empty, NUM_HEADS, HEAD, BLOCK_N, STAGES, V_STAGES,
                         EARLY_K_RELEASE, Q_SLOTS, IS_FIRST_PROMPT, HAS_WINDOW, HAS_SOFTCAP,
                         HAS_SINK, SINK_FROM_PTR, EPILOGUE_SMEM, EPILOGUE_TMA, OVERLAP,
                         CROSS_ITEM, PINGPONG, LAZY_RESCALE)),
            (_producer, (q_desc, k_desc, v_desc, seqlens_ptr, counter_ptr, max_total, seq_len,
                         window, n_bn, n_m, q_smem, k_smem, v_smem, info, q_bar, q_empty,
                         k_ready, v_ready, k_empty, v_empty, NUM_HEADS, GROUP, HEAD, BLOCK_N,
                         STAGES, V_STAGES, Q_SLOTS, IS_FIRST_PROMPT, HAS_WINDOW, ORDER,
                         DYNAMIC)),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )
    # fmt: on
