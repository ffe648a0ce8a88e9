"""Sweep of the DSA split kernel's launch plan (GPU machine): splits x num_stages x num_warps.

    PYTHONPATH=src python benchmarks/tune_dsa.py --out $OUT
    PYTHONPATH=src python benchmarks/tune_dsa.py --cases 1x8 --cfg '{"PREFETCH": true}'

Qwen3.8 geometry of ``bench_sparse`` (H = 256, (24, 4), r = 64, budget 2048, bf16 cache),
T = 128K, decode S = 1 (and S = 8), B in {1, 4}. Each point is the CUDA-graph replay of the
public ``dynamic_sparse_attention`` call (prologue + split + merge), median over rotated input
sets, with ``plan_splits`` / ``decode_config`` of the Triton tier overridden. Writes
``tune_dsa.json`` (one row per point, plus the default plan's time).
"""

from __future__ import annotations

import argparse
import contextlib
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


@contextlib.contextmanager
def _plan(plan_splits, decode_config):
    """The DSA tier with ``plan_splits`` / ``decode_config`` replaced (None: keep)."""
    saved = dsa_decode.plan_splits, dsa_decode.decode_config
    dsa_decode.plan_splits = plan_splits or saved[0]
    dsa_decode.decode_config = decode_config or saved[1]
    try:
        yield
    finally:
        dsa_decode.plan_splits, dsa_decode.decode_config = saved


def _cases(spec, default_t):
    """``BxS`` or ``BxSxT`` items -> (b, s, t, layer, seqlens, sets), one case at a time."""
    for case in spec.split(","):
        b, s, t = ([int(x) for x in case.split("x")] + [default_t])[:3]
        layer = bs.Layer(b, t + 64, torch.bfloat16)
        seqlens, sets = bs._inputs(layer, s, t, 4, bs.BUDGET)
        yield b, s, t, layer, seqlens, sets
        del layer, sets
        torch.cuda.empty_cache()


def _time(layer, seqlens, t, sets):
    return round(bs._graph_time(functools.partial(bs._dsa_sel, layer, seqlens, t), sets), 2)


def _save(args, name, rows):
    out = Path(args.out or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(dict(meta=gpu_meta(), rows=rows), indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="1x1,4x1,4x8")
    ap.add_argument(
        "--ab",
        action="store_true",
        help="only: the default plan vs session 9's (2 x SMs, 3 stages)",
    )
    ap.add_argument("--cfg", default="{}", help="JSON: DSA cfg keys added at every point")
    args = ap.parse_args(argv)
    extra = json.loads(args.cfg)  # parsed before any GPU work
    if not isinstance(extra, dict):
        raise ValueError(f"--cfg must be a JSON object, got {args.cfg!r}")
    if args.ab:
        return ab(args)
    torch.manual_seed(0)
    rows = []
    plan0 = dsa_decode.plan_splits
    for b, s, t, layer, seqlens, sets in _cases(args.cases, T):
        rows.append(dict(B=b, S=s, plan="default", us=_time(layer, seqlens, t, sets)))
        print(rows[-1], flush=True)
        if extra:  # the default plan and config plus --cfg
            cfg0 = dsa_decode.decode_config
            with _plan(None, lambda *a, cfg0=cfg0: dict(cfg0(*a), **extra)):
                rows.append(dict(B=b, S=s, plan="default", **extra,
                                 us=_time(layer, seqlens, t, sets)))  # fmt: skip
            print(rows[-1], flush=True)
        for splits in (8, 16, 33, 66, 127):
            for stages, warps in ((2, 4), (3, 4), (4, 4), (3, 8)):
                plan = functools.partial(_fixed_splits, plan0, splits)
                cfg = functools.partial(_fixed_config, stages, warps, extra)
                try:
                    with _plan(plan, cfg):
                        us = _time(layer, seqlens, t, sets)
                except Exception as exc:  # pragma: no cover - e.g. out of shared memory
                    us = f"{type(exc).__name__}"
                rows.append(dict(B=b, S=s, splits=splits, stages=stages, warps=warps, **extra,
                                 us=us))  # fmt: skip
                print(rows[-1], flush=True)
    _save(args, "tune_dsa.json", rows)


def _fixed_splits(plan0, splits, *args):
    return plan0(*args[:6], splits)


def _fixed_config(stages, warps, extra, *args):
    return dict(BLOCK_N=32, num_warps=warps, num_stages=stages, **extra)


def ab(args):
    """Default plan vs the previous one (programs ~2 x SMs, 3 stages), interleaved twice."""
    plan0, cfg0 = dsa_decode.plan_splits, dsa_decode.decode_config
    rows = []

    def old_plan(r, kv, window, max_sel, block_n, num_sms, num_splits=None):
        return plan0(r, kv, window, max_sel, block_n, num_sms, cdiv(2 * num_sms, max(r * kv, 1)))

    def old_config(*a):
        return dict(cfg0(*a), num_stages=3)

    for b, s, t, layer, seqlens, sets in _cases(args.cases, T):
        for rep in range(2):
            for name, plan, cfg in (("old", old_plan, old_config), ("new", None, None)):
                with _plan(plan, cfg):
                    us = _time(layer, seqlens, t, sets)
                rows.append(dict(B=b, S=s, T=t, plan=name, rep=rep, us=us))
                print(rows[-1], flush=True)
    _save(args, "tune_dsa_ab.json", rows)


if __name__ == "__main__":
    main()
