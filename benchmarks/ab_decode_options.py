"""Same-process A/B of decode tuning options (run on the GPU machine).

    PYTHONPATH=src python benchmarks/ab_decode_options.py [--quick] [--out DIR]

- ``gqa_fused``: GQA decode (bf16 activations, (N, KV) = (32, 8), H = 128, S = 1), default
  (``FUSE_PROLOGUE`` on since session 23) vs the unfused prologue kernel + split kernel,
  interleaved (default, unfused, default, unfused), as one-call CUDA graphs and as
  chained graphs of 4 steps over distinct caches: bf16 cache at B in {1, 8, 32} x T in {4K,
  32K, 128K}, int8 cache at T = 128K.
- ``gqa_waves``: GQA bf16 decode (same geometry) at the shapes whose work is about one or two
  waves of split programs (B=1 T=4K/32K, B=8 T=4K, B=32 T=4K, B=8 T=32K): the default config
  and split count vs split-kernel configs whose shared memory holds 2-3 CTAs per SM and vs
  split counts that fill a whole number of waves, and vs the ``BALANCED`` grid (``BAL_CFGS``:
  one wave of resident CTAs taking equal runs of key tiles across pairs), with cuDNN SDPA
  (graph) in the same process.
- ``gqa_merge``: GQA bf16 decode (same geometry) with the shared merge's one-warp programs
  (``_triton_merge.MERGE_ONE_WARP_FROM``, the default 64) vs the 4-warp programs everywhere,
  interleaved twice, one-call graphs and chains, at ``MERGE_SHAPES`` (session 30, H100,
  ``gqa_merge_one_warp_ab_session30_h100.json``: within 0.3% either way).
- ``dsa_int8``: DSA with an int8 main cache at budget 8192 (the sparse benchmark's geometry,
  H = 256, (N, KV) = (24, 4), T = 128K), CUDA-graph replays: the default config vs each of
  ``bench_sparse._CACHE_VARIANTS`` (the previous uncapped build, other stage counts and
  tiles), then the default again (drift check).

Session 23 (H100, ab_decode_options_h100.json) decided the int8 default (168-register cap, the
split plan at one wave of 3 programs per SM) and removed the GQA decode ``FUSE_MERGE`` option
(0.97-1.00x of the merge kernel at every shape); ab_decode_options2_h100.json (then the fused
variant vs the default) made GQA's ``FUSE_PROLOGUE`` the default at H <= 128.
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
from _harness import copies_for_l2, gpu_meta, write_results  # noqa: E402

DSA_VARIANTS = tuple(sparse._CACHE_VARIANTS)


def gqa_variant_rows(section: str, variants: tuple[str, ...], quick: bool) -> list[dict]:
    """The default decode vs each of ``variants`` (``bench_gqa.DECODE_VARIANTS``), interleaved
    twice, as one-call graphs and chains, at bf16 B x T {1, 8, 32} x {4K, 32K, 128K} and int8
    T=128K (``quick``: B=1 only); ``default_<kind>_speedup_vs_<variant>`` = the variant's best
    time over the default's (> 1: the default is faster)."""
    rows = []
    shapes = [(torch.bfloat16, b, t) for b in ((1,) if quick else (1, 8, 32))
              for t in (4096, 32768, 131072)]  # fmt: skip
    shapes += [(torch.int8, b, 131072) for b in ((1,) if quick else (1, 8, 32))]
    for dt, b, t in shapes:
        sets, p = gqa._decode_sets(b, t, dt, gqa._decode_set_count(b, t, dt.itemsize))
        fns = {"default": gqa._decode_fn(p)}
        fns.update({v: gqa._decode_fn(p, gqa._variant_cfg(dt, v, b)) for v in variants})
        chain_sets = gqa._chain_sets(sets, b, t, dt)  # the same caches for every variant
        row = dict(section=section, cache=str(dt).removeprefix("torch."), B=b, T=t)
        for rep in (1, 2):
            for name, fn in fns.items():
                row[f"{name}{rep}_graph_us"] = gqa._graph_time_or_none(fn, sets)
                row[f"{name}{rep}_chain_us"] = gqa._chain_time_or_none(fn, chain_sets)
        for kind in ("graph", "chain"):
            base = [row[f"default{r}_{kind}_us"] for r in (1, 2)]
            for v in variants:
                other = [row[f"{v}{r}_{kind}_us"] for r in (1, 2)]
                if all(base) and all(other):
                    row[f"default_{kind}_speedup_vs_{v}"] = min(other) / min(base)
        print(row, flush=True)
        rows.append(row)
        del sets, chain_sets
        torch.cuda.empty_cache()
    return rows


# (name, BLOCK_N, num_stages) of the gqa_waves section (4 warps; bf16 H=128 K+V stages:
# 64 x 4 = 128 KB: 1 CTA per SM, 64 x 3 = 96 KB: 2, 32 x 4 / 64 x 2 = 64 KB: 3)
WAVE_CFGS = (("n64s4", 64, 4), ("n64s3", 64, 3), ("n32s4", 32, 4), ("n64s2", 64, 2))
# the BALANCED split grid (one wave of resident CTAs, equal tile runs across pairs)
BAL_CFGS = (("bal_n64s4", 64, 4), ("bal_n64s3", 64, 3), ("bal_n64s2", 64, 2))
WAVE_SHAPES = ((1, 4096), (1, 32768), (8, 4096), (32, 4096), (8, 32768))


def _wave_splits(b: int, t: int, resident: int, block_n: int, num_sms: int) -> list[int]:
    """Split counts whose programs fill 1 and 2 whole waves of ``resident`` CTAs per SM (each
    split >= 4 tiles), deduplicated."""
    pairs = b * gqa.KV
    out = []
    for waves in (1, 2):
        n = max(1, waves * num_sms * resident // pairs)
        n = min(n, max(1, t // (4 * block_n)))
        if n not in out:
            out.append(n)
    return out


def _best_ours_graph(row: dict) -> str | None:
    """The fastest of OUR ``*_graph_us`` columns (the peer's ``cudnn_graph_us`` excluded: with
    it, a row where cuDNN was fastest read best_graph_vs_cudnn = 1.0)."""
    ours = {k: v for k, v in row.items()
            if k.endswith("_graph_us") and not k.startswith("cudnn") and v}  # fmt: skip
    return min(ours, key=ours.get) if ours else None


def gqa_wave_rows(shapes=WAVE_SHAPES, cfg_names=None, cache="bf16") -> list[dict]:
    """``cache="int8"``: int8 caches (bf16 activations, fp16 Q rows), no cuDNN peer and no
    WAVE_CFGS split sweeps; ``split_plan`` is then the int8 split plan (an explicit
    ``decode_cfg``, which keeps the launcher from switching to the balanced grid)."""
    from longattn.gqa.triton import launch
    from longattn.gqa.triton.decode import four_split_band, pair_count_plan

    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cudnn = gqa._sdpa("cudnn")
    int8 = cache == "int8"
    for b, t in shapes:
        dt = torch.bfloat16
        cdt = torch.int8 if int8 else dt
        sets, p = gqa._decode_sets(b, t, cdt, gqa._decode_set_count(b, t, cdt.itemsize))
        chain_sets = gqa._chain_sets(sets, b, t, cdt)
        nbytes = 2 * b * gqa.KV * t * 128 * cdt.itemsize
        base = launch.decode_config(128, torch.float16 if int8 else dt, cdt, False, b * gqa.KV,
                                    sms)  # fmt: skip
        row = dict(section="gqa_waves", cache=cache, B=b, T=t, KV_MB=nbytes / 1e6)
        q_sets = [(torch.randn(b, gqa.N, 1, 128, device=gqa.DEV, dtype=dt), s[3], s[4], False)
                  for s in sets]  # fmt: skip
        row["cudnn_graph_us"] = None if int8 else gqa._graph_time_or_none(cudnn, q_sets)
        row["default_graph_us"] = gqa._graph_time_or_none(gqa._decode_fn(p), sets)
        row["default_chain_us"] = gqa._chain_time_or_none(gqa._decode_fn(p), chain_sets)
        for name, bn, st in WAVE_CFGS:
            if int8 or (cfg_names is not None and name not in cfg_names):
                continue
            cfg = dict(base, BLOCK_N=bn, num_stages=st)
            res = launch.resident_ctas(cfg, 128, 2)
            balance = pair_count_plan(128, dt, dt)  # the plan run_decode would choose
            dflt = launch.choose_num_splits(b, gqa.KV, t, bn, sms, res, balance=balance)
            for splits in [dflt] + [n for n in _wave_splits(b, t, res, bn, sms) if n != dflt]:
                key = f"{name}_sp{splits}"
                fn = gqa._decode_fn(p, cfg, splits)
                row[f"{key}_graph_us"] = gqa._graph_time_or_none(fn, sets)
                row[f"{key}_chain_us"] = gqa._chain_time_or_none(fn, chain_sets)
        if cfg_names is not None and "split_plan" in cfg_names:
            # the split plan without the balanced grid (what decode_config chose before it)
            band = four_split_band(b * gqa.KV, sms)
            plan = dict(base) if int8 else dict(base, num_stages=2 if band else 4)
            fn = gqa._decode_fn(p, dict(plan, BALANCED=False))
            row["split_plan_graph_us"] = gqa._graph_time_or_none(fn, sets)
            row["split_plan_chain_us"] = gqa._chain_time_or_none(fn, chain_sets)
        for name, bn, st in BAL_CFGS:
            if cfg_names is not None and name not in cfg_names:
                continue
            cfg = dict(base, BALANCED=True)
            if not int8:  # int8: its own tiles (BLOCK_N 128, 3 stages)
                cfg.update(BLOCK_N=bn, num_stages=st)
            fn = gqa._decode_fn(p, cfg)
            row[f"{name}_graph_us"] = gqa._graph_time_or_none(fn, sets)
            row[f"{name}_chain_us"] = gqa._chain_time_or_none(fn, chain_sets)
        row["default_again_graph_us"] = gqa._graph_time_or_none(gqa._decode_fn(p), sets)
        best = _best_ours_graph(row)
        row["best_graph"] = best
        if row["cudnn_graph_us"] and row["default_graph_us"] and best:
            row["best_graph_vs_cudnn"] = row["cudnn_graph_us"] / row[best]
            row["default_graph_vs_cudnn"] = row["cudnn_graph_us"] / row["default_graph_us"]
        print(row, flush=True)
        rows.append(row)
        del sets, chain_sets, q_sets
        torch.cuda.empty_cache()
    return rows


MERGE_SHAPES = ((1, 32768), (1, 131072), (8, 32768), (1, 4096), (17, 32768), (32, 4096))
# (name, MERGE_ONE_WARP_FROM; None: the module's default)
MERGE_OPTIONS = (("one_warp", None), ("four_warp", sparse.MERGE_NEVER))


def gqa_merge_rows(shapes=MERGE_SHAPES) -> list[dict]:
    """The default (``None``: the module's MERGE_ONE_WARP_FROM) vs the 4-warp merge (a
    threshold no slot count reaches), interleaved twice per shape."""
    from longattn import _triton_merge

    default = _triton_merge.MERGE_ONE_WARP_FROM
    rows = []
    for b, t in shapes:
        dt = torch.bfloat16
        sets, p = gqa._decode_sets(b, t, dt, gqa._decode_set_count(b, t, dt.itemsize))
        fn = gqa._decode_fn(p)
        chain_sets = gqa._chain_sets(sets, b, t, dt)
        row = dict(section="gqa_merge", B=b, T=t, one_warp_from=default)
        try:
            for rep in (1, 2):
                for name, value in MERGE_OPTIONS:
                    _triton_merge.MERGE_ONE_WARP_FROM = default if value is None else value
                    row[f"{name}{rep}_graph_us"] = gqa._graph_time_or_none(fn, sets)
                    row[f"{name}{rep}_chain_us"] = gqa._chain_time_or_none(fn, chain_sets)
        finally:
            _triton_merge.MERGE_ONE_WARP_FROM = default
        print(row, flush=True)
        rows.append(row)
        del sets, chain_sets
        torch.cuda.empty_cache()
    return rows


def dsa_int8_rows(quick: bool) -> list[dict]:
    rows = []
    t, budget = 131072, 8192
    for b in (1,) if quick else (1, 4):
        layer = sparse.Layer(b, t + 64, torch.int8)
        for s in (1,) if quick else (1, 8):
            n_sets = copies_for_l2(sparse._set_bytes(layer, s, budget), min_sets=4, max_sets=32)
            seqlens, sets = sparse._inputs(layer, s, t, n_sets, budget)
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
    ap.add_argument("--sections", default="gqa_fused,dsa_int8", help="also: gqa_waves, gqa_merge")
    ap.add_argument("--wave-shapes", default=None, help="gqa_waves: BxT list, e.g. 32x4096")
    ap.add_argument("--wave-cfgs", default=None, help="gqa_waves: WAVE_CFGS names to run")
    ap.add_argument(
        "--wave-cache",
        default="bf16",
        choices=["bf16", "int8"],
        help="gqa_waves: cache dtype (int8: bal_* = the balanced grid, one wave)",
    )
    args = ap.parse_args(argv)
    meta = gpu_meta()
    print(meta, flush=True)
    sections = args.sections.split(",")
    rows = []
    if "gqa_waves" in sections:
        shapes = WAVE_SHAPES
        if args.wave_shapes:
            shapes = [tuple(int(x) for x in bt.split("x")) for bt in args.wave_shapes.split(",")]
        names = args.wave_cfgs.split(",") if args.wave_cfgs else None
        rows += gqa_wave_rows(shapes, names, args.wave_cache)
    if "gqa_fused" in sections:
        rows += gqa_variant_rows("gqa_fused", ("unfused",), args.quick)
    if "gqa_merge" in sections:
        rows += gqa_merge_rows(MERGE_SHAPES[:1] if args.quick else MERGE_SHAPES)
    if "dsa_int8" in sections:
        rows += dsa_int8_rows(args.quick)
    notes = ["Same-process CUDA-graph replays (median over rotated input sets); see the module "
             "docstring for shapes. Command: PYTHONPATH=src python benchmarks/"
             "ab_decode_options.py"]  # fmt: skip
    write_results("ab_decode_options", meta, rows, notes=notes, out_dir=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
