"""Triton top-k + emission kernel of SparseAttentionIndexer (``sparse/triton/select.py``).

Truth: the reference tier's selection rule (stable descending sort, ties to the lower block,
``emit_selection``), applied here to the same fp32 scores (``select_from_scores``), so the
kernel is checked exactly and apart from score rounding; end to end, the triton tier must equal
``backend="reference"`` on integer-valued data (exact fp32 scores, many exact ties). Outputs
are NaN/int-min poisoned before the call.

``-m interpret``: tiny shapes (CPU, TRITON_INTERPRET=1). ``-m gpu``: T = 64K / 256K.
"""

from __future__ import annotations

import pytest
import torch

from longattn.sparse import sparse_attention_indexer
from longattn.sparse._shared import emit_selection, indexer_rows
from longattn.sparse.triton import indexer, select
from longattn.testing import nan_tensor

interpret = pytest.mark.interpret
gpu = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poison_buffers(monkeypatch):
    def poisoned(shape, *, dtype, device):
        return nan_tensor(shape, dtype, device)

    monkeypatch.setattr(indexer, "_empty", poisoned)


_TILES = {"on": False}  # rank_tiles: run_select passes tile maxima (tile_maxima)


@pytest.fixture(
    params=[
        "topk",
        "radix2",
        "radix3",
        "radix4",
        "rank",
        "rank_cap1",
        "rank_cross",
        "rank_tiles",
    ]  # fmt: skip
)
def method(request, monkeypatch):
    """The select methods on every row width (the host picks by NB_PAD): top-k, radix steps at
    each ``RADIX_BITS``, the rank method (``RANK_SELECT``, every budget) at its default
    capacity (``2 * KB_PAD`` candidates) and at ``KB_PAD`` (``rank_cap1``: rows of more
    candidates take the radix steps from its floor), with ``RANK_FLOOR`` "cross", and with the
    floor from tile maxima (``rank_tiles``, folded into 2 * KB_PAD groups: ``run_select``
    passes ``tile_maxima`` of the scores; rows whose budget no tiling serves keep the "groups"
    floor)."""
    topk = request.param == "topk"
    monkeypatch.setattr(select, "TOPK_MAX_BLOCKS", 1 << 30 if topk else 0)
    monkeypatch.setitem(_TILES, "on", request.param == "rank_tiles")
    over = dict(RANK_SELECT=False)
    if request.param.startswith("radix"):
        over.update(RADIX_BITS=int(request.param[5]))
    elif not topk:
        over.update(RADIX_BITS=2, RANK_SELECT=True)
        over["RANK_CAP_MULT"] = 1 if request.param == "rank_cap1" else 2
        floor = {"rank_cross": "cross", "rank_tiles": None}
        over["RANK_FLOOR"] = floor.get(request.param, "groups")
        monkeypatch.setattr(select, "RANK_MAX_KB_PAD", 1 << 30)
    monkeypatch.setattr(select, "SELECT_DEFAULTS", dict(select.SELECT_DEFAULTS, **over))
    return request.param


def tile_maxima(scores, seqlens_k, *, s, r, first, tile):
    """What the score kernel's ``TILE_MAX`` writes for ``scores [B*S, NB]``: per row and each of
    the ``n_tiles = cdiv(NB, tile)`` tiles ``p`` (the runs of ``TILE_RUN`` blocks ``c //
    TILE_RUN = p (mod n_tiles)``; runs of 1 for a tile width that is no multiple of it), the
    largest select key (``select._order_keys``: fp32 bits of a score >= +0.0, -0.0 -> 0, NaN ->
    0x7F800001) of its visible blocks, -1 where none."""
    nb = scores.shape[1]
    rows = indexer_rows(seqlens_k, s, first, r, nb)
    bits = scores.contiguous().view(torch.int32)
    key = torch.where(scores.isnan(), 0x7F800001, torch.clamp(bits, min=0))
    vis = torch.arange(nb, device=scores.device)[None, :] < rows.n_complete[:, None]
    key = torch.where(vis, key, -1)
    n_tiles = -(-nb // tile)
    key = torch.nn.functional.pad(key, (0, n_tiles * tile - nb), value=-1)
    w = indexer.TILE_RUN if tile % indexer.TILE_RUN == 0 else 1  # runs of w blocks
    return key.view(-1, tile // w, n_tiles, w).amax((1, 3)).to(torch.int32)


def _tile_width(nb, budget, r):
    """A tiling with at least 2 * KB_PAD and at most RANK_MAX_TILES tiles, odd where it can be
    (non-power-of-two tile counts: padded tile ids, groups folded from unequal tile counts)."""
    kb_pad = select.select_pads(nb, budget // r)[1]
    tile = max(1, nb // (2 * kb_pad))
    tile = tile - 1 if tile > 2 and tile % 2 == 0 else tile
    return max(tile, -(-nb // select.RANK_MAX_TILES))


def select_from_scores(scores, seqlens_k, *, s, r, budget, first):
    """The reference tier's selection, from given scores ``[B*S, NB]``."""
    nb = scores.shape[1]
    rows = indexer_rows(seqlens_k, s, first, r, nb)
    vis = torch.arange(nb, device=scores.device)[None, :] < rows.n_complete[:, None]
    scores = torch.where(vis, scores, float("-inf"))
    kb = budget // r
    n_sel = torch.clamp(rows.n_complete, max=kb)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :kb]
    if order.shape[1] < kb:
        order = torch.cat((order, order.new_full((order.shape[0], kb - order.shape[1]), nb)), 1)
    ok = torch.arange(kb, device=scores.device)[None, :] < n_sel[:, None]
    blocks = torch.where(ok, order, nb).sort(-1).values
    return emit_selection(blocks, n_sel, rows, compress_ratio=r, max_selected=budget + r - 1)


def run_select(scores, sk, *, s, r, budget, first):
    tmax = None
    if _TILES["on"]:
        tile = _tile_width(scores.shape[1], budget, r)
        tmax = tile_maxima(scores, sk, s=s, r=r, first=first, tile=tile)
    return select.indexer_select(
        scores, sk, seq_len=s, num_blocks=scores.shape[1], compress_ratio=r,
        token_budget=budget, is_first_prompt=first, interpret=DEV == "cpu",
        empty=lambda shape, *, dtype, device: nan_tensor(shape, dtype, device), tile_max=tmax,
    )  # fmt: skip


def check_select(scores, sk, *, s, r, budget, first=False):
    got = run_select(scores, sk, s=s, r=r, budget=budget, first=first)
    want = select_from_scores(scores, sk, s=s, r=r, budget=budget, first=first)
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.int32
    assert torch.equal(got[1], want[1]), f"counts differ: {got[1]} vs {want[1]}"
    assert torch.equal(got[0], want[0]), "selections differ"
    return got


def _scores(gen, rows, nb, kind):
    if kind == "ties":  # few distinct values: exact ties at the k-th place
        sc = torch.randint(0, 4, (rows, nb), generator=gen).float() * 0.5
    elif kind == "equal":
        sc = torch.full((rows, nb), 0.75)
    elif kind == "zeros":  # relu killed everything; -0.0 must tie with +0.0
        sc = torch.where(torch.rand(rows, nb, generator=gen) < 0.5, 0.0, -0.0)
    elif kind == "nan":  # NaN sorts above everything (torch.sort), ties among NaNs by index
        sc = torch.rand(rows, nb, generator=gen) * 3
        sc[torch.rand(rows, nb, generator=gen) < 0.1] = float("nan")
        sc[torch.rand(rows, nb, generator=gen) < 0.05] = float("inf")
    elif kind == "close":  # 1.0 plus 0..3 ulps: the keys differ in their lowest bits only
        ulps = torch.randint(0, 4, (rows, nb), generator=gen, dtype=torch.int32)
        sc = (torch.full((rows, nb), 1.0).view(torch.int32) + ulps).view(torch.float32)
    elif kind == "prefix":  # keys span [0x40000000, 0x41FFFFFF]: the key range's xor,
        # 0x01FFFFFF, rounds up to 2**25 in fp32 (the radix start over-estimates its top bit)
        bits = torch.randint(0x40000000, 0x42000000, (rows, nb), generator=gen, dtype=torch.int32)
        bits[:, 0], bits[:, -1] = 0x40000000, 0x41FFFFFF
        sc = bits.view(torch.float32)
    elif kind == "strided":  # the best blocks in few strided groups c = g (mod G): the radix
        # floor (least group maximum) lies far below the k-th key
        c = torch.arange(nb)
        sc = torch.rand(rows, nb, generator=gen) + 100.0 * (c % 16 == 0) + 10.0 * (c % 4 == 0)
    else:  # continuous, wide range
        sc = torch.rand(rows, nb, generator=gen) ** 3 * 1e3
    return sc.to(DEV)


_SELECT_GRID = [
    # b, s, r, budget, seqlens, first
    (2, 1, 8, 32, [100, 37], False),  # k = 4
    (3, 2, 4, 40, [9, 2, 70], False),  # rows with fewer complete blocks than k, zero blocks
    (1, 6, 16, 64, [95], False),  # S > 1 decode rows
    (2, 7, 4, 12, [6, 3], True),  # first prompt: padding rows (count 0)
    (1, 3, 1, 20, [40], False),  # r = 1
    (2, 2, 8, 6, [30, 60], False),  # budget < r: trailing tokens only
    (2, 1, 4, 400, [30, 70], False),  # budget > every block
    (1, 1, 2, 130, [600], False),  # k = 65 > 64, NB padded to 512
    (1, 1, 4, 80, [101], False),  # k = 20 < 25 complete blocks < KB_PAD = 32 groups
]


@interpret
@pytest.mark.parametrize(
    "kind", ["ties", "equal", "zeros", "nan", "close", "prefix", "strided", "rand"]
)
@pytest.mark.parametrize("b,s,r,budget,seqlens,first", _SELECT_GRID)
def test_select_equals_reference_rule(b, s, r, budget, seqlens, first, kind, method):
    _check_grid_case(31, 7, b, s, r, budget, seqlens, first, kind)


def _check_grid_case(seed_a, seed_b, b, s, r, budget, seqlens, first, kind):
    gen = torch.Generator().manual_seed(len(seqlens) * seed_a + s * seed_b + r + budget)
    nb = max(seqlens) // r + 2
    scores = _scores(gen, b * s, nb, kind)
    sk = torch.tensor(seqlens, dtype=torch.int32, device=DEV)
    check_select(scores, sk, s=s, r=r, budget=budget, first=first)


@interpret
@pytest.mark.parametrize(
    "options",
    [
        dict(EMIT_2D=True),
        dict(EMIT_2D=True, BLOCK_O=4096),
        dict(EMIT_2D=False, EARLY_SCORES=True),
        dict(ONE_SCAN=False),
        dict(PACKED_SCATTER=False),
    ],
)
@pytest.mark.parametrize("kind", ["ties", "rand"])
@pytest.mark.parametrize("b,s,r,budget,seqlens,first", _SELECT_GRID)
def test_select_options_equal_reference_rule(b, s, r, budget, seqlens, first, kind, options,
                                             method, monkeypatch):  # fmt: skip
    """``EMIT_2D`` (the chosen blocks' positions as one ``[KB_PAD, r]`` tile, then 1-D tiles
    of trailing tokens and -1), with the ids from registers and (BLOCK_O 4096, radix) from the
    scratch row; ``EARLY_SCORES`` (the row's scores loaded without waiting for seqlens, the
    invisible ones masked after the load); ``ONE_SCAN`` off (the radix scatter masked by
    ``chosen & (slot < k)``), ``PACKED_SCATTER`` off (the scatter's own pointers): the
    reference rule's outputs; rows with fewer blocks than k, k = 0, r = 1."""
    monkeypatch.setattr(select, "SELECT_DEFAULTS", dict(select.SELECT_DEFAULTS, **options))
    _check_grid_case(29, 5, b, s, r, budget, seqlens, first, kind)


def test_select_emit_ratio():
    """The 2-D emission applies to power-of-two ratios and tiles of <= EMIT_2D_MAX positions;
    a non-bool EMIT_2D is an error."""
    on = dict(EMIT_2D=True)
    assert select.emit_ratio(on, 64, 32) == 64 and select.emit_ratio(on, 1, 2) == 1
    assert select.emit_ratio(on, 48, 32) == 0 and select.emit_ratio({}, 64, 32) == 0
    assert select.emit_ratio(on, 64, 512) == 0  # 32K positions
    with pytest.raises(ValueError, match="EMIT_2D"):
        select.select_config(dict(EMIT_2D=1), 2048, interpret=False)


@interpret
@pytest.mark.parametrize("early", [False, True])
def test_select_never_reads_invisible_scores(method, early, monkeypatch):
    """Invisible blocks' scores (NaN here, -inf from the score kernel) do not matter, also
    when loaded (``EARLY_SCORES``)."""
    over = dict(select.SELECT_DEFAULTS, EARLY_SCORES=early)
    monkeypatch.setattr(select, "SELECT_DEFAULTS", over)
    gen = torch.Generator().manual_seed(5)
    r, budget, sk = 4, 16, torch.tensor([21, 10, 2], dtype=torch.int32, device=DEV)
    scores = _scores(gen, 3, 9, "ties")
    want = run_select(scores, sk, s=1, r=r, budget=budget, first=False)
    nc = torch.tensor([5, 2, 0], device=DEV)
    poisoned = torch.where(torch.arange(9, device=DEV)[None, :] < nc[:, None], scores, torch.nan)
    got = check_select(poisoned, sk, s=1, r=r, budget=budget)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[1].tolist() == [16 + 2, 8 + 3, 3]


@interpret
@pytest.mark.parametrize("first", [False, True])
def test_score_kernel_tile_maxima(first):
    """``indexer_scores_and_tiles(tile_max=n)``: per row and score program's tile of blocks, the
    largest select key of its visible blocks (-1: none), as ``tile_maxima`` computes from the
    same launch's scores; ragged rows, a row without a complete block, first-prompt padding
    rows, a partial last tile; the scores equal those of the launch without tile maxima."""
    iq, keys, sk = _int_case(3, b=3, s=4, ni=2, di=16, nb=37, seqlens=[150, 2, 90])
    kw = dict(num_index_heads=2, compress_ratio=4, scale=0.5, is_first_prompt=first)
    if first:
        sk = torch.tensor([3, 1, 2], dtype=torch.int32, device=DEV)
    scores, tmax = indexer.indexer_scores_and_tiles(iq, keys, sk, tile_max=3, **kw)
    assert indexer.indexer_scores_and_tiles(iq, keys, sk, tile_max=4, **kw)[1] is None
    block_b = indexer.score_config(3, 4, 2, 37, 132, DEV == "cpu")["BLOCK_B"]
    assert tmax.shape == (12, -(-37 // block_b)) and tmax.dtype == torch.int32
    want = tile_maxima(scores, sk, s=4, r=4, first=first, tile=block_b)
    assert torch.equal(tmax, want)
    assert (tmax == -1).any() and (tmax >= 0).any()
    assert torch.equal(scores, indexer.indexer_scores(iq, keys, sk, **kw))
    bad = dict(BLOCK_B=4, BLOCK_R=16, BLOCK_D=16, num_warps=4)  # tiles of half a run
    with pytest.raises(ValueError, match="BLOCK_B a multiple of 8, got 4"):
        indexer.indexer_scores_and_tiles(iq, keys, sk, tile_max=1, cfg=bad, **kw)


@interpret
def test_scores_for_select_asks_by_row_count(monkeypatch):
    """``scores_for_select`` asks ``wants_tile_max`` with the launch's B * S rows (the default
    floor takes no tile maxima above ``TILE_MAX_ROWS`` rows) and launches accordingly."""
    iq, keys, sk = _int_case(4, b=3, s=4, ni=2, di=16, nb=37, seqlens=[150, 2, 90])
    seen = []

    def spy(*args, **kw):
        seen.append(kw["rows"])
        return 3 if kw["rows"] <= 12 else 0

    monkeypatch.setattr(indexer, "wants_tile_max", spy)
    kw = dict(num_index_heads=2, compress_ratio=4, token_budget=16, scale=0.5,
              is_first_prompt=False)  # fmt: skip
    scores, tmax = indexer.scores_for_select(iq, keys, sk, **kw)
    assert seen == [12] and tmax is not None and tmax.shape[0] == 12
    _, tmax = indexer.scores_for_select(iq[:, :1].repeat(1, 5, 1), keys, sk, **kw)
    assert seen == [12, 15] and tmax is None


@interpret
def test_select_tile_max_argument():
    """``tile_max`` must be ``[rows, n_tiles]`` int32 with a contiguous last dim; the rank
    method takes it (``RANK_TILES``) when ``tiles_usable``, else keeps its groups floor (and
    by default runs at 2048 blocks only with tiles); the score launch is asked for tiles where
    the select may take them (``wants_tile_max``: the least usable count, else 0, also for
    launches of more than ``TILE_MAX_ROWS`` rows unless the cfg asks for "tiles"); an
    explicit ``RANK_FLOOR`` "tiles" without usable tiles is an error naming the count."""
    kw = dict(seq_len=1, num_blocks=1100, compress_ratio=16, token_budget=64,
              is_first_prompt=False)  # fmt: skip
    sc, sk = torch.rand(2, 1100), torch.tensor([600, 9], dtype=torch.int32)
    good = torch.zeros(2, 8, dtype=torch.int32)
    over = dict(select.SELECT_DEFAULTS, RANK_SELECT=True)
    *_, args = select.select_launch_args(sc, sk, tile_max=good, cfg=over, **kw)
    assert args["RANK_TILES"] == 8 and args["n_tiles"] == 8 and args["tmax_ptr"] is good
    assert args["RANK_G"] == 8  # folded into 2 * KB_PAD groups
    *_, args = select.select_launch_args(sc, sk, tile_max=good[:, :7], cfg=over, **kw)
    assert "RANK_TILES" not in args and args["RANK_G"] == 8  # 7 < 2 * KB_PAD: groups
    with pytest.raises(ValueError, match="got 7"):
        select.select_launch_args(sc, sk, tile_max=good[:, :7],
                                  cfg=dict(over, RANK_FLOOR="tiles"), **kw)  # fmt: skip
    *_, args = select.select_launch_args(sc, sk, tile_max=good, **kw)  # 2048: with tiles
    assert args["RANK_TILES"] == 8 and args["RANK_CAP"] == 8
    *_, args = select.select_launch_args(sc, sk, tile_max=good[:, :7], **kw)  # without: off
    assert "RANK_TILES" not in args and args["RANK_CAP"] == 0
    for bad in (good.long(), good[:1], good.t().contiguous().t(), good[0]):
        with pytest.raises(ValueError, match=r"tile_max must be \[2, n_tiles\] int32"):
            select.select_launch_args(sc, sk, tile_max=bad, cfg=over, **kw)
    want = select.wants_tile_max
    assert want(4096, 2048, 64) == 64 and want(2048, 2048, 64) == 64  # RANK_TILE_BLOCKS
    assert want(1025, 1024, 64) == 32 and want(8192, 2048, 64) == 0  # groups floor there
    assert want(16384, 2048, 64) == 0 and want(16385, 2048, 64) == 0  # (16385: > MAX_BLOCKS)
    assert want(8192, 2048, 64, cfg=dict(RANK_SELECT=True)) == 64
    assert want(4096, 2048, 64, cfg=dict(RANK_FLOOR="groups")) == 0
    assert want(4096, 2048, 64, cfg=dict(RANK_SELECT=False)) == 0
    assert want(4096, 8192, 64) == 0  # KB_PAD 128: radix steps
    assert want(4096, 32, 64) == 0 and want(0, 2048, 64) == 0  # no block to choose
    assert want(1000, 2048, 64) == 0  # tl.topk rows
    rows = select.TILE_MAX_ROWS
    assert want(4096, 2048, 64, rows=rows) == 64 and want(4096, 2048, 64, rows=rows + 1) == 0
    assert want(4096, 2048, 64, cfg=dict(RANK_FLOOR="tiles"), rows=rows + 1) == 64


@interpret
def test_select_no_blocks():
    """num_blocks == 0 or budget < r: no score tensor at all, only trailing tokens."""
    sk = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    idx, cnt = select.indexer_select(None, sk, seq_len=1, num_blocks=0, compress_ratio=4,
                                     token_budget=8, is_first_prompt=False)  # fmt: skip
    assert cnt.tolist() == [3, 1]
    assert idx.tolist() == [[0, 1, 2] + [-1] * 8, [0] + [-1] * 10]


def _int_case(seed, *, b, s, ni, di, nb, seqlens, lo=-2, hi=3):
    """Integer-valued query/keys: every dot and head sum is exact in fp32 (and ties abound)."""
    gen = torch.Generator().manual_seed(seed)
    iq = torch.randint(lo, hi, (b, s, ni * di), generator=gen).float()
    keys = torch.randint(lo, hi, (b, nb, di), generator=gen).float()
    sk = torch.tensor(seqlens, dtype=torch.int32)
    return iq.to(DEV), keys.to(DEV), sk.to(DEV)


def check_indexer(iq, keys, sk, **kw):
    got = sparse_attention_indexer(iq, keys, sk, backend="triton", **kw)
    want = sparse_attention_indexer(iq, keys, sk, backend="reference", **kw)
    assert torch.equal(got[1], want[1]), "counts differ"
    assert torch.equal(got[0], want[0]), "selections differ"
    return got


_E2E_GRID = [
    # b, s, ni, di, r, budget, seqlens, total_sequence_length
    (2, 1, 4, 16, 8, 32, [100, 37], None),
    (3, 4, 2, 16, 4, 24, [60, 3, 17], None),  # ragged: a row with no complete block
    (1, 9, 3, 16, 16, 64, [200], None),  # S > 1 prefill-style rows
    (2, 12, 2, 16, 4, 8, [11, 5], 12),  # first prompt with padding rows
    (2, 3, 1, 32, 1, 5, [20, 9], None),  # r = 1
]


@interpret
@pytest.mark.parametrize("b,s,ni,di,r,budget,seqlens,total", _E2E_GRID)
def test_triton_tier_equals_reference(b, s, ni, di, r, budget, seqlens, total):
    nb = max(seqlens) // r + 1
    iq, keys, sk = _int_case(b + s + r, b=b, s=s, ni=ni, di=di, nb=nb, seqlens=seqlens)
    check_indexer(iq, keys, sk, compress_ratio=r, token_budget=budget, scale=0.5,
                  total_sequence_length=total)  # fmt: skip


@interpret
def test_triton_tier_all_scores_tie():
    """Zero query: every score is 0 (relu of -0.0 / +0.0): the lowest blocks win."""
    iq, keys, sk = _int_case(3, b=2, s=2, ni=2, di=16, nb=12, seqlens=[90, 41])
    idx, cnt = check_indexer(iq * 0, keys, sk, compress_ratio=8, token_budget=24)
    assert idx[0, :24].tolist() == list(range(24))


@interpret
def test_fallback_path_matches(monkeypatch):
    """Rows beyond select.MAX_BLOCKS keep the torch top-k path; both paths agree."""
    iq, keys, sk = _int_case(9, b=2, s=3, ni=2, di=16, nb=20, seqlens=[70, 33])
    kw = dict(compress_ratio=4, token_budget=12, scale=0.5)
    fused = check_indexer(iq, keys, sk, **kw)
    monkeypatch.setattr(indexer, "MAX_BLOCKS", 16)  # 20 blocks pad to 32 > 16
    assert not indexer.select_supported(20)
    old = check_indexer(iq, keys, sk, **kw)
    assert torch.equal(fused[0], old[0]) and torch.equal(fused[1], old[1])


# ---------------------------------------------------------------------------------------------
# GPU: real sizes (T = 64K / 256K, r = 64, budget 2048 -> k = 32; budget 8192 -> k = 128).


@gpu
@pytest.mark.parametrize("t", [65536, 262144, 1048512])  # 1048512: 16384 blocks (MAX_BLOCKS)
@pytest.mark.parametrize("b,s", [(1, 1), (4, 1), (2, 8)])
@pytest.mark.parametrize("budget", [2048, 8192])
def test_gpu_select_real_sizes(t, b, s, budget, method):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    r = 64
    gen = torch.Generator().manual_seed(t + b + s)
    seqlens = [t - 1, t // 3, 100, t - 64][:b]
    sk = torch.tensor(seqlens, dtype=torch.int32, device=DEV)
    nb = t // r + 1
    for kind in ("rand", "ties", "nan", "equal"):
        scores = _scores(gen, b * s, nb, kind)
        check_select(scores, sk, s=s, r=r, budget=budget)


@gpu
@pytest.mark.parametrize("t", [65536, 262144])
@pytest.mark.parametrize("b,s", [(1, 1), (2, 8)])
@pytest.mark.parametrize("budget", [2048, 8192])
def test_gpu_select_1d_emission_real_sizes(t, b, s, budget, monkeypatch):
    """The 1-D emission (EMIT_2D off, no longer the default; 4096-wide tiles from 4096 blocks
    on) still matches the reference rule."""
    monkeypatch.setattr(select, "SELECT_DEFAULTS", dict(select.SELECT_DEFAULTS, EMIT_2D=False))
    gen = torch.Generator().manual_seed(t + b + s + 1)
    sk = torch.tensor([t - 1, t // 3][:b], dtype=torch.int32, device=DEV)
    for kind in ("rand", "ties"):
        check_select(_scores(gen, b * s, t // 64 + 1, kind), sk, s=s, r=64, budget=budget)


@gpu
@pytest.mark.parametrize("t", [65536, 262144])
def test_gpu_indexer_real_sizes(t):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    r, budget = 64, 2048
    seqlens = [t - 1, t // 3, 100, t - 64]
    iq, keys, sk = _int_case(t, b=4, s=2, ni=16, di=128, nb=t // r + 1, seqlens=seqlens)
    check_indexer(iq, keys, sk, compress_ratio=r, token_budget=budget, scale=0.125)
    iq = iq.to(torch.bfloat16)  # integers: exact in bf16 too
    check_indexer(iq, keys, sk, compress_ratio=r, token_budget=budget, scale=0.125)


@gpu
def test_gpu_indexer_cuda_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    t, r, budget = 131072, 64, 2048
    iq, keys, sk = _int_case(1, b=1, s=1, ni=16, di=128, nb=t // r + 1, seqlens=[t - 1])
    kw = dict(compress_ratio=r, token_budget=budget, scale=0.125, backend="triton")
    want = sparse_attention_indexer(iq, keys, sk, **kw)  # warm-up (compile) outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = sparse_attention_indexer(iq, keys, sk, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@interpret
def test_triton_tier_validate_false_out_of_range_seqlens():
    """validate=False, a length past index_block_keys' end: the Triton tier scores only the
    blocks that exist and selects what the reference selects (no out-of-bounds read)."""
    iq, keys, _ = _int_case(9, b=2, s=2, ni=2, di=16, nb=6, seqlens=[0, 0])
    sk = torch.tensor([500, 30], dtype=torch.int32, device=DEV)  # 6 blocks of 8 hold 47
    kw = dict(compress_ratio=8, token_budget=24, validate=False)
    got = sparse_attention_indexer(iq, keys, sk, backend="triton", **kw)
    want = sparse_attention_indexer(iq, keys, sk, backend="reference", **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[1].tolist()[:2] == [24 + 7, 24 + 7]  # 3 blocks + the trailing 7 positions


@interpret
def test_triton_tier_scores_only_blocks_below_total():
    """A block-key cache sized for a longer context (40 blocks) with total_sequence_length 100
    (12 blocks of 8): the Triton tier equals the reference, with a 16-wide select tile."""
    iq, keys, _ = _int_case(12, b=2, s=3, ni=2, di=16, nb=40, seqlens=[0, 0])
    sk = torch.tensor([99, 57], dtype=torch.int32, device=DEV)
    check_indexer(iq, keys, sk, compress_ratio=8, token_budget=40, scale=0.5,
                  total_sequence_length=100)  # fmt: skip


def test_score_config_fills_one_wave():
    """The score kernel's tile rule (H200 sweeps in indexer.score_config's docstring): one
    token's 16 (row, head) pairs in 16-row dots over 32-block tiles; beyond that 32-row dots,
    the smallest key tile whose grid fits one wave, over 32 // NI rows per program for 2..16
    new tokens (4 warps; prefill 2); split3 tensor-core dots."""
    from longattn.sparse.triton.indexer import score_config

    cfg = score_config(1, 1, 16, 2048, 132, interpret=False)
    assert cfg == dict(BLOCK_B=32, BLOCK_R=16, BLOCK_D=128, num_warps=4, DOT_PREC="split3")
    assert score_config(4, 1, 16, 4096, 132, interpret=False)["BLOCK_B"] == 32  # any grid
    # 2..16 new tokens: 2 rows (32 pairs) per program, 4 x 32 tiles of 64 blocks <= 132
    cfg = score_config(1, 8, 16, 2048, 132, interpret=False)
    assert cfg == dict(BLOCK_B=64, BLOCK_R=32, BLOCK_D=32, num_warps=4, S_TILE=2,
                       DOT_PREC="split3")  # fmt: skip
    assert score_config(1, 8, 16, 512, 132, interpret=False)["BLOCK_B"] == 16  # 4 x 32 tiles
    assert score_config(1, 3, 32, 2048, 132, interpret=False)["S_TILE"] == 1
    prefill = score_config(1, 64, 16, 2048, 132, interpret=False)
    assert prefill["S_TILE"] == 16 and prefill["num_warps"] == 2
    assert score_config(1, 1, 32, 2048, 132, interpret=False)["BLOCK_R"] == 32  # 32 pairs


@pytest.mark.parametrize(
    "cfg,match",
    [
        (dict(RADIX_BITS=5), "RADIX_BITS"),
        (dict(RADIX_BITS=1), "RADIX_BITS"),
        (dict(BLOCK_O=100), "BLOCK_O"),
        (dict(BLOCK_O=8), "BLOCK_O"),
        (dict(BLOCK=64), "unknown keys"),
        (dict(EARLY_SCORES=1), "EARLY_SCORES"),
        (dict(ONE_SCAN=None), "ONE_SCAN"),
        (dict(PACKED_SCATTER=1), "PACKED_SCATTER"),
        (dict(RANK_SELECT="rank"), "RANK_SELECT"),
        (dict(RANK_SELECT=1), "RANK_SELECT"),
        (dict(RANK_CAP_MULT=3), "RANK_CAP_MULT"),
        (dict(RANK_CAP_MULT=True), "RANK_CAP_MULT"),
        (dict(RANK_FLOOR="rows"), "RANK_FLOOR"),
        (dict(RANK_TILE_FOLD=True), "unknown keys"),
    ],
)
def test_select_config_errors(cfg, match):
    with pytest.raises(ValueError, match=match):
        select.select_config(cfg, 2048, interpret=False)


def test_select_config_defaults():
    assert select.select_config(None, 2048, interpret=False) == dict(
        select.SELECT_DEFAULTS, BLOCK_O=1024, num_warps=select.select_num_warps(2048)
    )
    assert select.SELECT_DEFAULTS["EMIT_2D"] is True
    assert select.SELECT_DEFAULTS["ONE_SCAN"] is True
    assert select.SELECT_DEFAULTS["PACKED_SCATTER"] is True
    # the 2-D emission leaves only the tail to 1-D tiles: 1024 wide at every size
    assert select.select_config(None, 4096, interpret=False)["BLOCK_O"] == 1024
    wide = select.select_config(dict(EMIT_2D=False), 4096, interpret=False)
    assert wide["BLOCK_O"] == 4096
    assert select.select_config(dict(EMIT_2D=False), 2048, interpret=False)["BLOCK_O"] == 1024
    assert select.select_config(None, 4096, interpret=True)["BLOCK_O"] == 256
    assert select.select_config(dict(num_warps=2), 64, interpret=True)["num_warps"] == 2


def test_select_rank_geometry():
    """``(RANK_G, RANK_CAP, RANK_CROSS, RANK_TILES)``: the rank floor over 2 * KB_PAD strided
    groups (``RANK_FLOOR`` "cross": NB_PAD / (2 * KB_PAD) columns; None: the given tile maxima
    when there are 2 * KB_PAD to RANK_MAX_TILES of them) and RANK_CAP_MULT * KB_PAD candidates
    (capped by the row); by default (None) at RANK_DEFAULT_BLOCKS; never for tl.topk rows or
    budgets above RANK_MAX_KB_PAD."""
    geo = select.rank_geometry
    auto = dict(RANK_SELECT=None, RANK_CAP_MULT=2, RANK_FLOOR=None)
    on = dict(auto, RANK_SELECT=True)
    assert (
        select.RANK_DEFAULT_BLOCKS == (4096, 8192, 16384)
        and select.SELECT_DEFAULTS["RANK_SELECT"] is None
    )
    assert select.SELECT_DEFAULTS["RANK_FLOOR"] is None
    assert geo(auto, False, 32, 4096) == (64, 64, False, 0)
    assert geo(auto, False, 32, 4096, 128) == (64, 64, False, 128)  # the score launch's tiles
    assert geo(auto, False, 32, 4096, 63) == (64, 64, False, 0)  # too few tiles: groups
    assert geo(auto, False, 32, 4096, 1025) == (64, 64, False, 0)  # too many to load
    assert geo(on, False, 32, 2048, 100) == (64, 64, False, 128)  # padded to a power of two
    assert geo(on, False, 8, 2048, 1000) == (16, 16, False, 1024)
    assert geo(dict(auto, RANK_FLOOR="groups"), False, 32, 4096, 128) == (64, 64, False, 0)
    with pytest.raises(ValueError, match="64 to 1024 tile maxima per row, got 0"):
        geo(dict(on, RANK_FLOOR="tiles"), False, 32, 4096)
    assert geo(auto, False, 32, 16384) == (64, 64, False, 0)  # 8192 / 16384: H100 session 35
    assert geo(auto, False, 32, 8192, 256) == (64, 64, False, 256)
    assert geo(auto, False, 32, 2048) == (0, 0, False, 0)  # lost at 2048 (H100, session 31)
    assert geo(auto, False, 32, 2048, 64) == (64, 64, False, 64)  # ... but not with tiles
    assert select.RANK_TILE_BLOCKS == (2048, 4096)
    assert geo(on, False, 32, 2048) == (64, 64, False, 0)
    assert geo(dict(on, RANK_CAP_MULT=4), False, 32, 2048) == (64, 128, False, 0)
    assert geo(on, False, 16, 16) == (16, 16, False, 0)
    assert geo(dict(on, RANK_FLOOR="cross"), False, 32, 4096, 128) == (64, 64, True, 0)
    assert geo(dict(on, RANK_FLOOR="cross"), False, 32, 2048) == (32, 64, True, 0)
    assert geo(dict(on, RANK_FLOOR="cross"), False, 16, 16) == (1, 16, True, 0)
    assert geo(dict(auto, RANK_SELECT=False), False, 32, 4096, 128) == (0, 0, False, 0)
    assert geo(on, True, 32, 1024) == (0, 0, False, 0)
    assert geo(auto, False, 64, 4096, 128) == (0, 0, False, 0)


@pytest.mark.parametrize("first", [False, True])
def test_select_early_scores_default(first):
    """``EARLY_SCORES`` None (the default): on unless the rows are a first prompt's."""
    *_, args = select.select_launch_args(
        torch.rand(2, 40), torch.tensor([600, 9], dtype=torch.int32), seq_len=1, num_blocks=40,
        compress_ratio=16, token_budget=64, is_first_prompt=first,
    )  # fmt: skip
    assert args["EARLY_SCORES"] is (not first)


def test_select_clocks_argument():
    """``clocks`` (the select's profiling build) must be ``[rows, CLOCK_MARKS]`` int64 on the
    scores' device; it switches the build's ``CLOCKS`` on, and its absence leaves the kernel's
    default build. The error states the expected shape in plain numbers."""
    kw = dict(seq_len=1, num_blocks=40, compress_ratio=16, token_budget=64, is_first_prompt=False)
    sc, sk = torch.rand(2, 40), torch.tensor([600, 9], dtype=torch.int32)
    *_, args = select.select_launch_args(sc, sk, **kw)
    assert "clk_ptr" not in args and "CLOCKS" not in args
    marks = torch.zeros(2, select.CLOCK_MARKS, dtype=torch.int64)
    *_, args = select.select_launch_args(sc, sk, clocks=marks, **kw)
    assert args["CLOCKS"] is True and args["clk_ptr"] is marks
    bads = [torch.zeros(2, 4, dtype=torch.int64), marks.to(torch.int32), marks[:1]]
    bads.append(torch.zeros(2, select.CLOCK_MARKS, dtype=torch.int64, device="meta"))
    for bad in bads:
        with pytest.raises(ValueError, match=r"clocks must be \[2, 5\] int64 on cpu"):
            select.select_launch_args(sc, sk, clocks=bad, **kw)


@gpu
@pytest.mark.parametrize("t", [32768, 262144])  # 513 blocks: TOPK; 4097: radix
def test_gpu_select_clocks_build(t):
    """The profiling build selects exactly as the default one and writes ordered phase marks
    (radix rows: start <= bounds <= radix <= chosen <= end; TOPK rows: start <= end, 0 between)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(t)
    sk = torch.tensor([t - 1, t // 3], dtype=torch.int32, device=DEV)
    kw = dict(seq_len=1, num_blocks=t // 64 + 1, compress_ratio=64, token_budget=2048,
              is_first_prompt=False)  # fmt: skip
    scores = _scores(gen, 2, t // 64 + 1, "rand").to(DEV)
    marks = torch.zeros(2, select.CLOCK_MARKS, dtype=torch.int64, device=DEV)
    got = select.indexer_select(scores, sk, clocks=marks, **kw)
    want = select.indexer_select(scores, sk, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    m = marks.cpu()
    assert bool((m[:, 0] > 0).all()) and bool((m[:, -1] >= m[:, 0]).all()), m
    if t // 64 + 1 > select.TOPK_MAX_BLOCKS:
        assert bool((m[:, 1:].diff(dim=1) >= 0).all() & (m[:, 1] >= m[:, 0]).all()), m
    else:
        assert bool((m[:, 1:-1] == 0).all()), m
