"""Prefill kernel alone, same process: the Triton kernel (per-thread copies: base; TMA K/V: tma)
and the Gluon warp-specialized kernel (gluon*) variants (GPU machine).

    PYTHONPATH=src python benchmarks/prefill_tma_ab.py --out $OUT

Causal bf16 first prompt, (N, KV) = (32, 8), B*S = 16K, H in {128, 256}, S in {2K, 8K, 32K}.
Variants are timed in ``--rounds`` interleaved rounds (order rotated per round; the row keeps
the median, every round's time and the spread): back-to-back runs of one config varied by up to
7% on the H200 (power-capped clocks drift with load). Each variant's output is compared with
the base output (``maxdiff_vs_base``: 0 where the two
kernels compute the same sums in the same order; a BLOCK_N change moves bf16 rounding). Writes
``prefill_tma_ab.json`` (kept runs: ``benchmarks/results/prefill_{tma,gluon_ab*}_h200.json``).

``--ref-src FILE`` times each chosen Gluon variant a second time (``<name>@ref``) with the
kernel built from another version of ``prefill_gluon.py``, in the same process and rounds
(flags that version lacks are left out of its build, and named in the log):

    git show HEAD~1:src/longattn/gqa/triton/prefill_gluon.py > /tmp/ref.py
    PYTHONPATH=src python benchmarks/prefill_tma_ab.py --ref-src /tmp/ref.py --variants gluon
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import bench_gqa as bg  # noqa: E402
from _harness import bench, gpu_meta, gpu_state  # noqa: E402
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
    out += [
        ("gluon_epi_4byte", _gl(EPILOGUE_SMEM=False)),  # 4-byte stores from the accumulator
        # K slots refilled after QK^T (separate K / V rings); with 2 Q slots at H=256 the V
        # ring keeps one slot (Q 128 KiB + K 64 + V 32 fits 227 KiB)
        # (the builds named after a session pin PINGPONG off, the H=128 default since session 41;
        # their *_pp twins turn it on)
        ("gluon_ekr", _gl(EARLY_K_RELEASE=True, OVERLAP=False, PINGPONG=False)),
        ("gluon_ekr_k3v2", _gl(EARLY_K_RELEASE=True, STAGES=3, V_STAGES=2)),  # H=256: 1 Q slot
        ("gluon_ekr_q2k2v1", _gl(EARLY_K_RELEASE=True, Q_SLOTS=2, STAGES=2, V_STAGES=1)),
        ("gluon_q2k2v1", _gl(Q_SLOTS=2, STAGES=2, V_STAGES=1)),
        # H=256: the ring shape past GLUON_SHORT_TOTAL keys (the default of shorter sequences
        # is the short-item shape, session 38)
        ("gluon_long", _gl(V_STAGES=2, EARLY_K_RELEASE=False, EPILOGUE_TMA=False)),
        # output tiles leave the freed Q tile by one TMA store each
        ("gluon_tma_epi", _gl(EPILOGUE_TMA=True)),
        (
            "gluon_ekr_q2k2v1_tma",
            _gl(EARLY_K_RELEASE=True, Q_SLOTS=2, STAGES=2, V_STAGES=1, EPILOGUE_TMA=True),
        ),
        # FA3's intra-warpgroup overlap: tile j's softmax while tile j-1's P.V runs (session
        # 39; sm_90 SASS: no spills in the H=128 tile loop, 23-26 local loads at H=256)
        ("gluon_overlap", _gl(OVERLAP=True, EARLY_K_RELEASE=False, PINGPONG=False)),
        # H=128 before session 39
        ("gluon_plain", _gl(OVERLAP=False, EARLY_K_RELEASE=False, PINGPONG=False)),
        (
            "gluon_overlap_ekr",
            _gl(OVERLAP=True, EARLY_K_RELEASE=True, CROSS_ITEM=False, PINGPONG=False),
        ),  # session 39's H=128 build past 4096 keys
        # ... carried across items: the next item's first softmax during this item's last P.V
        # (session 40; the H=128 default past 4096 keys)
        (
            "gluon_cross",
            _gl(OVERLAP=True, EARLY_K_RELEASE=True, CROSS_ITEM=True, PINGPONG=False),
        ),
        # FA3's inter-warpgroup ping-pong on the overlapped loops: the two consumers take turns
        # to issue their wgmma groups (session 41); the plain loop's turn is tile j's P.V and
        # tile j + 1's QK^T
        ("gluon_pp", _gl(PINGPONG=True)),  # the default build of each shape, with ping-pong
        ("gluon_nopp", _gl(PINGPONG=False)),  # ... and without (session 40's H=128 default)
        ("gluon_ekr_pp", _gl(EARLY_K_RELEASE=True, OVERLAP=False, PINGPONG=True)),
        # H=256: the long-item ring shape (2 V slots, so a consumer's turn never waits for the
        # V slot the other consumer still reads) with ping-pong
        (
            "gluon_long_pp",
            _gl(V_STAGES=2, EARLY_K_RELEASE=False, EPILOGUE_TMA=False, PINGPONG=True),
        ),  # fmt: skip
        # ... or 2 Q pairs, 1 K slot released after QK^T and 2 V slots (224 KiB at H=256)
        ("gluon_k1v2", _gl(STAGES=1, V_STAGES=2, EARLY_K_RELEASE=True)),
        ("gluon_k1v2_pp", _gl(STAGES=1, V_STAGES=2, EARLY_K_RELEASE=True, PINGPONG=True)),
        # H=256 with cuDNN's 128-key tiles: one K slot (released after QK^T) and one V slot,
        # one Q pair (192 KiB); sm_90 SASS: 834 instructions per 128 keys (two 64-key tiles:
        # 1190) but ~70 local loads of hoisted wgmma descriptors per tile (never timed before)
        ("gluon_bn128", _gl(BLOCK_N=128, STAGES=1, V_STAGES=1, EARLY_K_RELEASE=True)),
        (
            "gluon_bn128_pp",
            _gl(BLOCK_N=128, STAGES=1, V_STAGES=1, EARLY_K_RELEASE=True, PINGPONG=True),
        ),  # fmt: skip
        # FA4's conditional rescale decided per warp (LAZY_RESCALE, the plain loop; session 42:
        # sm_90 SASS H=256 short items, the tile loop's 128 accumulator FMULs behind one
        # warp-uniform branch; 595 -> 609 instructions, 481 where the branch skips)
        # (the H=256 default since session 43; "gluon_nolazy" is each shape's default without it)
        ("gluon_lazy", _gl(LAZY_RESCALE=True)),
        ("gluon_nolazy", _gl(LAZY_RESCALE=False)),
        (
            "gluon_overlap_pp",
            _gl(OVERLAP=True, EARLY_K_RELEASE=True, CROSS_ITEM=False, PINGPONG=True),
        ),  # fmt: skip
        (
            "gluon_cross_pp",
            _gl(OVERLAP=True, EARLY_K_RELEASE=True, CROSS_ITEM=True, PINGPONG=True),
        ),  # fmt: skip
    ]
    return out


class _RefKernel:
    """``gqa_prefill_gluon_kernel`` of another ``prefill_gluon.py``, launched as the current
    launcher launches its own; constexpr flags that source lacks are left out (it builds
    without them: the session's new options), and named once."""

    def __init__(self, fn):
        self.fn, self.names, self.told = fn, set(fn.arg_names), set()

    def __getitem__(self, grid):
        def launch_ref(*args, **kwargs):
            lacks = {k for k in kwargs if k not in self.names} - self.told
            if lacks:
                print(
                    f"  @ref: the reference source lacks {sorted(lacks)}: built without", flush=True
                )
                self.told |= lacks
            return self.fn[grid](*args, **{k: v for k, v in kwargs.items() if k in self.names})

        return launch_ref


def _load_ref_kernel(path: str) -> _RefKernel:
    """The Gluon prefill kernel built from another version of ``prefill_gluon.py`` (its
    relative imports resolve in the installed package)."""
    spec = importlib.util.spec_from_file_location("longattn.gqa.triton._ref_prefill_gluon", path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "longattn.gqa.triton"
    spec.loader.exec_module(mod)
    return _RefKernel(mod.gqa_prefill_gluon_kernel)


def _fn(p, cfg):
    if cfg.get("_GLUON"):
        g_cfg = {k: v for k, v in cfg.items() if k not in ("_GLUON", "_KERNEL")}
        kernel = cfg.get("_KERNEL")
        if kernel is None:
            return lambda q_rot, pk, pv, sl, out: launch.run_prefill_gluon(
                q_rot, pk, pv, sl, p, out, g_cfg)  # fmt: skip
        from longattn.gqa.triton import prefill_gluon

        def run_ref(q_rot, pk, pv, sl, out):  # the launcher imports the kernel per call
            own = prefill_gluon.gqa_prefill_gluon_kernel
            prefill_gluon.gqa_prefill_gluon_kernel = kernel
            try:
                launch.run_prefill_gluon(q_rot, pk, pv, sl, p, out, g_cfg)
            finally:
                prefill_gluon.gqa_prefill_gluon_kernel = own

        return run_ref
    return bg._prefill_attn_fn(p, cfg)


def _check(p, name, cfg, aset):
    """One NaN-poisoned call: (fn, fp32 output) or None when the variant cannot run."""
    q_rot, pk, pv, sl, out = aset
    out.fill_(float("nan"))
    fn = _fn(p, cfg)
    try:
        fn(q_rot, pk, pv, sl, out)
        torch.cuda.synchronize()
    except Exception as exc:  # e.g. shared memory
        print(f"  {name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        return None
    return fn, out.float().clone()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved rounds: every variant once per round, the order rotated "
                         "each round (clock / power drift lands on all variants alike)")  # fmt: skip
    ap.add_argument("--variants", default="",
                    help="comma-separated variant names to run (default: all; the first one "
                         "given is the maxdiff reference)")  # fmt: skip
    ap.add_argument("--heads", default="128,256")
    ap.add_argument("--seqs", default="2048,8192,32768")
    ap.add_argument("--ref-src", default="",
                    help="another prefill_gluon.py: each chosen Gluon variant is also timed "
                         "with its kernel, as <name>@ref")  # fmt: skip
    args = ap.parse_args(argv)
    keep = [v for v in args.variants.split(",") if v]
    ref_kernel = _load_ref_kernel(args.ref_src) if args.ref_src else None
    rows = []
    for h in (int(x) for x in args.heads.split(",")):
        for s in (int(x) for x in args.seqs.split(",")):
            b = max(1, 16384 // s)
            sets, p = bg._prefill_sets(b, s, h, 2 if s < 32768 else 1)
            asets = bg._attn_sets_from(sets, p, h)
            flops = 4 * b * bg.N * h * s * s / 2
            runs, ref = [], None
            chosen = [v for v in variants(h) if not keep or v[0] in keep]
            chosen.sort(key=lambda v: keep.index(v[0]) if keep else 0)
            if ref_kernel is not None:
                chosen += [(f"{name}@ref", dict(cfg, _KERNEL=ref_kernel))
                           for name, cfg in chosen if cfg.get("_GLUON")]  # fmt: skip
            for name, cfg in chosen:
                got = _check(p, name, cfg, asets[0])
                if got is None:
                    continue
                fn, o = got
                ref = o if ref is None else ref
                runs.append((name, cfg, fn, (o - ref).abs().max().item(), bool(o.isnan().any())))
            times = {name: [] for name, *_ in runs}
            heavy = s >= 32768
            for r in range(args.rounds):
                for name, _, fn, _, _ in runs[r % len(runs) :] + runs[: r % len(runs)]:
                    res = bench(fn, asets, warmup=2, reps=4 if heavy else None, min_time_s=0.1)
                    times[name].append(res["median_us"])
            state = gpu_state()  # right after the timings: the clock they ran at
            for name, cfg, _, maxdiff, nan in runs:
                us = statistics.median(times[name])
                cfg = {k: v for k, v in cfg.items() if k != "_KERNEL"}
                row = dict(H=h, S=s, B=b, variant=name, cfg=str(cfg), us=us,
                           TFLOPs=flops / (us * 1e-6) / 1e12, round_us=times[name],
                           spread=(max(times[name]) - min(times[name])) / us,
                           maxdiff_vs_base=maxdiff, nan=nan, gpu_state=state)  # fmt: skip
                print(f"  {row}", flush=True)
                rows.append(row)
            del sets, asets
            torch.cuda.empty_cache()
    path = Path(args.out) / "prefill_tma_ab.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu_meta(), rounds=args.rounds,
                timing="per variant: median over rounds of each round's median (bench, "
                       "min_time_s 0.1; S=32K: 4 reps); spread = (max - min) / median")  # fmt: skip
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(path)


if __name__ == "__main__":
    main()
