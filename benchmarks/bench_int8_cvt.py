"""int8-cache decode under each int8 -> 16-bit conversion mode (``LONGATTN_INT8_CVT``).

The mode is read once per process, so run this script once per mode; each run prints one JSON
line per row and appends them to ``--out`` (a .jsonl file). Rows: GQA decode, (N, KV) = (32, 8),
H = 128, T = 128K, bf16 activations (and fp16 activations at B = 8), CUDA-graph replay, against
the bf16-cache time of the same shape (measured in the same process), plus a small int8 tile
sweep at B = 8 (a cheaper conversion can move the best tile).

    for m in asm cast; do LONGATTN_INT8_CVT=$m python benchmarks/bench_int8_cvt.py \
        --out int8_cvt.jsonl; done
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import bench_gqa as g  # same folder (scripts run as benchmarks/<name>.py)
from longattn.gqa.triton._core import INT8_CVT


def _rows(copy_tbs: float):
    t = 131072
    for b, act in ((1, torch.bfloat16), (8, torch.bfloat16), (32, torch.bfloat16),
                   (8, torch.float16)):  # fmt: skip
        res = {}
        for name, dt in (("act", act), ("int8", torch.int8)):
            cache_dt = act if name == "act" else dt
            sets, p = g._decode_sets(b, t, cache_dt, g._decode_set_count(b, t, cache_dt.itemsize))
            if act == torch.float16:
                sets = [
                    tuple(x.half() if x.dtype == torch.bfloat16 else x for x in s) for s in sets
                ]
            res[name] = g._graph_time_or_none(g._decode_fn(p), sets)
            nbytes = 2 * b * g.KV * t * 128 * cache_dt.itemsize
            row = dict(mode=INT8_CVT, B=b, T=t, act=str(act), cache=str(cache_dt),
                       graph_us=res[name], floor_us=nbytes / (copy_tbs * 1e12) * 1e6)  # fmt: skip
            if res[name]:
                row["GBps"] = nbytes / (res[name] * 1e-6) / 1e9
            if name == "int8" and res["act"] and res["int8"]:
                row["speedup_vs_16bit_cache"] = res["act"] / res["int8"]
            yield row
            if name == "int8" and b == 8 and act == torch.bfloat16:
                for bn, w, st in ((64, 4, 4), (128, 4, 3), (128, 8, 3), (256, 8, 2), (64, 8, 4)):
                    cfg = dict(BLOCK_N=bn, num_warps=w, num_stages=st)
                    us = g._graph_time_or_none(g._decode_fn(p, cfg), sets)
                    yield dict(mode=INT8_CVT, B=b, T=t, act=str(act), cache="int8-tune",
                               cfg=str(cfg), graph_us=us,
                               GBps=nbytes / (us * 1e-6) / 1e9 if us else None)  # fmt: skip
            del sets
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help=".jsonl file the rows are appended to")
    args = ap.parse_args()
    torch.manual_seed(0)
    copy_tbs = g.measure_ceilings(gemm_n=2048)["copy_TBps"]
    meta = dict(g.gpu_meta(), copy_TBps=copy_tbs, env=os.environ.get("LONGATTN_INT8_CVT"))
    with open(args.out, "a") as f:
        f.write(json.dumps(dict(meta=meta, mode=INT8_CVT)) + "\n")
        for row in _rows(copy_tbs):
            print(row, flush=True)
            f.write(json.dumps(row) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
