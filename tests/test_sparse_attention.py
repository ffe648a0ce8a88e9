"""DynamicSparseAttention: hand-checkable spec cases, a seeded grid vs the fp64 reference (and a
plain dense-masked oracle written here), mixed precision, strict validation, bad input, opcheck
and torch.compile."""

from __future__ import annotations

import math
import random

import pytest
import torch

from longattn._rotary import apply_rotary, rms_norm, rope_cache
from longattn.sparse import dynamic_sparse_attention
from longattn.sparse._params import DSAParams
from longattn.sparse.chunked import dsa_chunked
from longattn.sparse.reference import dsa_reference
from longattn.testing import assert_close_to_fp64, nan_tensor

TIERS = ("reference", "chunked")


# ---------------------------------------------------------------------------------------------
# Case builder and the plain oracle.


def _random_selection(gen, rows_qpos, m, *, source, capacity, aux_len, extra_invalid=True):
    """Per row: a sorted random subset of valid positions, maybe + invalid entries, -1 padded."""
    sel = torch.full((len(rows_qpos), m), -1, dtype=torch.int32)
    cnt = torch.zeros(len(rows_qpos), dtype=torch.int32)
    for r, qp in enumerate(rows_qpos):
        limit = (qp + 1) if source == "main" else aux_len
        if limit <= 0:
            continue
        k = int(torch.randint(0, min(m, limit) + 1, (1,), generator=gen))
        picks = torch.randperm(limit, generator=gen)[:k].sort().values.tolist()
        if extra_invalid and k < m and torch.rand((), generator=gen) < 0.5:
            bad = (
                qp + 1 + int(torch.randint(0, 5, (1,), generator=gen))
                if source == "main"
                else aux_len + 2
            )
            picks.append(bad)  # future / out-of-range entry: skipped
        sel[r, : len(picks)] = torch.tensor(picks, dtype=torch.int32)
        cnt[r] = len(picks)
    return sel, cnt


def make_case(
    seed,
    *,
    b=2,
    s=1,
    n=4,
    kv=2,
    h=64,
    past=(20, 33),
    capacity=None,
    mode="selected_only",
    dtype=torch.float32,
    cache_dtype=None,
    v_dtype=None,
    m=24,
    window=8,
    aux_len=40,
    aux_dtype=None,
    shared_aux=False,
    rotary=True,
    norm=True,
    sink=True,
    first_prompt=False,
    per_channel=False,
):
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    v_dtype = v_dtype or dtype

    def rnd(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dt)

    if first_prompt:
        past = tuple(0 for _ in range(b))
        totals = [s - i % 2 * (s // 3) for i in range(b)]  # right padding in odd sequences
        t_max = s
    else:
        totals = [p + s for p in past]
        t_max = max(totals)
    cap = capacity or t_max
    kw = dict(
        query=rnd(b, s, n * h),
        key=rnd(b, s, kv * h),
        value=rnd(b, s, kv * h, dt=v_dtype),
        seqlens_k=torch.tensor([t - 1 for t in totals], dtype=torch.int32),
        total_sequence_length=t_max,
        num_heads=n,
        kv_num_heads=kv,
        attention_mode=mode,
        selected_kv_source="main" if mode == "selected_only" else "auxiliary",
    )
    if not first_prompt:
        if cache_dtype == torch.int8:
            shape = (kv, 1, h) if per_channel else (1,)
            kw["k_scale"] = (torch.rand(shape, generator=gen) * 0.02 + 0.02).float()
            kw["v_scale"] = (torch.rand(shape, generator=gen) * 0.02 + 0.02).float()
            pk = torch.randint(-127, 128, (b, kv, cap, h), generator=gen, dtype=torch.int8)
            pv = torch.randint(-127, 128, (b, kv, cap, h), generator=gen, dtype=torch.int8)
        else:
            pk = rnd(b, kv, cap, h, dt=cache_dtype)
            pv = rnd(b, kv, cap, h, dt=cache_dtype)
        for i, p in enumerate(past):  # rows past the sequence hold NaN (must never leak)
            if cache_dtype != torch.int8:
                pk[i, :, p:] = float("nan")
                pv[i, :, p:] = float("nan")
        kw["past_key"], kw["past_value"] = pk, pv
    else:
        kw["kv_cache_dtype"] = cache_dtype
        if cache_dtype == torch.int8:
            kw["k_scale"] = torch.tensor([0.03])
            kw["v_scale"] = torch.tensor([0.03])
    if rotary:
        cos, sin = rope_cache(t_max + 8, h // 2 if h >= 64 else h)
        kw.update(cos_cache=cos, sin_cache=sin, do_rotary=True)
    if norm:
        kw["q_norm_weight"] = 1 + 0.1 * rnd(h, dt=torch.float32)
        kw["k_norm_weight"] = 1 + 0.1 * rnd(h, dt=torch.float32)
    if sink:
        kw["head_sink"] = rnd(n, dt=torch.float32)
    qpos = []
    for i in range(b):
        for j in range(s):
            qpos.append(j if first_prompt else totals[i] - s + j)
    if mode == "local_plus_selected":
        kw["local_window_size"] = window
        aux_dt = aux_dtype or dtype
        kw["auxiliary_key"] = rnd(b, kv, aux_len, h, dt=aux_dt)
        if shared_aux:
            kw["auxiliary_kv_shared"] = True
        else:
            kw["auxiliary_value"] = rnd(b, kv, aux_len, h, dt=aux_dt)
    sel, cnt = _random_selection(
        gen,
        qpos,
        m,
        source="main" if mode == "selected_only" else "aux",
        capacity=cap,
        aux_len=aux_len,
    )
    kw["selected_indices"], kw["selected_counts"] = sel, cnt
    return kw


def _clone_caches(kw):
    kw = dict(kw)
    for name in ("past_key", "past_value"):
        if kw.get(name) is not None:
            kw[name] = kw[name].clone()
    return kw


def run(kw, **extra):
    return dynamic_sparse_attention(**_clone_caches(kw), **extra)


def _dequant(x, scale):
    if x.dtype == torch.int8:
        return x.to(torch.float64) * (scale.reshape(()) if scale.numel() == 1 else scale).double()
    return x.to(torch.float64)


def to_fp64(kw):
    """Every input upcast to fp64 (caches dequantized, scales dropped): the truth's inputs."""
    out = dict(kw)
    for name in (
        "query",
        "key",
        "value",
        "auxiliary_key",
        "auxiliary_value",
        "head_sink",
        "q_norm_weight",
        "k_norm_weight",
        "cos_cache",
        "sin_cache",
    ):
        if out.get(name) is not None:
            out[name] = out[name].to(torch.float64)
    if out.get("past_key") is not None:
        out["past_key"] = _dequant(kw["past_key"], kw.get("k_scale"))
        out["past_value"] = _dequant(kw["past_value"], kw.get("v_scale"))
    else:
        out["kv_cache_dtype"] = torch.float64
    out.pop("k_scale", None)
    out.pop("v_scale", None)
    return out


def plain_dsa(kw, wd):
    """The spec written plainly (dense mask over every cache row), in working dtype ``wd``.

    wd = fp64: an independent oracle. wd = the activation dtype: the same-precision baseline
    (prologue, matmuls and the cache in low precision, softmax in fp32).
    """
    q_in, k_in, v_in = kw["query"], kw["key"], kw["value"]
    b, s, _ = q_in.shape
    n, kv = kw["num_heads"], kw["kv_num_heads"]
    h = q_in.shape[-1] // n
    g = n // kv
    t_max = kw["total_sequence_length"]
    seqlens = kw["seqlens_k"].tolist()
    first = s == t_max
    q = q_in.reshape(b, s, n, h).to(wd)
    k = k_in.reshape(b, s, kv, h).to(wd)
    v = v_in.reshape(b, s, kv, h).to(wd)
    eps = kw.get("qk_norm_epsilon", 1e-6)
    if kw.get("q_norm_weight") is not None:
        q = rms_norm(q, kw["q_norm_weight"].to(wd), eps)
        k = rms_norm(k, kw["k_norm_weight"].to(wd), eps)
    qpos = torch.tensor(
        [[j if first else seqlens[i] + 1 - s + j for j in range(s)] for i in range(b)]
    )
    if kw.get("do_rotary"):
        pos = kw.get("position_ids", qpos)
        pos = pos.clamp(0, kw["cos_cache"].shape[0] - 1)
        cos = kw["cos_cache"][pos].to(wd)[:, :, None]
        sin = kw["sin_cache"][pos].to(wd)[:, :, None]
        q = apply_rotary(q, cos, sin, interleaved=kw.get("rotary_interleaved", False))
        k = apply_rotary(k, cos, sin, interleaved=kw.get("rotary_interleaved", False))
    cache_dtype = (
        kw["past_key"].dtype if kw.get("past_key") is not None else kw.get("kv_cache_dtype", wd)
    )
    ks, vs = kw.get("k_scale"), kw.get("v_scale")
    if kw.get("past_key") is not None:
        kc = _dequant(kw["past_key"], ks).to(wd)
        vc = _dequant(kw["past_value"], vs).to(wd)
    else:
        kc = torch.zeros(b, kv, t_max, h, dtype=wd)
        vc = torch.zeros(b, kv, t_max, h, dtype=wd)
    cap = max(kc.shape[2], t_max)
    if kc.shape[2] < cap:
        pad = torch.zeros(b, kv, cap - kc.shape[2], h, dtype=wd)
        kc, vc = torch.cat((kc, pad), 2), torch.cat((vc, pad.clone()), 2)

    def store(x, scale):
        if cache_dtype == torch.int8:
            sc = scale.reshape(()) if scale.numel() == 1 else scale.reshape(kv, h)
            return torch.round(x.to(torch.float32) / sc).clamp(-127, 127) * sc
        return x.to(cache_dtype).to(wd)

    for i in range(b):
        for j in range(s):
            p = int(qpos[i, j])
            if p <= seqlens[i]:
                kc[i, :, p] = store(k[i, j], ks).to(wd)
                vc[i, :, p] = store(v[i, j], vs).to(wd)
    sdt = torch.float64 if wd == torch.float64 else torch.float32
    scale = kw.get("scale") or 1 / math.sqrt(h)
    sink = kw.get("head_sink")
    if sink is None and kw.get("smooth_softmax"):
        sink = torch.zeros(n)
    sel, cnt = kw["selected_indices"], kw["selected_counts"]
    local = kw["attention_mode"] == "local_plus_selected"
    w = kw.get("local_window_size", -1)
    aux_k = kw.get("auxiliary_key")
    aux_v = aux_k if kw.get("auxiliary_kv_shared") else kw.get("auxiliary_value")
    out = torch.zeros(b, s, n, h, dtype=torch.float64)
    for i in range(b):
        for j in range(s):
            row = i * s + j
            p = int(qpos[i, j])
            if p > seqlens[i]:
                continue  # padding row
            mask = torch.zeros(cap, dtype=torch.bool)
            aux_mask = torch.zeros(0 if aux_k is None else aux_k.shape[2], dtype=torch.bool)
            if local:
                mask[max(0, p - w + 1) : p + 1] = True
            for e in sel[row, : max(0, min(int(cnt[row]), sel.shape[1]))].tolist():
                if not local and 0 <= e <= p and e < cap:
                    mask[e] = True
                if local and 0 <= e < aux_mask.shape[0]:
                    aux_mask[e] = True
            keys = [kc[i, :, mask]]
            vals = [vc[i, :, mask]]
            if local:
                keys.append(aux_k[i][:, aux_mask].to(wd))
                vals.append(aux_v[i][:, aux_mask].to(wd))
            kk = torch.cat(keys, 1)  # [KV, L, H]
            vv = torch.cat(vals, 1)
            kk = kk.repeat_interleave(g, 0)  # [N, L, H]: query head n reads KV head n // g
            vv = vv.repeat_interleave(g, 0)
            x = torch.einsum("nh,nlh->nl", q[i, j], kk).to(sdt) * scale  # [N, L]
            if sink is not None:
                x = torch.cat((x, sink[:, None].to(sdt)), 1)
            if x.shape[1] == 0:
                continue
            pr = torch.softmax(x, 1)
            if sink is not None:
                pr = pr[:, :-1]
            out[i, j] = torch.einsum("nl,nlh->nh", pr.to(wd), vv).double()
    return out.reshape(b, s, n * h)


def truth_of(kw):
    out, _, _ = run(to_fp64(kw), backend="reference")
    return out


# ---------------------------------------------------------------------------------------------
# Hand-checkable spec cases.


def _simple(b=1, s=1, n=2, kv=1, h=8, total=10, m=6, gen_seed=0):
    gen = torch.Generator().manual_seed(gen_seed)
    return dict(
        query=torch.randn(b, s, n * h, generator=gen),
        key=torch.randn(b, s, kv * h, generator=gen),
        value=torch.randn(b, s, kv * h, generator=gen),
        past_key=torch.randn(b, kv, total, h, generator=gen),
        past_value=torch.randn(b, kv, total, h, generator=gen),
        seqlens_k=torch.full((b,), total - 1, dtype=torch.int32),
        total_sequence_length=total,
        num_heads=n,
        kv_num_heads=kv,
        selected_indices=torch.full((b * s, m), -1, dtype=torch.int32),
        selected_counts=torch.zeros(b * s, dtype=torch.int32),
    )


@pytest.mark.parametrize("backend", TIERS)
def test_uniform_logits_give_mean_of_selected_values(backend):
    kw = _simple()
    kw["query"].zero_()  # every logit is 0
    kw["selected_indices"][0, :4] = torch.tensor([1, 4, 7, 9], dtype=torch.int32)
    kw["selected_counts"][0] = 4
    out, pk, pv = run(kw, backend=backend)
    v_new = kw["value"].reshape(1, 1, 8)
    vals = torch.cat((kw["past_value"][0, 0, [1, 4, 7]], v_new[0]), 0)  # 9 = the new token
    want = vals.mean(0).repeat(2)
    torch.testing.assert_close(out[0, 0], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", TIERS)
def test_sink_shares_the_softmax(backend):
    kw = _simple()
    kw["query"].zero_()
    kw["selected_indices"][0, :3] = torch.tensor([0, 2, 5], dtype=torch.int32)
    kw["selected_counts"][0] = 3
    kw["head_sink"] = torch.tensor([math.log(3.0), 0.0])
    out, _, _ = run(kw, backend=backend)
    vals = kw["past_value"][0, 0, [0, 2, 5]]
    torch.testing.assert_close(out[0, 0, :8], vals.sum(0) / 6, rtol=1e-6, atol=1e-6)  # 3 + e^ln3
    torch.testing.assert_close(out[0, 0, 8:], vals.sum(0) / 4, rtol=1e-6, atol=1e-6)  # 3 + e^0
    out_s, _, _ = run(dict(kw, head_sink=None), smooth_softmax=True, backend=backend)
    torch.testing.assert_close(out_s[0, 0, 8:], vals.sum(0) / 4, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", TIERS)
def test_empty_selection_gives_zeros_and_still_appends(backend):
    kw = _simple()
    kw["head_sink"] = torch.tensor([0.5, -0.5])
    past_k, past_v = kw["past_key"].clone(), kw["past_value"].clone()
    out, pk, pv = dynamic_sparse_attention(**kw, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))
    assert pk is kw["past_key"] and pv is kw["past_value"]  # shared buffer, in place
    torch.testing.assert_close(pk[0, 0, 9], kw["key"][0, 0], rtol=0, atol=0)
    torch.testing.assert_close(pv[0, 0, 9], kw["value"][0, 0], rtol=0, atol=0)
    assert torch.equal(pk[:, :, :9], past_k[:, :, :9]) and torch.equal(
        pv[:, :, :9], past_v[:, :, :9]
    )


def _local_params(w):
    return DSAParams(
        num_heads=2,
        kv_num_heads=1,
        head_size=8,
        scale=8**-0.5,
        local_window_size=w,
        attention_mode="local_plus_selected",
        selected_kv_source="main",
        do_rotary=False,
        rotary_interleaved=False,
        rotary_offset=0,
        smooth_softmax=False,
        qk_norm_epsilon=1e-6,
        auxiliary_kv_shared=False,
        is_first_prompt=False,
        total_sequence_length=10,
        query_dtype=None,
        cos_cache=None,
        sin_cache=None,
        position_ids=None,
        head_sink=None,
        q_norm_weight=None,
        k_norm_weight=None,
        k_scale=None,
        v_scale=None,
    )


@pytest.mark.parametrize("tier", [dsa_reference, dsa_chunked])
def test_local_window_dedup(tier):
    """A main entry inside the window is dropped (counted once), outside it joins."""
    kw = _simple()
    p = _local_params(3)  # window = positions 7, 8, 9

    def call(entries):
        sel = torch.full((1, 6), -1, dtype=torch.int32)
        sel[0, : len(entries)] = torch.tensor(entries, dtype=torch.int32)
        cnt = torch.tensor([len(entries)], dtype=torch.int32)
        pk, pv = kw["past_key"].clone(), kw["past_value"].clone()
        return tier(
            kw["query"], kw["key"], kw["value"], pk, pv, None, None, sel, cnt, kw["seqlens_k"], p
        )

    base = call([2])
    torch.testing.assert_close(call([2, 7, 8, 9]), base, rtol=0, atol=0)
    assert not torch.allclose(call([2, 6]), base)
    # the window alone equals plain attention over 7..9 (mode selected_only, main)
    only = dict(kw)
    only["selected_indices"] = torch.tensor([[7, 8, 9, -1, -1, -1]], dtype=torch.int32)
    only["selected_counts"] = torch.tensor([3], dtype=torch.int32)
    torch.testing.assert_close(call([]), run(only, backend="reference")[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", TIERS)
def test_aliased_cache_decode_writes_only_its_rows(backend):
    kw = make_case(3, past=(5, 9), capacity=16, dtype=torch.float32)
    pk, pv = kw["past_key"].clone(), kw["past_value"].clone()
    before_k = pk.clone()
    out, rk, rv = dynamic_sparse_attention(**dict(kw, past_key=pk, past_value=pv), backend=backend)
    assert rk is pk and rv is pv and rk.shape[2] == 16
    for i, row in enumerate((5, 9)):
        changed = ~torch.isclose(rk[i], before_k[i], equal_nan=True).all(-1).all(0)  # [C]
        assert changed.nonzero().flatten().tolist() == [row]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), plain_dsa(kw, torch.float64), rtol=1e-5, atol=1e-5)


def test_new_present_when_capacity_is_short():
    kw = make_case(4, past=(5, 9), capacity=7, dtype=torch.float32)
    kw["past_key"][:, :, 5:] = 1.5  # no NaN here: seq 1 is longer than the capacity
    kw["past_value"][:, :, 5:] = 1.5
    kw["past_key"][0, :, 5:] = float("nan")
    sel = kw["selected_indices"]  # seq 0's rows >= 5 are NaN (skipped: future positions)
    kw["selected_indices"] = torch.where(sel > 5, -1, sel)  # -1 inside the count: skipped
    out, pk, pv = run(kw, backend="chunked")
    assert pk.shape == (2, 2, 10, 64) and pk is not kw["past_key"]
    assert torch.equal(pk[1, :, :7], kw["past_key"][1]) and torch.equal(
        pk[1, :, 7:9], torch.zeros_like(pk[1, :, 7:9])
    )
    torch.testing.assert_close(out.double(), plain_dsa(kw, torch.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", TIERS)
def test_invalid_entries_are_skipped(backend):
    kw = _simple(total=10, m=8)
    kw["selected_indices"][0] = torch.tensor([3, 3, -5, 12, 9, 1, 4, 0], dtype=torch.int32)
    kw["selected_counts"][0] = 6  # -> 3 (twice, counted twice), 9, 1; entries 4, 0 ignored
    got = run(kw, backend=backend)[0]
    clean = dict(kw)
    clean["selected_indices"] = torch.tensor([[3, 3, 9, 1, -1, -1, -1, -1]], dtype=torch.int32)
    clean["selected_counts"] = torch.tensor([4], dtype=torch.int32)
    torch.testing.assert_close(got, run(clean, backend=backend)[0], rtol=0, atol=0)
    too_many = dict(kw, selected_counts=torch.tensor([99], dtype=torch.int32))  # clamped to M
    full = dict(kw, selected_counts=torch.tensor([8], dtype=torch.int32))
    torch.testing.assert_close(run(too_many, backend=backend)[0], run(full, backend=backend)[0])


def test_first_prompt_with_padding_and_causality():
    kw = make_case(5, s=9, past=None, first_prompt=True, m=12, dtype=torch.float32)
    outs = [run(kw, backend=t) for t in TIERS]
    truth = plain_dsa(kw, torch.float64)
    for out, pk, _ in outs:
        torch.testing.assert_close(out.double(), truth, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[1, 6:], torch.zeros_like(out[1, 6:]))  # padding rows
        assert torch.equal(pk[1, :, 6:], torch.zeros_like(pk[1, :, 6:]))  # not written


def test_packed_qkv_equals_separate():
    kw = make_case(6, s=3, dtype=torch.float32)
    packed = dict(
        kw, query=torch.cat((kw["query"], kw["key"], kw["value"]), -1), key=None, value=None
    )
    for t in TIERS:
        torch.testing.assert_close(run(packed, backend=t)[0], run(kw, backend=t)[0], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Seeded grid vs the fp64 truth.

_GRID = [
    # (h, group, s, mode, dtype, cache_dtype)
    (64, 1, 1, "selected_only", torch.float32, None),
    (64, 4, 8, "local_plus_selected", torch.bfloat16, None),
    (128, 6, 1, "selected_only", torch.bfloat16, torch.float16),
    (128, 8, 64, "selected_only", torch.float16, None),
    (256, 6, 8, "selected_only", torch.bfloat16, torch.float16),
    (256, 1, 1, "local_plus_selected", torch.float16, torch.int8),
    (64, 8, 64, "local_plus_selected", torch.bfloat16, torch.float16),
    (128, 4, 1, "selected_only", torch.bfloat16, torch.int8),
    (256, 4, 64, "local_plus_selected", torch.float32, None),
    (80, 6, 8, "selected_only", torch.float32, torch.int8),
    (256, 6, 64, "selected_only", torch.bfloat16, torch.float16),
    (128, 1, 8, "local_plus_selected", torch.float16, torch.int8),
    (64, 6, 1, "local_plus_selected", torch.float32, torch.float16),
    (256, 8, 8, "selected_only", torch.bfloat16, torch.int8),
]


@pytest.mark.parametrize("h,group,s,mode,dtype,cache_dtype", _GRID)
def test_grid_vs_fp64(h, group, s, mode, dtype, cache_dtype):
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    kv = 2 if group < 8 else 1
    kw = make_case(
        seed,
        h=h,
        n=kv * group,
        kv=kv,
        s=s,
        past=(37, 70),
        mode=mode,
        dtype=dtype,
        cache_dtype=cache_dtype,
        m=48,
        window=16,
        per_channel=(h == 80),
    )
    truth = truth_of(kw)
    oracle = plain_dsa(to_fp64(kw), torch.float64)
    torch.testing.assert_close(truth, oracle, rtol=1e-10, atol=1e-10)
    baseline = plain_dsa(kw, dtype)
    for t in TIERS:
        out, _, _ = run(kw, backend=t)
        assert out.dtype == dtype
        assert_close_to_fp64(out, truth, baseline, name=f"{t} seed={seed}")


@pytest.mark.parametrize("backend", TIERS)
def test_fp16_value_stored_without_loss(backend):
    kw = make_case(7, s=2, dtype=torch.bfloat16, cache_dtype=torch.float16, v_dtype=torch.float16)
    out, pk, pv = run(kw, backend=backend)
    assert pk.dtype == pv.dtype == torch.float16
    v = kw["value"].reshape(2, 2, 2, 64)
    for i, t in enumerate((20, 33)):
        assert torch.equal(pv[i, :, t : t + 2], v[i].transpose(0, 1))
    assert_close_to_fp64(out, truth_of(kw), plain_dsa(kw, torch.bfloat16))


@pytest.mark.parametrize("backend", TIERS)
def test_bf16_auxiliary_values_beyond_fp16_range(backend):
    kw = make_case(
        8, mode="local_plus_selected", dtype=torch.bfloat16, cache_dtype=torch.float16, rotary=False
    )
    kw["auxiliary_value"] = kw["auxiliary_value"] * 1e5  # > 65504: would overflow in fp16
    kw["selected_counts"].clamp_(min=1)
    kw["selected_indices"][:, 0] = torch.where(
        kw["selected_indices"][:, 0] < 0, 0, kw["selected_indices"][:, 0]
    )
    out, _, _ = run(kw, backend=backend)
    assert torch.isfinite(out).all() and out.abs().max() > 65504
    assert_close_to_fp64(out, truth_of(kw), plain_dsa(kw, torch.bfloat16))


@pytest.mark.parametrize("shared", [True, False])
def test_auxiliary_shared_kv(shared):
    kw = make_case(9, mode="local_plus_selected", shared_aux=shared, s=3)
    for t in TIERS:
        torch.testing.assert_close(
            run(kw, backend=t)[0].double(), plain_dsa(kw, torch.float64), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("backend", TIERS)
def test_query_dtype_rounds_q_once(backend):
    kw = make_case(10, s=2, rotary=False, norm=False, dtype=torch.float32)
    got = run(kw, query_dtype=torch.float16, backend=backend)[0]
    want = run(dict(kw, query=kw["query"].half().float()), backend=backend)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, run(kw, backend=backend)[0])


def test_chunked_with_tiny_chunks(monkeypatch):
    import longattn.sparse.chunked as ch

    kw = make_case(11, s=8, mode="local_plus_selected", m=40, window=12)
    want = run(kw, backend="reference")[0]
    monkeypatch.setattr(ch, "_CAND_CHUNK", 5)
    monkeypatch.setattr(ch, "_ELEMS", 1000)
    torch.testing.assert_close(run(kw, backend="chunked")[0], want, rtol=1e-6, atol=1e-6)


def test_outputs_are_fresh_not_poison():
    kw = make_case(12, s=4)
    out = nan_tensor((2, 4, 4 * 64), torch.float32)
    out, _, _ = run(kw)  # the op allocates its own output; NaN in unused cache rows never leaks
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------
# Strict validation: one test per violation.


def _strict_case():
    kw = _simple(b=1, s=2, total=10, m=4)  # rows at qpos 8, 9
    kw["selected_indices"] = torch.tensor([[1, 2, -1, -1], [3, 9, -1, -1]], dtype=torch.int32)
    kw["selected_counts"] = torch.tensor([2, 2], dtype=torch.int32)
    return kw


@pytest.mark.parametrize(
    "row,entries,count,msg",
    [
        (0, [1, 2, -1, -1], 5, "max_selected"),
        (0, [1, 2, -1, -1], -1, r"\[0, max_selected"),
        (1, [3, 9, 4, -1], 2, "padding"),
        (1, [3, 3, -1, -1], 2, "duplicate"),
        (0, [-2, 2, -1, -1], 2, "out of range"),
        (0, [1, 10, -1, -1], 2, "out of range"),
        (0, [1, 9, -1, -1], 2, "future"),
    ],
)
def test_strict_validation_errors(row, entries, count, msg):
    kw = _strict_case()
    kw["selected_indices"][row] = torch.tensor(entries, dtype=torch.int32)
    kw["selected_counts"][row] = count
    with pytest.raises(ValueError, match=msg):
        run(kw, validate=True)
    run(kw)  # without strict mode: invalid entries are skipped, no error


def test_strict_count_exceeds_capacity():
    kw = make_case(13, mode="local_plus_selected", aux_len=3, m=6)
    kw["selected_indices"][0] = torch.tensor([0, 1, 2, 0, 1, 2], dtype=torch.int32)
    kw["selected_counts"][0] = 5
    with pytest.raises(ValueError, match="auxiliary length 3"):
        run(kw, validate=True)


def test_strict_env_variable(monkeypatch):
    kw = _strict_case()
    kw["selected_indices"][1] = torch.tensor([3, 3, -1, -1], dtype=torch.int32)
    run(kw)
    monkeypatch.setenv("LONGATTN_STRICT_VALIDATION", "1")
    with pytest.raises(ValueError, match="duplicate"):
        run(kw)


def test_strict_accepts_valid_selection():
    run(_strict_case(), validate=True)
    kw = make_case(14, s=1, m=20)  # drop the planted invalid (future) entries
    b_qpos = [20, 33]
    for r in range(2):
        c = int(kw["selected_counts"][r])
        ok = [e for e in kw["selected_indices"][r, :c].tolist() if e <= b_qpos[r]]
        kw["selected_indices"][r] = -1
        kw["selected_indices"][r, : len(ok)] = torch.tensor(ok, dtype=torch.int32)
        kw["selected_counts"][r] = len(ok)
    run(kw, validate=True)


# ---------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
    "change,exc,msg",
    [
        (dict(query=torch.randn(1, 1, 15)), ValueError, "query.shape"),
        (dict(key=torch.randn(1, 1, 7)), ValueError, "key"),
        (dict(value=None), ValueError, "key and value"),
        (dict(query=torch.randn(1, 1, 16, dtype=torch.float64).int()), TypeError, "query"),
        (dict(past_key=torch.randn(1, 2, 10, 8)), ValueError, "past_key"),
        (dict(past_value=None), ValueError, "past_key and past_value"),
        (dict(seqlens_k=torch.tensor([9])), TypeError, "seqlens_k"),
        (dict(seqlens_k=torch.tensor([12], dtype=torch.int32)), ValueError, "seqlens_k"),
        (
            dict(selected_indices=torch.zeros(2, 6, dtype=torch.int32)),
            ValueError,
            "selected_indices",
        ),
        (dict(selected_indices=torch.zeros(1, 6)), TypeError, "selected_indices"),
        (dict(selected_counts=torch.zeros(3, dtype=torch.int32)), ValueError, "selected_counts"),
        (dict(num_heads=3), ValueError, "num_heads"),
        (dict(total_sequence_length=0), ValueError, "total_sequence_length"),
        (dict(scale=-0.5), ValueError, "scale must be a finite float > 0"),
        (dict(scale=True), ValueError, "scale must be a finite float > 0"),
        (dict(scale=False), ValueError, "scale must be a finite float > 0"),
        (dict(qk_norm_epsilon=-1e-6), ValueError, "qk_norm_epsilon"),
        (dict(qk_norm_epsilon=float("nan")), ValueError, "qk_norm_epsilon"),
        (dict(total_sequence_length=torch.tensor(10)), TypeError, "total_sequence_length"),
        (dict(attention_mode="dense"), ValueError, "attention_mode"),
        (dict(selected_kv_source="auxiliary"), ValueError, "valid pair"),
        (dict(local_window_size=4), ValueError, "local_window_size"),
        (
            dict(attention_mode="local_plus_selected", selected_kv_source="auxiliary"),
            ValueError,
            "local_window_size",
        ),
        (dict(do_rotary=True), ValueError, "cos_cache"),
        (dict(head_sink=torch.zeros(3)), ValueError, "head_sink"),
        (dict(q_norm_weight=torch.ones(4)), ValueError, "q_norm_weight"),
        (dict(k_scale=torch.ones(1)), ValueError, "k_scale"),
        (dict(auxiliary_key=torch.randn(1, 1, 4, 8)), ValueError, "auxiliary"),
        (dict(is_causal=False), ValueError, "is_causal"),
        (dict(is_causal="yes"), TypeError, "is_causal must be a bool"),
        (dict(smooth_softmax="no"), TypeError, "smooth_softmax must be a bool"),
        (dict(auxiliary_kv_shared=2), TypeError, "auxiliary_kv_shared must be a bool"),
        (dict(backend="fast"), ValueError, "backend"),
        (dict(query_dtype=torch.int8), TypeError, "query_dtype"),
        # 1-D parameters the Triton kernels read at ptr + i: a strided view is refused (it was
        # read as if contiguous: wrong rows, and the new K/V row appended at the wrong slot)
        (dict(head_sink=torch.zeros(4)[::2]), ValueError, "head_sink must be contiguous"),
        (dict(past_value="past_key"), ValueError, "must be different tensors"),
        (dict(q_norm_weight=torch.ones(16)[::2]), ValueError, "q_norm_weight must be contiguous"),
        (dict(k_norm_weight=torch.ones(16)[1::2]), ValueError, "k_norm_weight must be contiguous"),
        (
            dict(
                do_rotary=True,
                cos_cache=torch.ones(10, 4),
                sin_cache=torch.zeros(4, 10).t(),
            ),
            ValueError,
            "sin_cache must be contiguous",
        ),
        (  # a bool is no channel offset
            dict(
                do_rotary=True,
                cos_cache=torch.ones(10, 2),
                sin_cache=torch.ones(10, 2),
                rotary_offset=True,
            ),
            ValueError,
            "rotary_offset must be a non-negative int",
        ),
    ],
)
def test_bad_input_names_the_argument(change, exc, msg):
    kw = _simple()
    kw.update(change)
    if kw["past_value"] == "past_key":  # the same tensor for both caches
        kw["past_value"] = kw["past_key"]
    with pytest.raises(exc, match=msg):
        dynamic_sparse_attention(**kw)


def test_strided_seqlens_k_is_refused():
    kw = _simple(b=2)
    kw["seqlens_k"] = torch.tensor([9, 0, 5, 0], dtype=torch.int32)[::2]  # values [9, 5]
    with pytest.raises(ValueError, match="seqlens_k must be contiguous"):
        dynamic_sparse_attention(**kw)
    kw["seqlens_k"] = kw["seqlens_k"].contiguous()
    dynamic_sparse_attention(**kw)


def test_int8_cache_needs_scales():
    kw = _simple()
    kw["past_key"] = kw["past_key"].to(torch.int8)
    kw["past_value"] = kw["past_value"].to(torch.int8)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        dynamic_sparse_attention(**kw)
    with pytest.raises(ValueError, match="k_scale"):
        dynamic_sparse_attention(**kw, k_scale=torch.ones(3), v_scale=torch.ones(1))


def test_explicit_triton_raises_naming_the_gate():
    with pytest.raises(RuntimeError, match="not implemented"):
        dynamic_sparse_attention(**_simple(), backend="triton")


# ---------------------------------------------------------------------------------------------
# torch-native.


def test_opcheck():
    from longattn.sparse.api import _dsa_op

    kw = make_case(15, s=1, dtype=torch.float32, m=8)
    args = (
        kw["query"],
        kw["key"],
        kw["value"],
        kw["past_key"].nan_to_num(),
        kw["past_value"].nan_to_num(),
        None,
        None,
        kw["selected_indices"],
        kw["selected_counts"],
        kw["seqlens_k"],
        kw["cos_cache"],
        kw["sin_cache"],
        None,
        kw["head_sink"],
        kw["q_norm_weight"],
        kw["k_norm_weight"],
        None,
        None,
        4,
        2,
        64,
        0.125,
        -1,
        "selected_only",
        "main",
        True,
        False,
        0,
        False,
        1e-6,
        False,
        False,
        kw["total_sequence_length"],
        None,
        "chunked",
    )
    torch.library.opcheck(_dsa_op, args)


def test_torch_compile_fullgraph_decode():
    kw = make_case(16, s=1, dtype=torch.float32, m=8, capacity=40)
    kw["past_key"] = kw["past_key"].nan_to_num()
    kw["past_value"] = kw["past_value"].nan_to_num()

    def step(q, k, v, pk, pv, sel, cnt, seqlens):
        return dynamic_sparse_attention(
            q,
            k,
            v,
            pk,
            pv,
            selected_indices=sel,
            selected_counts=cnt,
            seqlens_k=seqlens,
            total_sequence_length=40,
            num_heads=4,
            kv_num_heads=2,
            cos_cache=kw["cos_cache"],
            sin_cache=kw["sin_cache"],
            do_rotary=True,
            head_sink=kw["head_sink"],
        )

    args = [kw[x] for x in ("query", "key", "value")]
    sel = (kw["selected_indices"], kw["selected_counts"], kw["seqlens_k"])
    pk1, pv1 = kw["past_key"].clone(), kw["past_value"].clone()
    pk2, pv2 = kw["past_key"].clone(), kw["past_value"].clone()
    want, wk, _ = step(*args, pk1, pv1, *sel)
    got, gk, _ = torch.compile(step, fullgraph=True)(*args, pk2, pv2, *sel)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(pk2, pk1, rtol=0, atol=0)  # appended in place under compile too


@pytest.mark.parametrize("backend", TIERS)
def test_validate_off_out_of_range_seqlens_writes_nothing_outside(backend):
    """validate="off": seqlens_k past the cache is not read on the host (no error), the new
    token's write at qpos >= capacity is dropped (no other cache row changes) and the output
    is finite; the default (False: range checks) still raises."""
    kw = _simple(b=2, s=1, total=10, m=4)
    kw["seqlens_k"] = torch.tensor([9, 14], dtype=torch.int32)  # row 1: qpos 14 >= 10 rows
    kw["selected_indices"][:, :2] = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    kw["selected_counts"][:] = 2
    with pytest.raises(ValueError, match="seqlens_k must lie"):
        run(kw, backend=backend)
    out, pk, pv = run(kw, backend=backend, validate="off")
    assert torch.isfinite(out).all()
    assert torch.equal(pk[1], kw["past_key"][1]) and torch.equal(pv[1], kw["past_value"][1])
    assert torch.equal(pk[0, :, :9], kw["past_key"][0, :, :9])  # row 0 wrote only its qpos 9
    with pytest.raises(ValueError, match='validate must be True, False or "off"'):
        run(kw, backend=backend, validate=0)


# ---------------------------------------------------------------------------------------------
# Empty candidate sources.


@pytest.mark.parametrize("backend", TIERS)
def test_empty_auxiliary_cache(backend):
    """Auxiliary length 0 (no compressed block yet): only the local window is attended."""
    kw = _simple(b=2, kv=1, total=10)
    mode = dict(attention_mode="local_plus_selected", selected_kv_source="auxiliary",
                local_window_size=4, backend=backend)  # fmt: skip
    empty = torch.randn(2, 1, 0, 8)
    out, _, _ = run(kw, auxiliary_key=empty, auxiliary_value=empty, **mode)
    three = torch.randn(2, 1, 3, 8)  # a non-empty auxiliary cache, nothing selected from it
    ref, _, _ = run(kw, auxiliary_key=three, auxiliary_value=three, **mode)
    torch.testing.assert_close(out, ref)  # counts 0 either way: the same window


@pytest.mark.parametrize("backend", TIERS)
def test_zero_width_selection(backend):
    """max_selected = 0 (selected_indices [B*S, 0]): no candidate, output zeros."""
    kw = _simple(b=2)
    kw["selected_indices"] = torch.zeros(2, 0, dtype=torch.int32)
    kw["selected_counts"] = torch.zeros(2, dtype=torch.int32)
    out, pk, _ = run(kw, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(pk[:, :, 9], kw["key"].reshape(2, 1, 8))  # appended anyway
    kw["selected_counts"] = torch.tensor([5, -2], dtype=torch.int32)
    with pytest.raises(ValueError, match="selected_counts must lie in"):
        run(kw, validate=True, backend=backend)


@pytest.mark.parametrize("backend", TIERS)
def test_window_wider_than_context_is_the_whole_context(backend, monkeypatch):
    """W > T: the tiers get W = T (the same candidates; W = 10**6 used to build 10**6 slots
    per row in the torch tiers and plan as many in Triton)."""
    from longattn.sparse import api as sparse_api

    seen = []
    real_run = sparse_api._run

    def spy(*args):
        seen.append(args[-2].local_window_size)  # (..., p, backend)
        return real_run(*args)

    monkeypatch.setattr(sparse_api, "_run", spy)
    kw = _simple(b=2, total=10)
    aux = torch.randn(2, 1, 3, 8)
    mode = dict(attention_mode="local_plus_selected", selected_kv_source="auxiliary",
                auxiliary_key=aux, auxiliary_value=aux, backend=backend)  # fmt: skip
    wide, _, _ = run(kw, local_window_size=10**6, **mode)
    exact, _, _ = run(kw, local_window_size=10, **mode)
    assert seen == [10, 10]
    assert torch.equal(wide, exact)
