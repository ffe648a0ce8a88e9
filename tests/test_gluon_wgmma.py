"""Gluon wgmma operand paths in isolation on the GPU (``benchmarks/gluon_wgmma_probe.py``):
A from shared memory, A from registers (loaded out of its swizzled shared tile), and half of A
from registers. A Gluon prefill option that took half of Q from registers (``Q_HALF_REGS``)
was removed: it gave wrong output at H=128 on the H200 (max diff 0.8 against the default,
``benchmarks/results/prefill_gluon_ab9_h200.json``) and at most +2% at H=256; an earlier
all-of-Q-in-registers variant was also wrong, no cause found."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(64, 256), (128, 128), (64, 64)])
def test_wgmma_operand_paths_gpu(dtype, n, k, device):
    if torch.cuda.get_device_capability(device)[0] != 9:
        pytest.skip("wgmma is sm_90")
    import gluon_wgmma_probe as probe

    gen = torch.Generator(device=device).manual_seed(n + k)
    a = torch.randn(64, k, generator=gen, device=device).to(dtype)
    b = torch.randn(n, k, generator=gen, device=device).to(dtype)
    want = a.double() @ b.double().T
    for name, got in zip(("ss", "rs", "half"), probe.run(a, b)):
        err = (got.double() - want).abs().max().item()
        assert err < 1e-3 * k, f"{name}: max error {err}"
