"""RMSNormRotary on the GPU: our Triton kernel vs the eager torch composition and torch.compile.

Bytes counted: read x + write out + read the cos/sin rows used (the floor is bytes / copy BW).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402
import longattn  # noqa: E402
from longattn.rms_norm_rotary.reference import rms_norm_rotary_fp64  # noqa: E402
from longattn.rms_norm_rotary.triton.kernel import rms_norm_rotary_triton  # noqa: E402
from longattn.testing import error_stats  # noqa: E402

SHAPES = [(1, 16384, 32, 128), (1, 16384, 16, 256)]
CONFIGS = [(bn, w, t) for t in (False, True)
           for bn, w in ((4, 2), (8, 2), (16, 2), (8, 4), (16, 4), (8, 8))]  # fmt: skip


def eager_composition(x, w, cos, sin, num_heads, eps=1e-6):
    """What a user writes in plain PyTorch: fp32 math, fp16 output, positions 0..S-1."""
    b, s, d = x.shape
    h = d // num_heads
    xf = x.float().view(b, s, num_heads, h)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w
    c, sn = cos[:s][None, :, None, :], sin[:s][None, :, None, :]
    x1, x2 = y[..., : h // 2], y[..., h // 2 :]
    return torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn], -1).to(torch.float16).view(b, s, d)


def _graph_and_host_us(fn, args):
    """(median us of CUDA-graph replays of fn(*args): GPU time alone; host us per eager call,
    measured over 50 calls issued without waiting: the Python/launch cost alone)."""
    graph_us = _harness.graph_bench(fn, [args])["median_us"]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        fn(*args)
    host_us = (time.perf_counter() - t0) / 50 * 1e6
    torch.cuda.synchronize()
    return round(graph_us, 2), round(host_us, 2)


def bench_shape(b, s, n, h, *, ceil, compiled):
    d = n * h
    cos, sin = longattn.rope_cache(262144, h, device="cuda")
    w = (1 + 0.25 * torch.randn(h, device="cuda")).float()
    nbytes = b * s * d * (2 + 2) + 2 * s * (h // 2) * 4
    sets = [(torch.randn(b, s, d, device="cuda").to(torch.bfloat16),)
            for _ in range(_harness.copies_for_l2(b * s * d * 2))]  # fmt: skip
    # Correctness on the first set (fp64 truth from the same inputs).
    x0 = sets[0][0]
    pos = torch.arange(s, device="cuda").expand(b, s)
    truth = rms_norm_rotary_fp64(x0, w, cos, sin, pos, num_heads=n, epsilon=1e-6,
                                 interleaved=False, rotary_offset=0, exact=True)  # fmt: skip
    ours = longattn.rms_norm_rotary(x0, w, cos, sin, num_heads=n, out_dtype=torch.float16)
    err = error_stats(ours, truth).rel_rms
    floor = error_stats(truth.to(torch.float16), truth).rel_rms

    def api(x):
        return longattn.rms_norm_rotary(x, w, cos, sin, num_heads=n, out_dtype=torch.float16)

    def kernel(x, bn, nw, tile):
        return rms_norm_rotary_triton(x, w, cos, sin, None, num_heads=n, epsilon=1e-6,
                                      interleaved=False, rotary_offset=0, exact=True,
                                      out_dtype=torch.float16, block_n=bn, num_warps=nw,
                                      tile_tables=tile)  # fmt: skip

    t_eager = _harness.bench(lambda x: eager_composition(x, w, cos, sin, n), sets)
    t_comp = _harness.bench(lambda x: compiled(x, w, cos, sin, n), sets)
    t_api = _harness.bench(api, sets)
    api_graph_us, api_host_us = _graph_and_host_us(api, sets[0])
    best, sweep = None, []
    for bn, nw, tile in CONFIGS:
        if bn <= n:
            t = _harness.bench(kernel, [(x, bn, nw, tile) for (x,) in sets])
            sweep.append(f"{bn}/{nw}{'T' if tile else ''}:{t['median_us']:.1f}")
            if best is None or t["median_us"] < best[3]["median_us"]:
                best = (bn, nw, tile, t)
    rows = []
    for name, t in [("longattn (default config)", t_api),
                    (f"longattn best (BLOCK_N={best[0]}, warps={best[1]}, tiled={best[2]})", best[3]),
                    ("torch eager", t_eager), ("torch.compile", t_comp)]:  # fmt: skip
        us = t["median_us"]
        tbs = nbytes / (us * 1e-6) / 1e12
        rows.append({
            "shape": f"[{b},{s},{n}x{h}] bf16->fp16",
            "impl": name,
            "median_us": round(us, 2),
            "TB/s": round(tbs, 3),
            "vs_copy_BW": round(tbs / ceil["copy_TBps"], 3),
            "speedup_vs_eager": round(t_eager["median_us"] / us, 2),
            "speedup_vs_compile": round(t_comp["median_us"] / us, 2),
            "floor_us": round(nbytes / (ceil["copy_TBps"] * 1e12) * 1e6, 2),
            "rel_rmse_vs_fp64": f"{err:.3e} (floor {floor:.3e})" if "longattn" in name else "",
            "sweep BLOCK_N/warps:us": " ".join(sweep) if "best" in name else "",
        })  # fmt: skip
        if name.startswith("longattn (default"):
            rows[-1]["api_graph_us"] = api_graph_us
            rows[-1]["api_host_us_per_call"] = api_host_us
    print("\n".join(str(r) for r in rows), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    meta = _harness.gpu_meta()
    ceil = _harness.measure_ceilings()
    meta.update(ceil)
    rows = []
    compiled = torch.compile(eager_composition, dynamic=False)
    for shape in SHAPES:
        rows += bench_shape(*shape, ceil=ceil, compiled=compiled)
    notes = [
        "bytes = read x (bf16) + write out (fp16) + read cos/sin rows (fp32); floor_us = bytes / "
        "measured copy bandwidth (read+write bytes over time, this run)",
        "timing: CUDA events, median over >=0.2 s of calls, inputs rotated over >= 3x L2",
        "peers: eager torch composition (fp32 math) and torch.compile of it, same process",
    ]
    paths = _harness.write_results("rms_norm_rotary", meta, rows, notes=notes, out_dir=args.out)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
