"""Tests of the Triton PagedAttention tier (paged prologue, paged attention kernel in its decode
and prefill launches, split merge).

Truth: the colleague's ``paged_attention_reference`` on fp64 activations with the real cache
dtype (its only rounding is the write of the new K/V into the cache). Baseline (for
``assert_close_to_fp64``): the same-precision torch computation: the fp32 prologue, Q rounded to
the activation dtype, and ``attention_unfused`` run in the activation dtype per sequence.

Every batch mixes decode and prefill sequences, spreads its blocks as a random permutation over
3x the blocks it needs, and fills every slot it does not own (and the owned slots past each
sequence's end) with NaN (int8: -128): a stray read shows in the output, and every slot except
the new tokens' must be bit-identical after the call. Every buffer the tier allocates starts as
NaN. Interpreter tests (``-m interpret``) use tiny shapes and fp16/fp32; GPU tests (``-m gpu``)
use real shapes, bf16 included.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from _kernel_checks import KernelSpy, assert_within_two_roundings
from longattn import _attention_torch as at
from longattn._rotary import rope_cache
from longattn.paged import _slots, _torch_steps
from longattn.paged._params import PagedParams
from longattn.paged.reference import paged_attention_reference
from longattn.paged.triton import launch, paged_attention_triton, unsupported_reason
from longattn.testing import assert_close_to_fp64, nan_tensor

FP16, BF16, FP32, FP64, INT8 = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
)


@pytest.fixture(autouse=True)
def _poison_buffers(monkeypatch):
    """Every buffer the tier allocates starts as NaN (or int min)."""

    def poisoned(shape, *, dtype, device):
        return nan_tensor(shape, dtype, device)

    monkeypatch.setattr(launch, "_empty", poisoned)


@dataclasses.dataclass(frozen=True)
class Case:
    seqs: tuple[tuple[int, int], ...] = ((1, 37), (11, 0), (6, 20), (2, 50))  # (new, past)
    n: int = 4
    kv: int = 2
    h: int = 16
    block_size: int = 16
    act: torch.dtype = FP16
    cache: str = "same"  # same | fp16 | int8 | int8_channel
    rotary: str | None = "half"  # half | interleaved | partial | None
    qk_norm: bool = False
    window: int = -1
    softcap: float = 0.0
    sink: str | None = None  # head | smooth
    packed: bool = False
    decode_splits: int | None = None  # split budgets (tier hooks)
    prefill_splits: int | None = None
    min_chunk: int | None = None
    seed: int = 0

    @property
    def cache_dtype(self) -> torch.dtype:
        if self.cache == "fp16":
            return FP16
        return INT8 if self.cache.startswith("int8") else self.act


@dataclasses.dataclass
class Batch:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    cu: torch.Tensor
    past: torch.Tensor
    table: torch.Tensor
    p: PagedParams


def _sentinel(shape, dtype, device):
    if dtype == INT8:
        return torch.full(shape, -128, dtype=dtype, device=device)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def build(c: Case, device) -> Batch:
    g = torch.Generator().manual_seed(c.seed)
    n, kv, h, bs = c.n, c.kv, c.h, c.block_size
    new = torch.tensor([s for s, _ in c.seqs])
    past = torch.tensor([q for _, q in c.seqs])
    b = len(c.seqs)
    total = past + new
    needed = (total + bs - 1) // bs
    max_blocks = int(needed.max()) + 2  # padding columns
    num_blocks = 3 * max(int(needed.sum()), 1)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.full((b, max_blocks), -1, dtype=torch.int32)
    off = 0
    for i in range(b):
        table[i, : needed[i]] = perm[off : off + needed[i]]
        off += int(needed[i])
    cd = c.cache_dtype
    caches = []
    for _ in range(2):
        cache = _sentinel((num_blocks * bs, kv, h), cd, "cpu")
        for i in range(b):
            rows = int(past[i])
            if rows == 0:
                continue
            j = torch.arange(rows)
            slot = table[i, j // bs].long() * bs + j % bs
            if cd == INT8:
                cache[slot] = torch.randint(-127, 128, (rows, kv, h), generator=g, dtype=INT8)
            else:
                cache[slot] = (torch.randn(rows, kv, h, generator=g) * 1.5).to(cd)
        caches.append(cache.view(num_blocks, bs, kv, h).to(device))
    tokens = int(new.sum())
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = new.cumsum(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(c.act).to(device)

    if c.packed:
        qkv = randn(tokens, (n + 2 * kv) * h, scale=1.5)
        q, k, v = qkv[:, : n * h], qkv[:, n * h : (n + kv) * h], qkv[:, (n + kv) * h :]
    else:
        q, k, v = (
            randn(tokens, n * h, scale=1.5),
            randn(tokens, kv * h, scale=1.5),
            randn(tokens, kv * h),
        )
    cos = sin = None
    if c.rotary:
        rot = h // 2 if c.rotary == "partial" else h
        cos, sin = rope_cache(int(total.max()) + 8, rot, device=device)
    k_scale = v_scale = None
    if cd == INT8:
        if c.cache == "int8_channel":
            k_scale = (0.02 + 0.04 * torch.rand(kv, 1, h, generator=g)).to(device)
            v_scale = (0.02 + 0.03 * torch.rand(kv, 1, h, generator=g)).to(device)
        else:
            k_scale = torch.tensor([0.04], device=device)
            v_scale = torch.tensor([0.03], device=device)
    p = PagedParams(
        num_heads=n, kv_num_heads=kv, head_size=h, scale=1.0 / math.sqrt(h), softcap=c.softcap,
        local_window_size=c.window, do_rotary=c.rotary is not None,
        rotary_interleaved=c.rotary == "interleaved", smooth_softmax=c.sink == "smooth",
        qk_norm_epsilon=1e-6, cos_cache=cos, sin_cache=sin,
        head_sink=(torch.randn(n, generator=g) * 2).to(device) if c.sink == "head" else None,
        q_norm_weight=(torch.rand(h, generator=g) + 0.5).to(c.act).to(device) if c.qk_norm else None,
        k_norm_weight=(torch.rand(h, generator=g) + 0.5).to(c.act).to(device) if c.qk_norm else None,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    return Batch(q, k, v, caches[0], caches[1], cu.to(device), past.to(torch.int32).to(device),
                 table.to(device), p)  # fmt: skip


def baseline(bt: Batch) -> torch.Tensor:
    """Same-precision torch: fp32 prologue and cache write, attention in the activation dtype."""
    p, act = bt.p, bt.query.dtype
    kc, vc = bt.key_cache.clone(), bt.value_cache.clone()
    q = _torch_steps.prologue_and_append(bt.query, bt.key, bt.value, kc, vc, bt.cu, bt.past,
                                         bt.table, p, FP32)  # fmt: skip
    sink = at.sink_logits(p.head_sink, p.smooth_softmax, p.num_heads, bt.query.device)
    nb, bs = kc.shape[0], kc.shape[1]
    out = torch.zeros(q.shape[1:], dtype=act, device=q.device)
    dev = q.device
    for b, t0, t1, past in _torch_steps.sequences(bt.cu, bt.past):
        total = past + t1 - t0
        pos = torch.arange(total, device=dev)
        slot, _ = _slots.table_slots(bt.table, torch.full_like(pos, b), pos, bs, nb)
        k = _slots.flat_view(kc)[slot].permute(1, 0, 2)[None]
        v = _slots.flat_view(vc)[slot].permute(1, 0, 2)[None]
        o = at.attention_unfused(
            q[:, t0:t1].to(act), k, v, qpos=pos[past:][None],
            total_len=torch.full((1,), total, device=dev), scale=p.scale, k_scale=p.k_scale,
            v_scale=p.v_scale, window=p.local_window_size, softcap=p.softcap,
            sink=None if sink is None else sink.to(act),
        )  # fmt: skip
        out[t0:t1] = o[0]
    return out.reshape(bt.query.shape[0], -1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return (
        t.view(torch.uint8)
        if t.dtype == INT8
        else t.view({4: torch.int32, 2: torch.int16}[t.element_size()])
    )


def _new_slots(bt: Batch) -> torch.Tensor:
    bs, nb = bt.key_cache.shape[1], bt.key_cache.shape[0]
    _, _, slot, valid = _slots.new_token_slots(bt.cu, bt.past, bt.table, num_tokens=bt.query.shape[0],
                                               block_size=bs, num_blocks=nb)  # fmt: skip
    assert bool(valid.all())
    return slot


def check_cache(bt: Batch, before: torch.Tensor, ours: torch.Tensor, truth: torch.Tensor, name):
    """Bit-identical outside the new tokens' slots; the new slots as the fp64 truth wrote them
    (16-bit: rarely one ulp off, int8: rarely one step: fp32 vs fp64 just before the rounding)."""
    flat_b, flat_o, flat_t = (_slots.flat_view(x) for x in (before, ours, truth))
    new = torch.zeros(flat_b.shape[0], dtype=torch.bool, device=flat_b.device)
    new[_new_slots(bt)] = True
    assert torch.equal(_bits(flat_b[~new]), _bits(flat_o[~new])), (
        f"{name}: a slot other than the new tokens' changed"
    )
    a, t = flat_o[new].double(), flat_t[new].double()
    assert bool(torch.isfinite(a).all()), f"{name}: non-finite value written"
    if ours.dtype == INT8:
        bad, limit = (a - t).abs() > 1, a.numel() // 100
    elif ours.dtype == FP32:
        bad, limit = (a - t).abs() > 8 * torch.finfo(FP32).eps * t.abs() + 1e-6, a.numel()
    else:
        bad, limit = (a - t).abs() > torch.finfo(ours.dtype).eps * t.abs() + 1e-6, a.numel() // 1000
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} new values off by more than 1 ulp"
    assert int((a != t).sum()) <= max(2, limit), f"{name}: {int((a != t).sum())} new values differ"


def _up(t):
    return t.to(FP64)


def run_and_check(c: Case, device, k: float | None = None) -> torch.Tensor:
    # fp32: Triton's exp2/log2 are approximate (~2 ulp) and the merge adds an exp2/log2 pair.
    k = k or (4.0 if c.act == FP32 else 2.0)
    bt = build(c, device)
    kc, vc = bt.key_cache.clone(), bt.value_cache.clone()
    out = paged_attention_triton(bt.query, bt.key, bt.value, kc, vc, bt.cu, bt.past, bt.table,
                                 bt.p, decode_splits=c.decode_splits,
                                 prefill_splits=c.prefill_splits, min_chunk=c.min_chunk)  # fmt: skip
    kt, vt = bt.key_cache.clone(), bt.value_cache.clone()
    truth = paged_attention_reference(_up(bt.query), _up(bt.key), _up(bt.value), kt, vt, bt.cu,
                                      bt.past, bt.table, bt.p)  # fmt: skip
    check_cache(bt, bt.key_cache, kc, kt, "key_cache")
    check_cache(bt, bt.value_cache, vc, vt, "value_cache")
    assert out.dtype == bt.query.dtype and out.shape == truth.shape
    assert_close_to_fp64(out, truth, baseline(bt), k=k, out_dtype=bt.query.dtype)
    return out


# ------------------------------------------------------------------------------------------
# Interpreter tests: tiny shapes, fp16/fp32.

# Sequences are (new tokens, cached tokens). With H = 16 / group 2 the decode launch takes
# sequences of <= 8 new tokens (16-row tiles), the prefill launch the rest (16-row tiles too
# under the interpreter, so a prefill sequence spans several tiles).
INTERPRET_CASES = {
    "mixed-bs16-half-splits": Case(decode_splits=6, min_chunk=16),
    "bs1-fp32-window-sink": Case(
        seqs=((1, 23), (13, 4), (3, 0)), block_size=1, act=FP32, window=7, sink="head",
        rotary=None, decode_splits=3, min_chunk=16,
    ),
    "bs64-int8ch-softcap-smooth": Case(
        seqs=((1, 90), (20, 70), (2, 5)), block_size=64, cache="int8_channel", softcap=3.0,
        sink="smooth", rotary="interleaved", decode_splits=4, min_chunk=16,
    ),
    "bs16-int8-qknorm-partial-packed-group4": Case(
        seqs=((1, 40), (9, 0), (0, 12), (4, 33)), n=8, kv=2, cache="int8", qk_norm=True,
        rotary="partial", packed=True,
    ),
    "bs16-fp32-prefill-splits-window": Case(
        seqs=((10, 80), (1, 31)), act=FP32, window=50, prefill_splits=8, min_chunk=16,
        sink="head",
    ),
    "bs16-window-at-block-edge-group1": Case(
        seqs=((4, 34), (1, 47), (18, 0)), n=2, kv=2, window=4, decode_splits=2, min_chunk=16,
    ),
    "bs64-h32-group4-decode-only": Case(
        seqs=((1, 100), (1, 3), (1, 64)), n=8, kv=2, h=32, block_size=64, decode_splits=5,
        min_chunk=16, sink="head",
    ),
}  # fmt: skip


@pytest.mark.interpret
@pytest.mark.parametrize("name", list(INTERPRET_CASES))
def test_paged_triton_interpret(name, device):
    run_and_check(INTERPRET_CASES[name], device)


INT8_BUILDS = {"i2f": dict(I8_I2F=True), "v_pairs": dict(V_PAIRS=True)}


def _with_build(monkeypatch, flags: dict) -> list:
    """Every paged launch from here on with ``flags`` in its decode / prefill config; the
    returned list collects each launch's kernel kwargs."""
    for cfg in ("decode_config", "prefill_config"):
        orig = getattr(launch, cfg)
        monkeypatch.setattr(launch, cfg, lambda *a, orig=orig: dict(orig(*a), **flags))
    seen = []
    monkeypatch.setattr(launch, "paged_attn_kernel", KernelSpy(launch.paged_attn_kernel, seen))
    return seen


@pytest.mark.interpret
@pytest.mark.parametrize("build", list(INT8_BUILDS))
@pytest.mark.parametrize(
    "name", ["bs64-int8ch-softcap-smooth", "bs16-int8-qknorm-partial-packed-group4"]
)
def test_int8_tile_builds_agree(name, build, device, monkeypatch):
    """The int8 tile options against the default build (K / V to fp16 by
    ``_triton_utils.cache_to_dot``: xor + byte permutes, no I2F), decode and prefill launches,
    fp64 tolerance each: ``I8_I2F`` (the bench's A/B of that conversion: ``.to``) and
    ``V_PAIRS`` (V read as int16 channel pairs into even / odd accumulators, interleaved after
    the loops; swapped halves or a wrong interleave fail the fp64 check) are exact
    conversions of the same values in the same sums: bitwise equal outputs."""
    new = run_and_check(INTERPRET_CASES[name], device)
    seen = _with_build(monkeypatch, INT8_BUILDS[build])
    old = run_and_check(INTERPRET_CASES[name], device)
    assert seen and all(kw[k] == v for kw in seen for k, v in INT8_BUILDS[build].items())
    assert torch.equal(new, old)


@pytest.mark.parametrize("flag", ["V_PAIRS", "I8_I2F"])
def test_int8_tile_options_must_be_bools(flag, device):
    """A tuning flag given as 1 would silently pick another build: a ValueError names it."""
    bt = build(INTERPRET_CASES["bs64-int8ch-softcap-smooth"], device)
    cfg = dict(launch.decode_config(bt.p.head_size, FP16, INT8, True), **{flag: 1})
    with pytest.raises(ValueError, match=rf"paged cfg\['{flag}'\] must be a bool, got 1"):
        paged_attention_triton(bt.query, bt.key, bt.value, bt.key_cache, bt.value_cache, bt.cu,
                               bt.past, bt.table, bt.p, decode_cfg=cfg)  # fmt: skip


@pytest.mark.interpret
def test_split_and_unsplit_agree(device):
    """The same decode-heavy batch with and without key splits (merge vs direct write)."""
    c = Case(seqs=((1, 70), (2, 40), (12, 9)), rotary=None, sink="smooth")
    a = run_and_check(dataclasses.replace(c, decode_splits=0, prefill_splits=0), device)
    b = run_and_check(dataclasses.replace(c, decode_splits=7, prefill_splits=6, min_chunk=16),
                      device)  # fmt: skip
    torch.testing.assert_close(a.float(), b.float(), atol=2e-3, rtol=2e-3)


def _tiny_key_twins(bt: Batch, k_pow: int) -> tuple[Batch, Batch]:
    """(tiny, twin) of an int8 batch: ``tiny`` has the new keys and ``k_scale`` times 2**-k_pow
    and the softmax scale times 2**k_pow (the cached integers unchanged); ``twin`` is the same
    attention at the original scale, its new keys tiny's times 2**k_pow (exact: 2**-k_pow is
    applied in the activation dtype first). Every logit and every cached or appended integer
    is the same in exact arithmetic."""
    f = 2.0**-k_pow
    key = (bt.key.float() * f).to(bt.key.dtype)
    p = dataclasses.replace(bt.p, k_scale=bt.p.k_scale * f, scale=bt.p.scale / f)
    tiny = dataclasses.replace(bt, key=key, p=p)
    twin = dataclasses.replace(bt, key=(key.float() / f).to(bt.key.dtype))
    return tiny, twin


def check_tiny_keys(c: Case, device, k_pow: int = 14) -> None:
    """An int8 cache with tiny keys (``_tiny_key_twins``): Q * k_scale ~ 1e-6 .. 3e-5 (fp16
    subnormals below 6.1e-5). The tier's error vs fp64 is within the house tolerance of the
    same-precision baseline of the normal-scale twin (that baseline rounds the unfolded Q and
    the dequantized K, which fp16 represents there), and its output and caches equal the twin's
    bit for bit (the power-of-two factors of the Q rows are exact)."""
    tiny, twin = _tiny_key_twins(build(c, device), k_pow)
    outs, caches = [], []
    for bt in (tiny, twin):
        kc, vc = bt.key_cache.clone(), bt.value_cache.clone()
        outs.append(paged_attention_triton(bt.query, bt.key, bt.value, kc, vc, bt.cu, bt.past,
                                           bt.table, bt.p, decode_splits=c.decode_splits,
                                           prefill_splits=c.prefill_splits,
                                           min_chunk=c.min_chunk))  # fmt: skip
        caches.append((kc, vc))
    kt, vt = tiny.key_cache.clone(), tiny.value_cache.clone()
    truth = paged_attention_reference(_up(tiny.query), _up(tiny.key), _up(tiny.value), kt, vt,
                                      tiny.cu, tiny.past, tiny.table, tiny.p)  # fmt: skip
    check_cache(tiny, tiny.key_cache, caches[0][0], kt, "key_cache")
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert_close_to_fp64(outs[0], truth, baseline(twin), k=2.0, out_dtype=tiny.query.dtype,
                         name=f"paged triton {c.cache} tiny keys")  # fmt: skip
    assert torch.equal(outs[0], outs[1]), "tiny keys: not the normal-scale twin's output"


@pytest.mark.interpret
@pytest.mark.parametrize("cache", ["int8", "int8_channel"])
def test_paged_triton_int8_tiny_keys_pow2_q_rows(cache, device):
    """int8 K cache, fp16 activations, keys ~3e-4 (k_scale ~2e-6, per tensor / per channel):
    the folded Q is rounded to fp16 with power-of-two rows, the factors undone on the fp32
    logits (before: ~6x the baseline's rms error, output not the twin's). Decode and prefill
    sequences, key splits; softcap + sink with per-channel scales."""
    ch = cache == "int8_channel"
    c = Case(cache=cache, softcap=3.0 if ch else 0.0, sink="head" if ch else None,
             decode_splits=4, prefill_splits=3 if ch else None, min_chunk=16)  # fmt: skip
    check_tiny_keys(c, device)


def test_gate_reasons():
    assert unsupported_reason(64, 16, FP16) is None
    assert unsupported_reason(128, 1, BF16) is None
    why = unsupported_reason(64, 48, FP16)
    assert why is not None and "power of two" in why and "block_size 48" in why
    assert "head_size 80" in unsupported_reason(80, 16, FP16)
    assert unsupported_reason(64, 16, FP64) is not None
    bt = build(Case(block_size=16), "cpu")
    kc = torch.zeros(4, 12, bt.p.kv_num_heads, bt.p.head_size, dtype=FP16)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention_triton(bt.query, bt.key, bt.value, kc, kc.clone(), bt.cu, bt.past,
                               bt.table, bt.p)  # fmt: skip


def test_api_dispatch_when_gate_is_wired(device):
    """Through ``paged_attention(backend="triton")`` once api.py routes to this tier."""
    from longattn.paged import api

    bt = build(Case(), device)
    ok, reason = api.gates(bt.query, bt.key_cache, bt.p)["triton"](True)
    if "not implemented" in reason:
        pytest.skip("paged/api.py still has the triton gate stub (see the tier's report)")
    if not ok:
        pytest.skip(reason)
    kc, vc = bt.key_cache.clone(), bt.value_cache.clone()
    out = api.paged_attention(bt.query, bt.key, bt.value, kc, vc, bt.cu, bt.past, bt.table,
                              num_heads=bt.p.num_heads, kv_num_heads=bt.p.kv_num_heads,
                              cos_cache=bt.p.cos_cache, sin_cache=bt.p.sin_cache, do_rotary=True,
                              backend="triton")  # fmt: skip
    kc2, vc2 = bt.key_cache.clone(), bt.value_cache.clone()
    direct = paged_attention_triton(bt.query, bt.key, bt.value, kc2, vc2, bt.cu, bt.past,
                                    bt.table, bt.p)  # fmt: skip
    torch.testing.assert_close(out, direct, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------
# GPU tests: real shapes.


def _ragged(b: int, t_max: int, seed: int, new: int = 1) -> tuple[tuple[int, int], ...]:
    g = torch.Generator().manual_seed(seed)
    pasts = torch.randint(1, t_max, (b,), generator=g).tolist()
    pasts[0] = t_max - new  # the longest sequence
    return tuple((new, int(x)) for x in pasts)


GPU_CASES = {
    "decode-bf16-h128-bs16-32k": Case(
        seqs=_ragged(6, 32768, 1), n=32, kv=8, h=128, block_size=16, act=BF16,
    ),
    "decode-bf16-h64-bs256-int8ch-sink": Case(
        seqs=_ragged(4, 20000, 2), n=16, kv=4, h=64, block_size=256, act=BF16,
        cache="int8_channel", sink="head",
    ),
    "mixed-bf16-h256-bs64-fp16cache-window-softcap": Case(
        seqs=((1, 9000), (700, 300), (1, 1), (3, 4000), (513, 0)), n=16, kv=4, h=256,
        block_size=64, act=BF16, cache="fp16", window=2048, softcap=30.0,
    ),
    "mixed-bf16-h128-bs16-qknorm-smooth": Case(
        seqs=((1200, 0), (1, 5000), (257, 2100), (1, 17)), n=32, kv=8, h=128, block_size=16,
        act=BF16, qk_norm=True, sink="smooth",
    ),
    "prefill-fp16-h64-bs64-int8": Case(
        seqs=((900, 0), (333, 1000)), n=8, kv=8, h=64, block_size=64, act=FP16, cache="int8",
    ),
    "mixed-fp32-h128-bs256": Case(
        seqs=((300, 200), (1, 3000)), n=8, kv=2, h=128, block_size=256, act=FP32,
    ),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_paged_triton_gpu(name, device):
    run_and_check(GPU_CASES[name], device)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("build", list(INT8_BUILDS))
@pytest.mark.parametrize("name", [k for k, c in GPU_CASES.items() if c.cache.startswith("int8")])
def test_int8_tile_builds_gpu(name, build, device, monkeypatch):
    """The int8 tile options on real shapes (decode with per-channel scales and a sink, an
    fp16 prefill): fp64 tolerance, within two output roundings of the default build."""
    base = run_and_check(GPU_CASES[name], device)
    seen = _with_build(monkeypatch, INT8_BUILDS[build])
    got = run_and_check(GPU_CASES[name], device)
    assert seen and all(kw[k] == v for kw in seen for k, v in INT8_BUILDS[build].items())
    assert_within_two_roundings(got, base)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "c",
    [
        Case(seqs=_ragged(4, 20000, 2), n=16, kv=4, h=64, block_size=256, act=BF16,
             cache="int8_channel", sink="head"),
        Case(seqs=((1, 9000), (700, 300), (1, 1), (513, 0)), n=32, kv=8, h=128, block_size=16,
             act=BF16, cache="int8", softcap=30.0),
        Case(seqs=((900, 0), (1, 5000), (333, 1000)), n=8, kv=8, h=64, block_size=64, act=FP16,
             cache="int8_channel", window=512),
    ],
    ids=["decode-bf16-int8ch-sink", "mixed-bf16-int8-softcap", "mixed-fp16-int8ch-window"],
)  # fmt: skip
def test_paged_triton_int8_tiny_keys_gpu(c, device):
    """Real shapes of ``check_tiny_keys``: bf16 activations take the fp16 power-of-two Q rows
    too (the kernels' HAS_QSCALE builds; the interpreter cannot run bf16)."""
    check_tiny_keys(c, device)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_decode_cuda_graph_capturable(device):
    """Decode launches no host sync: it captures into a CUDA graph and replays correctly."""
    c = Case(seqs=_ragged(8, 9000, 3), n=32, kv=8, h=128, block_size=64, act=BF16)
    bt = build(c, device)
    args = (bt.query, bt.key, bt.value)
    idx = (bt.cu, bt.past, bt.table, bt.p)
    kc1, vc1 = bt.key_cache.clone(), bt.value_cache.clone()
    eager = paged_attention_triton(*args, kc1, vc1, *idx)
    kc2, vc2 = bt.key_cache.clone(), bt.value_cache.clone()
    paged_attention_triton(*args, kc2.clone(), vc2.clone(), *idx)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(*args, kc2, vc2, *idx)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    torch.testing.assert_close(kc2, kc1, atol=0, rtol=0, equal_nan=True)


@pytest.mark.interpret
@pytest.mark.parametrize("cu", [[0, 1, 5], [-3, 1, 4]])
def test_bad_cu_seqlens_stay_in_bounds(cu, device):
    """validate=False with cu_seqlens past the tokens (or negative): query rows outside
    [0, tokens) are skipped instead of read / written out of bounds (this crashed the process
    before), and the rows of well-formed sequences match the chunked tier."""
    from longattn import paged_attention

    g = torch.Generator().manual_seed(5)
    n, kv, h, bs = 4, 2, 16, 4
    q, k, v = (torch.randn(4, x * h, generator=g).to(device) for x in (n, kv, kv))
    kc = torch.randn(16, bs, kv, h, generator=g).to(device)
    vc = torch.randn(16, bs, kv, h, generator=g).to(device)
    past = torch.tensor([5, 2], dtype=torch.int32, device=device)
    table = torch.tensor([[4, 2], [6, 5]], dtype=torch.int32, device=device)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    outs = []
    for backend in ("chunked", "triton"):
        outs.append(paged_attention(q, k, v, kc.clone(), vc.clone(), cu_t, past, table,
                                    num_heads=n, kv_num_heads=kv, backend=backend,
                                    validate=False))  # fmt: skip
    ok_rows = slice(0, 4) if cu[0] == 0 else slice(1, 4)  # rows of sequence 1 / 0 and 1
    torch.testing.assert_close(outs[1][ok_rows], outs[0][ok_rows], atol=1e-5, rtol=1e-5)


def test_int8_decode_config_and_split_budget(monkeypatch):
    """int8 caches at H <= 128: 4 warps on blocks of >= 64 rows (8 where a tile gathers several
    blocks), 16-bit builds unchanged; the decode split budget covers 4x the SM target."""
    bf16 = torch.bfloat16
    assert launch.decode_config(128, torch.float16, INT8, False) == dict(
        BLOCK_N=64, num_warps=4, num_stages=3
    )
    assert launch.decode_config(128, bf16, bf16, False)["num_warps"] == 8
    assert launch.decode_config(256, torch.float16, INT8, False)["BLOCK_N"] == 32
    p = PagedParams(
        num_heads=32, kv_num_heads=8, head_size=128, scale=0.1, softcap=0.0,
        local_window_size=-1, do_rotary=False, rotary_interleaved=False, smooth_softmax=False,
        qk_norm_epsilon=1e-6, cos_cache=None, sin_cache=None, head_sink=None,
        q_norm_weight=None, k_norm_weight=None, k_scale=None, v_scale=None,
    )  # fmt: skip
    monkeypatch.setattr(launch, "_interpret", lambda: False)
    warps = {bs: launch.launch_shapes(p, INT8, torch.float16, bs)["decode"][2]["num_warps"]
             for bs in (16, 32, 64, 256)}  # fmt: skip
    assert warps == {16: 8, 32: 8, 64: 4, 256: 4}
    assert launch.launch_shapes(p, bf16, bf16, 16)["decode"][2]["num_warps"] == 8


@pytest.mark.interpret
@pytest.mark.parametrize("cache", [None, "int8"])
def test_decode_split_budget_follows_the_cache_dtype(cache, device, monkeypatch):
    """The decode launch's split budget: WAVES programs per SM per KV head, 4x that for int8
    caches (issue-bound tiles), or 8 items per sequence if more."""
    seen = []
    orig = launch.run_attention
    monkeypatch.setattr(
        launch,
        "run_attention",
        lambda *a, **k: seen.append((k["flavor"], k["extra"])) or orig(*a, **k),
    )
    bt = build(Case(seqs=((1, 37), (1, 20)), kv=2, cache=cache or "same"), device)
    paged_attention_triton(bt.query, bt.key, bt.value, bt.key_cache, bt.value_cache, bt.cu,
                           bt.past, bt.table, bt.p)  # fmt: skip
    target = -(-launch.WAVES * launch._device_sms(bt.query) // 2)
    per_seq = launch.DECODE_ITEMS_PER_SEQ * 2
    assert seen == [("decode", max(target * (4 if cache else 1), per_seq))]
    assert target < per_seq < 4 * target  # the two cases differ
