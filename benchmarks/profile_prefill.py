"""One causal bf16 prefill attention call between cudaProfilerStart / Stop, for Nsight Compute
(GPU machine): our Gluon kernel alone (``ours``) or SDPA's cuDNN backend (``cudnn``) on the
bench_gqa prefill shape ((N, KV) = (32, 8), B * S = 16K).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section WarpStateStats --csv --page details \\
        python benchmarks/profile_prefill.py --H 256 --S 2048 --peer ours

Two warm-up calls run before the profiled one (compiles, cuDNN plan cache).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import bench_gqa as bg  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--H", type=int, default=128)
    ap.add_argument("--S", type=int, default=2048)
    ap.add_argument("--peer", choices=["ours", "cudnn"], default="ours")
    args = ap.parse_args(argv)
    b = max(1, 16384 // args.S)
    sets, p = bg._prefill_sets(b, args.S, args.H, 1)
    q_rot, pk, pv, seqlens, out = bg._attn_sets_from(sets, p, args.H)[0]
    if args.peer == "ours":
        fn = bg._prefill_attn_fn(p, None)

        def call():
            fn(q_rot, pk, pv, seqlens, out)
    else:
        sdpa = bg._sdpa("cudnn")
        q4 = q_rot.transpose(1, 2)  # [B, N, S, H]

        def call():
            sdpa(q4, pk, pv, True)

    for _ in range(2):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {args.peer} H={args.H} S={args.S} B={b}")


if __name__ == "__main__":
    main()
