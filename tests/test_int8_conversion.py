"""The int8 -> fp16/bf16 tile conversion of the attention kernels (``_core.int8_to_float``).

Every int8 value must come out as the same integer, exactly, in every mode: the attention
kernels multiply Q (with the K scale folded in) by these integers and apply the V scale after.
Under the interpreter only "cast" runs (not its bf16 cast, which the triton 3.6 interpreter
gets wrong); "asm" (inline PTX) is GPU-only, checked on every int8 value.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from longattn.gqa.triton._core import INT8_CVT, int8_to_float

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _convert_kernel(x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, DTYPE: tl.constexpr,
                    MODE: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]  # [ROWS, COLS]
    t = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, int8_to_float(t, DTYPE, MODE).to(tl.float32))


def _all_int8(device) -> torch.Tensor:
    """[16, 64]: every value -128..127 four times, shuffled (so byte lanes see all of them)."""
    vals = torch.arange(-128, 128, dtype=torch.int16).repeat(4)
    perm = torch.randperm(vals.numel(), generator=torch.Generator().manual_seed(7))
    return vals[perm].to(torch.int8).reshape(16, 64).to(device)


def _run(mode: str, dtype: torch.dtype, device: str) -> None:
    x = _all_int8(device)
    out = torch.full(x.shape, float("nan"), dtype=torch.float32, device=device)
    _convert_kernel[(1,)](x, out, ROWS=16, COLS=64, DTYPE=_TL[dtype], MODE=mode)
    expected = x.to(torch.float32)
    bad = (out != expected).nonzero()
    assert bad.numel() == 0, (
        f"mode={mode} dtype={dtype}: {bad.shape[0]} wrong values, first at {bad[0].tolist()}: "
        f"int8 {int(x[tuple(bad[0])])} -> {float(out[tuple(bad[0])])}"
    )


@pytest.mark.interpret
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter variant (CPU)")
@pytest.mark.parametrize("mode", ["cast"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_int8_to_float_interpret(mode, dtype):
    if mode == "cast" and dtype == torch.bfloat16:
        pytest.skip(
            "the triton 3.6 interpreter's int8 -> bf16 cast returns garbage (its bf16 trap)"
        )
    _run(mode, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["asm", "cast"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_int8_to_float_gpu(mode, dtype):
    _run(mode, dtype, "cuda")


def test_mode_is_known():
    assert INT8_CVT in ("asm", "cast")
