"""Hopper machine code of our kernels, compiled on the CPU (benchmarks/sass.py: ptxas/nvdisasm
from the triton wheel). Guards code-generation properties that timings on the GPU rely on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture(scope="module")
def sass():
    try:
        import sass as mod
    except Exception as exc:  # pragma: no cover - triton without its NVIDIA backend
        pytest.skip(f"cannot load benchmarks/sass.py: {exc}")
    return mod


def test_rms_tiled_tables_use_wide_loads_and_no_barriers(sass):
    """H=256 default (tiled weight/cos/sin rows): every global load/store 16 bytes, no
    shared-memory shuffle; the 1-D variant needs barriers (the test can tell them apart)."""
    heads = "HEAD=256,HALF_PAD=128,NUM_HEADS=16,ROT_DIM=256,BLOCK_N=8"
    tiled = sass.memory_ops(sass.main(["rms", "--set", heads + ",TILE_TABLES=True"])["sass"])
    assert set(tiled) == {"LDG.E.128", "STG.E.128"}, tiled
    flat = sass.memory_ops(sass.main(["rms", "--set", heads + ",TILE_TABLES=False"])["sass"])
    assert any(op.startswith("BAR") for op in flat), flat


def test_prefill_main_loop_one_fma_per_logit(sass):
    """The unmasked prefill loop (BLOCK 128x128, 8 warps: 64 logits per thread) scales and
    subtracts the max in one FFMA per logit, with one exp2 (MUFU) each and no extra FMUL/FADD
    pass over the logits (the acc update rides on the wgmma)."""
    res = sass.main(["gqa-prefill"])
    unmasked = min(sass.loops(res["sass"]), key=lambda c: c["ISETP"])
    assert unmasked["HGMMA"] > 0
    assert 64 <= unmasked["FFMA"] <= 70 and 64 <= unmasked["MUFU"] <= 70, unmasked
    assert unmasked["FMUL"] <= 70 and unmasked["FADD"] <= 70, unmasked
