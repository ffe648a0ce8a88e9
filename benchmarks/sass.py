"""Compile a Triton kernel for sm_90 on any machine (no GPU needed) and summarize its SASS.

Triton's wheel ships ptxas and nvdisasm, so the exact Hopper machine code of a kernel can be read
on the CPU box: instruction mix per loop, load/store widths, shared-memory traffic, barriers.
That is how to check a kernel change before spending GPU time (e.g. "are the K/V loads 16-byte
cp.async?", "did the softmax lose an FMUL per logit?").

    python benchmarks/sass.py gqa-prefill [--set HAS_SOFTCAP=True] [--warps 8 --stages 3]
    python benchmarks/sass.py gqa-prefill --set USE_DESC=True   # TMA K/V (sm_90+ default)
    python benchmarks/sass.py gqa-decode --set BLOCK_N=128 --cache i8
    python benchmarks/sass.py dsa-decode --set BLOCK_N=64
    python benchmarks/sass.py dsa-decode --set FUSE_PROLOGUE=True,HAS_ROTARY=True,ROT_DIM=128
    python benchmarks/sass.py rms --set HEAD=256,HALF_PAD=128,NUM_HEADS=16,TILE_TABLES=True
    python benchmarks/sass.py indexer-select --set TOPK=True,NB_PAD=1024
    python benchmarks/sass.py merge --set SPLITS_PAD=128,BLOCK_D=16 --warps 1

Pointer arguments and ``stride_*`` arguments get Triton's runtime divisibility-by-16
specialization (as real launches of contiguous tensors do); without it every load would look
scalar. Prints the whole-kernel histogram and one per backward-branch loop.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
from collections import Counter

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("benchmarks/sass.py compiles real kernels: run it without TRITON_INTERPRET")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_NVDISASM = os.path.join(_BIN, "nvdisasm")
_INS = re.compile(r"/\*([0-9a-f]{4,6})\*/\s+(.*?);")
_OP = re.compile(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def compile_sass(
    fn, types: dict, constexprs: dict, *, num_warps=4, num_stages=3, cc=90, maxnreg=None
) -> dict:
    """{"sass", "ttgir", "ptx", "shared", "regs", "stack"} of ``fn`` built for sm_<cc>; non-constexpr arguments
    not in ``types`` are i32 (``*_ptr``: *fp32)."""
    sig, attrs = {}, {}
    constexprs = dict(constexprs)
    for param in getattr(fn, "params", ()):  # constexprs left out take their defaults
        default = getattr(param, "default", inspect.Parameter.empty)
        if (
            param.is_constexpr
            and param.name not in constexprs
            and default is not inspect.Parameter.empty
        ):
            constexprs[param.name] = default
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        sig[name] = types.get(name) or ("*fp32" if name.endswith("_ptr") else "i32")
        if name.endswith("_ptr") or name.startswith("stride_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    else:
        source = ASTSource
    src = source(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    opts = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=opts)
    path = f"/tmp/longattn_sass_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([_NVDISASM, "-c", path], capture_output=True, text=True).stdout
    res = subprocess.run([os.path.join(_BIN, "cuobjdump"), "--dump-resource-usage", path],
                         capture_output=True, text=True).stdout  # fmt: skip
    os.remove(path)
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", res)
    regs, stack = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    return dict(
        sass=sass,
        ttgir=k.asm["ttgir"],
        ptx=k.asm["ptx"],
        shared=k.metadata.shared,
        regs=regs,
        stack=stack,
    )


def histogram(sass: str) -> Counter:
    return Counter(_OP.match(m.group(2)).group(1) for m in _INS.finditer(sass))


def loops(sass: str) -> list[Counter]:
    """Instruction histograms of the loops (a backward branch to a label), largest first."""
    ins, labels, pending = [], {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*\.(L_x_\d+):", line)
        if m:
            pending = m.group(1)
            continue
        m = _INS.search(line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
            if pending:
                labels[pending], pending = ins[-1][0], None
    out = []
    for addr, text in ins:
        # also the uniform-predicate form "BRA P2, `(.L_x_7)"
        m = re.search(r"BRA\s+(?:!?U?P\w+,\s*)?`?\(?\.?(L_x_\d+)", text)
        if m and labels.get(m.group(1), addr + 1) < addr:
            lo = labels[m.group(1)]
            out.append(Counter(_OP.match(t).group(1) for a, t in ins if lo <= a <= addr))
    return sorted(out, key=lambda c: -sum(c.values()))


def memory_ops(sass: str) -> Counter:
    return Counter(re.findall(r"\b((?:LDG|STG|LDS|STS|LDSM|LDGSTS|LDL|STL|BAR)[A-Z0-9._]*)", sass))


def named_barriers(sass: str) -> dict:
    """{"<SYNC|ARV> <id>/<threads or all>": count} of the kernel's named-barrier instructions."""
    found = re.findall(r"BAR\.(SYNC|ARV)\S* (0x[0-9a-f]+)(?:, (0x[0-9a-f]+))?", sass)
    return dict(Counter(f"{op} {int(i, 16)}/{int(n, 16) if n else 'all'}" for op, i, n in found))


def _presets(cache: str):
    from gluon_wgmma_probe import wgmma_paths_kernel
    from longattn._triton_merge import merge_splits_kernel
    from longattn.gqa.triton.decode import gqa_decode_split_kernel
    from longattn.gqa.triton.prefill import gqa_prefill_kernel
    from longattn.gqa.triton.prefill_gluon import gqa_prefill_gluon_kernel
    from longattn.paged.triton.attention import paged_attn_kernel
    from longattn.rms_norm_rotary.triton.kernel import _rms_norm_rotary_kernel
    from longattn.sparse.triton.decode import dsa_split_kernel
    from longattn.sparse.triton.indexer import indexer_score_kernel
    from longattn.sparse.triton.select import indexer_select_kernel

    q16 = "fp16" if cache == "i8" else "bf16"  # int8 K: fp16 Q rows with power-of-two scales
    attn_types = {"q_ptr": f"*{q16}", "k_ptr": f"*{cache}", "v_ptr": f"*{cache}", "o_ptr": "*bf16",
                  "out_ptr": "*bf16", "sink_ptr": "*bf16", "seqlens_ptr": "*i32", "bias_ptr": "*bf16", "qk_scale": "fp32",
                  "softcap_mult": "fp32", "xq_ptr": "*bf16", "xk_ptr": "*bf16", "xv_ptr": "*bf16",
                  "pos_ptr": "*i64", "eps": "fp32"}  # fmt: skip
    attn_q_dtype = tl.float16 if cache == "i8" else tl.bfloat16
    # DSA: fp16 Q (and dots) for an fp16 cache or an int8 one (power-of-two Q rows)
    dsa_dot = tl.float16 if cache in ("i8", "fp16") else tl.bfloat16
    dsa_q = "fp16" if cache in ("i8", "fp16") else "bf16"
    flags = dict(IS_FIRST_PROMPT=True, HAS_WINDOW=False, HAS_SOFTCAP=False, HAS_BIAS=False,
                 HAS_VSCALE=cache == "i8", HAS_QSCALE=cache == "i8", DOT_PREC="tf32",
                 DOT_DTYPE=tl.float16 if cache == "i8" else tl.bfloat16,
                 INTERPRET=False)  # fmt: skip
    return {
        "gqa-prefill": (gqa_prefill_kernel, attn_types,
                        dict(NUM_HEADS=32, GROUP=4, HEAD=128, BLOCK_M=128, BLOCK_N=128,
                             HAS_SINK=False, SINK_FROM_PTR=False, USE_DESC=False, **flags), 8, 3),
        "gqa-prefill-gluon": (gqa_prefill_gluon_kernel,
                              {**attn_types, "sink_ptr": "*bf16", "max_total": "i32",
                               "counter_ptr": "*i32"},
                              dict(NUM_HEADS=32, GROUP=4, HEAD=128, BLOCK_N=128, STAGES=2,
                                   V_STAGES=2, EARLY_K_RELEASE=False,
                                   IS_FIRST_PROMPT=True, HAS_WINDOW=False, HAS_SOFTCAP=False,
                                   HAS_SINK=False, SINK_FROM_PTR=False,
                                   CONSUMER_REGS=240, ORDER=2, DYNAMIC=True,
                                   Q_SLOTS=2, EPILOGUE_SMEM=True, EPILOGUE_TMA=False), 4, 1),
        "gqa-decode": (gqa_decode_split_kernel, attn_types,
                       dict(NUM_HEADS=32, KV_HEADS=8, GROUP=4, HEAD=128, ROWS_PAD=16, BLOCK_N=64,
                            PV_DTYPE=tl.float16 if cache == "i8" else tl.bfloat16, PDL=False,
                            FUSE_PROLOGUE=False, Q_DTYPE=attn_q_dtype, ROT_DIM=0,
                            HAS_ROTARY=False, INTERLEAVED=False, HAS_POS=False, HAS_QNORM=False,
                            HAS_KNORM=False, K_QUANT=cache == "i8",
                            **dict(flags, IS_FIRST_PROMPT=False)), 4, 4),
        "paged-decode": (paged_attn_kernel,
                         {"q_ptr": f"*{q16}", "kc_ptr": f"*{cache}", "vc_ptr": f"*{cache}",
                          "o_ptr": "*bf16", "cu_ptr": "*i32", "past_ptr": "*i32",
                          "table_ptr": "*i32", "sink_ptr": "*bf16", "qk_scale": "fp32",
                          "softcap_mult": "fp32"},
                         dict(NUM_HEADS=32, KV_HEADS=8, GROUP=4, HEAD=128, ROWS=16, TOK_M=4,
                              DEC_TOK=1, IS_DECODE=True, BLOCK_N=64, BLOCK_SIZE=64, B_PAD=8,
                              HAS_SINK=False, SINK_FROM_PTR=False, PDL=False,
                              **{k: v for k, v in flags.items()
                                 if k not in ("IS_FIRST_PROMPT", "HAS_BIAS")}), 4, 3),
        "dsa-decode": (dsa_split_kernel,
                       {**{f"{n}_ptr": "*bf16" for n in ("qa", "ka", "va", "xq", "xk", "xv")},
                        "q_ptr": f"*{dsa_q}", "qs_ptr": "*fp32",
                        "kc_ptr": f"*{cache}", "vc_ptr": f"*{cache}", "sel_ptr": "*i32",
                        "cnt_ptr": "*i32", "seqlens_ptr": "*i32", "pos_ptr": "*i64",
                        "qk_scale": "fp32", "eps": "fp32"},
                       dict(NUM_HEADS=24, KV_HEADS=4, GROUP=6, HEAD=256, HEAD_PAD=256, G_PAD=16,
                            BLOCK_N=32, IS_FIRST_PROMPT=False, HAS_WINDOW=False, SEL_AUX=False,
                            HAS_VSCALE=cache == "i8", INTERPRET=False, PDL=False,
                            FUSE_PROLOGUE=False, Q_DTYPE=dsa_dot, ROT_DIM=0,
                            HAS_ROTARY=False, INTERLEAVED=False, HAS_POS=False, HAS_QNORM=False,
                            HAS_KNORM=False, K_QUANT=cache == "i8", HAS_QSCALE=cache == "i8",
                            **{f"{a}_{b}_{c}": (dsa_dot if c == "DTYPE" else "tf32")
                               for a in ("MAIN", "SEL") for b in ("QK", "PV")
                               for c in ("DTYPE", "PREC")}), 4, 3),
        "rms": (_rms_norm_rotary_kernel,
                {"x_ptr": "*bf16", "out_ptr": "*fp16", "pos_ptr": "*bf16", "eps": "fp32"},
                dict(NUM_HEADS=32, HEAD=128, HEAD_PAD=128, HALF_PAD=64, BLOCK_N=8, ROT_OFF=0,
                     ROT_DIM=128, IS_PARTIAL=False, HAS_POS=False, INTERLEAVED=False,
                     EXACT=True, TILE_TABLES=False, PDL=False), 2, 1),
        "indexer-score": (indexer_score_kernel,
                          {"q_ptr": "*bf16", "k_ptr": "*fp32", "seqlens_ptr": "*i32", "tmax_ptr": "*i32",
                           "scale": "fp32"},
                          dict(NI=16, DI=128, DI_PAD=128, BLOCK_B=32, BLOCK_S=16, S_TILE=1,
                               BLOCK_R=16, BLOCK_D=128, IS_FIRST_PROMPT=False, OUT_KEYS=False,
                               PDL=False, DOT_PREC="split3"), 4, 1),
        "wgmma-probe": (wgmma_paths_kernel, {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32"},
                        dict(M=64, N=64, K=256), 4, 1),
        "merge": (merge_splits_kernel,
                  {"o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "sink_ptr": "*fp32",
                   "o_ptr": "*bf16"},
                  dict(NUM_HEADS=24, HEAD=256, SPLITS_PAD=128, BLOCK_D=64, HAS_SINK=False,
                       SINK_FROM_PTR=False, PDL=True, EARLY_O=True), 4, 1),
        "indexer-select": (indexer_select_kernel,
                           {"score_ptr": "*fp32", "clk_ptr": "*i64", **{f"{n}_ptr": "*i32" for n in
                                                     ("seqlens", "scratch", "idx", "cnt", "tmax")}},
                           dict(NB_PAD=2048, KB_PAD=32, BLOCK_O=1024, TOPK=False, RADIX_BITS=2,
                                IDS_IN_REGS=True, IS_FIRST_PROMPT=False, PDL=False, EMIT_R=0), 8, 1),
    }  # fmt: skip


def _value(text: str):
    if text in ("True", "False"):
        return text == "True"
    if text.lstrip("-").isdigit():
        return int(text)
    return getattr(tl, text) if hasattr(tl, text) else text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=["gqa-prefill", "gqa-prefill-gluon", "gqa-decode", "paged-decode", "dsa-decode", "rms", "indexer-score",
                                       "indexer-select", "merge", "wgmma-probe"])  # fmt: skip
    ap.add_argument("--set", default="", help="constexpr overrides: NAME=VALUE,...")
    ap.add_argument("--cache", default="bf16", help="K/V cache element type (bf16, fp16, i8)")
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap (launch option)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = ap.parse_args(argv)
    fn, types, ce, warps, stages = _presets(args.cache)[args.kernel]
    for item in filter(None, args.set.split(",")):
        name, val = item.split("=")
        ce[name] = _value(val)
    if ce.get("USE_DESC"):  # gqa-prefill's TMA path: the caches arrive as tensor descriptors
        elem = types["k_ptr"].lstrip("*")
        types = dict(types, **{f"{n}_desc": f"tensordesc<{elem}[1, 1, {ce['BLOCK_N']}, "
                                            f"{ce['HEAD']}]>" for n in ("k", "v")})  # fmt: skip
    maxnreg = args.maxnreg
    if args.kernel == "gqa-prefill-gluon":  # Q arrives as a Gluon descriptor; 168 regs at launch
        from triton.experimental.gluon import language as gl

        h, bn = ce["HEAD"], ce["BLOCK_N"]
        q_layout = gl.NVMMASharedLayout.get_default_for([64, h], gl.bfloat16)
        kv_layout = gl.NVMMASharedLayout.get_default_for([1, 1, bn, h], gl.bfloat16)
        kv_type = f"tensordesc<bf16[1, 1, {bn}, {h}],{kv_layout!r}>"
        o_layout = gl.NVMMASharedLayout.get_default_for([1, 64, h], gl.bfloat16)
        q_type = f"tensordesc<bf16[64, {h}],{q_layout!r}>"
        o_type = f"tensordesc<bf16[1, 64, {h}],{o_layout!r}>" if ce["EPILOGUE_TMA"] else q_type
        types = dict(types, q_desc=q_type, k_desc=kv_type, v_desc=kv_type, o_desc=o_type)
        maxnreg = maxnreg or 168
    res = compile_sass(fn, types, ce, num_warps=args.warps or warps,
                       num_stages=args.stages or stages, maxnreg=maxnreg)  # fmt: skip
    hist = histogram(res["sass"])
    if args.json:
        print(
            json.dumps(
                dict(
                    total=sum(hist.values()),
                    hist=hist,
                    regs=res["regs"],
                    stack=res["stack"],
                    shared=res["shared"],
                    memory=memory_ops(res["sass"]),
                    loops=loops(res["sass"]),
                    hgmma_rs=len(re.findall(r"HGMMA\S* R\d+, R\d+, gdesc", res["sass"])),
                    # waits that leave one wgmma group in flight (an overlapped schedule)
                    hgmma_wait1=len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", res["sass"])),
                    # all waits: one per HGMMA where ptxas serialized the wgmmas (C7512)
                    hgmma_waits=len(re.findall(r"WARPGROUP\.DEPBAR", res["sass"])),
                    clock_reads=len(re.findall(r"SR_CLOCKLO", res["sass"])),
                    # named barriers: "SYNC 14/256" -> count (id / thread count; all: no count)
                    barriers=named_barriers(res["sass"]),
                )
            )
        )
        return res
    print(
        f"{args.kernel}: {sum(hist.values())} instructions, shared {res['shared']} B, "
        f"{res['regs']} registers, stack {res['stack']} B"
    )
    print("  memory:", dict(memory_ops(res["sass"])))
    for i, c in enumerate(loops(res["sass"])):
        print(f"  loop {i}: {sum(c.values())} instructions:", dict(c.most_common(14)))
    return res


if __name__ == "__main__":
    main()
