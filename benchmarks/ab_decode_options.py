"""Same-process A/B of decode tuning options (run on the GPU machine).

    PYTHONPATH=src python benchmarks/ab_decode_options.py [--quick] [--out DIR]

- ``dsa_int8``: DSA with an int8 main cache at budget 8192 (the sparse benchmark's geometry,
  H = 256, (N, KV) = (24, 4), T = 128K), CUDA-graph replays: the default config vs each of
  ``bench_sparse._CACHE_VARIANTS`` (the previous uncapped build, other stage counts and
  tiles), then the default again (drift check).

Session 23 (H100, ab_decode_options_h100.json) decided the int8 default (168-register cap, the
split plan at one wave of 3 programs per SM) and removed the GQA decode ``FUSE_MERGE`` option
(0.97-1.00x of the merge kernel at every shape).
Writes ``ab_decode_options.{json,md}``; ``--quick``: B=1 rows only.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_sparse as sparse  # noqa: E402
from _harness import gpu_meta, write_results  # noqa: E402

DSA_VARIANTS = tuple(sparse._CACHE_VARIANTS)


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
            row["default_again_us"] = sparse._graph_time(fn, sets)
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
    rows = dsa_int8_rows(args.quick)
    notes = ["Same-process CUDA-graph replays (median over rotated input sets); see the module "
             "docstring for shapes. Command: PYTHONPATH=src python benchmarks/"
             "ab_decode_options.py"]  # fmt: skip
    write_results("ab_decode_options", meta, rows, notes=notes, out_dir=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
