"""sparse_attention_layer: SparseAttentionIndexer + DynamicSparseAttention as one op.

Truth: the two public ops called one after the other with the same tier (their own tests check
them against fp64 and onnxruntime-style oracles). The layer must give the same selection, the
same caches and the same output; on the Triton tier it runs the DSA prologue beside the select
kernel (``sparse/triton/layer.py``), which must not change a bit in the interpreter (numpy
reductions) and stays within one rounding on the GPU (the prologue runs with the select's warp
count, so its norm reduction may sum in another order). Every buffer the Triton tiers allocate
is NaN-poisoned and cache rows past each sequence hold NaN (int8: -128).
"""

from __future__ import annotations

import pytest
import torch

from longattn import (
    _triton_merge,
    _triton_utils,
    dynamic_sparse_attention,
    sparse_attention_indexer,
    sparse_attention_layer,
)
from longattn._rotary import rope_cache
from longattn.sparse.triton import decode, indexer, select
from longattn.sparse.triton import layer as layer_mod
from longattn.testing import nan_tensor

interpret = pytest.mark.interpret
gpu = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TIERS = ("reference", "chunked", "triton")


@pytest.fixture(autouse=True)
def _poison_buffers(monkeypatch):
    def poisoned(shape, *, dtype, device):
        return nan_tensor(shape, dtype, device)

    for mod in (decode, indexer, layer_mod):
        monkeypatch.setattr(mod, "_empty", poisoned)


def make_layer_case(seed, *, b=2, s=1, n=8, kv=2, h=64, r=16, budget=64, ni=4, di=32,
                    total=300, lens=None, dtype=torch.float16, cache_dtype=None,
                    per_channel=False, packed=False, positions=False, sink="head",
                    no_cache=False, device=DEV):  # fmt: skip
    """Keyword arguments of ``sparse_attention_layer`` (the caches at ``cap = total + 20``
    rows, NaN / -128 past each sequence's history)."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    first = s == total
    lens = lens or [total - 7 * i for i in range(b)]  # total lengths (first prompt: <= S)
    cap = total + 20

    def rnd(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dt).to(device)

    kw = {}
    if packed:
        kw["query"] = rnd(b, s, (n + 2 * kv) * h)
    else:
        kw.update(query=rnd(b, s, n * h), key=rnd(b, s, kv * h), value=rnd(b, s, kv * h))
    if cache_dtype == torch.int8:
        shape = (kv, 1, h) if per_channel else (1,)
        kw["k_scale"] = (0.01 + 0.02 * torch.rand(*shape, generator=gen)).to(device)
        kw["v_scale"] = (0.01 + 0.02 * torch.rand(*shape, generator=gen)).to(device)
        pk = torch.randint(-127, 128, (b, kv, cap, h), generator=gen, dtype=torch.int8)
        pv = torch.randint(-127, 128, (b, kv, cap, h), generator=gen, dtype=torch.int8)
    else:
        pk = torch.randn(b, kv, cap, h, generator=gen).to(cache_dtype)
        pv = torch.randn(b, kv, cap, h, generator=gen).to(cache_dtype)
    for i, length in enumerate(lens):
        past = 0 if first else length - s
        pk[i, :, past:] = nan_tensor((1,), cache_dtype)
        pv[i, :, past:] = nan_tensor((1,), cache_dtype)
    kw.update(past_key=pk.to(device), past_value=pv.to(device))
    if no_cache:  # (first prompt) presents allocated by the op in the cache dtype
        kw.update(past_key=None, past_value=None, kv_cache_dtype=cache_dtype)
    cos, sin = rope_cache(cap + 8, h // 2, device=device)
    kw.update(cos_cache=cos, sin_cache=sin, do_rotary=True)
    kw.update(q_norm_weight=rnd(h, dt=torch.float32) * 0.1 + 1,
              k_norm_weight=rnd(h, dt=torch.float32) * 0.1 + 1)  # fmt: skip
    if sink == "head":
        kw["head_sink"] = rnd(n, dt=torch.float32)
    elif sink == "smooth":
        kw["smooth_softmax"] = True
    if positions:
        kw["position_ids"] = torch.stack(
            [torch.arange(length - s, length) + 3 for length in lens]
        ).to(device)
    seqlens = torch.tensor([length - 1 for length in lens], dtype=torch.int32, device=device)
    kw.update(index_query=rnd(b, s, ni * di),
              index_block_keys=torch.randn(b, cap // r + 1, di, generator=gen).to(device),
              seqlens_k=seqlens, total_sequence_length=total, num_heads=n, kv_num_heads=kv,
              compress_ratio=r, token_budget=budget)  # fmt: skip
    return kw


def _clone_caches(kw):
    if kw["past_key"] is None:  # a first prompt without a past buffer: the op allocates it
        return dict(kw)
    return dict(kw, past_key=kw["past_key"].clone(), past_value=kw["past_value"].clone())


def two_ops(kw, backend):
    """The indexer, then DSA on its selection (the layer's definition)."""
    kw = _clone_caches(kw)
    sel, cnt = sparse_attention_indexer(
        kw["index_query"], kw["index_block_keys"], kw["seqlens_k"],
        compress_ratio=kw["compress_ratio"], token_budget=kw["token_budget"],
        scale=kw.get("index_scale"), total_sequence_length=kw["total_sequence_length"],
        backend=backend,
    )  # fmt: skip
    skip = ("index_query", "index_block_keys", "compress_ratio", "token_budget", "index_scale",
            "query", "key", "value", "past_key", "past_value")  # fmt: skip
    rest = {k: v for k, v in kw.items() if k not in skip}
    out, pk, pv = dynamic_sparse_attention(
        kw["query"], kw.get("key"), kw.get("value"), kw["past_key"], kw["past_value"],
        selected_indices=sel, selected_counts=cnt, backend=backend, **rest,
    )  # fmt: skip
    return out, pk, pv, sel, cnt


def layer(kw, backend):
    kw = _clone_caches(kw)
    args = [kw.pop(k) for k in ("index_query", "index_block_keys", "query")]
    args += [kw.pop(k, None) for k in ("key", "value")]
    args += [kw.pop("past_key"), kw.pop("past_value")]
    return sparse_attention_layer(*args, backend=backend, **kw)


def _same(got, want, exact=True):
    out, pk, pv, sel, cnt = got
    w_out, w_pk, w_pv, w_sel, w_cnt = want
    assert torch.equal(sel, w_sel) and torch.equal(cnt, w_cnt)
    assert not out.isnan().any()
    if exact:
        for a, b in ((out, w_out), (pk, w_pk), (pv, w_pv)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    else:  # within one rounding of the stored dtypes
        torch.testing.assert_close(out.float(), w_out.float(), rtol=1e-2, atol=1e-3)
        for a, b in ((pk, w_pk), (pv, w_pv)):  # one unit in the last place
            tol = dict(rtol=0, atol=1) if a.dtype == torch.int8 else dict(rtol=2**-7, atol=1e-6)
            torch.testing.assert_close(a, b, equal_nan=True, **tol)


CASES = {
    "decode": {},
    "decode_fp32_packed": dict(dtype=torch.float32, packed=True, b=1),
    "decode_b3_positions": dict(b=3, positions=True, sink="smooth"),
    "chunked_prefill_s3": dict(s=3, sink=None),
    "first_prompt_padding": dict(s=40, total=40, lens=[40, 23], budget=16, r=8),
    "first_prompt_no_cache_int8": dict(
        s=24, total=24, lens=[24, 9], budget=8, r=4, no_cache=True, cache_dtype=torch.int8
    ),
    "int8_per_tensor": dict(cache_dtype=torch.int8),
    "int8_per_channel_s2": dict(cache_dtype=torch.int8, per_channel=True, s=2),
    "budget_below_ratio": dict(budget=8),  # no block chosen: trailing tokens only
    "h128_group1": dict(n=2, kv=2, h=128, sink=None),
    # > select.TOPK_MAX_BLOCKS blocks: the radix select (scratch row + CTA barrier) in the
    # co-launch, not the in-register tl.topk
    "radix_select": dict(b=1, n=2, kv=1, h=16, r=4, budget=64, ni=2, di=16, total=4500),
}


@interpret
@pytest.mark.parametrize("backend", TIERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_equals_two_ops(case, backend):
    kw = make_layer_case(1, **CASES[case])
    _same(layer(kw, backend), two_ops(kw, backend))


@interpret
@pytest.mark.parametrize("case", ["decode_b3_positions", "first_prompt_padding", "radix_select"])
def test_triton_layer_early_loads_equal_two_ops(case, monkeypatch):
    """The select's EARLY_SCORES, the split's EARLY_CNT and the merge's EARLY_O
    (``_early_options``) in the layer's launches: the two ops' outputs (defaults)."""
    kw = make_layer_case(1, **CASES[case])
    want = two_ops(kw, "triton")
    _early_options(monkeypatch)
    _same(layer(kw, "triton"), want)


@interpret
def test_triton_layer_one_warp_merge_equals_two_ops(monkeypatch):
    """One-warp merge programs at every slot count (MERGE_ONE_WARP_FROM = 2) in the layer:
    the two ops' outputs with the 4-warp merge."""
    kw = make_layer_case(1, **CASES["radix_select"])
    monkeypatch.setattr(_triton_merge, "MERGE_ONE_WARP_FROM", None)
    want = two_ops(kw, "triton")
    monkeypatch.setattr(_triton_merge, "MERGE_ONE_WARP_FROM", 2)
    _same(layer(kw, "triton"), want)


@interpret
def test_triton_layer_rank_select_equals_two_ops(monkeypatch):
    """The select's rank method (``RANK_SELECT``) in the layer's co-launch: the two ops'
    outputs with the radix steps; every floor (``RANK_FLOOR`` "tiles": the score launch's
    tile maxima, 71 tiles of 16 blocks here)."""
    kw = make_layer_case(1, **CASES["radix_select"])
    _select_defaults(monkeypatch, RANK_SELECT=False)
    want = two_ops(kw, "triton")
    for floor in ("groups", "cross", "tiles"):
        _select_defaults(monkeypatch, RANK_SELECT=True, RANK_FLOOR=floor)
        _same(layer(kw, "triton"), want)


def _select_defaults(monkeypatch, **over):
    monkeypatch.setattr(select, "SELECT_DEFAULTS", dict(select.SELECT_DEFAULTS, **over))


@gpu
@pytest.mark.parametrize("case", [dict(b=1, s=1, total=262144), dict(b=4, s=8, total=131072)])
def test_gpu_layer_rank_select_matches_two_ops(case, monkeypatch):
    """The rank method vs the radix steps (two ops) at real shapes: identical selections,
    outputs within rounding. Floor None: the tile maxima where the score launch's tiling
    serves them (B=1 S=1 256K: 128 tiles of 32 blocks; B=4 S=8 128K: 32 tiles of 64, too
    few: the groups floor)."""
    kw = make_layer_case(8, **dict(dict(b=1, s=1, n=24, kv=4, h=256, r=64, budget=2048, ni=16,
                                        di=128, total=9000, dtype=torch.bfloat16), **case))  # fmt: skip
    _select_defaults(monkeypatch, RANK_SELECT=False)
    want = two_ops(kw, "triton")
    for floor in ("groups", "cross", None):
        _select_defaults(monkeypatch, RANK_SELECT=True, RANK_FLOOR=floor)
        _same(layer(kw, "triton"), want, exact=False)


@gpu
@pytest.mark.parametrize("case", [dict(b=1, s=1, total=262144), dict(b=4, s=1, total=131072)])
def test_gpu_layer_one_warp_merge_matches_two_ops(case, monkeypatch):
    """The one-warp merge (the default from 64 slots) vs the two ops with the 4-warp merge at
    real shapes (66 split slots at B=1 S=1)."""
    kw = make_layer_case(8, **dict(dict(b=1, s=1, n=24, kv=4, h=256, r=64, budget=2048, ni=16,
                                        di=128, total=9000, dtype=torch.bfloat16), **case))  # fmt: skip
    monkeypatch.setattr(_triton_merge, "MERGE_ONE_WARP_FROM", None)
    want = two_ops(kw, "triton")
    monkeypatch.setattr(_triton_merge, "MERGE_ONE_WARP_FROM", 64)
    _same(layer(kw, "triton"), want, exact=False)


def _early_options(monkeypatch):
    """EARLY_SCORES, EARLY_CNT, MERGE_EARLY_O and PDL_EARLY_TRIGGER forced on (the defaults
    except for a first prompt's rows; the trigger acts only where PDL is on: the GPU)."""
    over = dict(select.SELECT_DEFAULTS, EARLY_SCORES=True)
    monkeypatch.setattr(select, "SELECT_DEFAULTS", over)
    cfg = decode.decode_config
    monkeypatch.setattr(decode, "decode_config", lambda *a: dict(cfg(*a), EARLY_CNT=True))
    monkeypatch.setattr(_triton_merge, "MERGE_EARLY_O", True)
    monkeypatch.setattr(_triton_utils, "PDL_EARLY_TRIGGER", True)


@interpret
def test_triton_layer_runs_the_prologue_in_the_select_launch(monkeypatch):
    """Eligible inputs: one select + prologue launch, no separate prologue launch; the split
    kernel reads the co-launched prologue's Q (a DSA prologue call would raise here)."""
    launches = []
    real = layer_mod.select_prologue_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    def no_prologue(*a, **k):
        raise AssertionError("the DSA prologue ran outside the select launch")

    monkeypatch.setattr(layer_mod, "select_prologue_kernel", Spy())
    monkeypatch.setattr(decode, "run_prologue", no_prologue)
    kw = make_layer_case(2, b=3, n=8, kv=2)
    got = layer(kw, "triton")
    monkeypatch.undo()
    _same(got, two_ops(kw, "triton"))
    # 3 select programs, then 3 tokens x (1 query + 1 key head block) prologue programs
    assert launches == [(3 + 3 * 2,)]


@interpret
def test_triton_layer_falls_back_to_the_two_ops(monkeypatch):
    """rotary_offset != 0 (the Triton prologue takes 0 only): no co-launch, same results."""
    launches = []
    monkeypatch.setattr(layer_mod, "select_prologue_kernel", launches)  # subscript would fail
    kw = make_layer_case(3)
    kw["cos_cache"], kw["sin_cache"] = rope_cache(340, 16, device=DEV)  # rotary_dim 32 of 64
    kw["rotary_offset"] = 8
    _same(layer(kw, "triton"), two_ops(kw, "triton"))
    assert launches == []


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(query=torch.randn(2, 2, 8 * 64)), "index_query's B and S"),
        (dict(query=torch.randn(2, 8 * 64)), r"query must be \[B, S, N\*H\]"),
        (dict(validate="yes"), "validate must be"),
        (dict(index_block_keys=torch.randn(2, 10, 32)), "total_sequence_length // compress_ratio"),
        (dict(token_budget=0), "token_budget"),
        (dict(kv_num_heads=3), "multiple of kv_num_heads"),
        (dict(seqlens_k=torch.tensor([299, 400], dtype=torch.int32)), "seqlens_k must lie"),
        (dict(index_query=torch.randn(2, 1, 100)), "num_index_heads"),
    ],
)
def test_bad_input(change, match):
    kw = make_layer_case(4, device="cpu")
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        layer(kw, "chunked")


def test_explicit_triton_backend_names_the_failed_gate():
    kw = make_layer_case(5, dtype=torch.float64, device="cpu")
    with pytest.raises(RuntimeError, match="triton"):
        layer(kw, "triton")


def test_validate_off_skips_value_checks(monkeypatch):
    from longattn.sparse import api

    calls = []
    monkeypatch.setattr(api, "host_ranges", lambda *t: calls.append(1) or [(0, 0)] * len(t))
    kw = make_layer_case(6, device="cpu")
    layer(dict(kw, validate="off"), "chunked")
    assert calls == []


def test_opcheck_and_compile():
    from longattn.sparse.layer import _LAYER_PARAMS, _layer_op

    kw = make_layer_case(7, dtype=torch.float32, device="cpu", b=1)
    kw["past_key"] = kw["past_key"].nan_to_num()
    kw["past_value"] = kw["past_value"].nan_to_num()
    named = dict(
        kw, index_block_keys=kw["index_block_keys"][:, : 300 // 16], num_index_heads=4,
        index_scale=32**-0.5, present_key=kw["past_key"].clone(),
        present_value=kw["past_value"].clone(), position_ids=None, head_size=64, scale=0.125,
        local_window_size=-1, attention_mode="selected_only", selected_kv_source="main",
        rotary_interleaved=False, rotary_offset=0, smooth_softmax=False, qk_norm_epsilon=1e-6,
        auxiliary_kv_shared=False, is_first_prompt=False, query_dtype=None, k_scale=None,
        v_scale=None, backend="chunked",
    )  # fmt: skip
    torch.library.opcheck(_layer_op, tuple(named[k] for k in _LAYER_PARAMS))

    def step(iq, bk, q, k, v, pk, pv, seqlens):
        return sparse_attention_layer(
            iq, bk, q, k, v, pk, pv, seqlens_k=seqlens, total_sequence_length=300, num_heads=8,
            kv_num_heads=2, compress_ratio=16, token_budget=64, cos_cache=kw["cos_cache"],
            sin_cache=kw["sin_cache"], do_rotary=True, head_sink=kw["head_sink"],
            backend="chunked",
        )  # fmt: skip

    args = [kw[k] for k in ("index_query", "index_block_keys", "query", "key", "value")]
    pk1, pv1 = kw["past_key"].clone(), kw["past_value"].clone()
    pk2, pv2 = kw["past_key"].clone(), kw["past_value"].clone()
    want = step(*args, pk1, pv1, kw["seqlens_k"])
    got = torch.compile(step, fullgraph=True)(*args, pk2, pv2, kw["seqlens_k"])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(pk2, pk1, rtol=0, atol=0)  # appended in place under compile


# ---------------------------------------------------------------------------------------------
# GPU: the Qwen3.8-like geometry (H=256, group 6, r=64, budget 2048) in bf16.


@gpu
@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(b=2, s=8),
        dict(cache_dtype=torch.float16),
        dict(cache_dtype=torch.int8, per_channel=True),
        dict(b=4, s=1, total=40000),
        dict(b=1, s=1, total=131072),  # 2048 blocks: the radix select
    ],
)
def test_gpu_layer_matches_two_ops(case):
    kw = make_layer_case(8, **dict(dict(b=1, s=1, n=24, kv=4, h=256, r=64, budget=2048, ni=16,
                                        di=128, total=9000, dtype=torch.bfloat16), **case))  # fmt: skip
    _same(layer(kw, "triton"), two_ops(kw, "triton"), exact=False)


@gpu
@pytest.mark.parametrize("case", [dict(b=2, s=8), dict(b=1, s=1, total=131072)])
def test_gpu_layer_early_loads_match_two_ops(case, monkeypatch):
    """Every session-28 option forced on (``_early_options``) at real shapes: the two ops."""
    kw = make_layer_case(8, **dict(dict(b=1, s=1, n=24, kv=4, h=256, r=64, budget=2048, ni=16,
                                        di=128, total=9000, dtype=torch.bfloat16), **case))  # fmt: skip
    want = two_ops(kw, "triton")
    _early_options(monkeypatch)
    _same(layer(kw, "triton"), want, exact=False)
    # the two ops with early triggers: the same step (graph replays of it in bench_sparse)
    _same(two_ops(kw, "triton"), want, exact=False)
