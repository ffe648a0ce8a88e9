"""Where a sparse layer step's time goes (H200): per-kernel GPU times and host overhead.

    PYTHONPATH=src python benchmarks/profile_sparse.py --out $OUT

For each (B, S) and T (default 128K) (geometry of ``bench_sparse.py``):
- ``kernels``: torch.profiler over 20 eager layer steps (indexer + DSA): every GPU kernel's
  mean duration per step, in launch order, and their sum;
- ``graph``: the same step timed as a one-step CUDA graph replayed once per timing (what
  ``bench_sparse`` reports: GPU time + the replay's launch latency) and as a graph of
  ``STEPS`` back-to-back steps over distinct layers (as in a model's decode graph: each layer
  its own cache and block keys), divided by ``STEPS``;
- ``host``: cProfile of eager layer steps at B=1, S=1 (top functions by cumulative time).
Writes ``profile_sparse.json`` and ``profile_sparse.txt`` under ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import bench_sparse as bs  # noqa: E402
from _harness import gpu_meta, kernel_table  # noqa: E402

T_DEFAULT = 131072
STEPS = 8


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--configs", default="1x1,4x1,1x8,4x8")
    ap.add_argument("--T", default=str(T_DEFAULT), help="comma-separated cache lengths")
    ap.add_argument(
        "--step",
        choices=("ops", "layer_op"),
        default="ops",
        help="ops: indexer + DSA calls; layer_op: sparse_attention_layer",
    )
    ap.add_argument("--no-host", action="store_true", help="skip the cProfile section")
    args = ap.parse_args(argv)
    step_fn = bs._layer_step_b if args.step == "ops" else bs._fused_step_b
    torch.manual_seed(0)
    out = dict(meta=gpu_meta(), configs=[])
    text = io.StringIO()
    grid = [(c, int(t)) for t in args.T.split(",") for c in args.configs.split(",")]
    for cfg, T in grid:
        cap = T + 64
        b, s = map(int, cfg.split("x"))
        layers = [bs.Layer(b, cap, torch.bfloat16) for _ in range(STEPS)]
        ly0 = layers[0]
        seqlens0, xs0 = bs._inputs(ly0, s, T, 1, bs.BUDGET)
        step = functools.partial(step_fn, ly0, seqlens0, T, xs0[0])
        dense = functools.partial(bs._dense_x, ly0, seqlens0, T, xs0[0])
        kt, total = kernel_table(step)
        kd, total_d = kernel_table(dense)
        one = bs._graph_time(functools.partial(step_fn, ly0, seqlens0, T), xs0)
        multi = bs._chain_us(step_fn, layers, s, T, bs.BUDGET, min_time_s=0.2)
        multi_dense = bs._chain_us(bs._dense_x, layers[:2], s, T, bs.BUDGET, min_time_s=0.2)
        rec = dict(B=b, S=s, T=T, step=args.step, kernels=kt, kernel_sum_us=total, dense_kernels=kd,
                   dense_kernel_sum_us=total_d, one_step_graph_us=round(one, 2),
                   multi_step_graph_us=round(multi, 2),
                   dense_multi_step_graph_us=round(multi_dense, 2))  # fmt: skip
        out["configs"].append(rec)
        print(f"== B={b} S={s} T={T}", file=text)
        for r in kt:
            print(f"  {r['us_per_step']:8.2f} us x{r['launches_per_step']:.0f}  {r['kernel']}",
                  file=text)  # fmt: skip
        print(f"  sum {total} us; one-step graph {one:.2f} us; {STEPS}-step graph "
              f"{multi:.2f} us/step; dense kernels {total_d} us, dense graph "
              f"{multi_dense:.2f} us/step", file=text)  # fmt: skip
        for r in kd:
            print(f"    dense {r['us_per_step']:8.2f} us  {r['kernel']}", file=text)
        print(text.getvalue().split("== ")[-1], flush=True)
        del layers
        torch.cuda.empty_cache()

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.no_host:
        (out_dir / "profile_sparse.json").write_text(json.dumps(out, indent=1))
        (out_dir / "profile_sparse.txt").write_text(text.getvalue())
        return
    # host overhead of the eager calls at B=1, S=1
    T = grid[0][1]
    cap = T + 64
    ly = bs.Layer(1, cap, torch.bfloat16)
    seqlens, xs = bs._inputs(ly, 1, T, 1, bs.BUDGET)
    x = xs[0]
    for _ in range(5):
        bs._layer_step(ly, x, seqlens, T, bs.BUDGET)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        bs._layer_step(ly, x, seqlens, T, bs.BUDGET)
    torch.cuda.synchronize()
    prof.disable()
    sio = io.StringIO()
    pstats.Stats(prof, stream=sio).sort_stats("cumulative").print_stats(45)
    print("== host (cProfile, 50 eager layer steps, B=1 S=1)", file=text)
    print(sio.getvalue(), file=text)
    print(sio.getvalue()[:6000], flush=True)
    (out_dir / "profile_sparse.json").write_text(json.dumps(out, indent=1))
    (out_dir / "profile_sparse.txt").write_text(text.getvalue())


if __name__ == "__main__":
    main()
