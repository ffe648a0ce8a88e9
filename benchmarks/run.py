"""Run the benchmarks (on a GPU): `python benchmarks/run.py [op ...] [--out DIR]`."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = {
    "rms_norm_rotary": "bench_rms_norm_rotary",
    "gqa": "bench_gqa",
    "paged": "bench_paged",
    "sparse": "bench_sparse",
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ops", nargs="*", default=[])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    ops = args.ops or [op for op, mod in BENCHES.items() if (HERE / f"{mod}.py").exists()]
    for op in ops:
        if op not in BENCHES:
            print(f"unknown benchmark {op!r}; known: {sorted(BENCHES)}")
            return 2
        mod = importlib.import_module(BENCHES[op])
        print(f"== {op}", flush=True)
        mod.main(["--out", args.out] if args.out else [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
