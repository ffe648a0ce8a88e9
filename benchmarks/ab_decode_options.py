"""Same-process A/B of the decode options that are off until measured (run on the GPU machine).

    PYTHONPATH=src python benchmarks/ab_decode_options.py [--quick] [--out DIR]

- ``gqa_merge``: GQA decode (bf16 activations, (N, KV) = (32, 8), H = 128, S = 1), CUDA-graph
  replay of the op with the default config vs ``FUSE_MERGE`` (the last split program of each KV
  head merges; one launch fewer), bf16 cache at B in {1, 8} x T in {4K, 32K, 128K} and the int8
  cache at T = 128K; the default is timed again after the variant (drift check).
- ``dsa_int8``: DSA with an int8 main cache at budget 8192 (the sparse benchmark's geometry,
  H = 256, (N, KV) = (24, 4), T = 128K): default vs ``SM_PROGRAMS`` (split plan capped at one
  wave of the build's resident programs) and the smaller-tile builds of
  ``bench_sparse._CACHE_VARIANTS``.

Prediction written before the first run (session 22, DEVELOPERS.md): FUSE_MERGE -1.5 to -2.5 us
at B=1 (no change at B=32); SM_PROGRAMS=2 -20 to -30% for int8 at B=1 S=1.
Writes ``ab_decode_options.{json,md}``; ``--quick``: B=1 rows only.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gqa as gqa  # noqa: E402
import bench_sparse as sparse  # noqa: E402
from _harness import gpu_meta, write_results  # noqa: E402

DSA_VARIANTS = ("sm2", "n16s3r128", "n16s3sm3", "maxnreg168sm3")


def gqa_merge_rows(quick: bool) -> list[dict]:
    rows = []
    shapes = [(torch.bfloat16, b, t) for b in ((1,) if quick else (1, 8))
              for t in (4096, 32768, 131072)]  # fmt: skip
    shapes.append((torch.int8, 1, 131072))
    for dt, b, t in shapes:
        sets, p = gqa._decode_sets(b, t, dt, gqa._decode_set_count(b, t, dt.itemsize))
        base = gqa._graph_time_or_none(gqa._decode_fn(p), sets)
        merged = gqa._graph_time_or_none(gqa._decode_fn(p, gqa._variant_cfg(dt, "merge")), sets)
        again = gqa._graph_time_or_none(gqa._decode_fn(p), sets)
        row = dict(section="gqa_merge", cache=str(dt).removeprefix("torch."), B=b, T=t,
                   default_graph_us=base, merge_graph_us=merged, default_again_graph_us=again)  # fmt: skip
        if base and merged:
            row["merge_speedup"] = base / merged
        print(row, flush=True)
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    return rows


def dsa_int8_rows(quick: bool) -> list[dict]:
    rows = []
    t, budget = 131072, 8192
    for b in (1,) if quick else (1, 4):
        layer = sparse.Layer(b, t + 64, torch.int8)
        for s in (1,) if quick else (1, 8):
            seqlens, sets = sparse._inputs(layer, s, t, 4, budget)
            fn = functools.partial(sparse._dsa_sel, layer, seqlens, t)
            row = dict(section="dsa_int8", B=b, S=s, T=t, budget=budget,
                       default_us=sparse._graph_time(fn, sets))  # fmt: skip
            for name in DSA_VARIANTS:
                with sparse._variant(sparse._CACHE_VARIANTS[name]):
                    row[f"{name}_us"] = sparse._graph_time(fn, sets)
            print(row, flush=True)
            rows.append(row)
            del sets
        del layer
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="B=1 rows only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    meta = gpu_meta()
    print(meta, flush=True)
    rows = gqa_merge_rows(args.quick) + dsa_int8_rows(args.quick)
    notes = ["Same-process CUDA-graph replays (median over rotated input sets); see the module "
             "docstring for shapes. Command: PYTHONPATH=src python benchmarks/"
             "ab_decode_options.py"]  # fmt: skip
    write_results("ab_decode_options", meta, rows, notes=notes, out_dir=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
