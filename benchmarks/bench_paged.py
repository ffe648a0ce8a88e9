"""PagedAttention benchmark (H200): the Triton paged tier vs contiguous GQA decode, gather + SDPA.

    PYTHONPATH=src python benchmarks/bench_paged.py --out benchmarks/results

Sections (results rewritten after each, so a cut-short run keeps what it measured):
- ``decode``: S = 1, bf16 cache, (N, KV) = (32, 8), H = 128, B in {8, 64}, ragged T in
  1K..64K (seeded), block_size in {16, 64, 256}, blocks a random permutation of the pool.
  GB/s on the K/V bytes read (sum_b T_b * KV * H * 2 * 2). Peers at the same bytes: the
  contiguous GQA Triton decode (``gqa_triton`` on a ``[B, KV, T_max, H]`` cache with the same
  ragged lengths) and "gather + SDPA" (the paged K/V gathered into a padded ``[B, KV, T_max, H]``
  buffer through the block table, then SDPA with a length mask; the gather is timed too).
- ``int8`` (not in the default sections): B in {8, 64} of the decode section's ragged lengths,
  block_size 64: the paged decode with an int8 cache (per-tensor scales) vs the bf16 cache on
  the same table and queries, and the contiguous GQA int8 decode on the same lengths;
  ``ours_int8_i2f_us``: the int8 tiles converted by I2F (``I8_I2F``, the build before
  session 44) for the A/B of the I2F-free conversion; ``ours_int8_v_pairs_us``: V read as
  int16 channel pairs (``V_PAIRS``, an option).
- ``mixed``: 4 sequences x 2K new tokens (first prompts) + 60 decode sequences (T in 1K..16K) in
  one paged call, vs the two parts run separately with SDPA (causal prefill on the 4 prompts,
  gather + SDPA decode on the 60).

All timings are CUDA-graph replays (GPU time, no Python launch overhead); one input set per
shape: every shape moves >= 3x the 60 MB L2 per call. FlexAttention paged decode
(``flex_peers.flex_paged_decode``: torch.compile'd flex over the physical cache in flex's
``[1, KV, slots, H]`` layout, a BlockMask of each sequence's blocks, complete blocks marked full)
is timed on the same query as gather + SDPA, and the two peers' outputs are compared.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import flex_peers  # noqa: E402
from _harness import (  # noqa: E402
    gpu_meta,
    graph_bench,
    measure_ceilings,
    peer_diff,
    write_results,
)
from longattn._rotary import rope_cache  # noqa: E402
from longattn.gqa._params import GQAParams  # noqa: E402
from longattn.gqa.triton.launch import gqa_triton  # noqa: E402
from longattn.paged._params import PagedParams  # noqa: E402
from longattn.paged.triton import paged_attention_triton  # noqa: E402
from longattn.paged.triton.launch import decode_config as paged_decode_config  # noqa: E402

N, KV, H = 32, 8, 128
DEV = "cuda"
BF16 = torch.bfloat16


def _graph_us(fn, args):
    """Median microseconds of CUDA-graph replays of ``fn(*args)``, or None if it fails."""
    try:
        return graph_bench(fn, [args], warmup=3)["median_us"]
    except Exception as exc:  # a peer that rejects the shape
        print(f"    n/a: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        torch.cuda.synchronize()
        return None


def _paged_params(cos, sin) -> PagedParams:
    return PagedParams(
        num_heads=N, kv_num_heads=KV, head_size=H, scale=1.0 / math.sqrt(H), softcap=0.0,
        local_window_size=-1, do_rotary=True, rotary_interleaved=False, smooth_softmax=False,
        qk_norm_epsilon=1e-6, cos_cache=cos, sin_cache=sin, head_sink=None, q_norm_weight=None,
        k_norm_weight=None, k_scale=None, v_scale=None,
    )  # fmt: skip


def _gqa_params(t_max, cos, sin) -> GQAParams:
    return GQAParams(
        num_heads=N, kv_num_heads=KV, head_size=H, scale=1.0 / math.sqrt(H), softcap=0.0,
        local_window_size=-1, do_rotary=True, rotary_interleaved=False, smooth_softmax=False,
        qk_norm_epsilon=1e-6, is_first_prompt=False, total_sequence_length=t_max, cos_cache=cos,
        sin_cache=sin, position_ids=None, attention_bias=None, head_sink=None,
        q_norm_weight=None, k_norm_weight=None, k_scale=None, v_scale=None,
    )  # fmt: skip


def _paged_batch(new: list[int], past: list[int], block_size: int, seed: int):
    """Caches (random bf16, blocks a permutation of the pool), cu, past, table, q/k/v."""
    g = torch.Generator().manual_seed(seed)
    total = [a + b for a, b in zip(new, past)]
    need = [-(-t // block_size) for t in total]
    num_blocks = sum(need) + 8
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.full((len(new), max(need)), -1, dtype=torch.int32)
    off = 0
    for i, n_b in enumerate(need):
        table[i, :n_b] = perm[off : off + n_b]
        off += n_b
    shape = (num_blocks, block_size, KV, H)
    kc = torch.randn(shape, device=DEV, dtype=BF16)
    vc = torch.randn(shape, device=DEV, dtype=BF16)
    cu = torch.zeros(len(new) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(new).cumsum(0)
    tokens = sum(new)
    q = torch.randn(tokens, N * H, device=DEV, dtype=BF16)
    k = torch.randn(tokens, KV * H, device=DEV, dtype=BF16)
    v = torch.randn(tokens, KV * H, device=DEV, dtype=BF16)
    past_t = torch.tensor(past, dtype=torch.int32, device=DEV)
    return q, k, v, kc, vc, cu.to(DEV), past_t, table.to(DEV)


def _gather_slots(table, lengths, t_max, block_size):
    """int64 [B, t_max] flat slots of each sequence's positions (clamped past its length)."""
    pos = torch.arange(t_max, device=DEV)
    lens = torch.tensor(lengths, device=DEV)
    pos = torch.minimum(pos[None, :], (lens - 1)[:, None])  # [B, t_max]
    blk = torch.gather(table.long(), 1, pos // block_size)
    return blk * block_size + pos % block_size


def _gather_sdpa_fn(kc, vc, slots, mask):
    """Gather the paged K/V into [B, KV, t_max, H] through the table, then SDPA."""
    flat_k, flat_v = kc.view(-1, KV, H), vc.view(-1, KV, H)

    def fn(q):
        k = flat_k[slots].transpose(1, 2)  # [B, KV, t_max, H]
        v = flat_v[slots].transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                enable_gqa=True)  # fmt: skip

    return fn


def _ragged(b, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(lo, hi + 1, (b,), generator=g).tolist()
    t[0] = hi
    return t


def _flex_paged(kc, vc, table, lengths, bs, sq, mask, slots):
    """(graph-replay us, max |flex - gather+SDPA|, that over max |gather+SDPA|) of
    FlexAttention's paged decode, or Nones."""
    try:
        k_phys = flex_peers.paged_physical_kv(kc)  # [1, KV, slots, H], outside the timing
        v_phys = flex_peers.paged_physical_kv(vc)
        lens = torch.tensor(lengths, device=DEV)
        bm = flex_peers.paged_block_mask(table, lens, bs, kc.shape[0])
        scale = 1.0 / math.sqrt(H)

        def fn(q):
            return flex_peers.flex_paged_decode(q, k_phys, v_phys, bm, scale=scale, compiled=True)

        got = fn(sq)
        want = _gather_sdpa_fn(kc, vc, slots, mask)(sq)
        diff, rel = peer_diff(got, want)
        us = _graph_us(fn, (sq,))
        return us, diff, rel
    except Exception as exc:
        print(f"    flex n/a: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        torch.cuda.empty_cache()
        return None, None, None


def decode(rows, copy_tbs):
    for b in (8, 64):
        lengths = _ragged(b, 1024, 65536, seed=b)  # totals incl. the new token
        t_max = max(lengths)
        nbytes = sum(lengths) * KV * H * 2 * 2
        cos, sin = rope_cache(t_max + 1, H, device=DEV)
        # Contiguous GQA decode on the same lengths (same bytes read).
        pk = torch.randn(b, KV, t_max, H, device=DEV, dtype=BF16)
        pv = torch.randn_like(pk)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEV) - 1
        gq = torch.randn(b, 1, N * H, device=DEV, dtype=BF16)
        gk = torch.randn(b, 1, KV * H, device=DEV, dtype=BF16)
        gv = torch.randn_like(gk)
        gp = _gqa_params(t_max, cos, sin)
        gqa_us = _graph_us(gqa_triton, (gq, gk, gv, pk, pv, seqlens, gp))
        del pk, pv
        torch.cuda.empty_cache()
        for bs in (16, 64, 256):
            q, k, v, kc, vc, cu, past, table = _paged_batch([1] * b, [t - 1 for t in lengths],
                                                            bs, seed=bs)  # fmt: skip
            p = _paged_params(cos, sin)
            ours = _graph_us(paged_attention_triton, (q, k, v, kc, vc, cu, past, table, p))
            slots = _gather_slots(table, lengths, t_max, bs)
            mask = (
                torch.arange(t_max, device=DEV)[None, :]
                < torch.tensor(lengths, device=DEV)[:, None]
            )
            mask = mask[:, None, None, :]  # [B, 1, 1, t_max]
            sq = torch.randn(b, N, 1, H, device=DEV, dtype=BF16)
            gather_sdpa = _graph_us(_gather_sdpa_fn(kc, vc, slots, mask), (sq,))
            flat_k, flat_v = kc.view(-1, KV, H), vc.view(-1, KV, H)
            # K and V, as gather_sdpa gathers them (was K alone: half the gather)
            gather_only = _graph_us(lambda fk, fv, i: (fk[i], fv[i]), (flat_k, flat_v, slots))
            flex_us, flex_diff, flex_rel = _flex_paged(kc, vc, table, lengths, bs, sq, mask, slots)
            row = dict(section="decode", B=b, block_size=bs, T_min=min(lengths), T_max=t_max,
                       KV_MB=nbytes / 1e6, ours_us=ours, gqa_contig_us=gqa_us,
                       gather_sdpa_us=gather_sdpa, gather_only_us=gather_only,
                       flex_us=flex_us, flex_vs_gather_sdpa_maxdiff=flex_diff,
                       flex_vs_gather_sdpa_maxdiff_rel=flex_rel,
                       floor_us=nbytes / (copy_tbs * 1e12) * 1e6)  # fmt: skip
            if ours and flex_us:
                row["speedup_vs_flex"] = flex_us / ours
            for name in ("ours", "gqa_contig", "gather_sdpa", "flex"):
                us = row[f"{name}_us"]
                row[f"{name}_GBps"] = nbytes / (us * 1e-6) / 1e9 if us else None
            if ours and gqa_us:
                row["ours_vs_gqa"] = gqa_us / ours
            if ours and gather_sdpa:
                row["speedup_vs_gather_sdpa"] = gather_sdpa / ours
            print(f"  {row}", flush=True)
            rows.append(row)
            del q, k, v, kc, vc, slots, mask, flat_k, flat_v
            torch.cuda.empty_cache()


def tune(rows, copy_tbs, block_size=64):
    """Decode split budget (``decode_splits`` = split items per KV head beyond one per
    sequence) on the decode section's ragged batches: the default is WAVES * SMs / KV."""
    for b in (8, 64):
        lengths = _ragged(b, 1024, 65536, seed=b)
        nbytes = sum(lengths) * KV * H * 2 * 2
        cos, sin = rope_cache(max(lengths) + 1, H, device=DEV)
        q, k, v, kc, vc, cu, past, table = _paged_batch([1] * b, [t - 1 for t in lengths],
                                                        block_size, seed=block_size)  # fmt: skip
        p = _paged_params(cos, sin)
        for extra in (None, 66, 132, 264, 528, 1056):

            def fn(*a, extra=extra):
                return paged_attention_triton(*a, decode_splits=extra)

            us = _graph_us(fn, (q, k, v, kc, vc, cu, past, table, p))
            row = dict(section="tune-splits", B=b, block_size=block_size,
                       decode_splits=extra or "default", us=us,
                       GBps=nbytes / (us * 1e-6) / 1e9 if us else None,
                       floor_us=nbytes / (copy_tbs * 1e12) * 1e6)  # fmt: skip
            print(f"  {row}", flush=True)
            rows.append(row)
        del q, k, v, kc, vc
        torch.cuda.empty_cache()


def mixed(rows, copy_tbs, block_size=64):
    n_pre, s_pre, n_dec = 4, 2048, 60
    dec_len = _ragged(n_dec, 1024, 16384, seed=7)
    new = [s_pre] * n_pre + [1] * n_dec
    past = [0] * n_pre + [t - 1 for t in dec_len]
    cos, sin = rope_cache(max(dec_len) + s_pre + 1, H, device=DEV)
    q, k, v, kc, vc, cu, past_t, table = _paged_batch(new, past, block_size, seed=11)
    p = _paged_params(cos, sin)
    ours = _graph_us(paged_attention_triton, (q, k, v, kc, vc, cu, past_t, table, p))
    # SDPA, the two parts separately: causal prefill [4, N, 2K, H] + gather + SDPA decode.
    pq = torch.randn(n_pre, N, s_pre, H, device=DEV, dtype=BF16)
    pk = torch.randn(n_pre, KV, s_pre, H, device=DEV, dtype=BF16)
    pv = torch.randn_like(pk)
    pre_us = _graph_us(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            pq, pk, pv, is_causal=True, enable_gqa=True
        ),
        (),
    )
    t_max = max(dec_len)
    slots = _gather_slots(table[n_pre:], dec_len, t_max, block_size)
    mask = torch.arange(t_max, device=DEV)[None, :] < torch.tensor(dec_len, device=DEV)[:, None]
    sq = torch.randn(n_dec, N, 1, H, device=DEV, dtype=BF16)
    dec_us = _graph_us(_gather_sdpa_fn(kc, vc, slots, mask[:, None, None, :]), (sq,))
    row = dict(section="mixed", block_size=block_size, prefill=f"{n_pre}x{s_pre}",
               decode=f"{n_dec} x T {min(dec_len)}..{t_max}", ours_us=ours,
               sdpa_prefill_us=pre_us, gather_sdpa_decode_us=dec_us)  # fmt: skip
    if pre_us and dec_us:
        row["sdpa_parts_us"] = pre_us + dec_us
        if ours:
            row["speedup_vs_sdpa_parts"] = (pre_us + dec_us) / ours
    print(f"  {row}", flush=True)
    rows.append(row)


# A/B builds of the int8 section (rows ours_int8_<name>_us): "i2f" the tiles converted by I2F
# (I8_I2F, the build before session 44), "v_pairs" V read as int16 channel pairs (V_PAIRS, an
# option since session 44)
INT8_VARIANTS = {"i2f": dict(I8_I2F=True), "v_pairs": dict(V_PAIRS=True)}


def int8(rows, copy_tbs, block_size=64):
    """Paged decode with an int8 cache (per-tensor scales) vs the bf16 cache, same ragged
    lengths, block table and queries; contiguous GQA int8 decode on the same lengths."""
    for b in (8, 64):
        lengths = _ragged(b, 1024, 65536, seed=b)
        t_max = max(lengths)
        cos, sin = rope_cache(t_max + 1, H, device=DEV)
        q, k, v, kc, vc, cu, past, table = _paged_batch([1] * b, [t - 1 for t in lengths],
                                                        block_size, seed=block_size)  # fmt: skip
        p = _paged_params(cos, sin)
        bf16_us = _graph_us(paged_attention_triton, (q, k, v, kc, vc, cu, past, table, p))
        scale = torch.full((1,), 0.03, device=DEV)
        kc8 = (kc.float() / 0.03).round().clamp(-127, 127).to(torch.int8)
        vc8 = (vc.float() / 0.03).round().clamp(-127, 127).to(torch.int8)
        del kc, vc
        p8 = dataclasses.replace(p, k_scale=scale, v_scale=scale)
        int8_us = _graph_us(paged_attention_triton, (q, k, v, kc8, vc8, cu, past, table, p8))
        base_cfg = paged_decode_config(H, torch.float16, torch.int8, False)
        variant_us = {
            f"ours_int8_{name}_us": _graph_us(
                functools.partial(paged_attention_triton, decode_cfg=dict(base_cfg, **flags)),
                (q, k, v, kc8, vc8, cu, past, table, p8),
            )
            for name, flags in INT8_VARIANTS.items()
        }
        del kc8, vc8
        torch.cuda.empty_cache()
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEV) - 1
        pk8 = torch.randint(-127, 128, (b, KV, t_max, H), device=DEV, dtype=torch.int8)
        pv8 = torch.randint_like(pk8, -127, 128)
        gp8 = dataclasses.replace(_gqa_params(t_max, cos, sin), k_scale=scale, v_scale=scale)
        gq = torch.randn(b, 1, N * H, device=DEV, dtype=BF16)
        gk = torch.randn(b, 1, KV * H, device=DEV, dtype=BF16)
        gqa8_us = _graph_us(gqa_triton, (gq, gk, torch.randn_like(gk), pk8, pv8, seqlens, gp8))
        del pk8, pv8
        torch.cuda.empty_cache()
        nbytes8 = sum(lengths) * KV * H * 2
        row = dict(section="int8", B=b, block_size=block_size, T_min=min(lengths), T_max=t_max,
                   KV_MB_int8=nbytes8 / 1e6, ours_bf16_us=bf16_us, ours_int8_us=int8_us,
                   **variant_us, gqa_contig_int8_us=gqa8_us,
                   floor_int8_us=nbytes8 / (copy_tbs * 1e12) * 1e6)  # fmt: skip
        if bf16_us and int8_us:
            row["int8_speedup_vs_bf16"] = bf16_us / int8_us
            row["ours_int8_GBps"] = nbytes8 / (int8_us * 1e-6) / 1e9
        if int8_us and gqa8_us:
            row["ours_int8_vs_gqa_int8"] = gqa8_us / int8_us
        print(f"  {row}", flush=True)
        rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--sections", default="decode,mixed")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    meta = gpu_meta()
    ceil = measure_ceilings(copy_bytes=1 << 30, gemm_n=4096)
    meta.update(ceil)
    print(meta, flush=True)
    notes = [
        "decode: S = 1, bf16, (N, KV) = (32, 8), H = 128, rotary on; bytes = K + V rows read "
        "(sum of the ragged T); floor_us = bytes / measured copy bandwidth.",
        "gqa_contig: longattn's contiguous GQA Triton decode on the same ragged lengths; "
        "gather_sdpa: paged K/V gathered to a padded [B, KV, T_max, H] buffer then SDPA with a "
        "length mask (it reads/writes the padding too); gather_only: the K and V gather alone.",
        "mixed: one paged call (4 x 2K first prompts + 60 decode rows) vs SDPA causal prefill "
        "on the prompts + gather + SDPA on the decode rows (the prompts' rotary/append excluded "
        "from SDPA's side).",
        "timing: CUDA-graph replay medians (benchmarks/_harness.bench), one input set per shape.",
    ]
    rows: list[dict] = []
    t0 = time.time()
    for name, fn in (("tune", lambda: tune(rows, ceil["copy_TBps"])),
                     ("decode", lambda: decode(rows, ceil["copy_TBps"])),
                     ("mixed", lambda: mixed(rows, ceil["copy_TBps"])),
                     ("int8", lambda: int8(rows, ceil["copy_TBps"]))):  # fmt: skip
        if name not in args.sections.split(","):
            continue
        print(f"== {name} ({time.time() - t0:.0f}s)", flush=True)
        fn()
        write_results("paged", meta, rows, notes=notes, out_dir=args.out)
    print(f"done in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
