"""Sweep of the DSA split kernel's launch plan (GPU machine): splits x num_stages x num_warps.

    PYTHONPATH=src python benchmarks/tune_dsa.py --out $OUT

Qwen3.8 geometry of ``bench_sparse`` (H = 256, (24, 4), r = 64, budget 2048, bf16 cache),
T = 128K, decode S = 1 (and S = 8), B in {1, 4}. Each point is the CUDA-graph replay of the
public ``dynamic_sparse_attention`` call (prologue + split + merge), median over rotated input
sets, with ``plan_splits`` / ``decode_config`` of the Triton tier overridden. Writes
``tune_dsa.json`` (one row per point, plus the default plan's time).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import bench_sparse as bs  # noqa: E402
import longattn.sparse.triton.decode as dsa_decode  # noqa: E402
from _harness import gpu_meta  # noqa: E402
from longattn._triton_utils import cdiv  # noqa: E402

T = 131072


def _time(layer, s, seqlens, sets):
    return bs._graph_time(functools.partial(bs._dsa_sel, layer, seqlens, T), sets)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="1x1,4x1,4x8")
    ap.add_argument(
        "--ab",
        action="store_true",
        help="only: the default plan vs session 9's (2 x SMs, 3 stages)",
    )
    args = ap.parse_args(argv)
    if args.ab:
        return ab(args)
    torch.manual_seed(0)
    rows = []
    plan0, cfg0 = dsa_decode.plan_splits, dsa_decode.decode_config
    for case in args.cases.split(","):
        b, s = (int(x) for x in case.split("x"))
        layer = bs.Layer(b, T + 64, torch.bfloat16)
        seqlens, sets = bs._inputs(layer, s, T, 4, bs.BUDGET)
        base = _time(layer, s, seqlens, sets)
        rows.append(dict(B=b, S=s, plan="default", us=round(base, 2)))
        print(rows[-1], flush=True)
        for splits in (8, 16, 33, 66, 127):
            for stages, warps in ((2, 4), (3, 4), (4, 4), (3, 8)):
                dsa_decode.plan_splits = lambda *a, _n=splits: plan0(*a[:6], _n)
                dsa_decode.decode_config = lambda *a, _s=stages, _w=warps: dict(
                    BLOCK_N=32, num_warps=_w, num_stages=_s
                )
                try:
                    us = round(_time(layer, s, seqlens, sets), 2)
                except Exception as exc:  # pragma: no cover - e.g. out of shared memory
                    us = f"{type(exc).__name__}"
                finally:
                    dsa_decode.plan_splits, dsa_decode.decode_config = plan0, cfg0
                rows.append(dict(B=b, S=s, splits=splits, stages=stages, warps=warps, us=us))
                print(rows[-1], flush=True)
        del layer, sets
        torch.cuda.empty_cache()
    out = Path(args.out or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune_dsa.json").write_text(json.dumps(dict(meta=gpu_meta(), rows=rows), indent=1))


def ab(args):
    """Default plan vs the previous one (programs ~2 x SMs, 3 stages), interleaved twice."""
    plan0, cfg0 = dsa_decode.plan_splits, dsa_decode.decode_config
    rows = []

    def old_plan(r, kv, window, max_sel, block_n, num_sms, num_splits=None):
        return plan0(r, kv, window, max_sel, block_n, num_sms, cdiv(2 * num_sms, max(r * kv, 1)))

    for case in args.cases.split(","):
        b, s, t = (int(x) for x in case.split("x"))
        layer = bs.Layer(b, t + 64, torch.bfloat16)
        seqlens, sets = bs._inputs(layer, s, t, 4, bs.BUDGET)
        fn = functools.partial(bs._dsa_sel, layer, seqlens, t)
        for rep in range(2):
            for name in ("old", "new"):
                if name == "old":
                    dsa_decode.plan_splits = old_plan
                    dsa_decode.decode_config = lambda *a: dict(cfg0(*a), num_stages=3)
                try:
                    us = round(bs._graph_time(fn, sets), 2)
                finally:
                    dsa_decode.plan_splits, dsa_decode.decode_config = plan0, cfg0
                rows.append(dict(B=b, S=s, T=t, plan=name, rep=rep, us=us))
                print(rows[-1], flush=True)
        del layer, sets
        torch.cuda.empty_cache()
    out = Path(args.out or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune_dsa_ab.json").write_text(json.dumps(dict(meta=gpu_meta(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
