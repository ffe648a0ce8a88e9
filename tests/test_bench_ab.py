"""benchmarks/ab_decode_options.py asks for the variants it names (CPU: no timing here)."""

from __future__ import annotations

import sys
from pathlib import Path

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
