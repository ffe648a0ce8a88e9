"""Planted-needle harness for the sparse stack (indexer + DynamicSparseAttention), any device.

A decode step at position ``T - 1`` over a long random K/V cache in which a few "needle" keys,
at depths 0..100% of the context, are aligned with the query heads of their KV group (every
other key is random): dense attention is then dominated by the needles. The indexer sees raw
indexer keys that are random except at the needles, where the key is planted so that its
block key (mean -> RMSNorm -> RoPE at the block start) aligns with the indexer query.

:func:`run_needle` reports

- ``recall``: fraction of needle positions among the indexer's selected positions;
- ``sparse_err``: relative RMS error of DSA's output (over the selection) vs the fp64 dense
  attention over the same cache;
- ``dense_err``: the same error of dense attention in the activation dtype (GQA when
  ``longattn.gqa`` is available, else torch SDPA);
- ``ratio = sparse_err / dense_err`` (goal at benchmark scale: recall 1.0, ratio <= 2 at
  T = 128K, budget 2048, r = 64).

Used by tests at T = 4K with small heads on the CPU, and by benchmarks on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._rotary import apply_rotary, rope_cache
from .api import dynamic_sparse_attention
from .indexer import IndexBlockKeyCache, sparse_attention_indexer

__all__ = [
    "NeedleCase",
    "NeedleReport",
    "build_needle_case",
    "dense_attention_fp64",
    "run_needle",
    "needle_sweep",
]

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class NeedleCase:
    """Inputs of one decode step (query row at position ``T - 1``).

    query ``[B, 1, N*H]``, key/value ``[B, 1, KV*H]`` (activation dtype); past_key/past_value
    ``[B, KV, T, H]`` (cache dtype; rows ``0 .. T-2`` filled, row ``T-1`` receives the new
    token); index_query ``[B, 1, NI*DI]`` fp32; block_keys ``[B, T//r + 1, DI]`` fp32 (built
    with :class:`IndexBlockKeyCache` from all T raw indexer keys); needles: positions.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    past_key: torch.Tensor
    past_value: torch.Tensor
    index_query: torch.Tensor
    block_keys: torch.Tensor
    seqlens_k: torch.Tensor
    total_sequence_length: int
    num_heads: int
    kv_num_heads: int
    compress_ratio: int
    token_budget: int
    needles: list[int]


@dataclass(frozen=True)
class NeedleReport:
    total_sequence_length: int
    recall: float
    selected: int  # selected positions of the (first) query row
    sparse_err: float
    dense_err: float
    dense_name: str
    sparse_vs_dense: float  # relative RMS difference of the sparse and dense outputs

    @property
    def ratio(self) -> float:
        return self.sparse_err / self.dense_err if self.dense_err > 0 else math.inf

    def __str__(self) -> str:
        return (
            f"T={self.total_sequence_length} recall={self.recall:.3f} selected={self.selected} "
            f"sparse_err={self.sparse_err:.3e} {self.dense_name}_err={self.dense_err:.3e} "
            f"ratio={self.ratio:.2f} sparse_vs_dense={self.sparse_vs_dense:.3e}"
        )


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def build_needle_case(
    total_sequence_length: int,
    *,
    batch: int = 1,
    num_heads: int = 8,
    kv_num_heads: int = 2,
    head_size: int = 64,
    index_heads: int = 4,
    index_head_dim: int = 64,
    compress_ratio: int = 64,
    token_budget: int = 2048,
    depths: tuple[float, ...] = DEFAULT_DEPTHS,
    needle_logit: float = 24.0,
    dtype: torch.dtype = torch.bfloat16,
    cache_dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> NeedleCase:
    """Build the inputs (see the module doc). ``needle_logit``: the needles' logit over the
    background (whose logits are ~N(0, 1)); with 24 the keys outside the needles' blocks hold
    ~e^-13 of the attention mass at T = 128K."""
    t = total_sequence_length
    b, n, kv, h, r = batch, num_heads, kv_num_heads, head_size, compress_ratio
    g = n // kv
    cache_dtype = cache_dtype or dtype
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    needles = sorted({min(t - 2, max(0, round(d * (t - 2)))) for d in depths})
    # attention: query heads of a group share a direction u (unit); |q| = sqrt(H) so a random
    # key's logit scale * q.k is ~N(0, 1); needles are needle_logit * u plus a little noise
    u = _unit(randn(b, kv, h))  # [B, KV, H]
    q = math.sqrt(h) * u[:, :, None, :] + 0.1 * randn(b, kv, g, h)  # [B, KV, G, H]
    keys = randn(b, kv, t, h)
    vals = randn(b, kv, t, h)
    for p in needles:
        keys[:, :, p] = needle_logit * u + 0.1 * randn(b, kv, h)
    past_k = keys.clone()
    past_v = vals.clone()
    past_k[:, :, t - 1] = 0  # the new token's row: written by the call
    past_v[:, :, t - 1] = 0
    if cache_dtype == torch.int8:
        raise ValueError("the needle harness uses float caches")
    query = q.reshape(b, 1, n * h).to(dtype)
    key = keys[:, :, t - 1].reshape(b, 1, kv * h).to(dtype)
    value = vals[:, :, t - 1].reshape(b, 1, kv * h).to(dtype)
    # indexer: random raw keys; the needle's raw key is planted so that the block key after
    # mean -> RMSNorm -> RoPE(block start) points along w, the indexer queries' direction
    di = index_head_dim
    cos, sin = rope_cache(t + r, di, device=device)
    w = _unit(randn(b, di))  # [B, DI]
    iq = _unit(w[:, None, :] + 0.3 * _unit(randn(b, index_heads, di))) * math.sqrt(di)
    raw = randn(b, t, di)
    for p in needles:
        start = p // r * r
        back = apply_rotary(w, cos[start], -sin[start], interleaved=False)  # RoPE^-1 at start
        raw[:, p] = 4 * math.sqrt(r * di) * back
    cache = IndexBlockKeyCache(
        b,
        t,
        di,
        compress_ratio=r,
        norm_weight=torch.ones(di, device=device),
        cos_cache=cos,
        sin_cache=sin,
        device=device,
    )
    cache.append(raw)
    return NeedleCase(
        query=query,
        key=key,
        value=value,
        past_key=past_k.to(cache_dtype),
        past_value=past_v.to(cache_dtype),
        index_query=iq.reshape(b, 1, index_heads * di),
        block_keys=cache.block_keys,
        seqlens_k=torch.full((b,), t - 1, dtype=torch.int32, device=device),
        total_sequence_length=t,
        num_heads=n,
        kv_num_heads=kv,
        compress_ratio=r,
        token_budget=token_budget,
        needles=needles,
    )


def dense_attention_fp64(
    query: torch.Tensor, present_key: torch.Tensor, present_value: torch.Tensor, num_heads: int
) -> torch.Tensor:
    """fp64 decode attention of ``query [B, 1, N*H]`` over every row of the presents
    ``[B, KV, T, H]`` (as stored): ``[B, 1, N*H]`` fp64."""
    b = query.shape[0]
    kv, t, h = present_key.shape[1:]
    g = num_heads // kv
    q = query.reshape(b, kv, g, h).double()
    x = torch.einsum("bkgh,bkth->bkgt", q, present_key.double()) / math.sqrt(h)
    p = torch.softmax(x, -1)
    return torch.einsum("bkgt,bkth->bkgh", p, present_value.double()).reshape(b, 1, -1)


def _rel(a: torch.Tensor, t: torch.Tensor) -> float:
    a, t = a.double(), t.double()
    return float((a - t).norm() / t.norm())


def _dense_lowp(case: NeedleCase, dense: str):
    """Dense attention in the activation dtype: ("gqa" | "sdpa", output [B, 1, N*H])."""
    if dense == "gqa":
        try:
            from ..gqa import group_query_attention
        except ImportError:
            dense = "sdpa"
    if dense == "gqa":
        out, _, _ = group_query_attention(
            case.query,
            case.key,
            case.value,
            case.past_key.clone(),
            case.past_value.clone(),
            seqlens_k=case.seqlens_k,
            total_sequence_length=case.total_sequence_length,
            num_heads=case.num_heads,
            kv_num_heads=case.kv_num_heads,
        )
        return "gqa", out
    b = case.query.shape[0]
    kv, t, h = case.past_key.shape[1:]
    pk, pv = case.past_key.clone(), case.past_value.clone()
    pk[:, :, t - 1] = case.key.reshape(b, kv, h).to(pk.dtype)
    pv[:, :, t - 1] = case.value.reshape(b, kv, h).to(pv.dtype)
    q = case.query.reshape(b, case.num_heads, 1, h)
    dt = case.query.dtype
    out = torch.nn.functional.scaled_dot_product_attention(
        q, pk.to(dt), pv.to(dt), enable_gqa=case.num_heads != kv
    )
    return "sdpa", out.reshape(b, 1, -1)


def run_needle(
    case: NeedleCase,
    *,
    dsa_backend: str = "auto",
    indexer_backend: str = "auto",
    dense: str = "gqa",
) -> NeedleReport:
    """Indexer -> DSA on the case; errors vs fp64 dense attention over the same cache."""
    sel, cnt = sparse_attention_indexer(
        case.index_query,
        case.block_keys,
        case.seqlens_k,
        compress_ratio=case.compress_ratio,
        token_budget=case.token_budget,
        backend=indexer_backend,
    )
    found = 0
    for row in range(sel.shape[0]):
        chosen = set(sel[row, : int(cnt[row])].tolist())
        found += sum(p in chosen for p in case.needles)
    recall = found / (len(case.needles) * sel.shape[0])
    out, pk, pv = dynamic_sparse_attention(
        case.query,
        case.key,
        case.value,
        case.past_key.clone(),
        case.past_value.clone(),
        selected_indices=sel,
        selected_counts=cnt,
        seqlens_k=case.seqlens_k,
        total_sequence_length=case.total_sequence_length,
        num_heads=case.num_heads,
        kv_num_heads=case.kv_num_heads,
        backend=dsa_backend,
    )
    truth = dense_attention_fp64(case.query, pk, pv, case.num_heads)
    del pk, pv
    name, dense_out = _dense_lowp(case, dense)
    return NeedleReport(
        total_sequence_length=case.total_sequence_length,
        recall=recall,
        selected=int(cnt[0]),
        sparse_err=_rel(out, truth),
        dense_err=_rel(dense_out, truth),
        dense_name=name,
        sparse_vs_dense=_rel(out, dense_out),
    )


def needle_sweep(
    lengths: tuple[int, ...] = (4096, 16384, 65536, 131072), **kwargs
) -> list[NeedleReport]:
    """:func:`run_needle` over context lengths; ``kwargs`` go to :func:`build_needle_case`
    (``dsa_backend`` / ``indexer_backend`` / ``dense`` to :func:`run_needle`)."""
    run_kw = {k: kwargs.pop(k) for k in ("dsa_backend", "indexer_backend", "dense") if k in kwargs}
    return [run_needle(build_needle_case(t, **kwargs), **run_kw) for t in lengths]
