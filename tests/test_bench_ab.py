"""benchmarks/ab_decode_options.py asks for the variants it names (CPU: no timing here)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ab_decode_options as ab  # noqa: E402
import bench_gqa  # noqa: E402
import bench_sparse  # noqa: E402
from longattn.gqa.triton import launch  # noqa: E402


def test_ab_variants_are_the_pending_options():
    for name in ab.DSA_VARIANTS:
        assert name in bench_sparse._CACHE_VARIANTS, name
    assert any("SM_PROGRAMS" in bench_sparse._CACHE_VARIANTS[n] for n in ab.DSA_VARIANTS)
    for dt in (torch.bfloat16, torch.int8):
        cfg = bench_gqa._variant_cfg(dt, "unfused")
        assert cfg["FUSE_PROLOGUE"] is False and "BLOCK_N" in cfg
        assert launch.decode_config(128, torch.bfloat16, dt, False)["FUSE_PROLOGUE"] is True


def test_gqa_merge_rows_toggle_the_merge_and_restore_it(monkeypatch):
    """gqa_merge times the default (one-warp merge from 64 slots) and the 4-warp merge (a
    threshold no slot count reaches) and restores the module's value, also on an error."""
    from longattn import _triton_merge

    seen = []
    monkeypatch.setattr(bench_gqa, "_decode_sets", lambda *a: ([None], None))
    monkeypatch.setattr(bench_gqa, "_decode_set_count", lambda *a: 1)
    monkeypatch.setattr(bench_gqa, "_decode_fn", lambda p: None)
    monkeypatch.setattr(bench_gqa, "_chain_sets", lambda *a: None)
    monkeypatch.setattr(bench_gqa, "_chain_time_or_none", lambda fn, s: 1.0)

    def graph(fn, sets):
        seen.append(_triton_merge.merge_launch(256, 128))
        return 1.0

    monkeypatch.setattr(bench_gqa, "_graph_time_or_none", graph)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    rows = ab.gqa_merge_rows(((1, 4096),))
    assert seen == [(16, 1), (64, 4)] * 2
    assert rows[0]["one_warp1_graph_us"] == 1.0 and rows[0]["four_warp2_chain_us"] == 1.0
    assert _triton_merge.MERGE_ONE_WARP_FROM == 64

    def fails_in_four_warp(fn, sets):
        if _triton_merge.merge_launch(256, 128)[1] == 4:
            raise RuntimeError("timing failed")
        return 1.0

    monkeypatch.setattr(bench_gqa, "_graph_time_or_none", fails_in_four_warp)
    with pytest.raises(RuntimeError, match="timing failed"):
        ab.gqa_merge_rows(((1, 4096),))
    assert _triton_merge.MERGE_ONE_WARP_FROM == 64


def test_wave_rows_best_graph_is_ours_not_the_peer():
    # B=17 T=32K of gqa_waves_b17_24_h100.json: cuDNN was fastest; best_graph used to be the
    # peer's own column, so best_graph_vs_cudnn read 1.0.
    row = {"cudnn_graph_us": 741.3, "default_graph_us": 865.9, "n64s3_sp3_graph_us": 790.0,
           "default_again_graph_us": 866.4, "n32s4_sp4_graph_us": None}  # fmt: skip
    assert ab._best_ours_graph(row) == "n64s3_sp3_graph_us"
    assert ab._best_ours_graph({"cudnn_graph_us": 1.0}) is None


def test_chains_and_dsa_sets_exceed_the_l2():
    import _harness

    l2 = _harness.L2_BYTES
    # GQA decode chains: B=1 T=4K (4 x 16.8 MB caches) rotates over 3 chains; T=32K over one.
    chain_4k = bench_gqa.CHAIN * 2 * 1 * bench_gqa.KV * 4096 * 128 * 2
    assert bench_gqa._chain_count(chain_4k) * chain_4k >= 3 * l2
    assert bench_gqa._chain_count(8 * chain_4k) == 1
    # DSA one-step sets at B=1 S=1 (8.65 MB of K+V rows each): >= 3x L2, not 8 sets (69 MB).
    layer = SimpleNamespace(b=1, k=torch.empty(0, dtype=torch.bfloat16))
    per_set = bench_sparse._set_bytes(layer, 1, bench_sparse.BUDGET)
    assert per_set == 1 * 1 * 4 * (2048 + 64) * 256 * 2 * 2
    assert _harness.copies_for_l2(per_set, max_sets=32) * per_set >= 3 * l2
    int8 = SimpleNamespace(b=1, k=torch.empty(0, dtype=torch.int8))
    assert bench_sparse._set_bytes(int8, 1, 8192) == 4 * (8192 + 64) * 256 * 2


def test_dsa_bytes_counts_rows_once_per_kv_group():
    n, h, kv = bench_sparse.N, bench_sparse.H, bench_sparse.KV
    b, s, m = 2, 3, 40
    sets = [dict(cnt=torch.tensor([10, 20, 30, 5, 5, 5]), sel=torch.zeros(b * s, m)),
            dict(cnt=torch.tensor([20, 30, 40, 5, 5, 5]), sel=torch.zeros(b * s, m))]  # fmt: skip
    for dt, item in ((torch.bfloat16, 2), (torch.int8, 1)):
        layer = SimpleNamespace(b=b, k=torch.empty(0, dtype=dt))
        rows = (15 + 25 + 35 + 15) * kv * h * 2 * item  # mean over sets, summed over rows
        qo = 2 * b * s * n * h * 2  # bf16 Q read + output written
        assert bench_sparse._dsa_bytes(layer, s, sets) == rows + qo + b * s * m * 4


def test_sparse_select_warp_variants_reach_the_select_launch():
    """bench_sparse's sel_w* layer variants set the select launch's warps (and only inside
    the variant)."""
    from longattn.sparse.triton import select as sel_mod

    def warps():
        scores = torch.rand(1, 2048)
        seqlens = torch.tensor([2048 * 64 - 1], dtype=torch.int32)
        *_, args = sel_mod.select_launch_args(
            scores, seqlens, seq_len=1, num_blocks=2048, compress_ratio=64, token_budget=2048,
            is_first_prompt=False,
        )  # fmt: skip
        return args["num_warps"]

    default = warps()
    for name in ("sel_w2", "sel_w4", "sel_w16"):
        dsa, sel = bench_sparse._VARIANTS[name]
        with bench_sparse._variant(dsa, sel):
            assert warps() == sel["num_warps"] != default
    assert warps() == default == 8


def test_tiles_any_rows_variant_reaches_wants_tile_max():
    """bench_sparse's tiles_any_rows variant asks for the tile maxima above
    ``select.TILE_MAX_ROWS`` rows (and only inside the variant); the select's cfg keeps no
    such key."""
    from longattn.sparse.triton import select as sel_mod

    rows = sel_mod.TILE_MAX_ROWS + 1
    assert sel_mod.wants_tile_max(4096, 2048, 64, rows=rows) == 0
    with bench_sparse._variant(*bench_sparse._VARIANTS["tiles_any_rows"]):
        assert sel_mod.wants_tile_max(4096, 2048, 64, rows=rows) == 64
        assert "TILE_MAX_ROWS" not in sel_mod.SELECT_DEFAULTS
    assert sel_mod.wants_tile_max(4096, 2048, 64, rows=rows) == 0


def test_layer_late_variant_reaches_the_launches():
    """The "late" variant turns the session-28 defaults off (select EARLY_SCORES, DSA
    EARLY_CNT, MERGE_EARLY_O, PDL_EARLY_TRIGGER) and restores them afterwards."""
    from longattn import _triton_merge, _triton_utils
    from longattn.sparse.triton import decode as dsa_decode
    from longattn.sparse.triton import select as sel_mod

    def flags():
        return (
            dsa_decode.decode_config(256, torch.bfloat16, torch.bfloat16, False).get("EARLY_CNT"),
            sel_mod.select_config(None, 2048, False)["EARLY_SCORES"],
            _triton_merge.MERGE_EARLY_O,
            _triton_utils.PDL_EARLY_TRIGGER,
        )

    before = flags()
    assert before == (None, None, True, True)  # None: decided per launch (not a first prompt)
    with bench_sparse._variant(*bench_sparse._VARIANTS["late"]):
        assert flags() == (False, False, False, False)
        # (kernels take TRIGGER only where PDL is on: never on the CPU)
        assert _triton_utils.pdl_kwargs(torch.zeros(1), trigger=True) == dict(
            PDL=False, TRIGGER=False
        )
    assert flags() == before


def test_layer_scatter_variants_reach_the_select_launch():
    """The "two_scan" variant launches the select with ONE_SCAN off (the pre-session-29
    scatter), "unpacked" with PACKED_SCATTER off; both restore the defaults afterwards."""
    from longattn.sparse.triton import select as sel_mod

    def one_scan():
        *_, args = sel_mod.select_launch_args(
            torch.rand(1, 40), torch.tensor([600], dtype=torch.int32), seq_len=1,
            num_blocks=40, compress_ratio=16, token_budget=64, is_first_prompt=False,
        )  # fmt: skip
        return args["ONE_SCAN"], args["PACKED_SCATTER"]

    assert one_scan() == (True, True)
    with bench_sparse._variant(*bench_sparse._VARIANTS["two_scan"]):
        assert one_scan() == (False, False)
    with bench_sparse._variant(*bench_sparse._VARIANTS["unpacked"]):
        assert one_scan() == (True, False)
    assert one_scan() == (True, True)


def test_layer_merge_4w_variant_reaches_the_merge_launch():
    """The "merge_4w" variant turns the one-warp merge programs (default from 64 split slots
    on) off and restores the default afterwards."""
    from longattn import _triton_merge

    assert _triton_merge.merge_launch(256, 128) == (16, 1)
    with bench_sparse._variant(*bench_sparse._VARIANTS["merge_4w"]):
        assert _triton_merge.merge_launch(256, 128) == (64, 4)
    assert _triton_merge.MERGE_ONE_WARP_FROM == 64


def test_prefill_ab_ref_src_builds_the_reference_without_flags_it_lacks(monkeypatch, capsys):
    """prefill_tma_ab --ref-src: the reference kernel gets the launcher's arguments less the
    flags its source lacks (named once), and the variant leaves the module's own kernel in
    place after each call."""
    import prefill_tma_ab
    from longattn.gqa.triton import prefill_gluon

    calls = []

    class FakeKernel:
        arg_names = ["q_desc", "BLOCK_N", "OVERLAP"]

        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append((grid, args, kw))

    ref = prefill_tma_ab._RefKernel(FakeKernel())
    for _ in range(2):
        ref[(4,)]("q", BLOCK_N=128, OVERLAP=True, PINGPONG=True)
    assert calls == [((4,), ("q",), dict(BLOCK_N=128, OVERLAP=True))] * 2
    assert capsys.readouterr().out.count("lacks ['PINGPONG']") == 1

    own = prefill_gluon.gqa_prefill_gluon_kernel
    seen = []
    monkeypatch.setattr(prefill_tma_ab.launch, "run_prefill_gluon",
                        lambda *a: seen.append(prefill_gluon.gqa_prefill_gluon_kernel))  # fmt: skip
    fn = prefill_tma_ab._fn(SimpleNamespace(), dict(_GLUON=True, _KERNEL=ref, OVERLAP=True))
    fn(None, None, None, None, None)
    assert seen == [ref] and prefill_gluon.gqa_prefill_gluon_kernel is own
