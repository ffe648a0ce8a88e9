"""SparseAttentionIndexer (QSA selection) vs a brute-force fp64 scorer written here, and the
incremental IndexBlockKeyCache vs from-scratch block keys."""

from __future__ import annotations

import random

import pytest
import torch

from longattn._rotary import rope_cache
from longattn.sparse import IndexBlockKeyCache, index_block_keys_from_keys, sparse_attention_indexer

TIERS = ("reference", "chunked")


def brute_force(index_query, block_keys, seqlens_k, *, r, budget, scale, first_prompt):
    """Plain python/fp64 QSA: (list of selected position lists, list of k-th score margins)."""
    b, s, d = index_query.shape
    di = block_keys.shape[-1]
    ni = d // di
    q = index_query.double().reshape(b, s, ni, di)
    keys = block_keys.double()
    rows, margins = [], []
    for i in range(b):
        total = int(seqlens_k[i]) + 1
        for j in range(s):
            qpos = j if first_prompt else total - s + j
            if qpos >= total or qpos < 0:
                rows.append([])
                margins.append(float("inf"))
                continue
            complete = (qpos + 1) // r
            scored = []
            for c in range(complete):
                sc = scale * sum(max(0.0, float(q[i, j, hh] @ keys[i, c])) for hh in range(ni))
                scored.append((-sc, c))
            scored.sort()  # score descending, then lower block index
            k = min(budget // r, complete)
            chosen = sorted(c for _, c in scored[:k])
            margin = float("inf")
            if 0 < k < complete:
                margin = scored[k][0] - scored[k - 1][0]  # >= 0
            margins.append(margin)
            tokens = [c * r + t for c in chosen for t in range(r)]
            tokens += list(range(complete * r, qpos + 1))
            rows.append(tokens)
    return rows, margins


def check_against_brute(idx, cnt, rows, margins, *, max_selected, tol=1e-4):
    assert idx.dtype == torch.int32 and cnt.dtype == torch.int32
    assert idx.shape == (len(rows), max_selected) and cnt.shape == (len(rows),)
    for r, (want, margin) in enumerate(zip(rows, margins)):
        got = idx[r, : int(cnt[r])].tolist()
        assert (idx[r, int(cnt[r]) :] == -1).all(), f"row {r}: padding not -1"
        if margin < tol:  # a near-tie at the budget boundary: fp32 may order it either way
            assert len(got) == len(want)
            continue
        assert got == want, f"row {r}: got {got} want {want}"


def _case(seed, *, b, s, ni, di, nb, seqlens, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    iq = torch.randn(b, s, ni * di, generator=gen).to(dtype)
    keys = torch.randn(b, nb, di, generator=gen)
    return iq, keys, torch.tensor(seqlens, dtype=torch.int32)


_GRID = [
    # b, s, ni, di, r, budget, seqlens
    (2, 1, 4, 32, 8, 32, [100, 37]),
    (1, 8, 8, 64, 16, 64, [255]),
    (2, 5, 2, 16, 4, 10, [50, 9]),  # budget not a multiple of r
    (3, 1, 1, 32, 64, 256, [1000, 63, 5]),
    (1, 16, 16, 32, 1, 20, [40]),  # r = 1: no trailing block
    (2, 3, 4, 32, 8, 4, [30, 60]),  # budget < r: only trailing tokens
]


@pytest.mark.parametrize("b,s,ni,di,r,budget,seqlens", _GRID)
@pytest.mark.parametrize("backend", TIERS)
def test_selection_matches_brute_force(b, s, ni, di, r, budget, seqlens, backend):
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    nb = max(seqlens) // r + 2
    iq, keys, sk = _case(seed, b=b, s=s, ni=ni, di=di, nb=nb, seqlens=seqlens)
    idx, cnt = sparse_attention_indexer(
        iq, keys, sk, compress_ratio=r, token_budget=budget, backend=backend
    )
    rows, margins = brute_force(
        iq, keys, sk, r=r, budget=budget, scale=di**-0.5, first_prompt=False
    )
    check_against_brute(idx, cnt, rows, margins, max_selected=budget + r - 1)


@pytest.mark.parametrize("backend", TIERS)
def test_first_prompt_padding_rows_and_bf16_query(backend):
    iq, keys, sk = _case(1, b=2, s=40, ni=4, di=32, nb=6, seqlens=[39, 20], dtype=torch.bfloat16)
    idx, cnt = sparse_attention_indexer(
        iq,
        keys,
        sk,
        compress_ratio=8,
        token_budget=16,
        total_sequence_length=40,
        scale=0.3,
        backend=backend,
    )
    rows, margins = brute_force(iq, keys, sk, r=8, budget=16, scale=0.3, first_prompt=True)
    check_against_brute(idx, cnt, rows, margins, max_selected=23)
    assert (cnt[40 + 21 :] == 0).all()  # padding rows of the second sequence


@pytest.mark.parametrize("backend", TIERS)
def test_ties_go_to_the_lower_block(backend):
    di, r = 16, 4
    e0 = torch.zeros(di)
    e0[0] = 1.0
    keys = -e0.repeat(1, 10, 1)  # relu -> score 0
    keys[0, [2, 7]] = 2 * e0  # best pair (tie)
    keys[0, [5, 8]] = e0  # second pair (tie)
    q = torch.stack((e0, 3 * e0)).reshape(1, 1, 2 * di)  # two indexer heads
    sk = torch.tensor([39], dtype=torch.int32)  # qpos 39: 10 complete blocks, no trailing

    def chosen(budget, query=q):
        idx, cnt = sparse_attention_indexer(
            query, keys, sk, compress_ratio=r, token_budget=budget, backend=backend
        )
        toks = idx[0, : cnt[0]].tolist()
        assert toks == sorted(toks) and len(toks) % r == 0
        return sorted({t // r for t in toks})

    assert chosen(4) == [2]
    assert chosen(8) == [2, 7]
    assert chosen(12) == [2, 5, 7]
    assert chosen(20) == [0, 2, 5, 7, 8]  # then the zero-score blocks, lowest first
    assert chosen(12, q * 0) == [0, 1, 2]  # all scores zero: the first blocks win


@pytest.mark.parametrize("backend", TIERS)
def test_hand_checked_trailing_block(backend):
    # one sequence, total 11 -> qpos 10 (decode): complete blocks 0, 1 (r = 4), trailing 8, 9, 10
    keys = torch.zeros(1, 3, 2)
    keys[0, 0] = torch.tensor([1.0, 0.0])
    keys[0, 1] = torch.tensor([0.0, 1.0])
    keys[0, 2] = torch.tensor([5.0, 5.0])  # incomplete block: never scored
    q = torch.tensor([[[0.2, 0.9]]])
    sk = torch.tensor([10], dtype=torch.int32)
    idx, cnt = sparse_attention_indexer(
        q, keys, sk, compress_ratio=4, token_budget=4, backend=backend
    )
    assert cnt.tolist() == [7]
    assert idx.tolist() == [[4, 5, 6, 7, 8, 9, 10]]


def test_chunked_tiny_chunks_equal_reference(monkeypatch):
    import longattn.sparse.chunked as ch

    iq, keys, sk = _case(2, b=2, s=7, ni=4, di=16, nb=40, seqlens=[150, 90])
    want = sparse_attention_indexer(
        iq, keys, sk, compress_ratio=4, token_budget=24, backend="reference"
    )
    monkeypatch.setattr(ch, "_ELEMS", 100)
    got = sparse_attention_indexer(
        iq, keys, sk, compress_ratio=4, token_budget=24, backend="chunked"
    )
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---------------------------------------------------------------------------------------------
# Block keys.


def _plain_block_keys(keys, r, w, cos, sin, eps):
    """fp64, one block at a time: mean -> RMSNorm -> split-half RoPE at the first position."""
    b, t, d = keys.shape
    out = torch.zeros(b, t // r, d, dtype=torch.float64)
    half = cos.shape[1]
    for i in range(b):
        for c in range(t // r):
            m = keys[i, c * r : c * r + r].double().mean(0)
            y = m / torch.sqrt(m.square().mean() + eps) * w.double()
            co, si = cos[c * r].double(), sin[c * r].double()
            x1, x2 = y[:half].clone(), y[half : 2 * half].clone()
            y[:half], y[half : 2 * half] = x1 * co - x2 * si, x2 * co + x1 * si
            out[i, c] = y
    return out


def test_block_keys_incremental_equals_from_scratch():
    gen = torch.Generator().manual_seed(3)
    b, t, d, r = 2, 70, 32, 8
    keys = torch.randn(b, t, d, generator=gen).to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(d, generator=gen)
    cos, sin = rope_cache(128, 24)  # partial rotary: 24 of 32 channels
    scratch = index_block_keys_from_keys(
        keys, compress_ratio=r, norm_weight=w, cos_cache=cos, sin_cache=sin
    )
    assert scratch.dtype == torch.float32 and scratch.shape == (b, t // r, d)
    plain = _plain_block_keys(keys, r, w, cos, sin, 1e-6)
    torch.testing.assert_close(scratch.double(), plain, rtol=1e-5, atol=1e-5)
    cache = IndexBlockKeyCache(
        b, 80, d, compress_ratio=r, norm_weight=w, cos_cache=cos, sin_cache=sin
    )
    pos = 0
    for step in (1, 5, 2, 17, 1, 1, 30, 13):  # prefill chunks across block boundaries, decodes
        cache.append(keys[:, pos : pos + step])
        pos += step
        done = pos // r
        assert cache.complete_blocks().tolist() == [done, done]
        torch.testing.assert_close(
            cache.block_keys[:, :done], scratch[:, :done], rtol=1e-5, atol=1e-6
        )
    assert pos == t


def test_block_keys_ragged_append():
    gen = torch.Generator().manual_seed(4)
    d, r = 16, 4
    keys = torch.randn(2, 30, d, generator=gen)
    cache = IndexBlockKeyCache(2, 32, d, compress_ratio=r)
    cache.append(
        torch.cat((keys[:, :10], torch.full((2, 3, d), float("nan"))), 1),
        num_new=torch.tensor([10, 7]),
    )
    cache.append(torch.stack((keys[0, 10:15], keys[1, 7:12])), num_new=torch.tensor([5, 5]))
    assert cache.lengths.tolist() == [15, 12]
    want0 = index_block_keys_from_keys(keys[:1, :15], compress_ratio=r)
    want1 = index_block_keys_from_keys(keys[1:, :12], compress_ratio=r)
    torch.testing.assert_close(cache.block_keys[0, :3], want0[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache.block_keys[1, :3], want1[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="max_tokens"):
        cache.append(keys[:, :20])


def test_indexer_reads_the_cache_end_to_end():
    """Block keys from the cache, index query planted on one block: that block is chosen."""
    gen = torch.Generator().manual_seed(5)
    d, r = 32, 8
    raw = torch.randn(1, 200, d, generator=gen)
    cache = IndexBlockKeyCache(1, 256, d, compress_ratio=r)
    cache.append(raw)
    target = cache.block_keys[0, 11].clone()
    q = torch.stack((target, target + 0.1 * torch.randn(d, generator=gen)))[None, None].reshape(
        1, 1, 2 * d
    )
    idx, cnt = sparse_attention_indexer(
        q,
        cache.block_keys,
        torch.tensor([199], dtype=torch.int32),
        compress_ratio=r,
        token_budget=8,
    )
    assert idx[0, : cnt[0]].tolist() == list(range(88, 96))


# ---------------------------------------------------------------------------------------------
# Bad input and torch-native.


@pytest.mark.parametrize(
    "change,exc,msg",
    [
        (dict(index_query=torch.randn(1, 1, 20)), ValueError, "index_query.shape"),
        (dict(index_query=torch.randn(1, 20)), ValueError, "index_query"),
        (dict(index_block_keys=torch.randn(2, 10, 16)), ValueError, "index_block_keys"),
        (dict(index_block_keys=torch.randn(1, 2, 16)), ValueError, "seqlens_k"),
        (dict(seqlens_k=torch.tensor([30])), TypeError, "seqlens_k"),
        (dict(compress_ratio=0), ValueError, "compress_ratio"),
        (dict(token_budget=-3), ValueError, "token_budget"),
        (dict(scale=-1.0), ValueError, "scale"),
        (dict(scale=True), ValueError, "scale must be a finite"),
        (dict(scale=False), ValueError, "scale must be a finite"),
        (dict(total_sequence_length=1000), ValueError, "total_sequence_length"),
        (dict(backend="cuda"), ValueError, "backend"),
        (  # the Triton kernels read seqlens_k[b] at ptr + b
            dict(
                index_query=torch.randn(2, 1, 32),
                index_block_keys=torch.randn(2, 10, 16),
                seqlens_k=torch.tensor([30, 0, 22, 0], dtype=torch.int32)[::2],
            ),
            ValueError,
            "seqlens_k must be contiguous",
        ),
    ],
)
def test_bad_input_names_the_argument(change, exc, msg):
    kw = dict(
        index_query=torch.randn(1, 1, 32),
        index_block_keys=torch.randn(1, 10, 16),
        seqlens_k=torch.tensor([30], dtype=torch.int32),
        compress_ratio=4,
        token_budget=8,
    )
    kw.update(change)
    with pytest.raises(exc, match=msg):
        sparse_attention_indexer(**kw)


def test_explicit_triton_raises():
    # index_head_dim 8 is outside the triton kernel's range: the gate names it.
    with pytest.raises(RuntimeError, match="index_head_dim 8 is not implemented"):
        sparse_attention_indexer(
            torch.randn(1, 1, 8),
            torch.randn(1, 4, 8),
            torch.tensor([9], dtype=torch.int32),
            compress_ratio=4,
            token_budget=4,
            backend="triton",
        )


def test_opcheck_and_compile():
    from longattn.sparse.indexer import _indexer_op

    iq, keys, sk = _case(6, b=2, s=3, ni=2, di=16, nb=12, seqlens=[40, 20])
    torch.library.opcheck(_indexer_op, (iq, keys, sk, 2, 4, 12, 0.25, False, "chunked"))

    def f(q, k, s):
        return sparse_attention_indexer(
            q, k, s, compress_ratio=4, token_budget=12, total_sequence_length=41
        )

    want = f(iq, keys, sk)
    got = torch.compile(f, fullgraph=True)(iq, keys, sk)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("backend", TIERS)
def test_validate_false_out_of_range_seqlens_stays_in_bounds(backend):
    """validate=False: no host read of seqlens_k; a length past index_block_keys' end selects
    among the blocks that exist (no out-of-bounds read), validate=True still raises."""
    iq, keys, _ = _case(3, b=2, s=1, ni=4, di=32, nb=5, seqlens=[0, 0])
    sk = torch.tensor([400, 12], dtype=torch.int32)  # 5 blocks of 8 hold 39 positions
    kw = dict(compress_ratio=8, token_budget=16, backend=backend)
    with pytest.raises(ValueError, match="seqlens_k must lie"):
        sparse_attention_indexer(iq, keys, sk, **kw)
    idx, cnt = sparse_attention_indexer(iq, keys, sk, validate=False, **kw)
    assert idx.shape == (2, 16 + 7) and cnt.shape == (2,)
    chosen = idx[0, :16]  # two whole blocks, both among the 5 that exist
    assert ((chosen >= 0) & (chosen < 40)).all()
    want = sparse_attention_indexer(iq[1:], keys[1:], sk[1:], **kw)
    assert torch.equal(idx[1], want[0][0]) and torch.equal(cnt[1], want[1][0])


@pytest.mark.parametrize("backend", TIERS)
def test_total_sequence_length_bounds_the_scored_blocks(backend):
    """Blocks at or past total_sequence_length // r are never scored: seqlens_k beyond the
    total raises with validate=True, and without validation only blocks < total // r can be
    chosen even when the later (larger-scored) blocks would be visible to the claimed length."""
    iq, keys, _ = _case(4, b=1, s=1, ni=2, di=16, nb=12, seqlens=[0])
    keys[:, 5:] = iq.view(2, 16).sum(0) * 10  # blocks 5.. would win every score
    sk = torch.tensor([90], dtype=torch.int32)  # 11 complete blocks of 8 visible to qpos 90
    kw = dict(compress_ratio=8, token_budget=16, total_sequence_length=41, backend=backend)
    with pytest.raises(ValueError, match="total_sequence_length = 41"):
        sparse_attention_indexer(iq, keys, sk, **kw)
    idx, cnt = sparse_attention_indexer(iq, keys, sk, validate=False, **kw)
    chosen = idx[0, :16]
    assert ((chosen >= 0) & (chosen < 5 * 8)).all(), chosen  # total // r = 5 blocks
    free = sparse_attention_indexer(iq, keys, sk, compress_ratio=8, token_budget=16,
                                    backend=backend)  # fmt: skip
    assert (free[0][0, :16] >= 5 * 8).all()  # without the bound the late blocks win


def test_block_keys_need_rotary_rows_for_every_block():
    keys = torch.randn(1, 64, 16)
    cos, sin = rope_cache(10, 8)  # block 15 starts at position 60
    with pytest.raises(ValueError, match="cos_cache/sin_cache have 10 rows"):
        index_block_keys_from_keys(keys, compress_ratio=4, cos_cache=cos, sin_cache=sin)
    with pytest.raises(ValueError, match="cos_cache/sin_cache have 10 rows"):
        IndexBlockKeyCache(1, 64, 16, compress_ratio=4, cos_cache=cos, sin_cache=sin)
    cos, sin = rope_cache(61, 8)  # exactly enough
    index_block_keys_from_keys(keys, compress_ratio=4, cos_cache=cos, sin_cache=sin)
    with pytest.raises(ValueError, match="rotary_offset must be a non-negative int"):
        index_block_keys_from_keys(
            keys, compress_ratio=4, cos_cache=cos, sin_cache=sin, rotary_offset=-2
        )


@pytest.mark.parametrize("backend", TIERS)
def test_nan_block_score_ranks_first(backend):
    """A NaN block score ranks above every number (torch.sort's order), in every tier."""
    gen = torch.Generator().manual_seed(3)
    kb = torch.randn(1, 12, 16, generator=gen)
    kb[0, 7] = float("nan")
    q = torch.randn(1, 1, 32, generator=gen)
    sl = torch.tensor([44], dtype=torch.int32)
    idx, cnt = sparse_attention_indexer(q, kb, sl, compress_ratio=4, token_budget=12,
                                        backend=backend)  # fmt: skip
    ref, _ = sparse_attention_indexer(q, kb, sl, compress_ratio=4, token_budget=12,
                                      backend="reference")  # fmt: skip
    assert torch.equal(idx, ref)
    chosen = idx[0, : cnt[0]].tolist()
    assert set(range(28, 32)) <= set(chosen)  # block 7 (the NaN) is chosen
    assert chosen == sorted(chosen) and max(chosen) <= 44
