"""Hopper machine code of our kernels, compiled on the CPU (benchmarks/sass.py: ptxas/nvdisasm
from the triton wheel). Guards code-generation properties that timings on the GPU rely on.
Runs the tool in a subprocess: the test session's kernels are interpreter objects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sass(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sass.py"), *args, "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if res.returncode != 0 and "nvidia" in res.stderr.lower() and "backend" in res.stderr.lower():
        pytest.skip(f"no NVIDIA backend in this triton: {res.stderr[-300:]}")
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_rms_tiled_tables_use_wide_loads_and_no_barriers():
    """H=256 default (tiled weight/cos/sin rows): every global load/store 16 bytes, no
    shared-memory shuffle; the 1-D variant needs barriers (the test can tell them apart)."""
    heads = "HEAD=256,HALF_PAD=128,NUM_HEADS=16,ROT_DIM=256,BLOCK_N=8"
    tiled = _sass("rms", "--set", heads + ",TILE_TABLES=True")["memory"]
    assert set(tiled) == {"LDG.E.128", "STG.E.128"}, tiled
    flat = _sass("rms", "--set", heads + ",TILE_TABLES=False")["memory"]
    assert any(op.startswith("BAR") for op in flat), flat


def test_prefill_main_loop_one_fma_per_logit():
    """The unmasked prefill loop (BLOCK 128x128, 8 warps: 64 logits per thread) scales and
    subtracts the max in one FFMA per logit, with one exp2 (MUFU) each and no extra FMUL/FADD
    pass over the logits (the acc update rides on the wgmma)."""
    loops = _sass("gqa-prefill")["loops"]
    unmasked = min(loops, key=lambda c: c.get("ISETP", 0))
    assert unmasked.get("HGMMA", 0) > 0
    assert 64 <= unmasked["FFMA"] <= 70 and 64 <= unmasked["MUFU"] <= 70, unmasked
    assert unmasked["FMUL"] <= 70 and unmasked["FADD"] <= 70, unmasked


def test_prefill_tma_main_loop():
    """With USE_DESC (the sm_90+ default for 16-bit caches) the unmasked prefill loop reads K/V
    by TMA (UTMALDG, no per-thread cp.async) in fewer instructions than the cp.async loop
    (481 vs 561 at H=128, BLOCK 128x128, 8 warps, 3 stages)."""

    def unmasked(loops):  # the tile loop with the fewest compares (mbarrier spins excluded)
        return min((c for c in loops if c.get("HGMMA", 0)), key=lambda c: c.get("ISETP", 0))

    tma = unmasked(_sass("gqa-prefill", "--set", "USE_DESC=True")["loops"])
    ptr = unmasked(_sass("gqa-prefill")["loops"])
    assert tma.get("HGMMA", 0) > 0 and tma.get("UTMALDG", 0) >= 2, tma
    assert tma.get("LDGSTS", 0) == 0 and ptr.get("LDGSTS", 0) > 0, (tma, ptr)
    assert sum(tma.values()) <= 500 < sum(ptr.values()), (sum(tma.values()), sum(ptr.values()))


def test_int8_decode_loop_instruction_budget():
    """The int8 decode loop is instruction-issue bound (benchmarks/results/gqa.md): its unmasked
    BLOCK_N=128 tile stays within 1100 instructions (1023 with fp16 K via the packed 4-byte
    conversion and power-of-two Q rows; 1081 with bf16 K; 1518 before the fp16 V conversion,
    the unmasked interior tiles and int32 in-tile offsets) and does no masking."""
    loops = _sass("gqa-decode", "--cache", "i8", "--set", "BLOCK_N=128", "--stages", "3")["loops"]
    unmasked = min(loops, key=lambda c: c.get("ISETP", 0) + c.get("FSEL", 0))
    assert unmasked.get("HMMA", 0) > 0, unmasked
    # the masked loop has ~70 ISETP and ~34 FSEL per tile; loop control and m_safe need a few
    assert unmasked.get("FSEL", 0) <= 4 and unmasked.get("ISETP", 0) <= 4, unmasked
    assert sum(unmasked.values()) <= 1100, sum(unmasked.values())
    # K: 1 xor + 2 permutes + 2 fp16 subtracts per 4 bytes (bf16 K took 4 ANDs more)
    assert unmasked["LOP3"] <= 130, unmasked
    # the Q rows' power-of-two factors ride in the softmax FMA: no extra multiply per logit
    assert unmasked["FMUL"] <= 24, unmasked


def test_int8_prefill_row_scale_costs_no_multiply_per_logit():
    """int8 K prefill: the per-row power-of-two Q factor is folded into the softmax's scale
    (one FMA per logit, as the bf16 loop), not a separate multiply of every logit."""
    loops = _sass("gqa-prefill", "--cache", "i8")["loops"]
    unmasked = min(loops, key=lambda c: c.get("ISETP", 0) + c.get("FSEL", 0))
    assert unmasked.get("HGMMA", 0) > 0, unmasked
    assert unmasked["FMUL"] <= 70 and 64 <= unmasked["FFMA"] <= 70, unmasked


@pytest.mark.parametrize(
    "shape",
    [
        "HEAD=128,BLOCK_N=128",
        "HEAD=256,BLOCK_N=64,Q_SLOTS=1",
        "HEAD=128,BLOCK_N=128,DYNAMIC=False",
        "HEAD=128,BLOCK_N=128,EPILOGUE_SMEM=False",
    ],
)
def test_prefill_gluon_compiles_warp_specialized(shape):
    """The Gluon prefill (no interpreter exists for it) compiles for sm_90 as designed: 168
    registers at launch with setmaxnreg partitions, no spills, K/V/Q by TMA only (no per-thread
    global loads but the producer's seqlens scalar), and, with DYNAMIC, relaxed ticket atomics
    (no memory fence around them)."""
    res = _sass("gqa-prefill-gluon", "--set", shape)
    hist = res["hist"]
    # H=256: a consumer keeps item-invariant values on the stack (STL once per CTA, LDL
    # per item; 40 bytes with the shared-memory epilogue, the default); nothing local in the
    # tile loops (loops with wgmma but no output store)
    wide = "EPILOGUE_SMEM=False" not in shape  # output rows through shared memory
    stack_cap = 40 if "HEAD=256" in shape and wide else 32
    assert res["regs"] == 168 and res["stack"] <= stack_cap, res
    tile_loops = [c for c in res["loops"] if c.get("HGMMA", 0) and not c.get("STG", 0)]
    assert tile_loops and not any(c.get("LDL", 0) + c.get("STL", 0) for c in tile_loops), res
    assert hist.get("USETMAXREG", 0) >= 2 and hist.get("UTMALDG", 0) >= 4, hist
    assert hist.get("HGMMA", 0) > 0 and "LDGSTS" not in hist, hist
    assert res["memory"].get("LDG.E", 0) <= 1, res["memory"]
    atomics = sum(c for op, c in hist.items() if op.startswith("ATOMG"))
    assert atomics == (0 if "DYNAMIC=False" in shape else 2), hist  # first claim + loop claim
    assert not any(op.startswith("MEMBAR") for op in hist), hist
    # wgmma instructions with a register A operand: each consumer's P.V (BLOCK_N / 16 k-steps)
    bn = 64 if "HEAD=256" in shape else 128
    assert res["hgmma_rs"] == 2 * bn // 16, (res["hgmma_rs"], bn)
    # output rows: 16-byte stores through shared memory (the default), else 4-byte ones from
    # the accumulator
    assert ("STG.E.128" in res["memory"]) == wide and ("STG.E" in res["memory"]) != wide, res


def test_prefill_gluon_short_item_shape_compiles():
    """The H=256 short-item build (``launch.prefill_gluon_config``: 2 Q pairs, 2 K slots released
    after QK^T, 1 V slot, TMA output stores) fits shared memory, stores its output tiles by TMA
    (one bulk store per consumer, no per-thread output stores) and keeps the tile loops nearly
    free of local memory (the dynamic Q slot costs a few scalar spills: at most 8 per tile)."""
    res = _sass("gqa-prefill-gluon", "--set", "HEAD=256,BLOCK_N=64,Q_SLOTS=2,V_STAGES=1,"
                "EARLY_K_RELEASE=True,EPILOGUE_TMA=True")  # fmt: skip
    hist, memory = res["hist"], res["memory"]
    assert res["regs"] == 168 and res["shared"] <= 232448, res
    assert hist.get("UTMASTG", 0) == 2 and not any(op.startswith("STG") for op in memory), res
    tile_loops = sorted((c for c in res["loops"] if c.get("HGMMA", 0)), key=lambda c: sum(
        v for v in c.values() if isinstance(v, int)))[:2]  # fmt: skip
    assert all(c["HGMMA"] == 20 for c in tile_loops), tile_loops  # QK^T 16 + P.V 4 per tile
    assert all(c.get("LDL", 0) + c.get("STL", 0) <= 8 for c in tile_loops), tile_loops


def _tile_loop(res: dict, hgmma: int = 16, exp2: int = 64) -> dict:
    """The smallest loop of a Gluon prefill build holding one tile's two wgmma groups (H=128:
    QK^T 8 + P.V 8 HGMMA; ``hgmma`` 12 at H=64: 4 + 8, 20 at H=256: 16 + 4) and its softmax
    (``exp2`` per thread: 64 at BLOCK_N 128, 32 at BLOCK_N 64); loops that close over more code
    (the item loop, a wait loop's branch back) hold more of either."""
    tiles = [c for c in res["loops"]
             if c.get("HGMMA") == hgmma and exp2 <= c.get("MUFU", 0) < 2 * exp2]  # fmt: skip
    assert tiles, res["loops"]
    return min(tiles, key=lambda c: sum(c.values()))


@pytest.mark.parametrize("shape", ["HEAD=256,BLOCK_N=64,Q_SLOTS=2,V_STAGES=1,"
                                   "EARLY_K_RELEASE=True,EPILOGUE_TMA=True",
                                   "HEAD=256,BLOCK_N=64,Q_SLOTS=1",
                                   "EARLY_K_RELEASE=True,PINGPONG=True"])  # fmt: skip
def test_prefill_gluon_lazy_rescale_branches_around_the_rescale(shape):
    """``LAZY_RESCALE`` (the plain loop; H=256's default shapes, short items and long ones
    (session 43: 605 -> 619 instructions), and H=128's plain ping-pong one): one warp vote per
    consumer and tile, and the accumulator's rescale (HEAD / 2 FMUL per thread) behind one more
    branch, with no copies left where the branch skips it and no local memory in the tile
    loop; the build without it has no vote."""
    base = _sass("gqa-prefill-gluon", "--set", shape)
    lazy = _sass("gqa-prefill-gluon", "--set", shape + ",LAZY_RESCALE=True")
    hgmma, exp2 = (20, 32) if "HEAD=256" in shape else (16, 64)
    tile, base_tile = (_tile_loop(r, hgmma, exp2) for r in (lazy, base))
    assert "VOTE" not in base["hist"] and lazy["hist"].get("VOTE") == 2, lazy["hist"]
    assert tile.get("VOTE") == 1 and tile.get("BRA", 0) == base_tile.get("BRA", 0) + 1, tile
    assert tile["FMUL"] == base_tile["FMUL"] and tile.get("MOV", 0) == base_tile.get("MOV", 0)
    assert tile.get("LDL", 0) + tile.get("STL", 0) == 0, tile
    # the vote, its two compares and branch, the two selects of exact alphas (595 -> 609 at H=256)
    assert sum(tile.values()) <= sum(base_tile.values()) + 16, (tile, base_tile)


def test_prefill_gluon_overlap_waits_for_the_older_wgmma_group_first():
    """``OVERLAP`` (tile j's softmax while tile j-1's P.V runs; with early K release and
    ``CROSS_ITEM`` the H=128 default past ``GLUON_OVERLAP_MIN_TOTAL`` keys) issues both wgmma
    groups back to back (16 HGMMA per tile) and waits for the older one first
    (``WARPGROUP.DEPBAR.LE gsb0, 0x1``), where the plain loop waits for each group alone. The
    build without CROSS_ITEM (a bench / test variant only) spills since session 41's one-compare
    mask (24 local loads per tile, in the mask path); the default crossed build keeps its tile
    loop in registers (next test)."""
    over = _sass("gqa-prefill-gluon", "--set", "OVERLAP=True,EARLY_K_RELEASE=True")
    plain = _sass("gqa-prefill-gluon", "--set", "OVERLAP=False,EARLY_K_RELEASE=True")
    tile = _tile_loop(over)
    assert tile["HGMMA"] == 16 and over["regs"] == 168, (tile, over["regs"])
    assert over["hgmma_wait1"] > 0 == plain["hgmma_wait1"], (over, plain)


def test_prefill_gluon_cross_item_keeps_the_wgmmas_asynchronous():
    """``CROSS_ITEM`` (the overlapped loop carried across items, the next item's first softmax
    during this item's last P.V; with PINGPONG the H=128 default past 4096 keys). ptxas
    serializes every wgmma of the kernel (one wait per HGMMA: C7512 short of registers, C7513 a
    wgmma's register operand written while one is in flight) as the first versions did: the
    next QK^T live through the whole epilogue, issue and wait in different branches, P rounded
    to 16 bits during a P.V, the P.V's operands built after the QK^T's issue. The build keeps
    one wait per group (five per consumer, two consumers), the overlapped waits, little stack,
    and a tile loop without local memory and no longer than the overlapped build's (session
    41: 739 vs 747 instructions)."""
    over = _sass("gqa-prefill-gluon", "--set", "OVERLAP=True,EARLY_K_RELEASE=True")
    cross = _sass("gqa-prefill-gluon", "--set",
                  "OVERLAP=True,EARLY_K_RELEASE=True,CROSS_ITEM=True,PINGPONG=True")  # fmt: skip
    assert over["hgmma_waits"] <= 8, over
    assert cross["hist"]["HGMMA"] == 80 and cross["hgmma_waits"] <= 10, cross["hist"]
    assert cross["hgmma_wait1"] >= 4 and cross["stack"] <= 16, cross
    tile, over_tile = _tile_loop(cross), _tile_loop(over)
    assert tile.get("LDL", 0) + tile.get("STL", 0) == 0, tile
    assert sum(tile.values()) <= sum(over_tile.values()), (tile, over_tile)
    assert cross["regs"] == 168, cross["regs"]


@pytest.mark.parametrize("keys, waits", [(2048, 4), (8192, 10)])
def test_prefill_gluon_pingpong_turns_use_their_own_named_barriers(keys, waits):
    """PINGPONG (the H=128 default: FA3's inter-warpgroup schedule): a consumer waits for its turn
    with ``bar.sync 14 + WG, 256`` and passes it with ``bar.arrive 15 - WG, 256``; Triton's own
    barriers (the CTA's, and each consumer warpgroup's 128-thread one) must keep other ids, or a
    warpgroup barrier would complete on the other consumer's turn arrivals. The turns leave
    ptxas' wgmma pipelining alone (one wait per group: 2 per consumer in the plain build, 5 in
    the crossed one)."""
    from longattn.gqa.triton import launch

    cfg = launch.fit_prefill_gluon_smem(launch.prefill_gluon_config(128, keys), 128, 2)
    keys_set = ("EARLY_K_RELEASE", "OVERLAP", "CROSS_ITEM", "PINGPONG")
    res = _sass("gqa-prefill-gluon", "--set", ",".join(f"{k}={cfg[k]}" for k in keys_set))
    bars = res["barriers"]
    assert cfg["PINGPONG"] and res["hgmma_waits"] == waits, (cfg, res["hgmma_waits"])
    for op in ("SYNC", "ARV"):
        assert all(bars.get(f"{op} {i}/256", 0) > 0 for i in (14, 15)), bars
    others = [k for k in bars if not k.endswith("/256")]
    assert others and all(int(k.split()[1].split("/")[0]) < 14 for k in others), bars


@pytest.mark.parametrize(
    "sets, hgmma", [("HEAD=64", 12), ("HEAD=128", 16), ("HEAD=128,HAS_WINDOW=True", 16)]
)
def test_prefill_gluon_mask_takes_one_compare_and_one_select_per_logit(sets, hgmma):
    """The causal / window / shifted-tile mask of a tile (``prefill_gluon._logits``) is one
    unsigned compare of ``key - first`` with the row's span of visible keys and one select per
    logit (64 per thread at BLOCK_N 128); the two-sided form before session 41 took two of
    each (tile loop 804 -> 713 instructions at H=128)."""
    res = _sass("gqa-prefill-gluon", "--set", f"EARLY_K_RELEASE=True,{sets}")
    tile = _tile_loop(res, hgmma)
    assert tile["FSEL"] <= 64 + 4 and tile["ISETP"] <= 64 + 8, tile


@pytest.mark.parametrize("head, keys", [(64, 0), (128, 2048), (256, 2048), (256, 0)])
def test_prefill_gluon_default_builds_keep_the_wgmmas_asynchronous(head, keys):
    """The Gluon prefill's default builds without OVERLAP (``launch.prefill_gluon_config``: H=64,
    H=128 up to 4096 keys, H=256 short and long items) wait once per wgmma group, QK^T and P.V
    in each of the two consumers. ptxas serializes every wgmma of a kernel it cannot pipeline
    (one wait per HGMMA: C7512 / C7513, see ``CROSS_ITEM``), silently but for a performance
    message, so the count is the guard."""
    from longattn.gqa.triton import launch

    cfg = launch.fit_prefill_gluon_smem(launch.prefill_gluon_config(head, keys), head, 2)
    # every option of the default config but the launch's own (grid shape, register cap), so a
    # new default build option is compiled here without this test naming it
    build = {k: v for k, v in cfg.items() if k not in ("PERSISTENT", "maxnreg")}
    sets = ",".join([f"HEAD={head}"] + [f"{k}={v}" for k, v in build.items()])
    res = _sass("gqa-prefill-gluon", "--set", sets)
    assert not cfg["OVERLAP"] and res["hist"]["HGMMA"] >= 24, (cfg, res["hist"])
    assert res["hgmma_waits"] == 4 and res["hgmma_wait1"] == 0, (sets, res["hgmma_waits"])


def test_wgmma_probe_compiles_all_three_operand_paths():
    """``benchmarks/gluon_wgmma_probe.py`` (the GPU check of the register-operand paths): for
    K = 256, 16 k-steps of A from shared memory, 16 of A from registers, and 8 + 8 split."""
    res = _sass("wgmma-probe")
    assert res["hist"].get("HGMMA", 0) == 48 and res["hgmma_rs"] == 24, res["hist"]
    assert res["stack"] == 0, res


def test_indexer_score_dots_on_tensor_cores():
    """The default decode score config (``DOT_PREC="split3"``, 32-block tiles) runs both dots
    as HMMA (per warp: three bf16 products per key part, 3 x 8 k-steps = 24 for its 16x128x8
    share of the dot, 3 for the head sum: 27), with no FFMA dot loop and no spill; ``"bf16x6"``
    splits the query too (54) and ``"ieee"`` is the FFMA dot, so the test tells them apart."""
    fast = _sass("indexer-score")
    six = _sass("indexer-score", "--set", "DOT_PREC=bf16x6")["hist"]
    slow = _sass("indexer-score", "--set", "DOT_PREC=ieee")["hist"]
    hist = fast["hist"]
    assert 24 <= hist.get("HMMA", 0) < six.get("HMMA", 0) and hist.get("FFMA", 0) < 32, hist
    assert fast["stack"] == 0, fast["stack"]
    assert slow.get("HMMA", 0) == 0 and slow.get("FFMA", 0) >= 256, slow


def test_dsa_fused_prologue_loop_costs_one_compare_per_candidate():
    """FUSE_PROLOGUE (H=256, group 6, bf16, 2 stages as the default config): the candidate loop
    only adds the new-row compare (<= 40 instructions over the unfused loop's ~540), no local
    memory anywhere at the default register budget, and with the 128-register cap the
    benchmark tries the spills stay outside the loop."""
    flags = "HAS_QNORM=True,HAS_KNORM=True,HAS_ROTARY=True,ROT_DIM=128"
    base = _sass("dsa-decode", "--set", flags, "--stages", "2")
    fused = _sass("dsa-decode", "--set", flags + ",FUSE_PROLOGUE=True", "--stages", "2")
    capped = _sass("dsa-decode", "--set", flags + ",FUSE_PROLOGUE=True", "--stages", "2",
                   "--maxnreg", "128")  # fmt: skip
    loop_b, loop_f, loop_c = (max(r["loops"], key=lambda c: c.get("HMMA", 0))
                              for r in (base, fused, capped))  # fmt: skip
    assert loop_f.get("HMMA", 0) == loop_b.get("HMMA", 0) > 0
    assert sum(loop_f.values()) <= sum(loop_b.values()) + 40, (loop_f, loop_b)
    assert fused["stack"] == 0 and base["stack"] == 0, (fused["stack"], base["stack"])
    assert capped["regs"] <= 128
    assert not any(op in loop_c for op in ("LDL", "STL", "LDL.LU")), loop_c


def test_dsa_prefetch_double_buffers_the_gathers():
    """PREFETCH (index entries one step ahead, 3 stages; H=256 bf16, BLOCK_N 32): the
    pipeliner keeps two K and two V tiles in shared memory (>= 4 x 16 KB), where the default
    loop at 2 or 3 stages gets one of each (its index load inside the step); same MMAs per
    tile, no local memory, fewer registers than the default build."""
    tile = 32 * 256 * 2  # one [BLOCK_N, HEAD] bf16 tile
    base = _sass("dsa-decode", "--stages", "2")
    base3 = _sass("dsa-decode", "--stages", "3")
    ahead = _sass("dsa-decode", "--stages", "3", "--set", "PREFETCH=True")
    assert base["shared"] < 4 * tile and base3["shared"] < 4 * tile, (base, base3)
    assert ahead["shared"] >= 4 * tile, ahead["shared"]
    (loop_b,), (loop_a,) = base["loops"], ahead["loops"]
    assert loop_a.get("HMMA", 0) == loop_b.get("HMMA", 0) > 0
    assert ahead["stack"] == 0 and ahead["regs"] <= base["regs"], (ahead["regs"], base["regs"])


def test_dsa_int8_loop_takes_fp16_operands_and_the_small_tile_fits_128_registers():
    """int8 main cache, H=256, group 6, bf16 activations (the preset's fp16 power-of-two Q
    rows): the default build (BLOCK_N 32, 2 stages) converts K and V to fp16 operands in a loop
    of <= 1000 instructions (the bf16-operand conversions took 1098) without local memory; the
    BLOCK_N 16 / 3-stage build that bench_sparse's cache section A/Bs fits 128 registers (4
    programs per SM, as the bf16 kernel) without spilling."""
    base = _sass("dsa-decode", "--cache", "i8", "--stages", "2")
    (loop,) = base["loops"]
    assert sum(loop.values()) <= 1000, loop
    assert not any(op.startswith("I2F") for op in loop), loop
    assert base["stack"] == 0
    small = _sass("dsa-decode", "--cache", "i8", "--stages", "3", "--set", "BLOCK_N=16",
                  "--maxnreg", "128")  # fmt: skip
    assert small["regs"] <= 128 and small["stack"] == 0, (small["regs"], small["stack"])


@pytest.mark.parametrize("cache,block_n,stages", [("bf16", 64, 4), ("i8", 128, 3)])
def test_gqa_decode_fused_prologue_keeps_the_unmasked_loop(cache, block_n, stages):
    """FUSE_PROLOGUE of the GQA decode kernel (H=128, the default tiles): the unmasked tile
    loop (the fewest compares) is no longer than the unfused one, and no local memory is used
    inside any loop (int8 runs at the 255-register limit: a few spills before/after only)."""
    flags = f"BLOCK_N={block_n},HAS_QNORM=True,HAS_KNORM=True,HAS_ROTARY=True,ROT_DIM=128"
    args = ("--cache", cache, "--stages", str(stages))
    base = _sass("gqa-decode", "--set", flags, *args)
    fused = _sass("gqa-decode", "--set", flags + ",FUSE_PROLOGUE=True", *args)

    def unmasked(r):
        return min(r["loops"], key=lambda c: c.get("ISETP", 0) + c.get("FSEL", 0))

    assert unmasked(fused).get("HMMA", 0) == unmasked(base).get("HMMA", 0) > 0
    assert sum(unmasked(fused).values()) <= sum(unmasked(base).values())
    assert not any(op in loop for loop in fused["loops"] for op in ("LDL", "STL")), fused["loops"]
    if cache == "bf16":
        assert fused["stack"] == 0


def _unmasked_mma_loop(res: dict) -> dict:
    """The tile loop of an ``mma.sync`` build with the fewest compares (the unmasked one)."""
    return min((c for c in res["loops"] if c.get("HMMA")), key=lambda c: c.get("ISETP", 0))


def test_paged_int8_tiles_skip_the_i2f_unit():
    """The paged decode kernel (H=128, BLOCK_N 64, block 64, 4 warps, 3 stages) converts int8
    K / V tiles to fp16 by ``cache_to_dot`` (xor + byte permutes + packed fp16 subtracts):
    no I2F in any loop (128 per tile by ``.to``, the ``I8_I2F`` build), and a shorter unmasked
    tile loop (session 44: 744 -> 639 instructions; with the affine tile addresses 726 -> 632)."""
    args = ("paged-decode", "--cache", "i8", "--set")
    new = _sass(*args, "BLOCK_N=64")
    old = _sass(*args, "BLOCK_N=64,I8_I2F=True")

    assert not any(loop.get("I2F", 0) for loop in new["loops"]), new["loops"]
    assert _unmasked_mma_loop(old).get("I2F", 0) >= 128
    assert sum(_unmasked_mma_loop(new).values()) + 80 <= sum(_unmasked_mma_loop(old).values())
    assert new["stack"] == 0


def test_paged_int8_v_pairs_read_v_by_ldmatrix_trans():
    """``V_PAIRS`` in the paged kernel (an option: the int8 V tile read as int16 channel
    pairs, as GQA's and DSA's default): no per-byte shared loads (192 ``LDS.U8`` in the
    default build), V^T by ``ldmatrix.trans``, a shorter unmasked tile loop (session 44: 632 ->
    470 instructions) and no stack (H=128, BLOCK_N 64, block 64, 4 warps, 3 stages)."""
    args = ("paged-decode", "--cache", "i8", "--set")
    pairs = _sass(*args, "BLOCK_N=64,V_PAIRS=True")
    plain = _sass(*args, "BLOCK_N=64")

    assert pairs["memory"].get("LDS.U8", 0) == 0 < plain["memory"].get("LDS.U8", 0)
    assert pairs["memory"].get("LDSM.16.MT88.4", 0) > 0
    assert sum(_unmasked_mma_loop(pairs).values()) + 100 <= sum(_unmasked_mma_loop(plain).values())
    assert pairs["stack"] == 0


@pytest.mark.parametrize("cache", ["bf16", "i8"])
def test_gqa_decode_direct_out_keeps_the_loop_and_drops_the_partials(cache):
    """``DIRECT_OUT`` (one split: rows finished into the output) changes only the epilogue of
    the default fused build (H=128, bf16 BLOCK_N 64 at 4 stages, int8 128 at 3): the
    unmasked tile loop within 12 instructions of the partials build's (session 44: bf16 256 ->
    252, int8 741 -> 730), no local memory in any loop (the epilogue spills 8 / 56 bytes
    outside them), and fewer instructions in all (2376 -> 2224, 4040 -> 3904)."""
    flags = "FUSE_PROLOGUE=True," + (
        "BLOCK_N=64" if cache == "bf16" else "BLOCK_N=128,V_PAIRS=True"
    )
    args = ("--cache", cache, "--stages", "4" if cache == "bf16" else "3")
    base = _sass("gqa-decode", "--set", flags, *args)
    direct = _sass("gqa-decode", "--set", flags + ",DIRECT_OUT=True", *args)

    def unmasked(r):
        return min(r["loops"], key=lambda c: c.get("ISETP", 0) + c.get("FSEL", 0))

    assert unmasked(direct).get("HMMA", 0) == unmasked(base).get("HMMA", 0) > 0
    assert abs(sum(unmasked(direct).values()) - sum(unmasked(base).values())) <= 12
    assert not any(op in loop for loop in direct["loops"] for op in ("LDL", "STL"))
    assert direct["total"] < base["total"]


@pytest.mark.parametrize("extra", ["", ",TOPK=True,NB_PAD=1024",
                                   ",BLOCK_O=4096,IDS_IN_REGS=False,NB_PAD=4096"])  # fmt: skip
def test_select_2d_emission_compiles_without_division(extra):
    """EMIT_2D (``EMIT_R = r``): the select kernel compiles for sm_90 (the interpreter does not
    check loop-carried shapes) and its remaining 1-D emission loop is a fraction of the
    division + gather loop's instructions (37 vs 131 at BLOCK_O 1024)."""
    old = _sass("indexer-select", "--set", "EMIT_R=0" + extra)
    new = _sass("indexer-select", "--set", "EMIT_R=64" + extra)
    # at 4096 blocks ptxas saves one predicate word to the stack once, outside the loops
    # (PACKED_SCATTER's build; 8 B), never inside a loop
    assert new["stack"] <= 8
    assert not any(op in loop for loop in new["loops"] for op in ("LDL", "STL")), new["loops"]
    # the emission loop is the one that stores to global memory (the radix loop does not)
    new_loop, old_loop = ([c for c in r["loops"] if c.get("STG")] for r in (new, old))
    assert len(new_loop) == 1 and len(old_loop) == 1, (new["loops"], old["loops"])
    assert sum(new_loop[0].values()) * 2 < sum(old_loop[0].values()), (new_loop, old_loop)


def test_select_clocks_build_marks_its_phases_and_costs_nothing_when_off():
    """The select kernel's profiling build (``CLOCKS``, ``select.CLOCK_MARKS`` marks) reads the
    SM clock once per mark around the same radix loop; the default build reads it never."""
    from longattn.sparse.triton.select import CLOCK_MARKS

    flags = "TOPK=False,NB_PAD=4096,KB_PAD=32,BLOCK_O=1024,EMIT_R=64,IDS_IN_REGS=True"
    base = _sass("indexer-select", "--set", flags, "--warps", "8")
    clk = _sass("indexer-select", "--set", flags + ",CLOCKS=True", "--warps", "8")
    assert base["clock_reads"] == 0
    assert clk["clock_reads"] == CLOCK_MARKS
    radix = [max(r["loops"], key=lambda c: c.get("SHFL", 0)) for r in (base, clk)]
    assert radix[0] == radix[1], radix
    assert clk["total"] - base["total"] < 40, (clk["total"], base["total"])


@pytest.mark.parametrize("nb_pad", [2048, 4096])
def test_select_one_scan_build_is_smaller(nb_pad):
    """``ONE_SCAN`` (the radix scatter's slots and mask from one tensor): one cumsum fewer in
    the sm_90 build than the ``chosen & (slot < k)`` mask (triton 3.6 computes that scan in two
    layouts): fewer instructions and registers, no more CTA barriers."""
    flags = f"TOPK=False,NB_PAD={nb_pad},KB_PAD=32,BLOCK_O=1024,EMIT_R=64,IDS_IN_REGS=True"
    one = _sass("indexer-select", "--set", flags, "--warps", "8")
    two = _sass("indexer-select", "--set", flags + ",ONE_SCAN=False", "--warps", "8")
    assert one["total"] + 300 < two["total"], (one["total"], two["total"])
    assert one["regs"] < two["regs"], (one["regs"], two["regs"])
    bars = [r["memory"].get("BAR.SYNC.DEFER_BLOCKING", 0) for r in (one, two)]
    assert bars[0] <= bars[1], bars


@pytest.mark.parametrize("nb_pad", [2048, 4096])
def test_select_packed_scatter_moves_no_data(nb_pad):
    """``PACKED_SCATTER``: the radix scatter's layout change is a reorder-reshape of packed
    (slot, block) pairs, not a shared-memory conversion of 64-bit pointers and the mask: at
    least 4 CTA barriers fewer, no more instructions, <= 1 KB of shared memory."""
    flags = f"TOPK=False,NB_PAD={nb_pad},KB_PAD=32,BLOCK_O=1024,EMIT_R=64,IDS_IN_REGS=True"
    packed = _sass("indexer-select", "--set", flags, "--warps", "8")
    plain = _sass("indexer-select", "--set", flags + ",PACKED_SCATTER=False", "--warps", "8")
    bars = [r["memory"].get("BAR.SYNC.DEFER_BLOCKING", 0) for r in (packed, plain)]
    assert bars[0] + 4 <= bars[1], bars
    assert packed["total"] <= plain["total"], (packed["total"], plain["total"])
    assert packed["shared"] <= 1024 < plain["shared"], (packed["shared"], plain["shared"])


def test_select_rank_build_reads_the_candidates_without_spills():
    """The rank method's build (``RANK_SELECT``: 2 * KB_PAD floor groups and candidates), 4096
    blocks, 8 warps: no local memory; the compacted keys read at most a column of the
    ``[CAP, CAP]`` tile per thread (broadcast reads, L1), not the whole tile."""
    flags = ("TOPK=False,NB_PAD=4096,KB_PAD=32,BLOCK_O=1024,EMIT_R=64,IDS_IN_REGS=True,"
             "EARLY_SCORES=True,RANK_G=64,RANK_CAP=64")  # fmt: skip
    got = _sass("indexer-select", "--set", flags, "--warps", "8")
    assert got["stack"] == 0, got["stack"]
    assert 1 <= got["memory"].get("LDG.E.64", 0) <= 64 // 2 + 1, got["memory"]


def test_select_cross_floor_needs_fewer_barriers():
    """``RANK_FLOOR`` "cross" (``_cross_bounds``: row and column maxima of one view of the row,
    compared without a layout change) builds with fewer CTA barriers than the ``[G, G]`` rank
    of the strided group maxima, and no spills (sm_90, 4096 blocks, 8 warps)."""
    flags = ("TOPK=False,NB_PAD=4096,KB_PAD=32,BLOCK_O=1024,EMIT_R=64,IDS_IN_REGS=True,"
             "EARLY_SCORES=True,RANK_G=64,RANK_CAP=64")  # fmt: skip
    groups = _sass("indexer-select", "--set", flags, "--warps", "8")
    cross = _sass("indexer-select", "--set", flags + ",RANK_CROSS=True", "--warps", "8")
    bars = [r["memory"].get("BAR.SYNC.DEFER_BLOCKING", 0) for r in (cross, groups)]
    assert bars[0] < bars[1], bars
    assert cross["stack"] == 0, cross["stack"]


def test_merge_one_warp_tiles_keep_the_split_reductions_in_the_warp():
    """``MERGE_ONE_WARP_FROM``'s builds (one warp, ``merge_launch``'s tile) at 128 / 64 split
    slots, H=256: at most 2 CTA barriers, against 14 / 10 for the 4-warp tiles; no spills."""
    from longattn import _triton_merge

    for splits_pad, four_warp_bars in ((128, 14), (64, 10)):
        base_d = _triton_merge.MERGE_TILE // splits_pad  # the 4-warp tile (<= 256 channels)
        base = _sass("merge", "--set", f"SPLITS_PAD={splits_pad},BLOCK_D={base_d}")
        block_d = _triton_merge.MERGE_WARP_TILE // splits_pad
        one = _sass("merge", "--set", f"SPLITS_PAD={splits_pad},BLOCK_D={block_d}",
                    "--warps", "1")  # fmt: skip
        bars = [r["memory"].get("BAR.SYNC.DEFER_BLOCKING", 0) for r in (one, base)]
        assert bars[0] <= 2 and bars[1] >= four_warp_bars - 2, bars
        assert one["stack"] == 0


def test_gqa_int8_small_tiles_fit_three_ctas_without_loop_spills():
    """bench_gqa's capped int8 decode tiles (BLOCK_N 64, 4 warps, 168 registers; fused
    prologue with QK-norm and rotary, as the default runs at H=128): 3 CTAs per SM by
    registers and shared memory, no local loads or stores in the tile loops (24 bytes of
    stack outside them)."""
    flags = (
        "BLOCK_N=64,FUSE_PROLOGUE=True,HAS_ROTARY=True,ROT_DIM=128,HAS_QNORM=True,HAS_KNORM=True"
    )
    for stages in (3, 4):
        res = _sass("gqa-decode", "--cache", "i8", "--warps", "4", "--stages", str(stages),
                    "--maxnreg", "168", "--set", flags)  # fmt: skip
        assert 3 * res["regs"] * 128 <= 65536 and 3 * res["shared"] <= 227 * 1024, res["regs"]
        assert res["stack"] <= 32, res["stack"]
        for loop in res["loops"]:
            assert loop.get("LDL", 0) == 0 and loop.get("STL", 0) == 0, loop


def test_gqa_int8_wide_tiles_take_ldmatrix_operands():
    """``WIDE_I8`` (an int8 decode option): K and V read as int32 words, converted in a
    blocked layout and stored as fp16, so both dots take ``ldmatrix`` operands at kWidth 2: no
    per-byte shared loads of V, Q by ``LDSM`` (not rebuilt from 64-bit loads and register
    moves), and the unmasked 128-key tile within 760 instructions (724 at session 35; 1023
    without it) at <= 168 registers (255 without)."""
    base = ("--cache", "i8", "--stages", "3", "--set", "BLOCK_N=128")
    wide = _sass("gqa-decode", *base[:-1], "BLOCK_N=128,WIDE_I8=True")
    old = _sass("gqa-decode", *base)
    assert wide["memory"].get("LDS.U8", 0) == 0 < old["memory"].get("LDS.U8", 0)
    assert wide["memory"].get("LDSM.16.MT88.4", 0) > 0  # V^T by ldmatrix.trans

    def unmasked(res):
        return min(res["loops"], key=lambda c: c.get("ISETP", 0) + c.get("FSEL", 0))

    w, o = unmasked(wide), _unmasked_mma_loop(old)
    assert w.get("HMMA", 0) == o.get("HMMA", 0) > 0
    assert sum(w.values()) <= 760 < sum(o.values()), (sum(w.values()), sum(o.values()))
    assert w.get("IMAD", 0) <= 60 < o.get("IMAD", 0), (w, o)  # no Q rebuild by moves
    assert wide["regs"] <= 168 < old["regs"] and wide["stack"] == 0


def test_gqa_int8_v_pairs_read_v_by_ldmatrix_trans():
    """``V_PAIRS`` (an int8 decode option): V read as int16 channel pairs reaches the P.V
    operand layout by ``ldmatrix.trans`` (no per-byte shared loads), its global reads are
    16-byte ``cp.async`` (8-byte without), same MMAs, and the unmasked 128-key tile within 800
    instructions (762 at session 36; 1023 without it), below the 255-register limit."""
    base = ("--cache", "i8", "--stages", "3", "--set")
    pairs = _sass("gqa-decode", *base, "BLOCK_N=128,V_PAIRS=True")
    old = _sass("gqa-decode", *base, "BLOCK_N=128")
    assert pairs["memory"].get("LDS.U8", 0) == 0 < old["memory"].get("LDS.U8", 0)
    assert pairs["memory"].get("LDSM.16.MT88.4", 0) > 0  # V^T pairs by ldmatrix.trans
    assert pairs["memory"].get("LDGSTS.E.64", 0) == 0 < old["memory"].get("LDGSTS.E.64", 0)

    def unmasked(res):
        return min(res["loops"], key=lambda c: c.get("ISETP", 0) + c.get("FSEL", 0))

    v, o = _unmasked_mma_loop(pairs), _unmasked_mma_loop(old)
    assert v.get("HMMA", 0) == o.get("HMMA", 0) > 0
    assert sum(v.values()) <= 800 < sum(o.values()), (sum(v.values()), sum(o.values()))
    assert pairs["regs"] < 255 == old["regs"] and pairs["stack"] == 0


def test_gqa_int8_k_pairs_keep_q_in_ldmatrix_operands():
    """``K_PAIRS`` (an int8 decode option, with the ``V_PAIRS`` default): K read as int16
    channel pairs and Q split into even / odd channels, so both Q.K dots take 16-bit operands
    at kWidth 2: no per-tile Q rebuild from shared memory (64-bit ``LDS``) and register moves,
    and the fused default build's unmasked 128-key tile within 680 instructions (643 at session
    36; 741 with ``V_PAIRS`` alone)."""
    base = ("--cache", "i8", "--stages", "3", "--set")
    both = _sass("gqa-decode", *base, "BLOCK_N=128,V_PAIRS=True,FUSE_PROLOGUE=True,K_PAIRS=True")
    v_only = _sass("gqa-decode", *base, "BLOCK_N=128,V_PAIRS=True,FUSE_PROLOGUE=True")

    def unmasked(res):
        return min(res["loops"], key=lambda c: c.get("ISETP", 0) + c.get("FSEL", 0))

    b, v = unmasked(both), unmasked(v_only)
    assert b.get("HMMA", 0) == v.get("HMMA", 0) > 0
    # Q's per-tile 64-bit shared loads (16 of V_PAIRS' 25 LDS) and register moves (IMAD.MOV)
    assert b.get("LDS", 0) + 16 <= v.get("LDS", 0), (b, v)
    assert b.get("IMAD", 0) <= 40 < v.get("IMAD", 0), (b, v)
    assert sum(b.values()) <= 680 < sum(v.values()), (sum(b.values()), sum(v.values()))
    assert all(loop.get("LDL", 0) == 0 for loop in both["loops"])


@pytest.mark.parametrize("pairs", ["", ",K_PAIRS=True"])
def test_gqa_int8_shifts_drop_the_fp16_subtracts(pairs):
    """``K_SHIFT`` + ``V_SHIFT`` (int8 decode options: K and V enter the dots as ``k + 1152``,
    the shift taken off after the tiles): the fused default build's unmasked 128-key tile
    keeps its MMAs and loses the conversions' packed fp16 subtracts (128 ``HADD2`` -> the
    16 that widen P's fp16 weights into ``l``): 741 -> 620 instructions at session 39 (with
    ``K_PAIRS``: 643 -> 535), no stack."""
    base = ("--cache", "i8", "--stages", "3", "--set")
    cfg = f"BLOCK_N=128,V_PAIRS=True,FUSE_PROLOGUE=True{pairs}"
    shifted = _sass("gqa-decode", *base, cfg + ",K_SHIFT=True,V_SHIFT=True")
    plain = _sass("gqa-decode", *base, cfg)

    def unmasked(res):
        return min(res["loops"], key=lambda c: c.get("ISETP", 0) + c.get("FSEL", 0))

    s, p = unmasked(shifted), unmasked(plain)
    assert s.get("HMMA", 0) == p.get("HMMA", 0) > 0
    assert s.get("HADD2", 0) <= 16 and p.get("HADD2", 0) >= 128, (s, p)
    assert sum(s.values()) + 100 <= sum(p.values()), (sum(s.values()), sum(p.values()))
    assert shifted["stack"] == 0


@pytest.mark.parametrize("flag,loop_max", [("WIDE_I8", 620), ("V_PAIRS", 690)])
def test_dsa_int8_word_reads_cut_the_tile_loop(flag, loop_max):
    """The int8 DSA read paths of wider words (H=256, BLOCK_N 32, 1 stage at 168 registers):
    ``WIDE_I8`` (an option: K and V rows as int32 words; 571 instructions at session 35) and
    ``V_PAIRS`` (the default: V rows as int16 channel pairs; 662 at session 36): V^T by
    ``ldmatrix.trans``, no per-byte shared loads, the tile loop within ``loop_max`` (726 per
    byte), at most 128 registers (127 / 112; 4 programs per SM fit)."""
    args = ("dsa-decode", "--cache", "i8", "--stages", "1", "--maxnreg", "168", "--set")
    new = _sass(*args, f"{flag}=True")
    old = _sass(*args, f"{flag}=False")
    assert new["memory"].get("LDS.U8", 0) == 0 < old["memory"].get("LDS.U8", 0)
    assert new["memory"].get("LDSM.16.MT88.4", 0) > 0
    n, o = (sum(r["loops"][0].values()) for r in (new, old))
    assert n <= loop_max < o, (n, o)
    assert new["regs"] <= 128 < old["regs"] and new["stack"] == 0


@pytest.mark.parametrize("head", [128, 256])
def test_dsa_int8_default_build_fits_its_wave(head):
    """The int8 default config (bf16 activations: fp16 Q rows) compiles within its register
    cap so that ``SM_PROGRAMS`` programs are resident per SM (64K registers, 128 threads,
    allocation in units of 8), which the split plan's one wave assumes, at its stages (no
    spills; H=256's 2-stage build spills 40 bytes at the cap) and at ``LONG_SPLIT_STAGES``
    with ``LONG_SPLIT_PREFETCH`` (long splits: the index entries one tile ahead; H=128 no
    spills, H=256 8 bytes of stack and one local load per tile, as measured in session 34)."""
    import torch

    from longattn.sparse.triton.decode import decode_config

    cfg = decode_config(head, torch.float16, torch.int8, False)
    assert cfg["LONG_SPLIT_PREFETCH"] is True
    flags = f"HEAD={head},HEAD_PAD={head},BLOCK_N={cfg['BLOCK_N']}"
    builds = ((cfg["num_stages"], "", 0), (cfg["LONG_SPLIT_STAGES"], ",PREFETCH=True", 8))
    for stages, more, max_stack in builds:
        res = _sass("dsa-decode", "--cache", "i8", "--stages", str(stages),
                    "--warps", str(cfg["num_warps"]), "--maxnreg", str(cfg["maxnreg"]),
                    "--set", flags + more)  # fmt: skip
        regs = -(-res["regs"] // 8) * 8
        assert cfg["SM_PROGRAMS"] * regs * 32 * cfg["num_warps"] <= 65536, (res["regs"], cfg)
        limit = max_stack if head == 256 else 0  # H=128: no stack in either build
        assert res["stack"] <= limit, (stages, more, res["stack"])
        assert sum(loop.get("LDL", 0) for loop in res["loops"]) <= limit // 8, res["loops"]
