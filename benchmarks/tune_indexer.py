"""Tuning sweep of the Triton SparseAttentionIndexer kernels (H200): score-kernel tiles and the
select kernel's warps, radix bits and emission tile, timed as one CUDA graph of back-to-back
calls over distinct layers (each layer its own block keys and queries, so every call reads its
keys from DRAM).

    PYTHONPATH=src python benchmarks/tune_indexer.py --out $OUT
    PYTHONPATH=src python benchmarks/tune_indexer.py --configs 1x1 --T 131072,262144 \
        --kernels select_phases --out $OUT   # cycles per phase of the select kernel
    PYTHONPATH=src python benchmarks/tune_indexer.py --configs 1x1,4x1,1x8,4x8 \
        --T 131072,262144 --kernels score_tiles --out $OUT   # the score launch's tile maxima

Geometry of ``bench_sparse.py``: NI = 16 index heads of DI = 128, fp32 block keys, bf16 index
query, r = 64, budget 2048 (32 blocks; ``--budgets`` for others). Writes ``tune_indexer.json``
under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _harness import gpu_meta, graph_bench_chain  # noqa: E402
from longattn.sparse.triton import indexer as ix  # noqa: E402
from longattn.sparse.triton import select as sl  # noqa: E402

NI, DI, R, BUDGET = 16, 128, 64, 2048
LAYERS = 16


def _layers(b, s, t):
    """Per layer: index query and block keys. The keys are a view of a cache of ``t // R + 1``
    blocks (IndexBlockKeyCache's size) cut to the ``t // R`` blocks the API scores when given
    ``total_sequence_length = t``."""
    nb = t // R + 1
    seqlens = torch.full((b,), t - 1, dtype=torch.int32, device="cuda")
    return seqlens, [
        (torch.randn(b, s, NI * DI, device="cuda", dtype=torch.bfloat16),
         torch.randn(b, nb, DI, device="cuda")[:, : t // R])
        for _ in range(LAYERS)
    ]  # fmt: skip


def _scored_layers(b, s, t):
    """``(seqlens, layers, num_blocks, scores)``: ``_layers`` and every layer's default scores,
    each ``(scores, tile maxima)`` (the score launch's ``tile_max``, which the select's rank
    method may take as its floor)."""
    seqlens, layers = _layers(b, s, t)
    scored = [_scores_and_tiles(q, k, seqlens, 1) for q, k in layers]
    return seqlens, layers, layers[0][1].shape[1], scored


def _scores_and_tiles(q, k, seqlens, tile_max):
    """One default score launch (``indexer_scores_and_tiles``): ``(scores, tile maxima)``."""
    return ix.indexer_scores_and_tiles(q, k, seqlens, num_index_heads=NI, compress_ratio=R,
                                       scale=DI**-0.5, is_first_prompt=False,
                                       tile_max=tile_max)  # fmt: skip


def _scores(q, k, seqlens, cfg):
    return ix.indexer_scores(q, k, seqlens, num_index_heads=NI, compress_ratio=R,
                             scale=DI**-0.5, is_first_prompt=False, cfg=cfg)  # fmt: skip


def _select(scored, seqlens, s, nb, cfg=None, budget=BUDGET, **kw):
    """The select launch over ``scored = (scores, tile maxima)``; the tile maxima go in when
    the launch would ask the score kernel for them (``select.wants_tile_max``)."""
    sc, tmax = scored
    if not sl.wants_tile_max(nb, budget, R, cfg, rows=seqlens.shape[0] * s):
        tmax = None
    return sl.indexer_select(sc, seqlens, seq_len=s, num_blocks=nb, compress_ratio=R,
                             token_budget=budget, is_first_prompt=False, cfg=cfg, tile_max=tmax,
                             **kw)  # fmt: skip


SELECT_GRID = dict(warps=(8,), bits=(2, 3), block_o=(1024, 4096), emit_2d=(False, True))


def sweep(b, s, t, rows, kernels=("score", "select"), budget=BUDGET, select_grid=None):
    seqlens, layers, nb, base = _scored_layers(b, s, t)
    # S_TILE: rows per program (None: min(16, S), one program per 16 rows; S > 1 also sweeps
    # fewer rows per program, i.e. S / S_TILE times the programs)
    tiles = (None,) if s == 1 else (None, 1, 2, 4)
    grid = itertools.product((16, 32, 64), (16, 32), (32, 128), (2, 4), tiles)
    if "score" not in kernels:
        grid = ()
    # tiles of the default's dot precision (split3 for the bf16 query; a cfg without DOT_PREC
    # would run the fp32 FMA dots)
    prec = ix.score_config(b, s, NI, nb, 132, False)["DOT_PREC"]
    for bb, br, bd, nw, st in grid:
        cfg = dict(BLOCK_B=bb, BLOCK_R=br, BLOCK_D=bd, num_warps=nw, DOT_PREC=prec)
        if st is not None:
            cfg["S_TILE"] = st
        try:
            got = _scores(*layers[0], seqlens, cfg)
            err = float(((got - base[0][0]).abs() / base[0][0].abs().clamp_min(1e-3))
                        .nan_to_num(0.0).max())  # fmt: skip
            us = graph_bench_chain([lambda q=q, k=k, cfg=cfg: _scores(q, k, seqlens, cfg)
                                    for q, k in layers], min_time_s=0.05)["median_us"]  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a config that does not compile
            print(f"score {cfg}: {type(exc).__name__}", flush=True)
            continue
        row = dict(kernel="score", B=b, S=s, T=t, **cfg, us=round(us, 2), rel_err=err)
        row.setdefault("S_TILE", min(s, ix.BLOCK_S))
        rows.append(row)
        print(row, flush=True)
    if "select" not in kernels:
        return
    sel = functools.partial(_select, budget=budget)
    ref = [sel(sc, seqlens, s, nb) for sc in base]
    # warps (1-2 warps: reductions without CTA barriers, 1.5-2.6x slower in session 10; 4 and
    # 16 lost to 8 at every shape in session 18, tune_select_h200.json, as did 4 radix bits),
    # bits per radix step (fewer CTA reductions, more compares each), emission tile; int32
    # count words (two fields) measured the same as int64 (four) and were dropped
    # EMIT_2D: the chosen blocks' positions as one [KB_PAD, r] tile (not yet a default)
    sg = dict(SELECT_GRID, **(select_grid or {}))
    grid = itertools.product(sg["warps"], sg["bits"], sg["block_o"], sg["emit_2d"])
    for nw, bits, bo, emit in grid:
        cfg = dict(num_warps=nw, RADIX_BITS=bits, BLOCK_O=bo, EMIT_2D=emit)
        got = sel(base[0], seqlens, s, nb, cfg)
        same = all(torch.equal(a, b2) for a, b2 in zip(got, ref[0]))
        us = graph_bench_chain([lambda sc=sc, cfg=cfg: sel(sc, seqlens, s, nb, cfg) for sc in base],
                               min_time_s=0.05)["median_us"]  # fmt: skip
        row = dict(kernel="select", B=b, S=s, T=t, budget=budget, **cfg, us=round(us, 2),
                   same=same)  # fmt: skip
        rows.append(row)
        print(row, flush=True)


def score_tiles(b, s, t, rows, budget=BUDGET, rounds=2):
    """The default score launch with and without the tile maxima the select's rank floor takes
    (``tile_max = select.wants_tile_max(...)`` vs 0; asked for at every row count, also
    above ``select.TILE_MAX_ROWS``), interleaved ``rounds`` times; the scores must be equal.
    A row with ``tile_max`` 0 (the select takes no maxima) is skipped."""
    seqlens, layers = _layers(b, s, t)
    nb = layers[0][1].shape[1]
    want = sl.wants_tile_max(nb, budget, R)
    plain = _scores_and_tiles(*layers[0], seqlens, 0)
    tiled = _scores_and_tiles(*layers[0], seqlens, want)
    if tiled[1] is None:
        print(f"score_tiles B={b} S={s} T={t}: no tile maxima (tile_max {want})", flush=True)
        return
    same = torch.equal(plain[0].nan_to_num(-1.0), tiled[0].nan_to_num(-1.0))
    row = dict(kernel="score_tiles", B=b, S=s, T=t, budget=budget, tile_max=want,
               n_tiles=tiled[1].shape[1], same_scores=same, plain_us=[], tiles_us=[])  # fmt: skip
    for _ in range(rounds):
        for key, tm in (("plain_us", 0), ("tiles_us", want)):
            fns = [functools.partial(_scores_and_tiles, q, k, seqlens, tm) for q, k in layers]
            us = graph_bench_chain(fns, min_time_s=0.05)["median_us"]
            row[key].append(round(us, 2))
    rows.append(row)
    print(row, flush=True)


PHASES = ("load_bounds", "radix", "chosen_scatter", "emit")  # between select.CLOCK_MARKS


def select_phases(b, s, t, rows, budget=BUDGET, reps=20, cfg=None):
    """Where the select kernel's time goes: its profiling build (``clocks``: the SM clock at
    ``select.CLOCK_MARKS``) over every layer's scores, ``reps`` eager calls each; the median
    cycles of each phase and of the whole row (start to the last store's issue), beside the
    default build's time in a chained graph. Phases: ``load_bounds`` (seqlens + score loads,
    order keys, radix bounds), ``radix`` (the radix steps), ``chosen_scatter`` (chosen flags,
    tie handling, cumsum, scatter to scratch + CTA barrier), ``emit`` (ids reload + emission);
    under ``RANK_SELECT`` (4096+ blocks by default) ``load_bounds`` includes the rank floor,
    ``radix`` is the candidate count, ``chosen_scatter`` the compaction + rank + ids;
    rows of <= ``select.TOPK_MAX_BLOCKS`` blocks (``tl.topk``) report the total only. ``cfg``:
    select tunables (``select.select_config``) of both builds; None: the defaults."""
    seqlens, layers, nb, base = _scored_layers(b, s, t)
    marks = torch.zeros(b * s, sl.CLOCK_MARKS, dtype=torch.int64, device="cuda")
    samples = []
    for _ in range(reps):
        for sc in base:
            _select(sc, seqlens, s, nb, cfg, budget=budget, clocks=marks)
            samples.append(marks.clone())
    m = torch.stack(samples).double()  # [calls, rows, marks]
    d = m.diff(dim=2)  # [calls, rows, marks - 1]
    row = dict(kernel="select_phases", B=b, S=s, T=t, budget=budget, cfg=cfg,
               total_cycles=float((m[..., -1] - m[..., 0]).median()))  # fmt: skip
    if nb > sl.TOPK_MAX_BLOCKS:
        row.update({f"{n}_cycles": float(d[..., i].median()) for i, n in enumerate(PHASES)})
    us = graph_bench_chain([lambda sc=sc: _select(sc, seqlens, s, nb, cfg, budget=budget)
                            for sc in base], min_time_s=0.05)["median_us"]  # fmt: skip
    row["default_chain_us"] = round(us, 2)  # the cfg's build without CLOCKS, chained
    row["same"] = all(  # the cfg's selections equal the defaults' on every layer
        torch.equal(a, b2)
        for sc in base
        for a, b2 in zip(
            _select(sc, seqlens, s, nb, cfg, budget=budget),
            _select(sc, seqlens, s, nb, None, budget=budget),
        )
    )
    try:  # the SM clock under load, for cycles -> us (needs pynvml)
        row["sm_clock_mhz"] = torch.cuda.clock_rate()
    except Exception:  # noqa: BLE001 - optional
        pass
    rows.append(row)
    print(row, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--configs", default="1x1,4x1,1x8,4x8")
    ap.add_argument("--T", default="131072", help="comma-separated lengths")
    ap.add_argument("--budgets", default=str(BUDGET), help="comma-separated (select sweep)")
    ap.add_argument(
        "--kernels", default="score,select", help="score, select, select_phases, score_tiles"
    )
    ap.add_argument("--select-warps", default=None, help="e.g. 4,8,16 (default 8)")
    ap.add_argument("--select-bits", default=None, help="e.g. 2 (default 2,3)")
    ap.add_argument(
        "--phases-cfgs",
        default="{}",
        help="select_phases: JSON list of select cfgs (or one dict), e.g. "
        "'[{}, {\"RADIX_BITS\": 3}]'",
    )
    ap.add_argument(
        "--select-defaults-only",
        action="store_true",
        help="select: BLOCK_O 1024 and EMIT_2D only (the defaults)",
    )
    args = ap.parse_args(argv)
    phases_cfgs = json.loads(args.phases_cfgs)  # parsed once, before any GPU work
    if not isinstance(phases_cfgs, list):
        phases_cfgs = [phases_cfgs]
    if not all(isinstance(c, dict) for c in phases_cfgs):
        raise ValueError(
            f"--phases-cfgs must be a JSON object or a list of them, got {args.phases_cfgs!r}"
        )
    rows = []
    runs = itertools.product(args.configs.split(","), args.T.split(","), args.budgets.split(","))
    for c, t, budget in runs:
        b, s = (int(x) for x in c.split("x"))
        sg = {}
        if args.select_warps:
            sg["warps"] = tuple(int(x) for x in args.select_warps.split(","))
        if args.select_bits:
            sg["bits"] = tuple(int(x) for x in args.select_bits.split(","))
        if args.select_defaults_only:
            sg.update(block_o=(1024,), emit_2d=(True,))
        kernels = args.kernels.split(",")
        if {"score", "select"} & set(kernels):
            sweep(b, s, int(t), rows, kernels, int(budget), sg)
        if "score_tiles" in kernels:
            score_tiles(b, s, int(t), rows, int(budget))
        if "select_phases" in kernels:
            for cfg in phases_cfgs:
                select_phases(b, s, int(t), rows, int(budget), cfg=cfg or None)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tune_indexer.json").write_text(
            json.dumps(dict(meta=gpu_meta(), rows=rows), indent=1)
        )
    best = {}
    for r in rows:
        if "us" not in r:  # select_phases rows
            continue
        key = (r["kernel"], r["B"], r["S"], r["T"], r.get("budget"))
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    for r in best.values():
        print("BEST", r)


if __name__ == "__main__":
    main()
