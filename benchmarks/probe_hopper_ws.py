"""Does triton's Hopper warp specialization (``tl.range(..., warp_specialize=True)``) engage on a
flash-attention loop? Compiles small variants for sm_90 on any machine (no GPU) and reports
whether the SASS has ``USETMAXREG`` (the producer/consumer register split of a specialized
kernel).

    python benchmarks/probe_hopper_ws.py

Findings with triton 3.6 (2026-12-03, compile only, not measured on the GPU):

- engages with 4 warps, BLOCK_M 64, Q/K/V loads and the O store all through TMA descriptors
  (2-D, or 3-D + reshape), runtime loop bounds allowed, and with an unconditional causal
  ``tl.where`` mask inside the loop; also with device-side descriptors
  (``tl.make_tensor_descriptor``, shape = the sequence's valid length, so TMA zero-fills the
  rows past it: no NaN garbage can enter, which would let masked tiles use TMA too; needs
  ``triton.set_allocator`` at launch);
- silently not applied: 8 warps; the loop under a runtime ``if``; a runtime ``if`` (diagonal
  mask) inside the loop; a pointer-loaded Q;
- the pass fails (RuntimeError): 4 warps with BLOCK_M 128; any second loop in the kernel
  (pointer or TMA loads, before or after the specialized one), e.g. ``gqa_prefill_kernel``'s
  masked lead/tail ranges.

So a warp-specialized prefill would be one loop over every tile with the mask applied on each
tile, BLOCK_M 64 per CTA, TMA for Q, K, V and O.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _probe(desc_q, desc_k, desc_v, desc_o, n_ctx, qk_scale, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, HEAD: tl.constexpr, VARIANT: tl.constexpr):  # fmt: skip
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    off = bh * n_ctx
    q = desc_q.load([off + start_m * BLOCK_M, 0])  # [BLOCK_M, HEAD]
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    acc = tl.zeros([BLOCK_M, HEAD], dtype=tl.float32)
    hi = n_ctx
    if VARIANT == 1:  # runtime bound
        hi = tl.minimum(n_ctx, (start_m + 1) * BLOCK_M)
    if (VARIANT != 2) or (start_m * BLOCK_M < n_ctx):  # VARIANT 2: loop under a runtime if
        for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=True):
            if VARIANT == 3:  # 3-D descriptors, as the [B*KV, C, H] cache view would be
                k = desc_k.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD)
                v = desc_v.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD)
            else:
                k = desc_k.load([off + start_n, 0])
                v = desc_v.load([off + start_n, 0])
            qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
            m_i = m_ij
    desc_o.store([off + start_m * BLOCK_M, 0], (acc / l_i[:, None]).to(tl.bfloat16))


def probe(variant: int, block_m: int, block_n: int, warps: int, stages: int = 2) -> str:
    h = 128
    kv = f"bf16[1, {block_n}, {h}]" if variant == 3 else f"bf16[{block_n}, {h}]"
    sig = {"desc_q": f"tensordesc<bf16[{block_m}, {h}]>", "desc_k": f"tensordesc<{kv}>",
           "desc_v": f"tensordesc<{kv}>", "desc_o": f"tensordesc<bf16[{block_m}, {h}]>",
           "n_ctx": "i32", "qk_scale": "fp32", **{c: "constexpr" for c in
                                                   ("BLOCK_M", "BLOCK_N", "HEAD", "VARIANT")}}  # fmt: skip
    src = ASTSource(fn=_probe, signature=sig,
                    constexprs=dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD=h, VARIANT=variant))  # fmt: skip
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps, num_stages=stages))  # fmt: skip
    except Exception as exc:  # the warp-specialization pass can fail
        return f"compile failed ({type(exc).__name__})"
    path = f"/tmp/longattn_ws_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "nvdisasm")  # fmt: skip
    sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True).stdout
    os.remove(path)
    ops = collections.Counter(re.findall(r"\b(USETMAXREG|UTMALDG|HGMMA)", sass))
    return ("SPECIALIZED " if ops["USETMAXREG"] else "not specialized ") + str(dict(ops))


def main():
    names = {0: "2-D desc", 1: "runtime bound", 2: "under runtime if", 3: "3-D desc + reshape"}
    for variant, bm, bn, warps in ((0, 64, 64, 4), (1, 64, 64, 4), (2, 64, 64, 4),
                                   (3, 64, 64, 4), (0, 64, 128, 4), (0, 128, 128, 8),
                                   (0, 128, 128, 4)):  # fmt: skip
        print(f"{names[variant]:20s} BLOCK {bm}x{bn} warps {warps}: "
              f"{probe(variant, bm, bn, warps)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
