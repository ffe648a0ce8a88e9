"""Host (Python + launch) cost of eager public-op calls, and where it goes (GPU machine).

    PYTHONPATH=src python benchmarks/profile_host.py --out $OUT

For each op call (with and without the host-side value checks, ``validate``), times ``N``
eager calls issued back to back (``perf_counter``; the GPU queue absorbs the kernels unless a
check syncs) and writes a cProfile
table (sorted by own time) of those calls to ``profile_host.txt``; one JSON line per op to
``profile_host.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import longattn  # noqa: E402

N = 300


def _rms_call(validate=True):
    n, h = 32, 128
    x = torch.randn(1, 16, n * h, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(h, device="cuda")
    cos, sin = longattn.rope_cache(4096, h, device="cuda")
    pos = torch.arange(16, device="cuda")[None]
    return lambda: longattn.rms_norm_rotary(
        x, w, cos, sin, pos, num_heads=n, out_dtype=torch.float16, validate=validate
    )


def _gqa_decode_call(validate=True):
    b, n, kv, h, cap = 1, 32, 8, 128, 4096
    q = torch.randn(b, 1, n * h, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, 1, kv * h, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pk = torch.randn(b, kv, cap, h, device="cuda", dtype=torch.bfloat16)
    pv = torch.randn_like(pk)
    seqlens = torch.full((b,), 2047, dtype=torch.int32, device="cuda")
    return lambda: longattn.group_query_attention(
        q, k, v, pk, pv, seqlens_k=seqlens, total_sequence_length=2048, num_heads=n,
        kv_num_heads=kv, validate=validate,
    )  # fmt: skip


def _gqa_tier_call():
    """The GQA Triton tier alone (no API, no validation): prologue + split + merge launches."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_gqa

    sets, p = bench_gqa._decode_sets(1, 4096, torch.bfloat16, 1)
    fn = bench_gqa._decode_fn(p)
    return lambda: fn(*sets[0])


def _sparse_step_call(validate=True):
    """indexer + DSA decode step (bench_sparse geometry, T = 4K)."""
    b, n, kv, h, cap, t, r, ni, di = 1, 24, 4, 256, 4160, 4096, 64, 16, 128
    q = torch.randn(b, 1, n * h, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, 1, kv * h, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pk = torch.randn(b, kv, cap, h, device="cuda", dtype=torch.bfloat16)
    pv = torch.randn_like(pk)
    iq = torch.randn(b, 1, ni * di, device="cuda", dtype=torch.bfloat16)
    bk = torch.randn(b, cap // r, di, device="cuda")
    seqlens = torch.full((b,), t - 1, dtype=torch.int32, device="cuda")

    def step():
        sel, cnt = longattn.sparse_attention_indexer(
            iq,
            bk,
            seqlens,
            compress_ratio=r,
            token_budget=2048,
            total_sequence_length=t,
            validate=validate,
        )
        return longattn.dynamic_sparse_attention(
            q, k, v, pk, pv, selected_indices=sel, selected_counts=cnt, seqlens_k=seqlens,
            total_sequence_length=t, num_heads=n, kv_num_heads=kv,
            validate=False if validate else "off",
        )  # fmt: skip

    return step


CALLS = {
    "rms_norm_rotary (position_ids, validate=True)": _rms_call,
    "rms_norm_rotary (position_ids, validate=False)": lambda: _rms_call(False),
    "gqa_decode (validate=True)": _gqa_decode_call,
    "gqa_decode (validate=False)": lambda: _gqa_decode_call(False),
    "gqa_decode (Triton tier called directly)": _gqa_tier_call,
    "indexer_plus_dsa (default validation)": _sparse_step_call,
    "indexer_plus_dsa (validate=False)": lambda: _sparse_step_call(False),
}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    text = io.StringIO()
    lines = []
    for name, make in CALLS.items():
        fn = make()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(N):
            fn()
        host_us = (time.perf_counter() - t0) / N * 1e6
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(N):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        sio = io.StringIO()
        pstats.Stats(prof, stream=sio).sort_stats("tottime").print_stats(30)
        print(f"== {name}: {host_us:.1f} us per eager call (host)", file=text)
        print(sio.getvalue(), file=text)
        lines.append(json.dumps(dict(op=name, host_us_per_call=round(host_us, 2))))
        print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_host.txt").write_text(text.getvalue())
    (out / "profile_host.json").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
