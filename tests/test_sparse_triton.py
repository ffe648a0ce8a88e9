"""Triton tier of DynamicSparseAttention and SparseAttentionIndexer.

Truth: the reference tier run on fp64 inputs (caches dequantized). Baseline (for
``assert_close_to_fp64``): a same-precision torch computation written here (``lowp_dsa``): the
shared fp32 prologue, Q rounded once to the tier's Q dtype, fp32 logits and softmax, P rounded
to the V dtype, fp32 P.V. Every buffer the tier allocates is NaN-poisoned and cache rows past
each sequence hold NaN (int8: -128), so an unwritten output or a stray read shows. Indexer
selections must equal the reference tier's exactly (same sets, same tie rule).

``-m interpret``: tiny shapes, fp16/fp32 data (CPU, TRITON_INTERPRET=1). ``-m gpu``: real
shapes (bf16 included), run on the GPU machine.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

from longattn import _triton_merge
from longattn._attention_torch import (
    contiguous_positions,
    from_cache,
    prepare_new_tokens,
    sink_logits,
    split_qkv,
)
from longattn._rotary import rope_cache
from longattn._triton_merge import merge_splits, merge_splits_kernel
from longattn.sparse import dynamic_sparse_attention, sparse_attention_indexer
from longattn.sparse._params import DSAParams
from longattn.sparse._shared import dsa_candidates, gather_rows
from longattn.sparse.api import gates as dsa_gates
from longattn.sparse.reference import dsa_reference
from longattn.sparse.triton import decode, indexer
from longattn.testing import assert_close_to_fp64, nan_tensor

interpret = pytest.mark.interpret
gpu = pytest.mark.gpu
# interpreter tests run on the GPU too when one is present (fp16/fp32 data only there)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poison_buffers(monkeypatch):
    """Every buffer the tier allocates starts as NaN (int: most negative)."""

    def poisoned(shape, *, dtype, device):
        return nan_tensor(shape, dtype, device)

    monkeypatch.setattr(decode, "_empty", poisoned)
    monkeypatch.setattr(indexer, "_empty", poisoned)


# ---------------------------------------------------------------------------------------------
# DSA case builder (any device), truth and the same-precision baseline.


def build(
    seed,
    *,
    device=DEV,
    b=2,
    s=1,
    n=4,
    kv=2,
    h=32,
    past=(20, 33),
    mode="selected_only",
    dtype=torch.float16,
    cache_dtype=None,
    v_dtype=None,
    m=24,
    window=8,
    aux_len=40,
    aux_dtype=None,
    shared_aux=False,
    sink="head",
    first_prompt=False,
    per_channel=False,
    rotary_offset=0,
    extra_capacity=3,
    invalid=True,
    counts="random",
):
    """Keyword arguments of ``dynamic_sparse_attention`` for a random case."""
    gen = torch.Generator(device=device).manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    dev = torch.device(device)

    def rnd(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dt)

    if first_prompt:
        totals = [s - (i % 2) * (s // 3) for i in range(b)]  # right padding in odd sequences
        t_max, past = s, [0] * b
    else:
        totals = [p + s for p in past]
        t_max = max(totals)
    kw = dict(
        query=rnd(b, s, n * h),
        key=rnd(b, s, kv * h),
        value=rnd(b, s, kv * h, dt=v_dtype or dtype),
        seqlens_k=torch.tensor([t - 1 for t in totals], dtype=torch.int32, device=dev),
        total_sequence_length=t_max,
        num_heads=n,
        kv_num_heads=kv,
        attention_mode=mode,
        selected_kv_source="main" if mode == "selected_only" else "auxiliary",
    )
    cap = t_max + extra_capacity
    if cache_dtype == torch.int8:
        shape = (kv, 1, h) if per_channel else (1,)
        kw["k_scale"] = torch.rand(shape, generator=gen, device=dev) * 0.02 + 0.02
        kw["v_scale"] = torch.rand(shape, generator=gen, device=dev) * 0.02 + 0.02
    if not first_prompt:
        if cache_dtype == torch.int8:
            pk = torch.randint(-127, 128, (b, kv, cap, h), generator=gen, device=dev)
            pv = torch.randint(-127, 128, (b, kv, cap, h), generator=gen, device=dev)
            pk, pv = pk.to(torch.int8), pv.to(torch.int8)
        else:
            pk, pv = rnd(b, kv, cap, h, dt=cache_dtype), rnd(b, kv, cap, h, dt=cache_dtype)
        poison = -128 if cache_dtype == torch.int8 else float("nan")
        for i, p in enumerate(past):  # rows past the sequence must never be read
            pk[i, :, p:] = poison
            pv[i, :, p:] = poison
        kw["past_key"], kw["past_value"] = pk, pv
    else:
        kw["kv_cache_dtype"] = cache_dtype
    rot = h // 2 if rotary_offset else (h if h < 64 else h // 2)
    cos, sin = rope_cache(t_max + 8, rot, device=dev)
    kw.update(cos_cache=cos, sin_cache=sin, do_rotary=True, rotary_offset=rotary_offset)
    kw["q_norm_weight"] = 1 + 0.1 * rnd(h, dt=torch.float32)
    kw["k_norm_weight"] = 1 + 0.1 * rnd(h, dt=torch.float32)
    if sink == "head":
        kw["head_sink"] = rnd(n, dt=torch.float32)
    elif sink == "smooth":
        kw["smooth_softmax"] = True
    local = mode == "local_plus_selected"
    if local:
        kw["local_window_size"] = window
        aux_dt = aux_dtype or dtype
        kw["auxiliary_key"] = rnd(b, kv, aux_len, h, dt=aux_dt)
        if shared_aux:
            kw["auxiliary_kv_shared"] = True
        else:
            kw["auxiliary_value"] = rnd(b, kv, aux_len, h, dt=aux_dt)
    qpos, _ = contiguous_positions(kw["seqlens_k"], s, first_prompt)
    kw["selected_indices"], kw["selected_counts"] = _selection(
        gen, qpos.reshape(-1), m, aux_len if local else None, invalid, counts
    )
    return kw


def _selection(gen, qpos, m, aux_len, invalid, counts):
    """Per row: distinct random valid positions (ascending), a few invalid entries, -1 pad."""
    rows, dev = qpos.shape[0], qpos.device
    limit = qpos + 1 if aux_len is None else torch.full_like(qpos, aux_len)
    span = int(limit.max()) if rows else 1
    score = torch.rand(rows, span, generator=gen, device=dev)
    score = torch.where(torch.arange(span, device=dev)[None, :] < limit[:, None], score, -1.0)
    k = min(m, span)
    top = score.topk(k, dim=1)
    picks = torch.where(top.values >= 0, top.indices, -1).sort(1, descending=True).values
    if counts == "random":
        cnt = torch.randint(0, m + 1, (rows,), generator=gen, device=dev)
    else:
        cnt = torch.full((rows,), m, device=dev)
    avail = (picks >= 0).sum(1)
    cnt = torch.minimum(cnt, avail)
    sel = torch.full((rows, m), -1, dtype=torch.int64, device=dev)
    sel[:, :k] = picks
    j = torch.arange(m, device=dev)
    sel = torch.where(j[None, :] < cnt[:, None], sel, -1)
    if invalid and m >= 3:  # two invalid entries inside the count, just past the limits
        odd = torch.arange(rows, device=dev) % 2 == 1
        bad1 = torch.where(odd, limit, 1 << 20)  # qpos + 1 (main) / A (aux); beyond C
        bad2 = torch.where(odd, -1, -3)
        put = cnt + 2 <= m
        sel[put, cnt[put]] = bad1[put]
        sel[put, cnt[put] + 1] = bad2[put]
        cnt = torch.where(put, cnt + 2, cnt)
    return sel.to(torch.int32), cnt.to(torch.int32)


def _clone(kw):
    out = dict(kw)
    for name in ("past_key", "past_value"):
        if out.get(name) is not None:
            out[name] = out[name].clone()
    return out


def run(kw, **extra):
    return dynamic_sparse_attention(**_clone(kw), **extra)


def to_fp64(kw):
    out = dict(kw)
    for name in ("query", "key", "value", "auxiliary_key", "auxiliary_value", "head_sink",
                 "q_norm_weight", "k_norm_weight", "cos_cache", "sin_cache"):  # fmt: skip
        if out.get(name) is not None:
            out[name] = out[name].to(torch.float64)
    if kw.get("past_key") is not None:
        out["past_key"] = from_cache(kw["past_key"], kw.get("k_scale"), dtype=torch.float64)
        out["past_value"] = from_cache(kw["past_value"], kw.get("v_scale"), dtype=torch.float64)
        if kw["past_key"].dtype == torch.int8:  # the poison rows
            poison = kw["past_key"] == -128
            out["past_key"] = out["past_key"].masked_fill(poison, float("nan"))
            out["past_value"] = out["past_value"].masked_fill(poison, float("nan"))
    else:
        out["kv_cache_dtype"] = torch.float64
    out.pop("k_scale", None)
    out.pop("v_scale", None)
    return out


def truth_of(kw):
    return run(to_fp64(kw), backend="reference")[0]


def _round_fp16_rows(x):
    """Rows (last axis) of fp32 ``x`` rounded to fp16's 11 significant bits after a
    power-of-two scaling of each row (no overflow, no underflow), scaled back."""
    amax = x.abs().amax(-1, keepdim=True)
    e = torch.frexp(amax)[1] - 1  # floor(log2(amax)) for amax > 0
    f = torch.ldexp(torch.ones_like(amax), 14 - e)
    return (x * f).to(torch.float16).float() / f


def _p_dtype(q_dtype: torch.dtype, v_dtype: torch.dtype) -> torch.dtype:
    """The dtype P is rounded to before P.V: never below Q's precision (fp32 Q: fp32; fp16 Q
    with bf16 V: fp16's mantissa), else V's 16-bit dtype; int8 V: fp16 (fp32 for an fp32 Q)."""
    if q_dtype == torch.float32:
        return torch.float32
    if v_dtype == torch.int8 or (q_dtype, v_dtype) == (torch.float16, torch.bfloat16):
        return torch.float16
    return v_dtype


def lowp_dsa(kw, q_dtype=None):
    """Same-precision baseline: fp32 prologue, Q rounded once (an int8 main cache with 16-bit
    activations: to fp16 with power-of-two rows for the main-cache keys; local mode's auxiliary
    keys take Q rounded to the activation dtype), fp32 softmax, P rounded as the tier's P.V
    operands are (``_p_dtype``), fp32 P.V. Independent of the tier's kernels."""
    kw = _clone(kw)
    q_in = kw["query"]
    b, s, _ = q_in.shape
    n, kv = kw["num_heads"], kw["kv_num_heads"]
    h = q_in.shape[-1] // n
    g = n // kv
    t_max = kw["total_sequence_length"]
    first = s == t_max
    cache_dtype = kw["past_key"].dtype if "past_key" in kw else kw["kv_cache_dtype"]
    explicit_q = q_dtype is not None
    q_dtype = q_dtype or (
        torch.float16
        if (q_in.dtype, cache_dtype) == (torch.bfloat16, torch.float16)
        else q_in.dtype
    )
    if "past_key" in kw:
        pk, pv = kw["past_key"], kw["past_value"]
    else:
        pk = torch.zeros(b, kv, t_max, h, dtype=cache_dtype, device=q_in.device)
        pv = torch.zeros_like(pk)
    q, k, v = split_qkv(q_in, kw["key"], kw["value"], n, kv, h)
    qpos, total = contiguous_positions(kw["seqlens_k"], s, first)
    qf = prepare_new_tokens(
        q, k, v, pk, pv, qpos, total, dtype=torch.float32, cos_cache=kw["cos_cache"],
        sin_cache=kw["sin_cache"], rotary_offset=kw.get("rotary_offset", 0),
        position_ids=kw.get("position_ids"), interleaved=kw.get("rotary_interleaved", False),
        q_norm_weight=kw["q_norm_weight"], k_norm_weight=kw["k_norm_weight"],
        k_scale=kw.get("k_scale"), v_scale=kw.get("v_scale"),
    )  # fmt: skip
    local = kw["attention_mode"] == "local_plus_selected"
    pow2 = cache_dtype == torch.int8 and q_in.dtype != torch.float32 and not explicit_q
    q_aux = qf.to(q_dtype).float().reshape(b * s, kv, g, h)
    q_main = _round_fp16_rows(qf).reshape(b * s, kv, g, h) if pow2 else q_aux
    main_q_dtype = torch.float16 if pow2 else q_dtype
    aux_k = kw.get("auxiliary_key")
    aux_v = aux_k if kw.get("auxiliary_kv_shared") else kw.get("auxiliary_value")
    segs = dsa_candidates(
        qpos, total, kw["selected_indices"], kw["selected_counts"],
        local_window=kw.get("local_window_size", -1) if local else -1,
        source="aux" if local else "main", capacity=pk.shape[2],
        aux_len=0 if aux_k is None else aux_k.shape[2],
    )  # fmt: skip
    rows_b = torch.arange(b, device=q_in.device).repeat_interleave(s)
    xs, vs, oks = [], [], []
    for seg in segs:
        main = seg.source == "main"
        kc, vc = (pk, pv) if main else (aux_k, aux_v)
        qr = q_main if main else q_aux
        kr = from_cache(gather_rows(kc, rows_b, seg.pos), kw.get("k_scale") if main else None,
                        kv_axis=-2)  # fmt: skip
        vr = gather_rows(vc, rows_b, seg.pos)
        v_dt = _p_dtype(main_q_dtype if main else q_dtype, vr.dtype)
        vr = from_cache(vr, kw.get("v_scale") if main else None, kv_axis=-2)
        vr = torch.where(seg.ok[:, :, None, None], vr, 0.0)
        xs.append(torch.einsum("rkgh,rlkh->rkgl", qr, kr) / math.sqrt(h))
        vs.append((vr, v_dt))
        oks.append(seg.ok)
    x = torch.cat(xs, -1)
    ok = torch.cat(oks, 1)
    x = torch.where(ok[:, None, None, :], x, float("-inf"))
    sink = sink_logits(kw.get("head_sink"), kw.get("smooth_softmax", False), n, q_in.device)
    if sink is not None:
        x = torch.cat((x, sink.float().reshape(1, kv, g, 1).expand(b * s, kv, g, 1)), -1)
    m = x.amax(-1, keepdim=True)
    e = torch.exp(x - torch.where(torch.isfinite(m), m, 0.0))
    den = e.sum(-1, keepdim=True)
    p = torch.where(den > 0, e / torch.where(den > 0, den, 1.0), 0.0)
    out, c0 = 0.0, 0
    for vr, v_dt in vs:
        L = vr.shape[1]
        out = out + torch.einsum("rkgl,rlkh->rkgh", p[..., c0 : c0 + L].to(v_dt).float(), vr)
        c0 += L
    return out.reshape(b, s, n * h)


def check_dsa(kw, **extra):
    out, pk, pv = run(kw, backend="triton", **extra)
    assert out.dtype == kw["query"].dtype
    truth = truth_of(kw)
    base = lowp_dsa(kw, extra.get("query_dtype"))
    assert_close_to_fp64(out, truth, base, name="dsa triton")
    return out, pk, pv


# ---------------------------------------------------------------------------------------------
# DSA, interpreter.

_GRID = [
    # h, group, s, mode, dtype, cache_dtype, sink, per_channel
    (32, 2, 1, "selected_only", torch.float16, None, "head", False),
    (64, 4, 1, "selected_only", torch.float32, None, None, False),
    (32, 6, 3, "selected_only", torch.float16, torch.int8, "smooth", False),
    (80, 3, 2, "local_plus_selected", torch.float16, torch.int8, "head", True),
    (32, 1, 4, "local_plus_selected", torch.float32, torch.float16, None, False),
    (16, 8, 1, "local_plus_selected", torch.float16, None, "smooth", False),
]


@interpret
@pytest.mark.parametrize("h,group,s,mode,dtype,cache_dtype,sink,per_channel", _GRID)
def test_dsa_vs_fp64(h, group, s, mode, dtype, cache_dtype, sink, per_channel):
    kv = 2 if group < 8 else 1
    kw = build(
        7 * h + group + s, h=h, n=kv * group, kv=kv, s=s, mode=mode, dtype=dtype,
        cache_dtype=cache_dtype, sink=sink, per_channel=per_channel, past=(37, 70), m=40,
        window=12,
    )  # fmt: skip
    out, pk, _ = check_dsa(kw)
    # the appended rows equal the torch prologue's (one rounding / quantization)
    want_k = run(kw, backend="reference")[1]
    tol = 1 if pk.dtype == torch.int8 else 0
    assert (pk.double() - want_k.double()).nan_to_num(0.0).abs().max() <= tol * 1.0 + 2e-3


@interpret
@pytest.mark.parametrize("cache_dtype", [None, torch.int8])
def test_dsa_first_prompt_padding_rows(cache_dtype):
    """Padding rows give zeros and write nothing (int8: the power-of-two Q row factors of
    the NaN-poisoned scratch are read only for real rows)."""
    kw = build(1, s=7, first_prompt=True, m=10, h=32, cache_dtype=cache_dtype)
    out, pk, _ = check_dsa(kw)
    assert torch.equal(out[1, 5:], torch.zeros_like(out[1, 5:]))  # padding rows: zeros
    assert torch.equal(pk[1, :, 5:], torch.zeros_like(pk[1, :, 5:]))  # and nothing written


@interpret
@pytest.mark.parametrize("sink", [None, "head", "smooth"])
def test_dsa_empty_selection_gives_zeros(sink):
    kw = build(2, sink=sink, h=16)
    kw["selected_counts"] = torch.zeros_like(kw["selected_counts"])
    out = run(kw, backend="triton")[0]
    assert torch.equal(out, torch.zeros_like(out))


@interpret
def test_dsa_invalid_entries_are_skipped():
    kw = build(3, b=1, h=16, m=8, invalid=False, counts="full", past=(20,))
    sel = torch.tensor([[3, 3, -5, 40, 20, 1, 4, 0]], dtype=torch.int32, device=DEV)
    kw.update(selected_indices=sel, selected_counts=torch.tensor([6], device=DEV))
    got = run(kw, backend="triton")[0]
    clean = torch.tensor([[3, 3, 20, 1, -1, -1, -1, -1]], dtype=torch.int32, device=DEV)
    want = run(
        dict(kw, selected_indices=clean, selected_counts=torch.tensor([4], device=DEV)),
        backend="triton",
    )
    torch.testing.assert_close(got, want[0], rtol=1e-3, atol=1e-3)
    ref = run(kw, backend="reference")[0]
    torch.testing.assert_close(got.float(), ref.float(), rtol=5e-3, atol=5e-3)


@interpret
def test_dsa_local_window_dedup_and_short_window():
    """Window rows before position 0 are skipped; the window alone equals attention over it."""
    kw = build(4, mode="local_plus_selected", past=(2, 30), window=6, h=16)
    check_dsa(kw)
    kw["selected_counts"] = torch.zeros_like(kw["selected_counts"])
    check_dsa(kw)


@interpret
@pytest.mark.parametrize("num_splits", [None, 3])
def test_dsa_main_source_window_dedup(num_splits):
    """The kernel's DEDUP path: a window over the main cache with main-cache selections (the
    API pairs a window with the auxiliary source only; the tiers take either pair): a selected
    main entry inside the window counts once, one before it joins. fp32, vs the fp64
    reference (same-precision baseline: the fp32 reference)."""
    gen = torch.Generator().manual_seed(17)
    b, n, kv, h, w = 2, 4, 2, 16, 5
    totals = (24, 15)
    cap = max(totals) + 3
    query = torch.randn(b, 1, n * h, generator=gen)
    key = torch.randn(b, 1, kv * h, generator=gen)
    value = torch.randn(b, 1, kv * h, generator=gen)
    pk = torch.randn(b, kv, cap, h, generator=gen)
    pv = torch.randn(b, kv, cap, h, generator=gen)
    for i, t in enumerate(totals):  # rows from the new token's on are never read
        pk[i, :, t - 1 :] = float("nan")
        pv[i, :, t - 1 :] = float("nan")
    # qpos 23: window 19..23; qpos 14: window 10..14 (entries inside it count once)
    sel = torch.tensor([[2, 11, 19, 21, 23, -1, -1, -1], [0, 9, 10, 12, 14, 13, -1, -1]])
    cnt = torch.tensor([5, 6], dtype=torch.int32)
    seqlens = torch.tensor([t - 1 for t in totals], dtype=torch.int32)
    p = DSAParams(
        num_heads=n, kv_num_heads=kv, head_size=h, scale=h**-0.5, local_window_size=w,
        attention_mode="local_plus_selected", selected_kv_source="main", do_rotary=False,
        rotary_interleaved=False, rotary_offset=0, smooth_softmax=False, qk_norm_epsilon=1e-6,
        auxiliary_kv_shared=False, is_first_prompt=False, total_sequence_length=max(totals),
        query_dtype=None, cos_cache=None, sin_cache=None, position_ids=None,
        head_sink=torch.randn(n, generator=gen), q_norm_weight=None, k_norm_weight=None,
        k_scale=None, v_scale=None,
    )  # fmt: skip

    def call(tier, q, k, v, **kw):
        return tier(q, k, v, pk.clone(), pv.clone(), None, None, sel, cnt, seqlens, p, **kw)

    up = lambda t: t.double()  # noqa: E731
    truth = call(dsa_reference, up(query), up(key), up(value))
    base = call(dsa_reference, query, key, value)
    got = call(decode.dsa_triton, query, key, value, num_splits=num_splits)
    assert_close_to_fp64(got, truth, base)


@interpret
def test_dsa_ragged_batch_and_int64_selection():
    kw = build(5, b=3, past=(1, 45, 9), s=2, h=32, m=30)
    kw["selected_indices"] = kw["selected_indices"].to(torch.int64)
    kw["selected_counts"] = kw["selected_counts"].to(torch.int64)
    check_dsa(kw)


@interpret
@pytest.mark.parametrize("num_splits", [1, 3, 50])
def test_dsa_split_counts_agree(num_splits):
    kw = build(6, mode="local_plus_selected", h=32, m=40, window=20, s=2)
    want = run(kw, backend="reference")[0]
    got, _ = _run_with_splits(kw, num_splits)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)


@interpret
@pytest.mark.parametrize("num_splits", [None, 4])
@pytest.mark.parametrize("mode", ["selected_only", "local_plus_selected"])
def test_dsa_early_cnt_ignores_entries_past_the_count(mode, num_splits):
    """``EARLY_CNT`` (the split's index loads cover every slot, not waiting for
    ``selected_counts``; candidates past the count masked): entries past the count hold a
    valid position (0) here and must still not count. fp16 vs the fp64 reference."""
    kw = build(21, mode=mode, h=32, m=30, s=2)
    sel, cnt = kw["selected_indices"], kw["selected_counts"]
    past = torch.arange(sel.shape[1], device=sel.device)[None, :] >= cnt[:, None].long()
    assert past.any() and (~past).any()
    kw["selected_indices"] = torch.where(past, torch.zeros_like(sel), sel)
    got, _ = _run_with_splits(kw, num_splits, EARLY_CNT=True)
    assert_close_to_fp64(got, truth_of(kw), lowp_dsa(kw), name="dsa EARLY_CNT")


@pytest.mark.parametrize(
    "rows,window,max_sel,block_n,sm_programs",
    [(1, 0, 8255, 32, 2), (8, 0, 8255, 32, 2), (4, 0, 2111, 16, 3), (1, 128, 2111, 32, 2),
     (64, 0, 2111, 32, 2), (1, 0, 8255, 32, None)],
)  # fmt: skip
def test_plan_splits_wave_cap(rows, window, max_sel, block_n, sm_programs):
    """``SM_PROGRAMS`` caps the grid at one wave of that many programs per SM (or one split
    per pair when even that does not fit); every candidate still lands in a split."""
    kv, sms = 4, 132
    chunk, win, sel = decode.plan_splits(rows, kv, window, max_sel, block_n, sms, None,
                                         sm_programs)  # fmt: skip
    assert chunk % block_n == 0 and win * chunk >= window and sel * chunk >= max_sel
    assert win + sel <= decode.MAX_SPLITS
    programs = rows * kv * (win + sel)
    if sm_programs is None:
        assert programs > 2 * sms  # the uncapped rule asks for 4 per SM at <= 16 pairs
    else:
        assert programs <= max(sm_programs * sms, rows * kv * (1 + (window > 0)))
        uncapped = decode.plan_splits(rows, kv, window, max_sel, block_n, sms)
        assert win + sel <= sum(uncapped[1:])


@interpret
@pytest.mark.parametrize("early_o", [False, True])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize(
    "splits,head,block_d,one_warp_from",
    [(5, 64, 16, None), (37, 80, 32, None), (3, 32, 32, None), (130, 256, None, None),
     (66, 256, None, 64), (130, 80, None, 64), (200, 256, None, 64)],
)  # fmt: skip
def test_merge_splits_kernel_tiles(splits, head, block_d, one_warp_from, sink, early_o,
                                   monkeypatch):  # fmt: skip
    """The shared GQA/DSA merge over channel tiles (BLOCK_D < HEAD, a padded last tile; None:
    the host launcher's own tile, 256-split rows; ``MERGE_ONE_WARP_FROM``: its one-warp tiles)
    equals a float64 log-sum-exp merge; an all-empty row gives zeros (or zeros with a sink).
    Empty slots' o_part is NaN (a split kernel may leave it unwritten): never used, also when
    loaded (``EARLY_O``)."""
    monkeypatch.setattr(_triton_merge, "MERGE_EARLY_O", early_o)
    monkeypatch.setattr(_triton_merge, "MERGE_ONE_WARP_FROM", one_warp_from)
    g = torch.Generator().manual_seed(splits)
    rn, n = 6, 3
    o_part = torch.randn(rn, splits, head, generator=g, dtype=torch.float64)
    lse = 4 * torch.randn(rn, splits, generator=g, dtype=torch.float64)
    lse[1, ::2] = -math.inf  # empty splits
    o_part[1, ::2] = math.nan
    lse[4] = -math.inf  # nothing valid in the row
    o_part[4] = math.nan
    sink_v = torch.randn(n, generator=g, dtype=torch.float64)
    out = nan_tensor((rn, head), torch.float32, DEV)
    o_dev, lse_dev = o_part.float().to(DEV), lse.float().to(DEV)
    if block_d is None:
        merge_splits(o_dev.view(rn // n, n, splits, head), lse_dev.view(rn // n, n, splits), out,
                     num_heads=n, head_sink=sink_v.float().to(DEV) if sink else None,
                     smooth_softmax=False)  # fmt: skip
    else:
        merge_splits_kernel[(rn, triton.cdiv(head, block_d))](
            o_part_ptr=o_dev, lse_part_ptr=lse_dev, sink_ptr=sink_v.float().to(DEV), o_ptr=out,
            num_splits=splits, NUM_HEADS=n, HEAD=head, SPLITS_PAD=triton.next_power_of_2(splits),
            BLOCK_D=block_d, HAS_SINK=sink, SINK_FROM_PTR=sink, PDL=False, EARLY_O=early_o,
        )  # fmt: skip
    logits = lse * math.log(2.0)
    if sink:
        sink_col = sink_v[torch.arange(rn) % n][:, None]
        logits = torch.cat([logits, sink_col], dim=1)
    w = torch.softmax(logits, dim=1)[:, :splits].nan_to_num(0.0)
    want = (w[:, :, None] * o_part.nan_to_num(0.0)).sum(1)
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[4].cpu(), torch.zeros(head))


def _run_with_splits(kw, num_splits, prologue=None, **cfg_extra):
    """Call the tier directly (tuning hooks) through the API's validation and allocation;
    ``cfg_extra``: keys added to the default config (e.g. ``FUSE_PROLOGUE=True``)."""
    from longattn.sparse import api

    captured = {}
    orig = api._run

    def fake_run(query, key, value, pk, pv, aux_k, aux_v, sel, cnt, seqlens_k, p, backend):
        cfg = None
        if cfg_extra:
            qd = decode.q_dtype_for(p, query.dtype, pk.dtype)
            cfg = dict(decode.decode_config(p.head_size, qd, pk.dtype, decode._interpret()),
                       **cfg_extra)  # fmt: skip
        captured["out"] = decode.dsa_triton(
            query, key, value, pk, pv, aux_k, aux_v, sel, cnt, seqlens_k, p,
            num_splits=num_splits, prologue=prologue, cfg=cfg,
        )  # fmt: skip
        captured["cache"] = (pk, pv)
        return captured["out"]

    api._run = fake_run
    try:
        run(kw)
    finally:
        api._run = orig
    return captured["out"], captured["cache"]


def _with_new_token_selected(kw):
    """Every row's selection starts with the new token's own row (qpos), a row shortly before
    it and qpos again (duplicates are counted, as by every tier, when not validated), so the
    candidates include the row the fused kernel folds in separately, twice."""
    kw = _clone(kw)
    qpos = kw["seqlens_k"].long()  # S = 1: qpos = total - 1
    sel, cnt = kw["selected_indices"].clone(), kw["selected_counts"].clone()
    if kw["attention_mode"] == "selected_only":
        sel[:, 0] = qpos.to(sel.dtype)
        sel[:, 1] = (qpos - 3).to(sel.dtype)
        sel[:, 2] = qpos.to(sel.dtype)
    cnt = torch.clamp(cnt, min=3)
    kw["selected_indices"], kw["selected_counts"] = sel, cnt
    return kw


_FUSED = [
    # dtype, cache_dtype, per_channel, mode, extra build kwargs
    (torch.float16, None, False, "selected_only", {}),
    (torch.float32, None, False, "selected_only", dict(sink="smooth")),
    (torch.float16, torch.int8, False, "selected_only", {}),
    (torch.float16, torch.int8, True, "selected_only", dict(h=80)),
    (torch.float32, torch.float16, False, "local_plus_selected", dict(window=20)),
    (torch.float16, None, False, "local_plus_selected", dict(shared_aux=True, h=16, n=16)),
    (torch.float16, None, False, "selected_only", dict(first_prompt=True, b=3)),
]


@interpret
@pytest.mark.parametrize("dtype,cache_dtype,per_channel,mode,extra", _FUSED)
@pytest.mark.parametrize("splits", [1, 5])
def test_dsa_fused_prologue_matches_the_prologue_kernel(
    dtype, cache_dtype, per_channel, mode, extra, splits
):
    """``FUSE_PROLOGUE`` (S = 1: each split program computes its Q and the new K/V row, folds
    that row in as many times as it is a candidate, split 0 appends it): within the fp64
    tolerance, within two output roundings of the prologue kernel + split kernel, and the same
    caches bit for bit; with the new token among the selected rows (and in the window),
    invalid entries included."""
    kw = build(splits * 100 + len(extra), dtype=dtype, cache_dtype=cache_dtype,
               per_channel=per_channel, mode=mode, **dict(dict(h=32, m=24), **extra))  # fmt: skip
    kw = _with_new_token_selected(kw)
    _assert_variant_matches(kw, "dsa triton fused", splits, FUSE_PROLOGUE=True)


def _assert_variant_matches(kw, name, splits=None, exact=False, base_cfg=None, **cfg):
    """The tier (Triton prologue) with ``cfg`` keys added against the same call without them
    (``base_cfg`` in both): the same caches bit for bit (NaN rows included), the output equal
    (``exact``) or within two output roundings, and within the fp64 tolerance."""
    base_cfg = base_cfg or {}
    base, (bk, bv) = _run_with_splits(_clone(kw), splits, prologue="triton", **base_cfg)
    got, (gk, gv) = _run_with_splits(_clone(kw), splits, prologue="triton", **base_cfg, **cfg)
    assert torch.equal(gk.view(torch.uint8), bk.view(torch.uint8))
    assert torch.equal(gv.view(torch.uint8), bv.view(torch.uint8))
    if exact:
        assert torch.equal(got, base)
    else:
        _assert_within_roundings(got, base, 2)
    assert_close_to_fp64(got, truth_of(kw), lowp_dsa(kw), name=name)


def _assert_within_roundings(got, base, ulps):
    """|got - base| <= ulps roundings of the output dtype at the output's largest magnitude."""
    assert torch.isfinite(got).all() and torch.isfinite(base).all()
    tol = ulps * torch.finfo(got.dtype).eps * base.abs().max().item()
    diff = (got.double() - base.double()).abs().max().item()
    assert diff <= tol, (diff, tol)


@interpret
def test_dsa_fused_prologue_packed_position_ids_interleaved():
    kw = build(41, h=32, m=20)
    kw["position_ids"] = torch.tensor([[9], [40]], device=DEV)
    kw["rotary_interleaved"] = True
    packed = dict(kw, query=torch.cat((kw["query"], kw["key"], kw["value"]), -1))
    packed.update(key=None, value=None)
    packed = _with_new_token_selected(packed)
    base, _ = _run_with_splits(_clone(packed), 3)
    got, _ = _run_with_splits(_clone(packed), 3, FUSE_PROLOGUE=True)
    _assert_within_roundings(got, base, 2)
    kw = _with_new_token_selected(kw)  # the same case unpacked
    assert_close_to_fp64(got, truth_of(kw), lowp_dsa(kw), name="dsa triton fused")
    unpacked, _ = _run_with_splits(kw, 3, FUSE_PROLOGUE=True)
    torch.testing.assert_close(got, unpacked, rtol=0, atol=0)


@interpret
def test_dsa_fused_prologue_is_s1_only_and_checked(monkeypatch):
    """S > 1 (or a rotary offset: the torch prologue) keeps the prologue kernel; a non-bool
    FUSE_PROLOGUE is a ValueError."""
    calls = []
    orig = decode.run_prologue
    monkeypatch.setattr(decode, "run_prologue", lambda *a, **k: calls.append(1) or orig(*a, **k))
    _run_with_splits(build(42, h=32, s=1), 2, FUSE_PROLOGUE=True)
    assert calls == []
    _run_with_splits(build(42, h=32, s=2), 2, FUSE_PROLOGUE=True)
    _run_with_splits(build(42, h=64, s=1, rotary_offset=16), 2, FUSE_PROLOGUE=True)
    assert calls == [1, 1]
    with pytest.raises(ValueError, match="FUSE_PROLOGUE"):
        _run_with_splits(build(42, h=32), 2, FUSE_PROLOGUE=1)


_PREFETCH = [
    # dtype, cache_dtype, per_channel, mode, extra build kwargs, extra cfg
    (torch.float16, None, False, "selected_only", dict(s=3), {}),
    (torch.float16, None, False, "selected_only", dict(s=2), dict(EARLY_CNT=False)),
    (torch.float16, torch.int8, True, "selected_only", dict(s=2, h=80), {}),
    (torch.float32, torch.float16, False, "local_plus_selected", dict(window=20, s=2), {}),
    (torch.float16, None, False, "local_plus_selected", dict(shared_aux=True, s=2), {}),
    (torch.float16, torch.int8, False, "selected_only", dict(s=1), dict(FUSE_PROLOGUE=True)),
    (torch.float16, None, False, "selected_only", dict(first_prompt=True, b=3, s=4), {}),
]


@interpret
@pytest.mark.parametrize("dtype,cache_dtype,per_channel,mode,extra,cfg", _PREFETCH)
@pytest.mark.parametrize("splits", [1, 3])
def test_dsa_prefetch_is_bitwise_the_tile_loop(dtype, cache_dtype, per_channel, mode, extra,
                                               cfg, splits):  # fmt: skip
    """``PREFETCH`` (each tile's index entries loaded one step ahead, so that the pipeliner
    multi-buffers the K/V gathers) folds the same tiles in the same order: the outputs and caches equal the default loop's bit for bit, over
    splits of several tiles (interpreter BLOCK_N 16), a window segment, auxiliary keys,
    int8 caches, the fused prologue (the new token's row among the candidates: counted, not
    loaded) and a first prompt's padding rows."""
    kw = build(splits * 10 + len(extra), dtype=dtype, cache_dtype=cache_dtype,
               per_channel=per_channel, mode=mode, **dict(dict(h=32, m=40), **extra))  # fmt: skip
    if extra["s"] == 1:
        kw = _with_new_token_selected(kw)
    _assert_variant_matches(kw, "dsa triton prefetch", splits, exact=True, base_cfg=cfg,
                            PREFETCH=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"cfg\['PREFETCH'\] must be a bool"):
        _run_with_splits(_clone(kw), splits, PREFETCH=1)


def _spy_split_launches(monkeypatch, pick) -> list:
    """A list that gets ``pick(launch keywords)`` of every ``dsa_split_kernel`` launch (the
    launches still run)."""
    seen = []
    real = decode.dsa_split_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(**kw):
                seen.append(pick(kw))
                return real[grid](**kw)

            return launch

    monkeypatch.setattr(decode, "dsa_split_kernel", Spy())
    return seen


@interpret
@pytest.mark.parametrize("splits,long", [(1, True), (3, False)])
def test_dsa_long_split_prefetch_keys_on_the_split_length(splits, long, monkeypatch):
    """``LONG_SPLIT_PREFETCH`` (the int8 default) launches ``PREFETCH`` (at least
    PREFETCH_STAGES stages) for splits of >= LONG_SPLIT_TILES tiles only (2 here: one split of
    the 40 candidates holds 3 interpreter tiles, three splits hold 1 each), and the int8
    output and caches equal the loop without it bit for bit; a non-bool is a ValueError."""
    seen = _spy_split_launches(monkeypatch, lambda kw: (kw.get("PREFETCH", False),
                                                       kw["num_stages"]))  # fmt: skip
    monkeypatch.setattr(decode, "LONG_SPLIT_TILES", 2)
    kw = build(44 + splits, h=32, m=40, s=2, cache_dtype=torch.int8, per_channel=True)
    _assert_variant_matches(kw, "dsa triton long-split prefetch", splits, exact=True,
                            LONG_SPLIT_PREFETCH=True)  # fmt: skip
    assert seen[0] == (False, 1), seen  # the base call: the interpreter config
    assert seen[1] == ((True, decode.PREFETCH_STAGES) if long else (False, 1)), seen
    with pytest.raises(ValueError, match=r"cfg\['LONG_SPLIT_PREFETCH'\] must be a bool"):
        _run_with_splits(_clone(kw), splits, LONG_SPLIT_PREFETCH=1)


@interpret
@pytest.mark.parametrize("per_channel,h,mode", [(False, 32, "selected_only"),
                                                (True, 32, "local_plus_selected"),
                                                (True, 80, "selected_only")])  # fmt: skip
def test_dsa_int8_wide_rows_match_the_default(per_channel, h, mode, monkeypatch):
    """``WIDE_I8`` (an option: main-cache rows read as int32 words, four channels per
    conversion; auxiliary rows stay float) against the default: the same caches bit
    for bit, within two output roundings, within the fp64 tolerance; a padded head (H = 80 <
    HEAD_PAD) launches without it; a non-bool is a ValueError."""
    kw = build(61 + h, h=h, m=24, s=2, cache_dtype=torch.int8, per_channel=per_channel,
               mode=mode, window=6)  # fmt: skip
    _assert_int8_read_option(monkeypatch, "WIDE_I8", kw, h == 32)


def _assert_int8_read_option(monkeypatch, flag: str, kw: dict, expect_on: bool, **extra):
    """An int8 main-cache read option ``flag`` (``WIDE_I8``, ``V_PAIRS``) asked for vs off:
    the launch takes it only where ``expect_on``; the same caches bit for bit, within two
    output roundings of each other, within the fp64 tolerance; a non-bool is a ValueError."""
    seen = _spy_split_launches(monkeypatch, lambda launch_kw: launch_kw[flag])
    base, (bk, bv) = _run_with_splits(_clone(kw), 3, prologue="triton", **{flag: False}, **extra)
    got, (gk, gv) = _run_with_splits(_clone(kw), 3, prologue="triton", **{flag: True}, **extra)
    assert seen == [False, expect_on], seen
    assert torch.equal(gk.view(torch.uint8), bk.view(torch.uint8))
    assert torch.equal(gv.view(torch.uint8), bv.view(torch.uint8))
    _assert_within_roundings(got, base, 2)
    assert_close_to_fp64(got, truth_of(kw), lowp_dsa(kw), name=f"dsa triton int8 {flag}")
    with pytest.raises(ValueError, match=rf"cfg\['{flag}'\] must be a bool"):
        _run_with_splits(_clone(kw), 3, **{flag: 1})


@interpret
@pytest.mark.parametrize("per_channel,h,mode,s,extra", [
    (False, 32, "selected_only", 2, {}),
    (True, 32, "selected_only", 2, {"PREFETCH": True}),
    (True, 32, "selected_only", 1, {"FUSE_PROLOGUE": True}),
    (True, 32, "local_plus_selected", 2, {}),
    (True, 80, "selected_only", 2, {}),
])  # fmt: skip
def test_dsa_int8_v_pairs_match_the_byte_path(per_channel, h, mode, s, extra, monkeypatch):
    """``V_PAIRS`` (the int8 default: main-cache V read as int16 channel pairs, even / odd
    channels in two dots, interleaved after the segments) against the per-byte build, also
    with ``PREFETCH`` and the fused prologue's new row: the same caches bit for bit, within two
    output roundings, within the fp64 tolerance. Auxiliary keys (local_plus_selected) or a
    padded head (H = 80 < HEAD_PAD) launch without it; a non-bool is a ValueError."""
    assert decode.decode_config(h, torch.float16, torch.int8, True)["V_PAIRS"]
    kw = build(71 + h + s, h=h, m=24, s=s, cache_dtype=torch.int8, per_channel=per_channel,
               mode=mode, window=6)  # fmt: skip
    on = h == 32 and mode == "selected_only"
    _assert_int8_read_option(monkeypatch, "V_PAIRS", kw, on, **extra)


@interpret
@pytest.mark.parametrize("first", [False, True])
def test_dsa_early_cnt_default_and_checked(first, monkeypatch):
    """``EARLY_CNT`` defaults to on unless the rows are a first prompt's; a non-bool is a
    ValueError naming the key."""
    seen = _spy_split_launches(monkeypatch, lambda kw: kw["EARLY_CNT"])
    kw = build(43, h=32, s=3, first_prompt=first)
    _run_with_splits(kw, None)
    assert seen == [not first]
    with pytest.raises(ValueError, match=r"cfg\['EARLY_CNT'\] must be a bool"):
        _run_with_splits(kw, None, EARLY_CNT=1)


@interpret
@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "2"])
def test_dsa_sm_programs_checked(bad):
    """SM_PROGRAMS must be a positive int (a float or a bool would silently change the plan)."""
    with pytest.raises(ValueError, match=r"cfg\['SM_PROGRAMS'\] must be a positive int"):
        _run_with_splits(build(42, h=32), None, SM_PROGRAMS=bad)
    _run_with_splits(build(42, h=32), None, SM_PROGRAMS=1)  # one program per SM: runs


_HOST_CFG_CHECKS = [
    *[("LONG_SPLIT_STAGES", bad, 3, "a positive int") for bad in (0, -1, 2.0, True)],
    ("PREFETCH", 1, True, "a bool"),
    ("LONG_SPLIT_PREFETCH", "yes", True, "a bool"),
]


@interpret
@pytest.mark.parametrize("key,bad,good,kind", _HOST_CFG_CHECKS)
def test_dsa_host_cfg_checked_before_the_prologue(key, bad, good, kind, monkeypatch):
    """LONG_SPLIT_STAGES must be a positive int, PREFETCH and LONG_SPLIT_PREFETCH bools,
    checked before the prologue appends to the cache (an error must leave the caches as they
    were)."""
    calls = []
    orig = decode.run_prologue
    monkeypatch.setattr(decode, "run_prologue", lambda *a, **k: calls.append(1) or orig(*a, **k))
    with pytest.raises(ValueError, match=rf"cfg\['{key}'\] must be {kind}"):
        _run_with_splits(build(43, h=32), None, **{key: bad})
    assert calls == [], "the prologue ran before the config was checked"
    _run_with_splits(build(43, h=32), None, **{key: good})
    assert calls == [1]


def test_stages_for_chunk():
    """Splits of >= LONG_SPLIT_TILES tiles take LONG_SPLIT_STAGES; shorter ones (and None)
    keep the config's stages; the int8 default asks for 3 and PREFETCH there (bf16: no
    change)."""
    tiles = decode.LONG_SPLIT_TILES
    assert decode.stages_for_chunk(2, 3, tiles * 32, 32) == 3
    assert decode.stages_for_chunk(2, 3, tiles * 32 - 32, 32) == 2
    assert decode.stages_for_chunk(2, None, 100 * 32, 32) == 2
    assert decode.decode_config(256, torch.float16, torch.int8, False)["LONG_SPLIT_STAGES"] == 3
    assert decode.decode_config(128, torch.float16, torch.int8, False)["LONG_SPLIT_PREFETCH"]
    assert decode.is_long_split(tiles * 32, 32) and not decode.is_long_split(tiles * 32 - 1, 32)
    assert "LONG_SPLIT_STAGES" not in decode.decode_config(256, torch.bfloat16, torch.bfloat16,
                                                           False)  # fmt: skip


@interpret
def test_dsa_rotary_offset_uses_torch_prologue():
    kw = build(8, h=64, rotary_offset=16, m=20)
    check_dsa(kw)


@interpret
def test_dsa_packed_qkv_position_ids_interleaved():
    kw = build(13, h=32, s=2, m=20)
    kw["position_ids"] = torch.tensor([[3, 9], [0, 40]], device=DEV)
    kw["rotary_interleaved"] = True
    check_dsa(kw)
    packed = dict(kw, query=torch.cat((kw["query"], kw["key"], kw["value"]), -1))
    packed.update(key=None, value=None)
    torch.testing.assert_close(run(packed, backend="triton")[0], run(kw, backend="triton")[0])


@interpret
def test_dsa_triton_and_torch_prologues_agree():
    kw = build(9, h=32, cache_dtype=torch.int8, per_channel=True, s=2)
    a, _ = _run_with_splits(kw, None, prologue="triton")
    t, _ = _run_with_splits(kw, None, prologue="torch")
    torch.testing.assert_close(a, t, rtol=2e-3, atol=2e-3)


def _scaled_pow2_case(kw, q_pow, k_pow):
    """The same attention with Q (and the new K) times ``2**q_pow`` / ``2**k_pow``, the K scale
    times ``2**k_pow`` and the softmax scale divided by ``2**(q_pow + k_pow)`` (no QK-norm):
    every logit and every cached integer are unchanged in exact arithmetic."""
    kw = dict(kw, q_norm_weight=None, k_norm_weight=None)
    big = dict(kw)
    big["query"] = kw["query"] * 2.0**q_pow
    big["key"] = kw["key"] * 2.0**k_pow
    big["k_scale"] = kw["k_scale"] * 2.0**k_pow
    h = kw["query"].shape[-1] // kw["num_heads"]
    big["scale"] = h**-0.5 * 2.0 ** -(q_pow + k_pow)
    return kw, big


@interpret
@pytest.mark.parametrize("variant", ["triton", "torch", "fused"])
def test_dsa_int8_pow2_q_rows_never_overflow(variant):
    """int8 K cache with 16-bit activations (QSA mode): the prepared Q (k_scale folded in) is
    rounded to fp16 after a power-of-two row scaling, undone on the fp32 logits. Q times 2**12
    and k_scale times 2**10 (folded Q ~ 1e6, far beyond fp16's 65504, an overflow without the
    row scaling) give the unscaled case's output bit for bit (power-of-two factors are exact),
    and both are within the fp64 tolerance."""
    extra = dict(rotary_offset=16, h=64) if variant == "torch" else dict(h=32)
    kw = build(77, cache_dtype=torch.int8, per_channel=True, m=24, **extra)
    kw, big = _scaled_pow2_case(kw, 12, 10)
    cfg = dict(FUSE_PROLOGUE=True) if variant == "fused" else {}
    prologue = "torch" if variant == "torch" else "triton"
    base, (bk, _) = _run_with_splits(_clone(kw), 3, prologue=prologue, **cfg)
    got, (gk, _) = _run_with_splits(_clone(big), 3, prologue=prologue, **cfg)
    assert torch.equal(gk, bk)  # the same integers appended
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, base, rtol=0, atol=0)
    assert_close_to_fp64(base, truth_of(kw), lowp_dsa(kw), name="dsa triton int8 pow2")


def _tiny_key_twins(kw, k_pow):
    """(tiny, twin) of an int8 local-mode case without K-norm: ``tiny`` has the new keys, the
    auxiliary keys and ``k_scale`` times 2**-k_pow and the softmax scale times 2**k_pow (the
    cached integers unchanged); ``twin`` is the same attention at the original scale, its keys
    tiny's times 2**k_pow (exact: 2**-k_pow is applied in the activation dtype first). Every
    logit and every cached or appended integer is the same in exact arithmetic."""
    f = 2.0**-k_pow
    h = kw["query"].shape[-1] // kw["num_heads"]
    tiny = dict(kw, k_norm_weight=None, k_scale=kw["k_scale"] * f, scale=h**-0.5 / f)
    twin = dict(kw, k_norm_weight=None, scale=h**-0.5)
    for name in ("key", "auxiliary_key"):
        tiny[name] = (kw[name].float() * f).to(kw[name].dtype)
        twin[name] = (tiny[name].float() / f).to(kw[name].dtype)
    return tiny, twin


def check_tiny_keys(kw, k_pow=14):
    """An int8 main cache with tiny keys (``_tiny_key_twins``): the window's Q * k_scale ~ 1e-6
    .. 3e-5 (fp16 subnormals below 6.1e-5). The tier's error vs fp64 is within the house
    tolerance of the same-precision baseline of the normal-scale twin, and its output and
    caches equal the twin's bit for bit (the power-of-two factors of the Q rows are exact)."""
    tiny, twin = _tiny_key_twins(kw, k_pow)
    got, gk, gv = run(tiny, backend="triton")
    want, wk, wv = run(twin, backend="triton")
    assert torch.equal(gk, wk) and torch.equal(gv, wv)  # the same integers appended
    assert_close_to_fp64(got, truth_of(tiny), lowp_dsa(twin), name="dsa triton tiny keys")
    assert torch.equal(got, want), "tiny keys: not the normal-scale twin's output"
    return got


@interpret
@pytest.mark.parametrize("per_channel", [False, True])
def test_dsa_local_int8_tiny_keys_pow2_q_rows(per_channel):
    """local_plus_selected with an int8 main cache, fp16 activations, keys ~3e-4 (k_scale ~2e-6
    per tensor / per channel): the window keys' folded Q is rounded to fp16 with power-of-two
    rows, undone on their fp32 logits only; the auxiliary keys' unfolded Q is unscaled (before:
    8-14x the baseline's rms error, output not the twin's)."""
    kw = build(78 + per_channel, cache_dtype=torch.int8, per_channel=per_channel,
               mode="local_plus_selected", s=2, h=32, m=24, window=8)  # fmt: skip
    check_tiny_keys(kw)


@interpret
def test_dsa_query_dtype_and_fp16_value():
    kw = build(10, dtype=torch.float32, cache_dtype=torch.float16, v_dtype=torch.float16, h=32)
    check_dsa(kw, query_dtype=torch.float16)
    _, _, pv = run(kw, backend="triton")
    v = kw["value"].reshape(2, 1, 2, 32)
    for i, t in enumerate((20, 33)):
        assert torch.equal(pv[i, :, t], v[i, 0])  # fp16 V stored without loss


@interpret
def test_dsa_shared_auxiliary_and_fp32_aux_with_fp16_cache():
    kw = build(11, mode="local_plus_selected", shared_aux=True, aux_dtype=torch.float32, h=32)
    check_dsa(kw)


# ---------------------------------------------------------------------------------------------
# Gates.


def test_gates_on_cpu():
    kw = build(12, h=32, device="cpu")
    with pytest.raises(RuntimeError, match="head_size 8"):
        run(build(12, h=8, device="cpu"), backend="triton")
    with pytest.raises(RuntimeError, match="bf16|CUDA"):
        run(build(12, h=16, dtype=torch.bfloat16, device="cpu"), backend="triton")
    g = dsa_gates(kw["query"])  # auto never picks the interpreter (nor a gate without params)
    assert not g["triton"](False)[0]


# ---------------------------------------------------------------------------------------------
# Indexer.


def _icase(seed, *, b, s, ni, di, nb, seqlens, dtype=torch.float32, device=DEV):
    gen = torch.Generator(device=device).manual_seed(seed)
    iq = torch.randn(b, s, ni * di, generator=gen, device=device).to(dtype)
    keys = torch.randn(b, nb, di, generator=gen, device=device)
    return iq, keys, torch.tensor(seqlens, dtype=torch.int32, device=device)


def check_indexer(iq, keys, sk, **kw):
    got = sparse_attention_indexer(iq, keys, sk, backend="triton", **kw)
    want = sparse_attention_indexer(iq, keys, sk, backend="reference", **kw)
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.int32
    assert torch.equal(got[1], want[1]), "counts differ"
    assert torch.equal(got[0], want[0]), "selections differ"
    return got


_IGRID = [
    # b, s, ni, di, r, budget, seqlens, dtype
    (2, 1, 4, 32, 8, 32, [100, 37], torch.float32),
    (1, 8, 3, 16, 16, 64, [255], torch.float16),
    (2, 5, 2, 48, 4, 10, [50, 9], torch.float32),  # budget not a multiple of r, DI padded
    (3, 1, 1, 32, 64, 256, [1000, 63, 5], torch.float32),
    (1, 20, 2, 16, 1, 20, [40], torch.float16),  # r = 1, two row tiles
    (2, 3, 4, 32, 8, 4, [30, 60], torch.float32),  # budget < r: trailing tokens only
    (2, 1, 2, 16, 4, 400, [30, 70], torch.float32),  # budget > every block
]


@interpret
@pytest.mark.parametrize("b,s,ni,di,r,budget,seqlens,dtype", _IGRID)
def test_indexer_equals_reference(b, s, ni, di, r, budget, seqlens, dtype):
    nb = max(seqlens) // r + 2
    iq, keys, sk = _icase(b * 100 + s, b=b, s=s, ni=ni, di=di, nb=nb, seqlens=seqlens, dtype=dtype)
    check_indexer(iq, keys, sk, compress_ratio=r, token_budget=budget)


@interpret
def test_indexer_first_prompt_padding_rows():
    iq, keys, sk = _icase(1, b=2, s=24, ni=2, di=16, nb=4, seqlens=[23, 12])
    idx, cnt = check_indexer(iq, keys, sk, compress_ratio=8, token_budget=16,
                             total_sequence_length=24, scale=0.3)  # fmt: skip
    assert (cnt[24 + 13 :] == 0).all()


@interpret
def test_indexer_ties_go_to_the_lower_block():
    di, r = 16, 4
    e0 = torch.zeros(di, device=DEV)
    e0[0] = 1.0
    keys = -e0.repeat(1, 10, 1)  # relu -> score 0 (and -0.0 products)
    keys[0, [2, 7]] = 2 * e0
    keys[0, [5, 8]] = e0
    q = torch.stack((e0, 3 * e0)).reshape(1, 1, 2 * di)
    sk = torch.tensor([39], dtype=torch.int32, device=DEV)
    for budget, want in ((4, [2]), (8, [2, 7]), (12, [2, 5, 7]), (20, [0, 2, 5, 7, 8])):
        idx, cnt = check_indexer(q, keys, sk, compress_ratio=r, token_budget=budget)
        assert sorted({t // r for t in idx[0, : cnt[0]].tolist()}) == want
    idx, cnt = check_indexer(q * 0, keys, sk, compress_ratio=r, token_budget=12)
    assert sorted({t // r for t in idx[0, : cnt[0]].tolist()}) == [0, 1, 2]


@interpret
def test_indexer_sort_keys_order_scores():
    """The kernel's keys decode to the reference scores' order (and -inf where invisible)."""
    iq, keys, sk = _icase(3, b=1, s=2, ni=2, di=16, nb=12, seqlens=[50])
    k = indexer.indexer_sort_keys(iq, keys, sk, num_index_heads=2, compress_ratio=8,
                                  scale=0.25, is_first_prompt=False)  # fmt: skip
    hi = (k >> 32).to(torch.int32)
    bits = torch.where(hi >= 0, hi, hi ^ 0x7FFFFFFF)
    score = bits.view(torch.float32)
    from longattn.sparse.reference import indexer_scores_reference

    want = indexer_scores_reference(iq, keys, 2, 0.25)
    vis = torch.arange(12, device=DEV)[None, :] < torch.tensor(
        [[6], [6]], device=DEV
    )  # qpos 49, 50: 6 blocks of 8
    torch.testing.assert_close(score[vis], want[vis], rtol=1e-6, atol=1e-6)
    assert torch.isinf(score[~vis]).all()


@interpret
@pytest.mark.parametrize("s_tile", [1, 3])
def test_indexer_scores_rows_per_program(s_tile):
    """``S_TILE`` rows per score program (the S = 8 decode option of ``score_config``): every
    row of every program is written (NaN-poisoned output), each equals the reference score, and
    no program writes a row of another's (the default one-program layout gives the same)."""
    iq, keys, sk = _icase(5, b=2, s=7, ni=2, di=16, nb=12, seqlens=[80, 60])
    kw = dict(num_index_heads=2, compress_ratio=8, scale=0.25, is_first_prompt=False)
    orig = indexer._empty
    indexer._empty = lambda *a, **k: torch.full(*a, float("nan"), **k)  # poison
    try:
        cfg = dict(BLOCK_B=16, BLOCK_R=16, BLOCK_D=16, num_warps=4, S_TILE=s_tile)
        got = indexer.indexer_scores(iq, keys, sk, cfg=cfg, **kw)
        ref = indexer.indexer_scores(iq, keys, sk, **kw)
    finally:
        indexer._empty = orig
    from longattn.sparse.reference import indexer_scores_reference

    want = indexer_scores_reference(iq, keys, 2, 0.25)
    assert not got.isnan().any() and not ref.isnan().any()
    vis = ~torch.isinf(ref)
    assert torch.equal(torch.isinf(got), ~vis)
    torch.testing.assert_close(got[vis], want[vis], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    # the first program of each sequence alone writes its S_TILE rows and nothing else
    # (the interpreter runs programs in order, so a later program would hide a stray write)
    real_cdiv = indexer.cdiv
    indexer._empty = lambda *a, **k: torch.full(*a, float("nan"), **k)
    indexer.cdiv = lambda a, b: 1 if (a, b) == (7, s_tile) else real_cdiv(a, b)
    try:
        first = indexer.indexer_scores(iq, keys, sk, cfg=cfg, **kw).view(2, 7, -1)
    finally:
        indexer._empty, indexer.cdiv = orig, real_cdiv
    assert first[:, s_tile:].isnan().all()
    torch.testing.assert_close(first[:, :s_tile], got.view(2, 7, -1)[:, :s_tile], rtol=0, atol=0)


@interpret
def test_indexer_score_dot_precision_is_checked():
    iq, keys, sk = _icase(5, b=1, s=1, ni=2, di=16, nb=4, seqlens=[30])
    cfg = dict(BLOCK_B=16, BLOCK_R=16, BLOCK_D=16, num_warps=4, DOT_PREC="tf32")
    with pytest.raises(ValueError, match="DOT_PREC"):
        indexer.indexer_scores(iq, keys, sk, cfg=cfg, num_index_heads=2, compress_ratio=8,
                               scale=0.25, is_first_prompt=False)  # fmt: skip


@interpret
@pytest.mark.parametrize("s_tile", [17, -1])
def test_indexer_rows_per_program_out_of_range(s_tile):
    iq, keys, sk = _icase(5, b=1, s=7, ni=2, di=16, nb=12, seqlens=[80])
    cfg = dict(BLOCK_B=16, BLOCK_R=16, BLOCK_D=16, num_warps=4, S_TILE=s_tile)
    with pytest.raises(ValueError, match="S_TILE"):
        indexer.indexer_scores(iq, keys, sk, cfg=cfg, num_index_heads=2, compress_ratio=8,
                               scale=0.25, is_first_prompt=False)  # fmt: skip


def test_indexer_gate_on_cpu():
    iq, keys, sk = _icase(4, b=1, s=1, ni=1, di=8, nb=4, seqlens=[9], device="cpu")
    with pytest.raises(RuntimeError, match="index_head_dim 8"):
        sparse_attention_indexer(iq, keys, sk, compress_ratio=4, token_budget=4,
                                 backend="triton")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# GPU: real shapes (bf16 included). Each case runs in well under a second on an H200.

_GPU_GRID = [
    # b, s, h, group, kv, past, cache, mode
    (1, 1, 256, 6, 4, (65531,), torch.bfloat16, "selected_only"),
    (4, 1, 256, 6, 4, (40000, 65531, 3000, 100), torch.float16, "selected_only"),
    (4, 8, 256, 6, 4, (20000, 65000, 7000, 300), torch.bfloat16, "selected_only"),
    (1, 8, 256, 6, 4, (32760,), torch.int8, "selected_only"),
    (2, 1, 128, 8, 2, (10000, 4096), torch.bfloat16, "selected_only"),
    (2, 8, 64, 1, 8, (5000, 9000), torch.float16, "selected_only"),
    (2, 1, 128, 4, 2, (8000, 333), torch.int8, "local_plus_selected"),
    (1, 8, 256, 6, 4, (20000,), torch.bfloat16, "local_plus_selected"),
]


@gpu
@pytest.mark.parametrize("b,s,h,group,kv,past,cache,mode", _GPU_GRID)
def test_gpu_dsa_real_shapes(b, s, h, group, kv, past, cache, mode):
    kw = build(
        b * 1000 + s * 10 + h, device="cuda", b=b, s=s, n=kv * group, kv=kv, h=h, past=past,
        mode=mode, dtype=torch.bfloat16, cache_dtype=cache, m=2111, window=128,
        aux_len=4096, per_channel=cache == torch.int8 and h == 128,
    )  # fmt: skip
    out, _, _ = check_dsa(kw)
    assert torch.isfinite(out).all()


@gpu
@pytest.mark.parametrize(
    "cfg",
    [
        dict(
            maxnreg=None,
            SM_PROGRAMS=None,
            LONG_SPLIT_STAGES=None,
            num_stages=2,
            LONG_SPLIT_PREFETCH=False,
        ),  # fmt: skip  # session 22
        dict(LONG_SPLIT_PREFETCH=False),  # sessions 23-33
        dict(num_stages=2, LONG_SPLIT_STAGES=None, LONG_SPLIT_PREFETCH=False),
        dict(num_stages=3, LONG_SPLIT_STAGES=None, LONG_SPLIT_PREFETCH=False),
        dict(num_stages=1, LONG_SPLIT_STAGES=None, LONG_SPLIT_PREFETCH=False),
        dict(BLOCK_N=16, num_stages=3, maxnreg=128, SM_PROGRAMS=4),
        dict(V_PAIRS=False),  # session 36: V by bytes (V_PAIRS is the default)
        dict(V_PAIRS=True, maxnreg=128, SM_PROGRAMS=4),
    ],
)
@pytest.mark.parametrize("s", [1, 8])
def test_gpu_dsa_int8_register_caps(cfg, s):
    """The int8 split kernel (fp16 power-of-two Q rows, bf16 activations, H=256) in the
    configs that bench_sparse's cache section A/Bs against the default (register caps, stages,
    smaller tiles): within the fp64 tolerance, and within two output roundings of the default
    config (itself within the fp64 tolerance in test_gpu_dsa_real_shapes)."""
    kw = build(31 + s, device="cuda", b=2, s=s, h=256, n=24, kv=4, past=(9000, 70000),
               m=2111, dtype=torch.bfloat16, cache_dtype=torch.int8, per_channel=True)  # fmt: skip
    base, _ = _run_with_splits(_clone(kw), None)
    got, _ = _run_with_splits(_clone(kw), None, **cfg)
    _assert_within_roundings(got, base, 2)
    assert_close_to_fp64(got, truth_of(kw), lowp_dsa(kw), name="dsa triton int8 capped")


@gpu
@pytest.mark.parametrize(
    "cache,mode,extra",
    [
        (torch.bfloat16, "selected_only", {}),
        (torch.float16, "selected_only", {}),
        (torch.int8, "selected_only", {}),  # the int8 default's 168-register cap
        (torch.int8, "selected_only", dict(maxnreg=None, SM_PROGRAMS=2)),
        (torch.bfloat16, "local_plus_selected", {}),
        (torch.bfloat16, "selected_only", dict(FUSE_PROLOGUE=True)),
    ],
)
@pytest.mark.parametrize("s", [1, 8])
def test_gpu_dsa_prefetch_matches_the_tile_loop(cache, mode, extra, s):
    """``PREFETCH`` at the Qwen-like geometry (bf16 activations, budget 2048, splits of one to
    many tiles): within two output roundings of the default loop (the same tiles in the same
    order), within the fp64 tolerance, and the same caches bit for bit. The base loop is
    the plain one for every split (without the int8 default's ``LONG_SPLIT_PREFETCH``)."""
    if s > 1 and extra.get("FUSE_PROLOGUE"):
        pytest.skip("the fused prologue is S = 1 only")
    kw = build(61 + s, device="cuda", b=2, s=s, h=256, n=24, kv=4, past=(9000, 70000),
               m=2111, dtype=torch.bfloat16, cache_dtype=cache, mode=mode, window=128,
               aux_len=4096, per_channel=cache == torch.int8)  # fmt: skip
    if s == 1:
        kw = _with_new_token_selected(kw)
    plain = dict(extra, LONG_SPLIT_PREFETCH=False)
    _assert_variant_matches(kw, "dsa triton prefetch", base_cfg=plain, PREFETCH=True)


@gpu
@pytest.mark.parametrize(
    "cache,mode,extra",
    [
        (torch.bfloat16, "selected_only", {}),
        (torch.bfloat16, "selected_only", {"maxnreg": 168}),
        (torch.float16, "selected_only", {}),
        (torch.int8, "selected_only", {"maxnreg": 128}),
        (torch.bfloat16, "local_plus_selected", {}),
        (torch.int8, "local_plus_selected", {}),
    ],
)
def test_gpu_dsa_fused_prologue_matches_the_prologue_kernel(cache, mode, extra):
    """bf16 activations at the Qwen-like geometry (with the register cap the benchmark tries):
    the fused prologue is within the fp64 tolerance, within two output roundings of the
    unfused tier, and leaves the same caches bit for bit."""
    kw = build(23, device="cuda", b=2, h=256, n=24, kv=4, past=(5000, 70000), m=2111,
               dtype=torch.bfloat16, cache_dtype=cache, mode=mode, window=128,
               aux_len=4096, per_channel=cache == torch.int8)  # fmt: skip
    kw = _with_new_token_selected(kw)
    _assert_variant_matches(kw, "dsa triton fused", FUSE_PROLOGUE=True, **extra)


@gpu
@pytest.mark.parametrize(
    "b,s,h,group,kv,past,dtype,per_channel",
    [
        (2, 1, 128, 4, 2, (8000, 333), torch.bfloat16, True),
        (1, 8, 256, 6, 4, (20000,), torch.bfloat16, False),
        (2, 1, 128, 8, 2, (10000, 4096), torch.float16, True),
    ],
)
def test_gpu_dsa_local_int8_tiny_keys(b, s, h, group, kv, past, dtype, per_channel):
    """Real shapes of ``check_tiny_keys`` (local_plus_selected, int8 main cache): bf16
    activations take the fp16 power-of-two window Q too, with a bf16 unfolded Q for the
    auxiliary keys (the interpreter cannot run bf16)."""
    kw = build(
        b * 1000 + s * 10 + h, device="cuda", b=b, s=s, n=kv * group, kv=kv, h=h, past=past,
        mode="local_plus_selected", dtype=dtype, cache_dtype=torch.int8, m=2111, window=128,
        aux_len=4096, per_channel=per_channel,
    )  # fmt: skip
    assert torch.isfinite(check_tiny_keys(kw)).all()


@gpu
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_dsa_cuda_graph_capture(fused, monkeypatch):
    if fused:
        orig = decode.decode_config
        monkeypatch.setattr(decode, "decode_config", lambda *a: dict(orig(*a), FUSE_PROLOGUE=True))
    kw = build(21, device="cuda", b=2, h=256, n=24, kv=4, past=(5000, 7000), m=2111,
               dtype=torch.bfloat16, counts="full")  # fmt: skip
    pk, pv = kw["past_key"].clone(), kw["past_value"].clone()
    args = dict(kw, past_key=pk, past_value=pv)
    want = dynamic_sparse_attention(**_clone(kw), backend="triton")[0]
    dynamic_sparse_attention(**args, backend="triton")  # warm-up (compile) outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dynamic_sparse_attention(**args, backend="triton")[0]
    pk.copy_(kw["past_key"])
    pv.copy_(kw["past_value"])
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("s,ni,di,t", [(1, 16, 128, 65536), (8, 16, 128, 65536), (8, 4, 64, 3000)])
def test_gpu_indexer_real_shapes(s, ni, di, t):
    r, budget = 64, 2048
    seqlens = [t - 1, t // 3, 100, t - 64]
    iq, keys, sk = _icase(s + di, b=4, s=s, ni=ni, di=di, nb=t // r + 1, seqlens=seqlens,
                          dtype=torch.bfloat16, device="cuda")  # fmt: skip
    check_indexer(iq, keys, sk, compress_ratio=r, token_budget=budget)


@gpu
@pytest.mark.parametrize(
    "b,s,t,dtype",
    [(1, 1, 131072, torch.bfloat16), (4, 1, 262144, torch.bfloat16), (4, 8, 65536, torch.bfloat16),
     (2, 64, 8192, torch.bfloat16), (2, 1, 65536, torch.float16), (1, 8, 32768, torch.float32)],
)  # fmt: skip
def test_gpu_indexer_scores_vs_fp64(b, s, t, dtype):
    """The default score config (split3 tensor-core dots for a bf16 query, bf16x6 for fp16 /
    fp32) against an fp64 score: error within 2x of the same scores computed by torch in fp32
    (TF32 off), and of the fp32 FMA dots."""
    ni, di, r = 16, 128, 64
    nb = t // r
    iq, keys, sk = _icase(b * s + t, b=b, s=s, ni=ni, di=di, nb=nb, seqlens=[t - 1] * b,
                          dtype=dtype, device="cuda")  # fmt: skip
    kw = dict(num_index_heads=ni, compress_ratio=r, scale=di**-0.5, is_first_prompt=False)
    got = indexer.indexer_scores(iq, keys, sk, **kw)
    cfg = dict(indexer.score_config(b, s, ni, nb, 132, False), DOT_PREC="ieee")
    fma = indexer.indexer_scores(iq, keys, sk, cfg=cfg, **kw)

    def score(q, k):  # [B*S, NB]
        d = torch.einsum("bshd,bcd->bshc", q.view(b, s, ni, di), k)
        return (d.clamp_min(0).sum(2) * di**-0.5).reshape(b * s, nb)

    want = score(iq.double(), keys.double())
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch32 = score(iq.float(), keys)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    vis = torch.isfinite(fma)  # blocks visible to each row (the rest is -inf)
    assert torch.equal(torch.isfinite(got), vis)

    def err(x):
        return float(((x.double() - want).abs() / want.abs().clamp_min(1e-2))[vis].max())

    assert err(got) <= 2 * max(err(torch32), err(fma)), (err(got), err(torch32), err(fma))


@gpu
def test_gpu_auto_picks_triton():
    kw = build(22, device="cuda", h=128, n=8, kv=2, dtype=torch.bfloat16)
    from longattn import _cascade

    g = dsa_gates(kw["query"], kw["key"], kw["value"], kw["past_key"], None, None,
                  _params_of(kw))  # fmt: skip
    assert _cascade.select_backend("dsa", "auto", g) == "triton"


def _params_of(kw):
    from longattn.sparse._params import DSAParams

    return DSAParams(
        num_heads=kw["num_heads"], kv_num_heads=kw["kv_num_heads"],
        head_size=kw["query"].shape[-1] // kw["num_heads"], scale=1.0, local_window_size=-1,
        attention_mode="selected_only", selected_kv_source="main", do_rotary=True,
        rotary_interleaved=False, rotary_offset=0, smooth_softmax=False, qk_norm_epsilon=1e-6,
        auxiliary_kv_shared=False, is_first_prompt=False,
        total_sequence_length=kw["total_sequence_length"], query_dtype=None, cos_cache=None,
        sin_cache=None, position_ids=None, head_sink=None, q_norm_weight=None,
        k_norm_weight=None, k_scale=None, v_scale=None,
    )  # fmt: skip


@interpret
@pytest.mark.parametrize("fused", [False, True])
def test_dsa_validate_off_out_of_range_seqlens_writes_nothing_outside(fused, monkeypatch):
    """validate="off" with a sequence length past the cache: no host check, the new token's
    append at qpos >= capacity is dropped, no other cache row of that sequence changes. (The
    output is undefined: the claimed length makes build()'s NaN-filled unused rows visible.)
    ``fused``: the same with the split kernel's fused prologue (split 0 stores the row)."""
    if fused:
        orig = decode.decode_config
        monkeypatch.setattr(decode, "decode_config", lambda *a: dict(orig(*a), FUSE_PROLOGUE=True))
    kw = build(21, b=2, s=1, past=(20, 33), dtype=torch.float32)
    cap = kw["past_key"].shape[2]
    kw["seqlens_k"] = torch.tensor([19, cap + 5], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="seqlens_k must lie"):
        run(kw, backend="triton")
    out, pk, pv = run(kw, backend="triton", validate="off")
    assert out.shape == kw["query"].shape

    def bits(t):  # bitwise view: the unused rows hold NaN
        return t.contiguous().view(torch.uint8)

    assert torch.equal(bits(pk[1]), bits(kw["past_key"][1]))
    assert torch.equal(bits(pv[1]), bits(kw["past_value"][1]))
    assert torch.equal(bits(pk[0, :, :19]), bits(kw["past_key"][0, :, :19]))


def test_merge_launch_one_warp_tiles(monkeypatch):
    """``merge_launch``: one warp and <= MERGE_WARP_TILE values per program from
    ``MERGE_ONE_WARP_FROM`` (default 64) slots on, up to the slots a 16-channel one-warp tile
    holds (beyond: 4 warps again); 4 warps and <= MERGE_TILE values otherwise, or when off."""
    launch = _triton_merge.merge_launch
    assert _triton_merge.MERGE_ONE_WARP_FROM == 64
    assert launch(256, 128) == (16, 1) and launch(256, 64) == (32, 1)
    assert launch(128, 32) == (128, 4)  # below the threshold: unchanged
    assert launch(256, 256) == (32, 4)  # 16 x 256 values would be twice MERGE_WARP_TILE
    for head in (64, 80, 128, 256):
        for pad in (2, 16, 64, 128, 256, 512):
            block_d, warps = launch(head, pad)
            assert block_d >= 16 and block_d * pad <= (2048 if warps == 1 else 8192), (head, pad)
    monkeypatch.setattr(_triton_merge, "MERGE_ONE_WARP_FROM", None)
    assert launch(256, 128) == (64, 4) and launch(128, 16) == (128, 4)
