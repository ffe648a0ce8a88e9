"""Random GroupQueryAttention cases and the fp64 oracle shared by test_gqa.py / test_gqa_ort.py."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from longattn._attention_torch import (
    attention_unfused,
    contiguous_positions,
    qk_prologue,
    rotary_tables,
    sink_logits,
    split_qkv,
    to_cache,
)
from longattn._rotary import rope_cache
from longattn.gqa import api
from longattn.gqa.reference import gqa_reference

ROTARY = ("none", "half", "interleaved", "partial")
SINKS = ("none", "head", "smooth")
CACHES = ("same", "fp16", "int8_tensor", "int8_channel")


@dataclass(frozen=True)
class Case:
    batch: int = 1
    s: int = 1  # new tokens
    past: int = 0  # max past length over the batch (0 and S == total: first prompt)
    num_heads: int = 4
    kv_num_heads: int = 2
    head_size: int = 64
    dtype: torch.dtype = torch.float32
    packed: bool = False
    rotary: str = "none"
    window: int = -1
    softcap: float = 0.0
    sink: str = "none"
    qk_norm: bool = False
    cache: str = "same"
    shared: bool = False  # past buffer with capacity >= total (in place)
    bias: str = "none"  # "none" | "full" | "bcast" ([1, 1, S, T'])
    bias_extra: int = 3  # T' - total_sequence_length
    rotary_align: int = 2  # partial rotary_dim: the largest multiple of this <= H / 2
    int8_range: float = 3.0  # |x| covered by the int8 scales (larger values clamp)
    position_ids: bool = False
    ragged: bool = True
    scale: float | None = None
    seed: int = 0

    @property
    def total(self) -> int:
        return self.s + self.past

    @property
    def first_prompt(self) -> bool:
        return self.past == 0

    @property
    def cache_dtype(self) -> torch.dtype:
        if self.cache == "fp16":
            return torch.float16
        if self.cache.startswith("int8"):
            return torch.int8
        return self.dtype


def sample_case(rng: random.Random, **fixed) -> Case:
    """A random case from the test grid; ``fixed`` overrides fields."""
    sp = rng.choice([(1, 1), (1, 128), (1, 2048), (35, 35), (64, 64), (113, 113), (3, 256)])
    sp = rng.choice([sp, sp, (sp[0], 0)]) if sp[0] > 1 else sp  # some first prompts too
    batch = 1 if sp == (3, 256) else rng.choice([1, 3])
    n, kv = rng.choice([(6, 3), (32, 8), (8, 1), (9, 9)])
    h = rng.choice([64, 80, 128, 256])
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    cache = rng.choice(CACHES)
    if cache == "fp16" and dtype != torch.bfloat16:
        cache = "same"
    s, past = sp
    total = s + past
    kw = dict(
        batch=batch,
        s=s,
        past=past,
        num_heads=n,
        kv_num_heads=kv,
        head_size=h,
        dtype=dtype,
        packed=rng.random() < 0.3,
        rotary=rng.choice(ROTARY),
        window=rng.choice([-1, max(2, total // 3)]),
        softcap=rng.choice([0.0, 50.0, 2.0]),
        sink=rng.choice(SINKS),
        qk_norm=rng.random() < 0.4,
        cache=cache,
        shared=rng.random() < 0.5,
        bias=rng.choice(["none", "none", "full", "bcast"]),
        ragged=rng.random() < 0.7,
        scale=rng.choice([None, None, 0.0, 0.11]),
        seed=rng.randrange(1 << 30),
    )
    kw["position_ids"] = kw["rotary"] != "none" and past > 0 and rng.random() < 0.3
    kw.update(fixed)
    return Case(**kw)


def _lengths(case: Case, g: torch.Generator) -> torch.Tensor:
    """Total length per sequence (int64 [B]); the first sequence has the maximum."""
    b, s, past = case.batch, case.s, case.past
    if case.first_prompt:
        lo, hi = 1, s
    else:
        lo, hi = s, s + past
    tot = torch.full((b,), hi, dtype=torch.int64)
    if case.ragged and b > 1:
        tot[1:] = torch.randint(lo, hi + 1, (b - 1,), generator=g)
    return tot


def _rand(shape, g, dtype=torch.float32, std=1.0):
    return (torch.randn(shape, generator=g) * std).to(dtype)


def _int8_scale(case: Case, g: torch.Generator) -> torch.Tensor:
    if case.cache == "int8_tensor":
        return torch.tensor([case.int8_range / 127.0])
    kv, h = case.kv_num_heads, case.head_size
    r = case.int8_range / 127.0
    return (r * (0.6 + 0.8 * torch.rand((kv, 1, h), generator=g))).float()


def poison_value(dtype: torch.dtype):
    return float("nan") if dtype.is_floating_point else 127


def make_inputs(case: Case) -> dict:
    """Keyword arguments of ``group_query_attention`` for ``case`` (plus ``_total_len``)."""
    g = torch.Generator().manual_seed(case.seed)
    b, s, n, kv, h = case.batch, case.s, case.num_heads, case.kv_num_heads, case.head_size
    dt, cdt = case.dtype, case.cache_dtype
    total = case.total
    tot = _lengths(case, g)
    kw: dict = dict(num_heads=n, kv_num_heads=kv, total_sequence_length=total)
    kw["seqlens_k"] = (tot - 1).to(torch.int32)
    if case.packed:
        kw["query"] = _rand((b, s, (n + 2 * kv) * h), g, dt)
    else:
        kw["query"] = _rand((b, s, n * h), g, dt)
        kw["key"] = _rand((b, s, kv * h), g, dt)
        kw["value"] = _rand((b, s, kv * h), g, dt)
    if cdt == torch.int8:
        kw["k_scale"] = _int8_scale(case, g)
        kw["v_scale"] = _int8_scale(case, g)
    # Past buffer: valid rows random, rows past each sequence's past length poisoned.
    cap = None
    if case.shared:
        cap = total + int(torch.randint(0, 5, (1,), generator=g))
    elif not case.first_prompt:
        cap = case.past
    elif cdt != dt:
        cap = 0  # an empty past only to choose the present's dtype
    if cap is not None:
        past_len = (tot - s).clamp(min=0) if not case.first_prompt else torch.zeros_like(tot)
        bufs = []
        for name in ("k_scale", "v_scale"):
            if cdt == torch.int8:  # quantized N(0, 1) rows, like the op would write
                x = to_cache(_rand((b, kv, cap, h), g), cdt, kw[name])
            else:
                x = _rand((b, kv, cap, h), g, cdt)
            rows = torch.arange(cap)[None, None, :, None]
            x = x.masked_fill(rows >= past_len[:, None, None, None], poison_value(cdt))
            bufs.append(x)
        kw["past_key"], kw["past_value"] = bufs
    if case.rotary != "none":
        rot = h if case.rotary != "partial" else (h // 2) - (h // 2) % case.rotary_align
        max_pos = total + 8
        cos, sin = rope_cache(max_pos, rot)
        kw.update(cos_cache=cos, sin_cache=sin, do_rotary=True)
        kw["rotary_interleaved"] = case.rotary == "interleaved"
        if case.position_ids:
            qpos = tot[:, None] - s + torch.arange(s)[None, :]
            kw["position_ids"] = (qpos + torch.randint(0, 8, (b, 1), generator=g)).clamp(
                0, max_pos - 1
            )
    if case.window > 0:
        kw["local_window_size"] = case.window
    if case.softcap:
        kw["softcap"] = case.softcap
    if case.sink == "head":
        kw["head_sink"] = _rand((n,), g)
    elif case.sink == "smooth":
        kw["smooth_softmax"] = True
    if case.qk_norm:
        kw["q_norm_weight"] = 1.0 + 0.2 * _rand((h,), g)
        kw["k_norm_weight"] = 1.0 + 0.2 * _rand((h,), g)
    if case.bias != "none":
        bb, bn = (b, n) if case.bias == "full" else (1, 1)
        kw["attention_bias"] = _rand((bb, bn, s, total + case.bias_extra), g, dt, std=0.5)
    if case.scale is not None:
        kw["scale"] = case.scale
    kw["_total_len"] = tot
    return kw


def clone_inputs(kw: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def call(kw: dict, backend: str, record: list | None = None, monkeypatch=None):
    """Run the public op on clones of ``kw``; with ``record`` (and pytest's monkeypatch) capture
    the tier call's (query, key, value, present_key_before, present_value_before, seqlens_k, p)
    and the inputs actually passed."""
    args = clone_inputs({k: v for k, v in kw.items() if not k.startswith("_")})
    if record is not None:
        orig = api._run

        def spy(query, key, value, pk, pv, seqlens_k, p, backend_):
            record.append((query, key, value, pk.clone(), pv.clone(), seqlens_k, p))
            return orig(query, key, value, pk, pv, seqlens_k, p, backend_)

        monkeypatch.setattr(api, "_run", spy)
    try:
        out = api.group_query_attention(**args, backend=backend)
    finally:
        if record is not None:
            monkeypatch.setattr(api, "_run", orig)
    return out, args


def oracle(recorded, presents=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64 run of the reference on the recorded tier inputs.

    The caches keep their real dtype, so the op's one real rounding of new K/V into the cache
    stays; everything else is fp64. Returns ``(output, present_key, present_value)`` of that run.
    With ``presents=(pk, pv)`` (the caches some implementation produced, rows ``< T`` used) the
    fp64 attention reads those instead of the oracle's own: the new K/V rows of two correct
    implementations may differ by one rounding at ties/boundaries (fp32 vs fp64 inputs to the
    rounding), and that must not count as attention error.
    """
    query, key, value, pk, pv, seqlens_k, p = recorded
    up = lambda t: None if t is None else t.to(torch.float64)
    pk, pv = pk.clone(), pv.clone()
    out = gqa_reference(up(query), up(key), up(value), pk, pv, seqlens_k, p)
    if presents is None:
        return out, pk, pv
    s = query.shape[1]
    q, _, _ = split_qkv(up(query), up(key), up(value), p.num_heads, p.kv_num_heads, p.head_size)
    qpos, total_len = contiguous_positions(seqlens_k, s, p.is_first_prompt)
    cos = sin = None
    if p.do_rotary:
        cos, sin = rotary_tables(
            p.cos_cache, p.sin_cache, qpos if p.position_ids is None else p.position_ids, q.dtype
        )
    qf = qk_prologue(
        q,
        norm_weight=p.q_norm_weight,
        epsilon=p.qk_norm_epsilon,
        cos=cos,
        sin=sin,
        interleaved=p.rotary_interleaved,
        dtype=torch.float64,
    )
    t = p.total_sequence_length
    out = attention_unfused(
        qf,
        presents[0][:, :, :t],
        presents[1][:, :, :t],
        qpos=qpos,
        total_len=total_len,
        scale=p.scale,
        k_scale=p.k_scale,
        v_scale=p.v_scale,
        window=p.local_window_size,
        softcap=p.softcap,
        bias=p.attention_bias,
        sink=sink_logits(p.head_sink, p.smooth_softmax, p.num_heads, query.device),
    )
    return out.reshape(query.shape[0], s, -1), pk, pv


def cache_bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a cache's bits (NaN-safe equality)."""
    if t.dtype == torch.int8:
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def written_rows(case: Case, total_len: torch.Tensor, capacity: int) -> torch.Tensor:
    """bool [B, C]: cache rows the op writes (the real new tokens' positions)."""
    rows = torch.arange(capacity)[None, :]
    t = total_len[:, None]
    if case.first_prompt:
        return rows < t
    return (rows >= t - case.s) & (rows < t)
