"""Precision report for RMSNormRotary: legacy BF16 path vs exact FP32 path vs the rounding floor.

Q/K-like inputs (random normal with a few large-magnitude outlier channels, as real Q/K
projections have) at ``num_positions`` positions drawn from a ``max_pos``-long cos/sin cache.
Every path's result is compared to an fp64 computation from the same input values:

- legacy: x bf16, cos/sin bf16, normalized value rounded to bf16 before RoPE, bf16 output;
- exact/bf16: fp32 cos/sin, fp32 math, one rounding to bf16;
- exact/fp16: the same with an fp16 output;
- floor: the fp64 result rounded once to bf16 / fp16 (the best any kernel can do).

Attention logits ``q.k`` (fp64 dot products of the rounded outputs) are compared the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _cascade
from ._rotary import rope_cache
from .rms_norm_rotary.api import rms_norm_rotary
from .rms_norm_rotary.reference import rms_norm_rotary_fp64
from .testing import error_stats

BF16, FP16 = torch.bfloat16, torch.float16


@dataclass
class PrecisionRow:
    head_size: int
    path: str
    qk_rel_rmse: float
    logit_rel_rmse: float | None
    backend: str


def qk_like(tokens: int, num_heads: int, head: int, gen: torch.Generator) -> torch.Tensor:
    """[1, tokens, num_heads*head] fp32 with 4 outlier channels per head (x8 .. x20 magnitude)."""
    x = torch.randn(1, tokens, num_heads, head, generator=gen)
    outliers = torch.randperm(head, generator=gen)[:4]
    x[..., outliers] *= torch.linspace(8.0, 20.0, 4)
    return x.reshape(1, tokens, num_heads * head)


def _logits(q: torch.Tensor, k: torch.Tensor, num_heads: int, n_query: int) -> torch.Tensor:
    """fp64 logits of the last ``n_query`` query rows against every key: [heads, n_query, T]."""
    b, t, d = q.shape
    h = d // num_heads
    qh = q.double().reshape(t, num_heads, h)[-n_query:].transpose(0, 1)
    kh = k.double().reshape(t, num_heads, h).transpose(0, 1)
    return qh @ kh.transpose(1, 2) / h**0.5


def precision_report(
    head_sizes=(128, 256),
    num_positions: int = 32768,
    max_pos: int = 262144,
    num_heads: int = 4,
    n_query: int = 32,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> list[PrecisionRow]:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for head in head_sizes:
        cos64, sin64 = rope_cache(max_pos, head, dtype=torch.float64)
        pos = torch.sort(torch.randperm(max_pos, generator=gen)[:num_positions]).values[None]
        w = 1.0 + 0.25 * torch.randn(head, generator=gen)
        q = qk_like(num_positions, num_heads, head, gen).to(BF16)
        k = qk_like(num_positions, num_heads, head, gen).to(BF16)
        dev = lambda t: t.to(device)
        cos32, sin32 = dev(cos64.float()), dev(sin64.float())
        cosb, sinb = dev(cos64.to(BF16)), dev(sin64.to(BF16))
        truths = {}
        for name, x in (("q", q), ("k", k)):
            truths[name] = rms_norm_rotary_fp64(x, w, cos64, sin64, pos, num_heads=num_heads,
                                                epsilon=1e-6, interleaved=False, rotary_offset=0,
                                                exact=True)  # fmt: skip
        true_logits = _logits(truths["q"], truths["k"], num_heads, n_query)
        paths = [  # (name, exact, cos, sin, out_dtype); exact=None marks a floor row
            ("legacy bf16 (bf16 cos/sin)", False, cosb, sinb, BF16),
            ("exact fp32 -> bf16", True, cos32, sin32, BF16),
            ("exact fp32 -> fp16", True, cos32, sin32, FP16),
            ("floor bf16 (fp64 rounded once)", None, None, None, BF16),
            ("floor fp16 (fp64 rounded once)", None, None, None, FP16),
        ]
        for path, exact, cos, sin, out_dtype in paths:
            if exact is None:
                outs = {n: t.to(out_dtype) for n, t in truths.items()}
                be = "-"
            else:
                outs = {
                    n: rms_norm_rotary(
                        dev(x),
                        dev(w),
                        cos,
                        sin,
                        dev(pos),
                        num_heads=num_heads,
                        exact=exact,
                        out_dtype=out_dtype,
                    ).cpu()  # fmt: skip
                    for n, x in (("q", q), ("k", k))
                }
                be = _cascade.last_backend("rms_norm_rotary")  # the tier that ran
            qk = torch.cat([outs["q"], outs["k"]], 1)
            truth = torch.cat([truths["q"], truths["k"]], 1)
            lg = error_stats(_logits(outs["q"], outs["k"], num_heads, n_query), true_logits)
            rows.append(PrecisionRow(head, path, error_stats(qk, truth).rel_rms, lg.rel_rms, be))
    return rows


def format_report(rows: list[PrecisionRow]) -> str:
    lines = [
        "| H | path | Q/K rel RMSE | logits rel RMSE | backend |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.head_size} | {r.path} | {100 * r.qk_rel_rmse:.4f}% | "
            f"{100 * r.logit_rel_rmse:.4f}% | {r.backend} |"
        )
    for head in sorted({r.head_size for r in rows}):
        by = {r.path: r for r in rows if r.head_size == head}
        legacy, exact = by["legacy bf16 (bf16 cos/sin)"], by["exact fp32 -> fp16"]
        floor = by["floor fp16 (fp64 rounded once)"]
        ratio = legacy.qk_rel_rmse / exact.qk_rel_rmse
        lratio = legacy.logit_rel_rmse / exact.logit_rel_rmse
        at_floor = exact.qk_rel_rmse <= 1.05 * floor.qk_rel_rmse
        lines.append(
            f"H={head}: legacy/exact-fp16 = {ratio:.1f}x (Q/K), {lratio:.1f}x (logits); "
            f"exact fp16 / floor = {exact.qk_rel_rmse / floor.qk_rel_rmse:.3f} "
            f"({'at the floor, within 5%' if at_floor else 'NOT within 5% of the floor'})"
        )
    return "\n".join(lines)
