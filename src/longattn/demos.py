"""The attention part of ``longattn demo``: GQA prefill + decode with a mixed-precision cache,
a paged decode through the cache manager, and the sparse needle test."""

from __future__ import annotations

import time

import torch

from . import _cascade
from ._rotary import rope_cache
from .gqa import group_query_attention
from .paged import PagedKVCache, paged_attention
from .sparse.needle import build_needle_case, run_needle
from .testing import error_stats

BF16, FP16 = torch.bfloat16, torch.float16


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _gqa_demo(dev: torch.device) -> tuple[torch.Tensor, ...]:
    b, s, n, kv, h, steps = 2, 512, 8, 2, 128, 4
    g = torch.Generator().manual_seed(1)
    cos, sin = rope_cache(4096, h, device=dev)
    cap = s + steps
    # Empty-capacity past of the wanted cache dtype selects it: fp16 cache, bf16 activations.
    pk = torch.zeros(b, kv, cap, h, dtype=FP16, device=dev)
    pv = torch.zeros_like(pk)
    qkv = (torch.randn(b, s, (n + 2 * kv) * h, generator=g) * 0.5).to(BF16).to(dev)
    kw = dict(num_heads=n, kv_num_heads=kv, cos_cache=cos, sin_cache=sin, do_rotary=True)
    seqlens = torch.full((b,), s - 1, dtype=torch.int32, device=dev)
    t0 = time.perf_counter()
    out, pk, pv = group_query_attention(qkv, past_key=pk, past_value=pv, seqlens_k=seqlens,
                                        total_sequence_length=s, **kw)  # fmt: skip
    _sync(dev)
    t_prefill = time.perf_counter() - t0
    decode_out, times = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        q1 = (torch.randn(b, 1, (n + 2 * kv) * h, generator=g) * 0.5).to(BF16).to(dev)
        seqlens = torch.full((b,), s + i, dtype=torch.int32, device=dev)
        o, pk, pv = group_query_attention(q1, past_key=pk, past_value=pv, seqlens_k=seqlens,
                                          total_sequence_length=s + i + 1, **kw)  # fmt: skip
        _sync(dev)
        times.append(time.perf_counter() - t0)
        decode_out.append(o)
    tier = _cascade.last_backend("group_query_attention")  # the tier the decode steps ran
    # Same last decode step on the reference tier from the same cache (the cache rows it writes
    # are bit-identical; the output differs only by fp32 vs unfused rounding).
    ref, _, _ = group_query_attention(q1, past_key=pk.clone(), past_value=pv.clone(),
                                      seqlens_k=seqlens, total_sequence_length=s + steps,
                                      backend="reference", **kw)  # fmt: skip
    err = error_stats(decode_out[-1], ref).rel_rms
    print(
        f"\n[3] group_query_attention: bf16 activations, fp16 KV cache (mixed precision), rotary, "
        f"B={b} N={n} KV={kv} H={h}\n    prefill S={s}: {out.shape} in {t_prefill * 1e3:.1f} ms (first call, incl. JIT); "
        f"decode x{steps}: {times[0] * 1e3:.1f} ms first step, then {min(times[1:]) * 1e3:.2f} ms "
        f"(eager, host-bound at this size); last step vs reference tier: rel RMS "
        f"{err:.2e}; cache dtype {pk.dtype}; backend={tier}"
    )
    return out, pk, pv


def _paged_demo(dev: torch.device) -> None:
    n, kv, h, bs = 8, 2, 64, 16
    cache = PagedKVCache(64, bs, 1, kv, h, dtype=FP16, device=dev)
    g = torch.Generator().manual_seed(2)
    lens = [37, 5, 100]
    ids = list(range(len(lens)))
    for i in ids:
        cache.add_sequence(i)
    step = cache.extend(ids, lens)
    tokens = sum(lens)
    q = torch.randn(tokens, (n + 2 * kv) * h, generator=g).to(FP16).to(dev)
    out = paged_attention(q, None, None, cache.key_cache(0), cache.value_cache(0),
                          step.cu_seqlens, step.past_seqlens, step.block_table,
                          num_heads=n, kv_num_heads=kv)  # fmt: skip
    step = cache.extend(ids, [1] * len(ids))
    q1 = torch.randn(len(ids), (n + 2 * kv) * h, generator=g).to(FP16).to(dev)
    out1 = paged_attention(q1, None, None, cache.key_cache(0), cache.value_cache(0),
                           step.cu_seqlens, step.past_seqlens, step.block_table,
                           num_heads=n, kv_num_heads=kv)  # fmt: skip
    print(
        f"\n[4] paged_attention: block_size {bs}, prefill of {lens} tokens {tuple(out.shape)}, "
        f"then one decode step {tuple(out1.shape)}; blocks in use "
        f"{64 - cache.num_free_blocks}/64; finite: {bool(torch.isfinite(out1).all())}; "
        f"backend={_cascade.last_backend('paged_attention')}"
    )


def _sparse_demo(dev: torch.device) -> None:
    t = 4096 if dev.type == "cpu" else 65536
    case = build_needle_case(t, num_heads=8, kv_num_heads=2, head_size=64, token_budget=512,
                             dtype=BF16, device=dev)  # fmt: skip
    rep = run_needle(case)
    print(
        f"\n[5] sparse: indexer (QSA, r=64, budget 512) + dynamic_sparse_attention, decode at "
        f"T={t} with planted needles\n    needle recall {rep.recall:.0%}, sparse output error vs "
        f"fp64 dense {rep.sparse_err:.2e} (dense bf16 {rep.dense_name}: {rep.dense_err:.2e}, "
        f"ratio {rep.ratio:.2f}); backends: indexer="
        f"{_cascade.last_backend('sparse_attention_indexer')}, dsa="
        f"{_cascade.last_backend('dynamic_sparse_attention')}"
    )


def attention_demo(dev: torch.device) -> None:
    _gqa_demo(dev)
    _paged_demo(dev)
    _sparse_demo(dev)
