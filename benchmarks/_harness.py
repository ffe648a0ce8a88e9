"""Shared benchmark harness (runs on the GPU machine).

- ``bench(fn_factory, ...)``: median time with warm-up and L2-busting input rotation: the caller
  gives a list of argument sets (``rotate``) whose total size exceeds the L2; each timed call uses
  the next set, so no call finds its inputs in L2.
- ``gpu_meta()``: GPU name, SM count, torch/triton versions.
- ``measure_ceilings()``: device-to-device copy bandwidth and bf16 GEMM TFLOP/s, in this run.
- ``write_results(op, meta, rows, notes)``: ``benchmarks/results/<op>.json`` and ``.md``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
L2_BYTES = 60 * 1024 * 1024  # H200: 60 MB (as PyTorch reports it there)


def copies_for_l2(bytes_per_set: int, min_sets: int = 2, max_sets: int = 64) -> int:
    """How many input sets to rotate through so that their total is >= 3 x L2."""
    need = math.ceil(3 * L2_BYTES / max(bytes_per_set, 1))
    return max(min_sets, min(max_sets, need))


def bench(
    fn: Callable[..., object],
    arg_sets: Sequence[tuple],
    *,
    warmup: int = 5,
    reps: int | None = None,
    min_time_s: float = 0.2,
) -> dict:
    """Time ``fn(*args)`` rotating over ``arg_sets``; returns median/min/mean in microseconds."""
    n = len(arg_sets)
    for i in range(warmup):
        fn(*arg_sets[i % n])
    torch.cuda.synchronize()
    # Estimate the per-call time to choose the repetition count.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(n):
        fn(*arg_sets[i % n])
    end.record()
    torch.cuda.synchronize()
    est_ms = max(start.elapsed_time(end) / n, 1e-3)
    reps = reps or int(min(1000, max(10, min_time_s * 1e3 / est_ms)))
    times = []
    for i in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        args = arg_sets[i % n]
        s.record()
        fn(*args)
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    us = [s.elapsed_time(e) * 1e3 for s, e in times]
    return {
        "median_us": statistics.median(us),
        "min_us": min(us),
        "mean_us": statistics.fmean(us),
        "reps": reps,
        "rotation": n,
    }


def graph_bench(fn: Callable[..., object], arg_sets: Sequence[tuple], **kw) -> dict:
    """``bench`` of CUDA-graph replays of ``fn(*args)``, one graph per input set (captured after
    one warm-up call, which also compiles): GPU time without Python launch overhead."""
    graphs = []
    for args in arg_sets:
        fn(*args)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(*args)
        graphs.append((g,))
    return bench(lambda g: g.replay(), graphs, **kw)


def graph_bench_chain(fns: Sequence[Callable[[], object]], **kw) -> dict:
    """``bench`` of ONE CUDA graph that runs ``fns`` back to back (e.g. one decode step per
    layer, each layer with its own tensors, as in a model's decode graph); times are per
    callable (the replay's median / ``len(fns)``), so a short step is not charged a whole
    graph launch as in ``graph_bench``. Every replay reads the same tensors: where they fit
    the L2 (a chain of small steps), use ``graph_bench_chains``."""
    return graph_bench_chains([fns], **kw)


def graph_bench_chains(chains: Sequence[Sequence[Callable[[], object]]], **kw) -> dict:
    """``graph_bench_chain`` rotating over several chains of equal length (one graph each,
    each chain over its own input sets, e.g. from ``copies_for_l2``), so a replay does not
    find the previous replay's inputs in L2; times per callable."""
    graphs = []
    for fns in chains:
        for f in fns:
            f()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in fns:
                f()
        graphs.append((g,))
    t = bench(lambda g: g.replay(), graphs, **kw)
    n = len(chains[0])
    return {k: (v / n if k.endswith("_us") else v) for k, v in t.items()}


def peer_diff(peer_out: torch.Tensor, ours_out: torch.Tensor) -> tuple[float, float]:
    """(max |peer - ours|, that over max |ours|). The relative one is the check: decode
    outputs over thousands of random keys are O(0.01), so an absolute bound of a few bf16 ulps
    of O(1) would pass a peer that computed another function (e.g. another window)."""
    diff = float((peer_out.float() - ours_out.float()).abs().max())
    return diff, diff / max(float(ours_out.float().abs().max()), 1e-30)


PEER_REL_TOL = 0.03  # a few bf16 ulps (2^-8 relative) of the largest output


def kernel_table(fn, n=20):
    """Mean GPU time per call of every kernel ``fn`` launches (profiler), launch order."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            r = rows.setdefault(ev.name, [0.0, 0, len(rows)])
            r[0] += ev.device_time
            r[1] += 1
    out = [dict(kernel=k[:90], us_per_step=round(v[0] / n, 2), launches_per_step=v[1] / n)
           for k, v in sorted(rows.items(), key=lambda kv: kv[1][2])]  # fmt: skip
    return out, round(sum(r["us_per_step"] for r in out), 2)


def gpu_meta() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
        "capability": f"sm_{props.major}{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }


def gpu_state() -> dict:
    """SM clock, power and temperature of GPU 0 now (``nvidia-smi``; {} where it is missing).
    The lent H200s run power-capped: sampled right after a timing, this says at what clock
    it ran (back-to-back runs of one kernel moved by up to 7%)."""
    import subprocess

    fields = ["clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "temperature.gpu"]
    try:
        out = subprocess.run(
            ["nvidia-smi", "-i", "0", f"--query-gpu={','.join(fields)}",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        vals = [v.strip() for v in out.splitlines()[0].split(",")]
    except (OSError, IndexError, subprocess.SubprocessError):
        return {}
    return {k: v for k, v in zip(fields, vals)} if len(vals) == len(fields) else {}


def measure_ceilings(copy_bytes: int = 4 << 30, gemm_n: int = 8192) -> dict:
    """Measured in this process: D2D copy bandwidth (read + write bytes) and bf16 GEMM rate."""
    src = torch.empty(copy_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = bench(lambda a, b: b.copy_(a), [(src, dst)], warmup=3, reps=20)
    copy_tbs = 2 * src.numel() / (t["median_us"] * 1e-6) / 1e12
    del src, dst
    a = torch.randn(gemm_n, gemm_n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(gemm_n, gemm_n, dtype=torch.bfloat16, device="cuda")
    t = bench(lambda x, y: x @ y, [(a, b)], warmup=3, reps=20)
    gemm_tflops = 2 * gemm_n**3 / (t["median_us"] * 1e-6) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return {"copy_TBps": round(copy_tbs, 3), "bf16_gemm_TFLOPs": round(gemm_tflops, 1)}


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def write_results(
    op: str,
    meta: dict,
    rows: list[dict],
    *,
    notes: Sequence[str] = (),
    out_dir: str | os.PathLike | None = None,
) -> tuple[Path, Path]:
    """Write ``<op>.json`` (everything) and ``<op>.md`` (meta, notes, a table per row section)."""
    out = Path(out_dir) if out_dir else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out / f"{op}.json", out / f"{op}.md"
    jpath.write_text(
        json.dumps({"op": op, "meta": meta, "notes": list(notes), "rows": rows}, indent=2)
    )
    lines = [f"# {op} benchmark", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += [""] + [f"- {n}" for n in notes]
    sections: dict[str, list[dict]] = {}
    for r in rows:  # one table per "section" (rows without one share a table)
        sections.setdefault(str(r.get("section", "")), []).append(r)
    for name, group in sections.items():
        cols: list[str] = []
        for r in group:
            cols += [c for c in r if c not in cols and c != "section"]
        lines += ["", f"## {name}" if name else "## results", ""]
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for r in group:
            lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    mpath.write_text("\n".join(lines) + "\n")
    return jpath, mpath
