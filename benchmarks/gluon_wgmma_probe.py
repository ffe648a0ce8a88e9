"""Gluon wgmma operand paths in isolation: A from shared memory (``ss``), A loaded from its
NVMMA-swizzled shared tile into the register-operand layout (``rs``), and the first K/2 channels
from registers with the rest from shared memory (``half``, as the removed Gluon prefill option
``Q_HALF_REGS`` did).
An earlier all-of-Q-in-registers prefill variant gave wrong output on the H200 with no cause
found; this probe separates the operand path from the attention kernel around it.

    PYTHONPATH=src python benchmarks/gluon_wgmma_probe.py      (sm_90 GPU)

``tests/test_gluon_wgmma.py`` runs it against torch on the GPU; ``benchmarks/sass.py
wgmma-probe`` compiles it for sm_90 anywhere.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def wgmma_paths_kernel(a_ptr, b_ptr, c_ptr, M: gl.constexpr, N: gl.constexpr,
                        K: gl.constexpr):  # fmt: skip
    """c[0] = A B^T (ss), c[1] = A B^T (rs), c[2] = A B^T (half): A [M, K], B [N, K] row-major
    16-bit, c [3, M, N] fp32; one warpgroup."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    offs_m = gl.arange(0, M, layout=gl.SliceLayout(1, ld))
    offs_n = gl.arange(0, N, layout=gl.SliceLayout(1, ld))
    offs_k = gl.arange(0, K, layout=gl.SliceLayout(0, ld))
    a = gl.load(a_ptr + gl.expand_dims(offs_m, 1) * K + gl.expand_dims(offs_k, 0))  # [M, K]
    b = gl.load(b_ptr + gl.expand_dims(offs_n, 1) * K + gl.expand_dims(offs_k, 0))  # [N, K]
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    a_smem = gl.allocate_shared_memory(dtype, [M, K],
                                       gl.NVMMASharedLayout.get_default_for([M, K], dtype))  # fmt: skip
    b_smem = gl.allocate_shared_memory(dtype, [N, K],
                                       gl.NVMMASharedLayout.get_default_for([N, K], dtype))  # fmt: skip
    a_smem.store(a)
    b_smem.store(b)
    fence_async_shared()  # generic-proxy stores before the wgmma (async proxy) reads
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, N, 16])  # fmt: skip
    a_op_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    zero = gl.zeros([M, N], gl.float32, layout=acc_l)
    c_ss = warpgroup_mma(a_smem, b_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
    c_ss = warpgroup_mma_wait(0, deps=(c_ss,))
    a_regs = a_smem.load(a_op_l)  # [M, K] register operand
    c_rs = warpgroup_mma(a_regs, b_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
    c_rs = warpgroup_mma_wait(0, deps=(c_rs,))
    a_lo = a_smem.slice(0, K // 2, dim=1).load(a_op_l)  # [M, K / 2]
    c_h = warpgroup_mma(a_lo, b_smem.slice(0, K // 2, dim=1).permute((1, 0)), zero,
                        use_acc=False, is_async=True)  # fmt: skip
    c_h = warpgroup_mma(a_smem.slice(K // 2, K // 2, dim=1),
                        b_smem.slice(K // 2, K // 2, dim=1).permute((1, 0)), c_h, is_async=True)  # fmt: skip
    c_h = warpgroup_mma_wait(0, deps=(c_h,))
    rows = gl.arange(0, M, layout=gl.SliceLayout(1, acc_l))
    cols = gl.arange(0, N, layout=gl.SliceLayout(0, acc_l))
    c_offs = gl.expand_dims(rows, 1) * N + gl.expand_dims(cols, 0)
    gl.store(c_ptr + c_offs, c_ss)
    gl.store(c_ptr + M * N + c_offs, c_rs)
    gl.store(c_ptr + 2 * M * N + c_offs, c_h)


def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[3, 64, N] fp32: A B^T by the ss, rs and half paths (A [64, K], B [N, K], 16-bit)."""
    c = torch.full((3, a.shape[0], b.shape[0]), float("nan"), device=a.device)
    wgmma_paths_kernel[(1,)](a, b, c, M=a.shape[0], N=b.shape[0], K=a.shape[1], num_warps=4)
    return c


def main():
    for dtype in (torch.bfloat16, torch.float16):
        for n, k in ((64, 256), (128, 128), (64, 64)):
            a = torch.randn(64, k, device="cuda").to(dtype)
            b = torch.randn(n, k, device="cuda").to(dtype)
            want = a.double() @ b.double().T
            errs = [(got.double() - want).abs().max().item() for got in run(a, b)]
            print(dtype, n, k, dict(zip(("ss", "rs", "half"), errs)), flush=True)


if __name__ == "__main__":
    main()
