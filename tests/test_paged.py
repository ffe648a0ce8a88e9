"""PagedAttention: tiers vs an fp64 truth, vs GroupQueryAttention on contiguous caches, cache
isolation, bad input, opcheck, torch.compile."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import pytest
import torch

from longattn import _attention_torch
from longattn._rotary import rope_cache
from longattn.paged import paged_attention
from longattn.paged._params import PagedParams
from longattn.paged.api import _paged_attention_op
from longattn.paged.reference import paged_attention_reference
from longattn.testing import assert_close_to_fp64, error_stats

FP16, BF16, FP32, FP64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
GRID_SEED = 20261202
CACHES = ("same", "fp16", "int8_tensor", "int8_channel")


@dataclass(frozen=True)
class Case:
    block_size: int = 16
    head_size: int = 64
    num_heads: int = 8
    kv_num_heads: int = 2
    batch: int = 3
    s_max: int = 6  # new tokens per sequence in [1, s_max]
    past_max: int = 40  # cached tokens per sequence in [0, past_max]
    dtype: torch.dtype = FP16
    cache: str = "same"
    rotary: str = "none"  # none | half | interleaved | partial
    window: int = -1
    softcap: float = 0.0
    sink: str = "none"  # none | head | smooth
    qk_norm: bool = False
    packed: bool = False
    pasts: tuple[int, ...] | None = None  # fixed past lengths (else random)
    seed: int = 0

    @property
    def cache_dtype(self) -> torch.dtype:
        if self.cache == "fp16":
            return FP16
        return torch.int8 if self.cache.startswith("int8") else self.dtype


@dataclass
class Batch:
    case: Case
    query: torch.Tensor  # [tokens, N*H] (or packed)
    key: torch.Tensor | None
    value: torch.Tensor | None
    key_cache: torch.Tensor  # [num_blocks, bs, KV, H], the state before the call
    value_cache: torch.Tensor
    cu: torch.Tensor
    past: torch.Tensor
    table: torch.Tensor
    kw: dict  # the op's keyword arguments

    def call(self, backend="auto", **over):
        kc, vc = self.key_cache.clone(), self.value_cache.clone()
        kw = {**self.kw, **over}
        out = paged_attention(self.query, self.key, self.value, kc, vc, self.cu, self.past,
                              self.table, backend=backend, **kw)  # fmt: skip
        return out, kc, vc


def sentinel_fill(shape, dtype):
    """NaN for float caches (a leak shows), -128 (outside the quantized range) for int8."""
    if dtype == torch.int8:
        return torch.full(shape, -128, dtype=dtype)
    return torch.full(shape, float("nan"), dtype=dtype)


def random_cache_values(g, shape, dtype):
    if dtype == torch.int8:
        return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    return torch.randn(shape, generator=g).to(dtype)


def make_batch(c: Case) -> Batch:
    g = torch.Generator().manual_seed(c.seed)
    b, n, kv, h, bs = c.batch, c.num_heads, c.kv_num_heads, c.head_size, c.block_size
    new = torch.randint(1, c.s_max + 1, (b,), generator=g)
    past = torch.randint(0, c.past_max + 1, (b,), generator=g)
    new[0] = 1  # a decode step ...
    if b > 1:
        new[-1], past[-1] = c.s_max, 0  # ... mixed with a first prompt
    if c.pasts is not None:
        past = torch.tensor(c.pasts)
    total = past + new
    needed = (total + bs - 1) // bs
    max_blocks = int(needed.max()) + 1  # one padding column at least
    num_blocks = 3 * int(needed.sum())
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((b, max_blocks), -1, dtype=torch.int32)
    off = 0
    for i in range(b):
        table[i, : needed[i]] = perm[off : off + needed[i]].to(torch.int32)
        off += int(needed[i])
    cd = c.cache_dtype
    shape = (num_blocks, bs, kv, h)
    caches = []
    for _ in range(2):
        cache = sentinel_fill(shape, cd)
        for i in range(b):  # cached rows 0 .. past-1 hold data; the rest of the blocks: sentinel
            for j in range(int(past[i])):
                cache[table[i, j // bs], j % bs] = random_cache_values(g, (kv, h), cd)
        caches.append(cache)
    tokens = int(new.sum())
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = new.cumsum(0)
    q = torch.randn(tokens, n * h, generator=g)
    k = torch.randn(tokens, kv * h, generator=g) * 1.5
    v = torch.randn(tokens, kv * h, generator=g)
    kw = dict(num_heads=n, kv_num_heads=kv, softcap=c.softcap, local_window_size=c.window)
    if c.rotary != "none":
        rot = h // 2 if c.rotary == "partial" else h
        cos, sin = rope_cache(int(total.max()) + 5, rot)
        kw.update(do_rotary=True, cos_cache=cos, sin_cache=sin,
                  rotary_interleaved=c.rotary == "interleaved")  # fmt: skip
    if c.sink == "head":
        kw["head_sink"] = torch.randn(n, generator=g)
    elif c.sink == "smooth":
        kw["smooth_softmax"] = True
    if c.qk_norm:
        kw["q_norm_weight"] = 1 + 0.2 * torch.randn(h, generator=g)
        kw["k_norm_weight"] = 1 + 0.2 * torch.randn(h, generator=g)
    if cd == torch.int8:
        if c.cache == "int8_tensor":
            kw["k_scale"], kw["v_scale"] = torch.tensor([0.04]), torch.tensor([0.03])
        else:
            kw["k_scale"] = (0.02 + 0.04 * torch.rand(kv, 1, h, generator=g)).float()
            kw["v_scale"] = (0.02 + 0.03 * torch.rand(kv, 1, h, generator=g)).float()
    q, k, v = q.to(c.dtype), k.to(c.dtype), v.to(c.dtype)
    if c.packed:
        q, k, v = torch.cat([q, k, v], dim=1), None, None
    return Batch(c, q, k, v, caches[0], caches[1], cu, past.to(torch.int32), table, kw)


def split(bt: Batch):
    c = bt.case
    if bt.key is not None:
        return bt.query, bt.key, bt.value
    n, kv, h = c.num_heads, c.kv_num_heads, c.head_size
    return bt.query.split((n * h, kv * h, kv * h), dim=1)


def dequant(cache: torch.Tensor, scale: torch.Tensor | None, dt) -> torch.Tensor:
    """[nb, bs, KV, H] -> dt (int8: q * scale, per-tensor or per-channel)."""
    if cache.dtype != torch.int8:
        return cache.to(dt)
    s = scale.to(dt).reshape(()) if scale.numel() == 1 else scale.to(dt).reshape(scale.shape[0], -1)
    return cache.to(dt) * s


def round_into_cache(x, cache_dtype, scale, dt):
    """What the cache holds after a write of x [T, KV, H] (back in dt)."""
    if cache_dtype == torch.int8:
        s = scale.to(dt).reshape(()) if scale.numel() == 1 else scale.to(dt).reshape(x.shape[1], -1)
        return torch.round(x / s).clamp(-127, 127) * s
    return x.to(cache_dtype).to(dt)


def rotate(x, cos, sin, interleaved):
    """Independent rotary: x [T, heads, H], cos/sin [T, R/2]; channels 0 .. R rotate."""
    r = 2 * cos.shape[1]
    c, s = cos[:, None, :], sin[:, None, :]
    y = x.clone()
    if interleaved:
        a, b = x[..., 0:r:2], x[..., 1:r:2]
        y[..., 0:r:2], y[..., 1:r:2] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., : r // 2], x[..., r // 2 : r]
        y[..., : r // 2], y[..., r // 2 : r] = a * c - b * s, b * c + a * s
    return y


def naive(bt: Batch, dt, round_cache: bool):
    """An independent per-sequence implementation in ``dt``: (output [tokens, N*H] in dt,
    new K rows [tokens, KV, H], new V rows) as the cache should hold them (in dt)."""
    c, kw = bt.case, bt.kw
    n, kv, h, bs = c.num_heads, c.kv_num_heads, c.head_size, c.block_size
    g = n // kv
    query, key, value = split(bt)
    kc = dequant(bt.key_cache, kw.get("k_scale"), dt)
    vc = dequant(bt.value_cache, kw.get("v_scale"), dt)
    cu, past = bt.cu.tolist(), bt.past.tolist()
    scale = 1 / math.sqrt(h)
    out = torch.zeros(query.shape[0], n, h, dtype=dt)
    k_new, v_new = (
        torch.zeros(query.shape[0], kv, h, dtype=dt),
        torch.zeros(query.shape[0], kv, h, dtype=dt),
    )
    for b in range(c.batch):
        t0, t1, p = cu[b], cu[b + 1], past[b]
        s_len, total = t1 - t0, p + t1 - t0
        q = query[t0:t1].to(dt).reshape(s_len, n, h)
        k = key[t0:t1].to(dt).reshape(s_len, kv, h)
        v = value[t0:t1].to(dt).reshape(s_len, kv, h)
        if c.qk_norm:

            def norm(x, w):
                return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.to(dt)

            q, k = norm(q, kw["q_norm_weight"]), norm(k, kw["k_norm_weight"])
        if c.rotary != "none":
            pos = torch.arange(p, total)
            cos, sin = kw["cos_cache"][pos].to(dt), kw["sin_cache"][pos].to(dt)
            inter = c.rotary == "interleaved"
            q, k = rotate(q, cos, sin, inter), rotate(k, cos, sin, inter)
        if round_cache:
            k = round_into_cache(k, c.cache_dtype, kw.get("k_scale"), dt)
            v = round_into_cache(v, c.cache_dtype, kw.get("v_scale"), dt)
        k_new[t0:t1], v_new[t0:t1] = k, v
        rows = [(int(bt.table[b, j // bs]), j % bs) for j in range(p)]
        kp = torch.stack([kc[r] for r in rows]) if rows else k[:0]
        vp = torch.stack([vc[r] for r in rows]) if rows else v[:0]
        kk = torch.cat([kp, k]).repeat_interleave(g, 1)  # [T, N, H]
        vv = torch.cat([vp, v]).repeat_interleave(g, 1)
        x = torch.einsum("snh,tnh->nst", q, kk) * scale
        if c.softcap > 0:
            x = c.softcap * torch.tanh(x / c.softcap)
        qpos = torch.arange(p, total)[:, None]
        j = torch.arange(total)[None, :]
        ok = j <= qpos
        if c.window > 0:
            ok &= j > qpos - c.window
        x = x.masked_fill(~ok, float("-inf"))
        sink = None
        if c.sink == "head":
            sink = kw["head_sink"].to(dt)[:, None, None]
        elif c.sink == "smooth":
            sink = torch.zeros(n, 1, 1, dtype=dt)
        m = x.amax(-1, keepdim=True)
        if sink is not None:
            m = torch.maximum(m, sink)
        e = torch.exp(x - m)
        den = e.sum(-1, keepdim=True) + (0 if sink is None else torch.exp(sink - m))
        out[t0:t1] = torch.einsum("nst,tnh->snh", e / den, vv)
    return out.reshape(query.shape[0], n * h), k_new, v_new


def truth_fp64(bt: Batch) -> torch.Tensor:
    """The reference tier on fp64 upcasts (int8 caches dequantized to fp64)."""
    c, kw = bt.case, bt.kw
    kc = dequant(bt.key_cache, kw.get("k_scale"), FP64)
    vc = dequant(bt.value_cache, kw.get("v_scale"), FP64)
    q, k, v = (t.to(FP64) for t in split(bt))
    p = PagedParams(
        num_heads=c.num_heads, kv_num_heads=c.kv_num_heads, head_size=c.head_size,
        scale=1 / math.sqrt(c.head_size), softcap=c.softcap, local_window_size=c.window,
        do_rotary=c.rotary != "none", rotary_interleaved=c.rotary == "interleaved",
        smooth_softmax=c.sink == "smooth", qk_norm_epsilon=1e-6,
        cos_cache=kw.get("cos_cache"), sin_cache=kw.get("sin_cache"), head_sink=kw.get("head_sink"),
        q_norm_weight=kw.get("q_norm_weight"), k_norm_weight=kw.get("k_norm_weight"),
        k_scale=None, v_scale=None,
    )  # fmt: skip
    return paged_attention_reference(q, k, v, kc, vc, bt.cu, bt.past, bt.table, p)


def slot_roles(bt: Batch):
    """Per flat slot: -1 not owned, 0 cached (before the call), 1 new token, 2 owned tail;
    and the token index of each new slot (-1 elsewhere)."""
    c = bt.case
    bs, nb = c.block_size, bt.key_cache.shape[0]
    role = torch.full((nb * bs,), -1)
    token = torch.full((nb * bs,), -1)
    cu, past = bt.cu.tolist(), bt.past.tolist()
    for b in range(c.batch):
        total = past[b] + cu[b + 1] - cu[b]
        for i in range((total + bs - 1) // bs):
            blk = int(bt.table[b, i])
            role[blk * bs : (blk + 1) * bs] = 2
        for j in range(total):
            sl = int(bt.table[b, j // bs]) * bs + j % bs
            role[sl] = 0 if j < past[b] else 1
            if j >= past[b]:
                token[sl] = cu[b] + j - past[b]
    return role, token


def bits(t: torch.Tensor) -> torch.Tensor:
    return (
        t.view(torch.uint8)
        if t.dtype == torch.int8
        else t.view({4: torch.int32, 2: torch.int16}[t.element_size()])
    )


def check_cache_writes(bt: Batch, kc, vc, k_new, v_new):
    """Isolation (bit-identical outside the new slots) and the new slots' contents."""
    c = bt.case
    role, token = slot_roles(bt)
    for name, before, after, rows, scale in (
        ("key_cache", bt.key_cache, kc, k_new, bt.kw.get("k_scale")),
        ("value_cache", bt.value_cache, vc, v_new, bt.kw.get("v_scale")),
    ):
        fb, fa = before.flatten(0, 1), after.flatten(0, 1)
        keep = role != 1
        assert torch.equal(bits(fb[keep]), bits(fa[keep])), (
            f"{name}: a slot other than the new tokens' changed"
        )
        new_slots = (role == 1).nonzero()[:, 0]
        got = dequant(fa[new_slots][None], scale, FP32)[0]
        want = rows[token[new_slots]].to(FP32)
        if c.cache_dtype == torch.int8:
            step = scale.reshape(()) if scale.numel() == 1 else scale.reshape(c.kv_num_heads, -1)
            diff = ((got - want).abs() / step).round()
            assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01, name
        else:
            tol = 2 * torch.finfo(c.cache_dtype).eps * want.abs() + 1e-6
            assert bool(((got - want).abs() <= tol).all()), f"{name}: new rows wrong"


def gqa_compare(bt: Batch, out, kc, vc, backend):
    """Each sequence through group_query_attention on a contiguous cache: same output (up to
    summation order: checked against the fp64 truth with GQA as the baseline) and bit-identical
    written K/V rows."""
    from longattn.gqa import group_query_attention

    c, kw = bt.case, bt.kw
    kv, h, bs = c.kv_num_heads, c.head_size, c.block_size
    query, key, value = split(bt)
    cu, past = bt.cu.tolist(), bt.past.tolist()
    outs = []
    extra = {k: kw[k] for k in ("cos_cache", "sin_cache", "rotary_interleaved", "do_rotary",
                                "head_sink", "smooth_softmax", "q_norm_weight", "k_norm_weight",
                                "k_scale", "v_scale") if k in kw}  # fmt: skip
    for b in range(c.batch):
        t0, t1, p = cu[b], cu[b + 1], past[b]
        total = p + t1 - t0
        slots = torch.tensor([int(bt.table[b, j // bs]) * bs + j % bs for j in range(total)])
        pk = torch.zeros(1, kv, total, h, dtype=c.cache_dtype)
        pv = torch.zeros_like(pk)
        pk[0, :, :p] = bt.key_cache.flatten(0, 1)[slots[:p]].transpose(0, 1)
        pv[0, :, :p] = bt.value_cache.flatten(0, 1)[slots[:p]].transpose(0, 1)
        o, pk2, pv2 = group_query_attention(
            query[t0:t1][None], key[t0:t1][None], value[t0:t1][None], pk, pv,
            seqlens_k=torch.tensor([total - 1], dtype=torch.int32), total_sequence_length=total,
            num_heads=c.num_heads, kv_num_heads=kv, softcap=c.softcap,
            local_window_size=c.window, backend=backend, **extra,
        )  # fmt: skip
        outs.append(o[0])
        for name, ours, theirs in (("key", kc, pk2), ("value", vc, pv2)):
            got = ours.flatten(0, 1)[slots[p:]]
            want = theirs[0, :, p:].transpose(0, 1)
            assert torch.equal(bits(got), bits(want)), f"{name} rows differ from GQA's (seq {b})"
    return torch.cat(outs)


def run_case(c: Case, backend: str, *, with_gqa=True):
    bt = make_batch(c)
    out, kc, vc = bt.call(backend)
    truth = truth_fp64(bt)
    # The truth against an independent fp64 implementation (guards the oracle itself).
    n64, _, _ = naive(bt, FP64, round_cache=False)
    err = error_stats(truth, n64)
    assert err.max_abs < 1e-9 and err.nonfinite == 0, f"oracle disagrees with naive fp64: {err}"
    base, k_new, v_new = naive(bt, FP32, round_cache=True)
    assert_close_to_fp64(out, truth, base.to(c.dtype), name=f"{backend} output", out_dtype=c.dtype)
    check_cache_writes(bt, kc, vc, k_new, v_new)
    if with_gqa:
        g_out = gqa_compare(bt, out, kc, vc, backend)
        assert_close_to_fp64(out, truth, g_out, name=f"{backend} output vs GQA", out_dtype=c.dtype)


# ---------------------------------------------------------------------------------------------
# Cases.

# fmt: off
EXPLICIT = [
    Case(block_size=16, head_size=64, dtype=FP16, rotary="half", seed=1),
    Case(block_size=1, head_size=64, past_max=12, dtype=FP32, sink="head", seed=2),
    Case(block_size=64, head_size=128, past_max=150, dtype=BF16, cache="fp16", window=37,
         rotary="interleaved", seed=3),
    Case(block_size=256, head_size=64, past_max=300, s_max=9, dtype=FP16, cache="int8_channel",
         softcap=2.0, sink="smooth", seed=4),
    Case(block_size=16, head_size=256, num_heads=6, kv_num_heads=1, dtype=FP16,
         cache="int8_tensor", qk_norm=True, rotary="partial", packed=True, seed=5),
    Case(block_size=16, head_size=128, num_heads=32, kv_num_heads=8, batch=2, past_max=20,
         s_max=3, dtype=BF16, rotary="half", window=9, seed=6),
    Case(block_size=1, past_max=12, dtype=FP32, window=3, sink="head", seed=7),
    # the first key visible to sequence 0's first query (34 - 4 + 1 = 31) ends a block
    Case(block_size=16, dtype=FP16, window=4, pasts=(34, 20, 0), s_max=4, seed=8),
]
# fmt: on


def grid_cases(count: int, seed: int = GRID_SEED) -> list[Case]:
    """A seeded random subset of the full grid (the seed is printed on failure via the id)."""
    rng = random.Random(seed)
    past_for = {1: 12, 16: 40, 64: 130, 256: 300}
    cases = []
    for i in range(count):
        bs = rng.choice((1, 16, 64, 256))
        dtype = rng.choice((FP16, FP32, BF16))
        cache = rng.choice(CACHES)
        if cache == "same" and dtype == BF16:
            cache = "fp16"  # bf16 activations with an fp16 cache: the torch tiers' case
        elif cache == "fp16" and dtype != BF16:
            cache = "same"
        n = rng.choice((8, 6))
        cases.append(Case(
            block_size=bs, head_size=rng.choice((64, 128, 256)), num_heads=n,
            kv_num_heads=2 if n == 8 else 1, past_max=past_for[bs], s_max=rng.randint(1, 8),
            dtype=dtype, cache=cache, rotary=rng.choice(("none", "half", "interleaved")),
            window=rng.choice((-1, rng.randint(1, past_for[bs]))),
            softcap=rng.choice((0.0, 0.0, 1.5)), sink=rng.choice(("none", "head", "smooth")),
            qk_norm=rng.random() < 0.3, packed=rng.random() < 0.3, seed=seed + i,
        ))  # fmt: skip
    return cases


GRID = grid_cases(10)
print(f"test_paged: grid seed {GRID_SEED}")


def case_id(c: Case) -> str:
    return (
        f"bs{c.block_size}-h{c.head_size}-{c.num_heads}x{c.kv_num_heads}-{str(c.dtype)[6:]}"
        f"-{c.cache}-{c.rotary}-w{c.window}-sc{c.softcap}-{c.sink}{'-qkn' * c.qk_norm}"
        f"{'-packed' * c.packed}-seed{c.seed}"
    )


@pytest.mark.parametrize("backend", ["reference", "chunked"])
@pytest.mark.parametrize("case", EXPLICIT + GRID, ids=case_id)
def test_against_truth_and_gqa(case, backend, monkeypatch):
    if backend == "chunked":  # several online-softmax steps even at these small lengths
        monkeypatch.setattr(_attention_torch, "KV_CHUNK", 32)
    run_case(case, backend)


def test_auto_picks_chunked_on_cpu_and_triton_gate_names_its_limits():
    bt = make_batch(Case(seed=11))
    out_auto, kc_a, _ = bt.call("auto")
    out_ch, kc_c, _ = bt.call("chunked")
    assert torch.equal(out_auto, out_ch) and torch.equal(bits(kc_a), bits(kc_c))
    with pytest.raises(RuntimeError, match="block_size 12 is not a power of two"):
        make_batch(Case(seed=11, block_size=12)).call("triton")
    with pytest.raises(RuntimeError, match="head_size 80 not in"):
        make_batch(Case(seed=11, head_size=80)).call("triton")


def test_padding_entries_are_never_used():
    """Entries past a sequence's needed blocks may hold anything (here: out-of-range values)."""
    bt = make_batch(Case(block_size=16, dtype=FP32, window=5, seed=13))
    table = bt.table.clone()
    table[table < 0] = 10**6
    out_a, kc_a, vc_a = bt.call("chunked")
    for backend in ("chunked", "reference"):
        out_b, kc_b, vc_b = replace(bt, table=table).call(backend)
        torch.testing.assert_close(out_b, out_a, rtol=1e-6, atol=1e-6)
        assert torch.equal(bits(kc_a), bits(kc_b)) and torch.equal(bits(vc_a), bits(vc_b))


def test_zero_new_tokens_and_decode_only():
    """A sequence with no new tokens in the batch is untouched; a pure decode batch works."""
    c = Case(block_size=16, batch=3, s_max=1, past_max=50, dtype=FP32, seed=12)
    run_case(c, "chunked")
    bt = make_batch(replace(c, s_max=3))
    cu = bt.cu.clone()
    cu[2:] = cu[2:] - (cu[2] - cu[1])  # sequence 1 brings 0 tokens
    tokens = int(cu[-1])
    keep = torch.ones(bt.query.shape[0], dtype=torch.bool)
    keep[bt.cu[1] : bt.cu[2]] = False
    bt2 = replace(bt, query=bt.query[keep], key=bt.key[keep], value=bt.value[keep], cu=cu)
    assert bt2.query.shape[0] == tokens
    out, kc, vc = bt2.call("reference")
    truth = truth_fp64(bt2)
    base, k_new, v_new = naive(bt2, FP32, round_cache=True)
    assert_close_to_fp64(out, truth, base, name="zero-token batch")
    check_cache_writes(bt2, kc, vc, k_new, v_new)


# ---------------------------------------------------------------------------------------------
# Bad input.


def _bad(bt: Batch, match, exc=ValueError, **changes):
    args = dict(query=bt.query, key=bt.key, value=bt.value, key_cache=bt.key_cache.clone(),
                value_cache=bt.value_cache.clone(), cumulative_sequence_length=bt.cu,
                past_seqlens=bt.past, block_table=bt.table)  # fmt: skip
    kw = dict(bt.kw)
    for k, v in changes.items():
        (args if k in args else kw)[k] = v
    with pytest.raises(exc, match=match):
        paged_attention(*args.values(), **kw)


def test_bad_data_names_the_argument():
    bt = make_batch(Case(block_size=16, dtype=FP32, rotary="half", seed=21))
    needed = (int(bt.past[0]) + int(bt.cu[1]) + 15) // 16
    t = bt.table.clone()
    t[0, needed - 1] = -1
    _bad(bt, r"block_table\[0, ", block_table=t)
    t = bt.table.clone()
    t[1, 0] = bt.key_cache.shape[0]
    _bad(bt, r"block_table\[1, 0\]", block_table=t)
    t, past = bt.table.clone(), bt.past.clone()
    col = int(past[0]) // 16
    past[0] = 16 * col  # sequence 0 appends at row 0 of its block `col` ...
    t[0, col] = t[2, 0]  # ... which is also where sequence 2 (a first prompt) writes row 0
    _bad(bt, "block_table: several new tokens write the same cache slot", block_table=t,
         past_seqlens=past)  # fmt: skip
    cu = bt.cu.clone()
    cu[1] = cu[2] + 1
    _bad(bt, "cumulative_sequence_length must be non-decreasing", cumulative_sequence_length=cu)
    _bad(bt, r"cumulative_sequence_length\[0\] must be 0", cumulative_sequence_length=bt.cu + 1)
    cu = bt.cu.clone()
    cu[-1] -= 1
    _bad(bt, r"cumulative_sequence_length\[-1\] = .* must equal", cumulative_sequence_length=cu)
    past = bt.past.clone()
    past[1] = bt.table.shape[1] * 16
    _bad(bt, r"past_seqlens\[1\] \+ new tokens .* exceed the block_table's capacity",
         past_seqlens=past)  # fmt: skip
    past = bt.past.clone()
    past[0] = -1
    _bad(bt, "past_seqlens must be >= 0", past_seqlens=past)
    cos, sin = bt.kw["cos_cache"][:3], bt.kw["sin_cache"][:3]
    _bad(bt, "cos_cache", cos_cache=cos, sin_cache=sin)


def test_bad_shapes_and_dtypes():
    bt = make_batch(Case(block_size=16, dtype=FP16, seed=22))
    _bad(bt, "cumulative_sequence_length must have dtype int32", TypeError,
         cumulative_sequence_length=bt.cu.long())  # fmt: skip
    _bad(bt, "past_seqlens must have shape", past_seqlens=bt.past[:2])
    _bad(bt, "block_table must be 2-D", block_table=bt.table[0])
    _bad(bt, "key_cache dtype must be", TypeError, key_cache=bt.key_cache.float(),
         value_cache=bt.value_cache.float())  # fmt: skip
    _bad(bt, "value_cache must have dtype", TypeError, value_cache=bt.value_cache.float())
    i8 = bt.key_cache.to(torch.int8)
    _bad(bt, "k_scale is required", key_cache=i8, value_cache=i8.clone())
    _bad(bt, "k_scale is only used with an int8 cache", k_scale=torch.ones(1))
    _bad(bt, r"query must have shape \(tokens, num_heads \* head_size\)", query=bt.query[:, :-8])
    _bad(bt, "key and value must both be given", value=None)
    _bad(bt, "key must have dtype", TypeError, key=bt.key.float())
    _bad(bt, r"key_cache.shape\[2\] = 2 must equal kv_num_heads = 4", kv_num_heads=4)
    _bad(bt, "num_heads = 8 must be a multiple of kv_num_heads = 3", kv_num_heads=3)
    _bad(bt, "local_window_size must be -1", local_window_size=0)
    _bad(bt, "softcap must be >= 0", softcap=-1.0)
    _bad(bt, "scale must be a finite float > 0", scale=-0.1)
    _bad(bt, "do_rotary=True needs cos_cache", do_rotary=True)
    _bad(bt, "key_cache must be contiguous",
         key_cache=bt.key_cache.transpose(0, 1).contiguous().transpose(0, 1),
         value_cache=bt.value_cache.transpose(0, 1).contiguous().transpose(0, 1))  # fmt: skip
    _bad(bt, "head_sink must have shape", head_sink=torch.zeros(3))
    _bad(bt, "backend must be one of", backend="cuda")
    _bad(bt, "validate must be a bool", TypeError, validate=1)
    _bad(bt, "rotary_interleaved must be a bool", TypeError, rotary_interleaved="no")
    _bad(bt, "smooth_softmax must be a bool", TypeError, smooth_softmax=2)
    _bad(bt, "softcap must be >= 0", softcap="x")
    _bad(bt, "scale must be a finite float", scale="x")
    _bad(bt, "qk_norm_epsilon must be a finite float >= 0", qk_norm_epsilon=-1e-6)
    _bad(bt, "qk_norm_epsilon must be a finite float >= 0", qk_norm_epsilon=float("inf"))
    _bad(bt, "scale must be a finite float", scale=False)  # a bool: not the default
    _bad(bt, "scale must be a finite float", scale=True)


@pytest.mark.parametrize(
    "table",
    [
        [[4, 2], [4, 6]],  # sequence 1 appends into block 4, sequence 0's history
        [[4, 2], [2, 6]],  # both append into block 2 (different rows)
    ],
)
def test_append_into_a_shared_block_is_refused(table):
    n, kv, h, bs = 4, 2, 16, 4
    q, k, v = torch.randn(2, n * h), torch.randn(2, kv * h), torch.randn(2, kv * h)
    kc = torch.randn(8, bs, kv, h)
    args = (
        q,
        k,
        v,
        kc,
        kc.clone(),
        torch.tensor([0, 1, 2], dtype=torch.int32),
        torch.tensor([5, 2], dtype=torch.int32),
        torch.tensor(table, dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="share only blocks none of them appends to"):
        paged_attention(*args, num_heads=n, kv_num_heads=kv)
    ok = torch.tensor([[4, 2], [5, 6]], dtype=torch.int32)  # private blocks: fine
    paged_attention(*args[:-1], ok, num_heads=n, kv_num_heads=kv)
    shared_prefix = torch.tensor([[4, 2], [4, 5]], dtype=torch.int32)
    past = torch.tensor([5, 5], dtype=torch.int32)  # both read block 4, append elsewhere
    paged_attention(*args[:-2], past, shared_prefix, num_heads=n, kv_num_heads=kv)  # fmt: skip


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view with stride 2 in the last dim."""
    return torch.stack((t, torch.zeros_like(t)), -1).flatten(-2)[..., ::2]


def test_strided_index_and_parameter_tensors_are_refused():
    """The Triton kernels read these at ptr + i: a strided view was read as if contiguous
    (wrong output, cache writes to the wrong slots, or a crash), so it is refused."""
    bt = make_batch(Case(block_size=16, dtype=FP32, rotary="none", seed=22))
    for name, value in (
        ("cumulative_sequence_length", _strided(bt.cu)),
        ("past_seqlens", _strided(bt.past)),
        ("block_table", _strided(bt.table)),
        ("head_sink", _strided(torch.zeros(bt.case.num_heads))),
        ("q_norm_weight", _strided(torch.ones(bt.case.head_size))),
        ("k_norm_weight", _strided(torch.ones(bt.case.head_size))),
    ):
        _bad(bt, f"{name} must be contiguous", **{name: value})


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_no_new_tokens(backend):
    """A batch whose sequences all have 0 new tokens: an empty [0, N*H] output."""
    bt = make_batch(Case(block_size=16, dtype=FP32, seed=22))
    cu = torch.zeros_like(bt.cu)
    q, k, v = bt.query[:0], bt.key[:0], bt.value[:0]
    out = paged_attention(q, k, v, bt.key_cache.clone(), bt.value_cache.clone(), cu, bt.past,
                          bt.table, backend=backend, **bt.kw)  # fmt: skip
    assert out.shape == (0, bt.query.shape[1])


def test_validate_false_is_memory_safe_and_skips_checks():
    """With validate=False a missing block (-1) is not an error; nothing is written outside the
    batch's valid slots and nothing reads out of bounds."""
    bt = make_batch(Case(block_size=16, dtype=FP32, seed=23))
    t = bt.table.clone()
    col = (int(bt.past[0])) // 16
    t[0, col] = -1  # the decode token of sequence 0 has no block
    bt2 = replace(bt, table=t)
    with pytest.raises(ValueError, match="block_table"):
        bt2.call("chunked")
    out, kc, vc = bt2.call("chunked", validate=False)
    assert out.shape == bt.query.shape
    role, _ = slot_roles(bt)  # roles under the original table
    flat_b, flat_a = bits(bt.key_cache.flatten(0, 1)), bits(kc.flatten(0, 1))
    assert torch.equal(flat_b[role != 1], flat_a[role != 1])
    dec = int(bt.table[0, col]) * 16 + int(bt.past[0]) % 16
    assert torch.equal(flat_b[dec], flat_a[dec])  # the unmapped token was not written


# ---------------------------------------------------------------------------------------------
# torch.library / torch.compile.


def _op_args(bt: Batch):
    kw = bt.kw
    return (bt.query, bt.key, bt.value, bt.key_cache.clone(), bt.value_cache.clone(), bt.cu,
            bt.past, bt.table, kw.get("cos_cache"), kw.get("sin_cache"), kw.get("head_sink"),
            kw.get("q_norm_weight"), kw.get("k_norm_weight"), kw.get("k_scale"), kw.get("v_scale"),
            bt.case.num_heads, bt.case.kv_num_heads, 1 / math.sqrt(bt.case.head_size),
            bt.case.softcap, bt.case.window, bt.case.rotary != "none",
            bt.case.rotary == "interleaved", bt.case.sink == "smooth", 1e-6, "chunked")  # fmt: skip


@pytest.mark.parametrize("cache", ["same", "int8_channel"])
def test_opcheck(cache):
    c = Case(block_size=4, head_size=16, num_heads=4, kv_num_heads=2, batch=2, s_max=3,
             past_max=6, dtype=FP32, cache=cache, rotary="half", sink="head", seed=31)  # fmt: skip
    bt = make_batch(c)
    # opcheck compares repeated runs, so the caches must hold finite data everywhere.
    bt.key_cache.copy_(random_cache_values(torch.Generator().manual_seed(0), bt.key_cache.shape,
                                           bt.key_cache.dtype))  # fmt: skip
    bt.value_cache.copy_(bt.key_cache)
    torch.library.opcheck(_paged_attention_op, _op_args(bt))


def test_torch_compile_decode_step():
    c = Case(block_size=8, head_size=32, num_heads=4, kv_num_heads=2, batch=3, s_max=1,
             past_max=20, dtype=FP32, rotary="half", seed=32)  # fmt: skip
    bt = make_batch(c)
    kw = bt.kw

    def step(q, k, v, kc, vc, cu, past, table):
        # validate=True: the data checks are skipped automatically while tracing
        return paged_attention(q, k, v, kc, vc, cu, past, table, **kw)

    compiled = torch.compile(step, fullgraph=True)
    kc, vc = bt.key_cache.clone(), bt.value_cache.clone()
    out = compiled(bt.query, bt.key, bt.value, kc, vc, bt.cu, bt.past, bt.table)
    want, kc2, vc2 = bt.call("auto")
    assert torch.equal(out, want)
    assert torch.equal(bits(kc), bits(kc2)) and torch.equal(bits(vc), bits(vc2))
