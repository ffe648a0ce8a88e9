"""longattn command line: demo, info, precision, bench."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _op_gates(device: torch.device) -> dict:
    """``{label: (op name, gates)}``: each op's tier gates for a representative bf16 input on
    ``device`` (the op name is the one ``_cascade.select_backend`` and its errors use)."""
    from .rms_norm_rotary.api import gates as rms_gates

    x = torch.empty(1, 1, 8 * 128, dtype=torch.bfloat16, device=device)
    cos = torch.empty(16, 64, dtype=torch.float32, device=device)
    ops = {
        "rms_norm_rotary (bf16, H=128)": ("rms_norm_rotary", rms_gates(x, cos, 8, torch.float16))
    }
    ops.update(_extra_op_gates(device))
    return ops


def _dsa_params(total: int):
    from .sparse._params import DSAParams

    return DSAParams(
        num_heads=24, kv_num_heads=4, head_size=256, scale=256**-0.5, local_window_size=-1,
        attention_mode="selected_only", selected_kv_source="main", do_rotary=False,
        rotary_interleaved=False, rotary_offset=0, smooth_softmax=False, qk_norm_epsilon=1e-6,
        auxiliary_kv_shared=False, is_first_prompt=False, total_sequence_length=total,
        query_dtype=None, cos_cache=None, sin_cache=None, position_ids=None, head_sink=None,
        q_norm_weight=None, k_norm_weight=None, k_scale=None, v_scale=None,
    )  # fmt: skip


def _extra_op_gates(device: torch.device) -> dict:
    """Gates of the attention ops for representative bf16 decodes (empty tensors, no data)."""
    from . import _cascade
    from .gqa.api import triton_gate_reason
    from .paged import api as paged_api
    from .sparse import api as dsa_api
    from .sparse import indexer as indexer_api

    bf16 = torch.bfloat16
    gqa = {
        "triton": lambda explicit: triton_gate_reason(device, bf16, bf16, 128, False, explicit),
        "chunked": _cascade.always,
        "reference": _cascade.always,
    }

    def empty(*shape, dtype=bf16):
        return torch.empty(shape, dtype=dtype, device=device)

    paged = {
        "triton": lambda explicit: paged_api.triton_gate_reason(
            device, bf16, bf16, 128, 64, explicit
        ),
        "chunked": _cascade.always,
        "reference": _cascade.always,
    }
    dsa_q, dsa_kv, dsa_cache = empty(1, 1, 24 * 256), empty(1, 1, 4 * 256), empty(1, 4, 64, 256)
    return {
        "group_query_attention (bf16 cache, H=128)": ("group_query_attention", gqa),
        "paged_attention (bf16 cache, H=128, block 64)": ("paged_attention", paged),
        "sparse_attention_indexer (bf16 query, fp32 block keys, 16 x 128)": (
            "sparse_attention_indexer",
            indexer_api.gates(empty(1, 1, 16 * 128), empty(1, 64, 128, dtype=torch.float32)),
        ),
        "dynamic_sparse_attention (bf16 cache, H=256, group 6)": (
            "dynamic_sparse_attention",
            dsa_api.gates(dsa_q, dsa_kv, dsa_kv, dsa_cache, None, None, _dsa_params(64)),
        ),
    }  # fmt: skip


def cmd_info(_args) -> int:
    from . import __version__, _cascade

    print(f"longattn {__version__}")
    print(f"python {platform.python_version()} on {platform.machine()}")
    print(f"torch {torch.__version__}")
    try:
        import triton

        print(f"triton {triton.__version__}")
    except Exception as exc:  # pragma: no cover
        print(f"triton: not importable ({exc})")
    dev = _default_device()
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        print(f"device: cuda:0 {p.name} sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")
    else:
        print(
            f"device: cpu ({os.cpu_count()} cores); TRITON_INTERPRET={_cascade.interpreter_active()}"
        )
    env = _cascade.env_settings()
    print(
        f"env: disabled={sorted(env.disabled) or 'none'} backend={env.backend or 'auto'} debug={env.debug}"
    )
    for label, (op, gates) in _op_gates(dev).items():
        print(f"\n{label}:")
        for tier, (ok, why) in _cascade.describe_gates(gates).items():
            print(f"  {tier:<9} {'yes' if ok else 'no '}  {why}")
        try:  # what backend="auto" picks, LONGATTN_BACKEND / LONGATTN_DISABLE_* included
            chosen = _cascade.select_backend(op, "auto", gates)
        except RuntimeError as exc:
            chosen = f"error: {exc}"
        print(f"  auto -> {chosen}")
    return 0


def cmd_precision(args) -> int:
    from .precision import format_report, precision_report

    t0 = time.perf_counter()
    rows = precision_report(head_sizes=tuple(args.head_sizes), num_positions=args.positions,
                            max_pos=args.max_pos, num_heads=args.num_heads, device=args.device)  # fmt: skip
    print(
        f"RMSNormRotary precision: {args.positions} positions of a {args.max_pos}-long cos/sin "
        f"cache, {args.num_heads} heads, Q/K-like inputs with outlier channels; errors vs fp64"
    )
    print(format_report(rows))
    print("reference (ORT PR, Qwen3.8 data): legacy 0.1954% vs exact fp16 0.0207% (9.4x); "
          "logits at 32K 0.2789% -> 0.0293%")  # fmt: skip
    print(f"({time.perf_counter() - t0:.1f}s)")
    return 0


def cmd_demo(args) -> int:
    from . import _cascade, rms_norm_rotary, rope_cache

    dev = args.device if args.device is not None else _default_device()  # (_device_arg)
    print(f"longattn demo on {dev} (torch {torch.__version__})")
    # 1. RMSNormRotary on a Qwen-like Q projection: bf16 in, fp16 out, fp32 cos/sin.
    b, s, n, h = 1, 2048, 16, 128
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, n * h, generator=gen).to(torch.bfloat16).to(dev)
    w = (1 + 0.25 * torch.randn(h, generator=gen)).to(dev)
    cos, sin = rope_cache(32768, h, device=dev)
    pos = torch.arange(30000, 30000 + s, device=dev)[None]
    t0 = time.perf_counter()
    y = rms_norm_rotary(x, w, cos, sin, pos, num_heads=n, out_dtype=torch.float16)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tier = _cascade.last_backend("rms_norm_rotary")  # the tier that ran
    print(f"\n[1] rms_norm_rotary x{tuple(x.shape)} bf16 -> {tuple(y.shape)} {y.dtype}, "
          f"positions 30000..{30000 + s - 1}: backend={tier}, {dt * 1e3:.1f} ms (first call)")  # fmt: skip
    # 2. Precision table at demo size (the full one: `longattn precision`).
    from .precision import format_report, precision_report

    rows = precision_report(head_sizes=(128, 256), num_positions=4096, num_heads=2, device=dev)
    print("\n[2] precision vs fp64 (4096 positions of a 256K cos/sin cache; full run: "
          "`longattn precision`)")  # fmt: skip
    print(format_report(rows))
    _demo_attention(dev)
    return 0


def _demo_attention(dev: torch.device) -> None:
    try:
        from .demos import attention_demo
    except ImportError:
        return
    attention_demo(dev)


def cmd_bench(args) -> int:
    if not torch.cuda.is_available():
        print("longattn bench needs a CUDA GPU (the benchmarks time GPU kernels); none found.")
        return 2
    root = Path(__file__).resolve().parents[2] / "benchmarks"
    runner = root / "run.py"
    if not runner.exists():
        print(f"benchmarks/ not found next to the package ({runner}); run from a source checkout.")
        return 2
    cmd = [sys.executable, str(runner), *args.ops]
    if args.out:
        cmd += ["--out", args.out]
    return subprocess.call(cmd)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="longattn", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    dev_help = "torch device, e.g. cpu or cuda:0 (default: cuda if available, else cpu)"
    p = sub.add_parser("demo", help="run the ops on an embedded example and print what happened")
    p.add_argument("--device", default=None, type=_device_arg, help=dev_help)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("info", help="versions, device, and which backend tiers each op can use")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("precision", help="RMSNormRotary precision report (legacy vs exact)")
    p.add_argument(
        "--positions",
        type=int,
        default=32768,
        help="positions sampled from the cos/sin cache (default 32768, <= --max-pos)",
    )
    p.add_argument(
        "--max-pos", type=int, default=262144, help="cos/sin cache length (default 262144)"
    )
    p.add_argument("--num-heads", type=int, default=4, help="heads per token (default 4)")
    p.add_argument(
        "--head-sizes",
        type=int,
        nargs="+",
        default=[128, 256],
        help="head sizes to report (default 128 256)",
    )
    p.add_argument("--device", default=None, type=_device_arg, help=dev_help)
    p.set_defaults(fn=cmd_precision)
    p = sub.add_parser("bench", help="run benchmarks/ on the GPU (writes benchmarks/results/)")
    p.add_argument(
        "ops", nargs="*", help="ops to run: rms_norm_rotary, gqa, paged, sparse (default: all)"
    )
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.set_defaults(fn=cmd_bench)
    args = parser.parse_args(argv)
    if args.cmd == "precision" and args.positions > args.max_pos:
        parser.error(f"--positions ({args.positions}) must be <= --max-pos ({args.max_pos})")
    return args.fn(args)


def _device_arg(value: str) -> torch.device:
    try:
        return torch.device(value)
    except RuntimeError as exc:
        raise argparse.ArgumentTypeError(f"not a torch device: {value!r} ({exc})") from None


if __name__ == "__main__":
    sys.exit(main())
