"""Prefill kernel alone, same process: the Triton kernel (per-thread copies: base; TMA K/V: tma)
and the Gluon warp-specialized kernel (gluon*) variants (GPU machine).

    PYTHONPATH=src python benchmarks/prefill_tma_ab.py --out $OUT

Causal bf16 first prompt, (N, KV) = (32, 8), B*S = 16K, H in {128, 256}, S in {2K, 8K, 32K}.
Each variant's output is compared with the base output (``maxdiff_vs_base``: 0 where the two
kernels compute the same sums in the same order; a BLOCK_N change moves bf16 rounding). Writes
``prefill_tma_ab.json`` (kept runs: ``benchmarks/results/prefill_{tma,gluon_ab*}_h200.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import bench_gqa as bg  # noqa: E402
from _harness import gpu_meta  # noqa: E402
from longattn.gqa.triton import launch  # noqa: E402
from longattn.gqa.triton.prefill import prefill_config  # noqa: E402


def _gl(**kw) -> dict:
    return dict(_GLUON=True, **kw)


def variants(h: int) -> list[tuple[str, dict]]:
    base = prefill_config(h, torch.bfloat16, False)
    out = [("base", dict(base, USE_DESC=False)), ("tma", dict(base, USE_DESC=True))]
    # the Gluon kernel (prefill_gluon.py): two consumer warpgroups + a TMA producer warp
    # default: persistent, dynamic work claims, ORDER 2 (KV groups), 2 Q slots (H <= 128)
    out += [("gluon", _gl()), ("gluon_q1", _gl(Q_SLOTS=1)), ("gluon_order1", _gl(ORDER=1)),
            ("gluon_static_q1", _gl(DYNAMIC=False, ORDER=0, Q_SLOTS=1))]  # fmt: skip
    return out


def _fn(p, cfg):
    if cfg.get("_GLUON"):
        g_cfg = {k: v for k, v in cfg.items() if k != "_GLUON"}
        return lambda q_rot, pk, pv, sl, out: launch.run_prefill_gluon(q_rot, pk, pv, sl, p, out,
                                                                       g_cfg)  # fmt: skip
    return bg._prefill_attn_fn(p, cfg)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    rows = []
    for h in (128, 256):
        for s in (2048, 8192, 32768):
            b = max(1, 16384 // s)
            sets, p = bg._prefill_sets(b, s, h, 2 if s < 32768 else 1)
            asets = bg._attn_sets_from(sets, p, h)
            flops = 4 * b * bg.N * h * s * s / 2
            ref = None
            for name, cfg in variants(h):
                q_rot, pk, pv, sl, out = asets[0]
                out.fill_(float("nan"))
                try:
                    _fn(p, cfg)(q_rot, pk, pv, sl, out)
                    torch.cuda.synchronize()
                except Exception as exc:  # e.g. shared memory
                    print(f"  {h} {s} {name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    continue
                o = out.float().clone()
                ref = o if ref is None else ref
                us = bg._time_or_none(_fn(p, cfg), asets, s >= 32768)
                row = dict(H=h, S=s, B=b, variant=name, cfg=str(cfg), us=us,
                           TFLOPs=flops / (us * 1e-6) / 1e12 if us else None,
                           maxdiff_vs_base=(o - ref).abs().max().item(),
                           nan=bool(torch.isnan(o).any()))  # fmt: skip
                print(f"  {row}", flush=True)
                rows.append(row)
            del sets, asets
            torch.cuda.empty_cache()
    path = Path(args.out) / "prefill_tma_ab.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(meta=gpu_meta(), rows=rows), indent=1))
    print(path)


if __name__ == "__main__":
    main()
