"""The open issues' performance goals, checked against benchmark result files.

    python benchmarks/goals.py benchmarks/results/gqa_prefill_session43_h100.json
    python benchmarks/goals.py $OUT                 # every result JSON under a folder
    python benchmarks/goals.py FILES --json         # one JSON object per line instead

Each goal of issue 3 (GroupQueryAttention) and issue 5 (sparse attention) that a file's rows
measure gets one line per shape: the measured value, the target, the verdict, the GPU and the
file. The issues name the H200: a shape measured on another GPU gets its verdict in brackets
(``[pass]`` / ``[FAIL]``) and does not count as met. A goal no given file measures is listed
as ``not measured``. Reading only: no GPU needed (``pending.py`` runs it on its output).

``bound`` (where the rows allow it): the best value the goal's metric could take at that shape.
For indexer + DSA vs dense it is the dense time over the DSA's bytes at the run's copy
bandwidth (a free indexer, no launch or round-trip latency): a target above it is out of reach
by bytes alone, whatever the kernels do.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

TARGET_GPU = "H200"
K128, K256 = 131072, 262144


@dataclass
class Row:
    """One result row with where it came from."""

    data: dict
    gpu: str
    source: str
    meta: dict

    def get(self, key, default=None):
        return self.data.get(key, default)


@dataclass
class Check:
    """One goal at one shape."""

    issue: int
    goal: str
    shape: str
    value: float
    target: str
    ok: bool
    gpu: str
    source: str
    column: str
    bound: float | None = None

    @property
    def on_target(self) -> bool:
        return TARGET_GPU in self.gpu

    @property
    def verdict(self) -> str:
        word = "pass" if self.ok else "FAIL"
        return word if self.on_target else f"[{word}]"


def load_rows(paths: list[str]) -> list[Row]:
    """Rows of every benchmark result JSON (``{"meta": ..., "rows": [...]}``) among ``paths``
    (files, or folders searched recursively); other JSON files are skipped."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.rglob("*.json"))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    rows = []
    for f in files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
            continue
        meta = doc.get("meta") if isinstance(doc.get("meta"), dict) else {}
        gpu = str(meta.get("gpu", "unknown GPU"))
        rows += [Row(r, gpu, str(f), meta) for r in doc["rows"] if isinstance(r, dict)]
    return rows


def _section(rows: list[Row], name: str) -> Iterator[Row]:
    return (r for r in rows if r.get("section") == name)


def _first(row: Row, *columns: str) -> tuple[str, float] | None:
    """The first of ``columns`` the row holds a number in: ``(column, value)``."""
    for c in columns:
        v = row.get(c)
        if isinstance(v, (int, float)) and v == v:
            return c, float(v)
    return None


def _check(issue, goal, shape, found, target, ok, row, bound=None) -> Check:
    column, value = found
    return Check(issue, goal, shape, value, target, ok(value), row.gpu, row.source, column, bound)


# --- issue 3: GroupQueryAttention ----------------------------------------------------------


def prefill_vs_sdpa(rows):
    """Prefill, causal bf16 (32, 8), B*S = 16K: >= 1.0x the best SDPA backend (H 128 and 256)."""
    for r in _section(rows, "prefill"):
        found = _first(r, "attn_vs_best_sdpa")
        if found:
            shape = f"H={r.get('H')} S={r.get('S')}"
            yield _check(3, "prefill vs best SDPA", shape, found, ">= 1.00x", lambda v: v >= 1.0, r)


def decode_bandwidth(rows):
    """Decode, bf16 cache: >= 90% of copy bandwidth for T >= 32K (the chained graph, a model's
    decode step, where measured; else the one-call graph)."""
    for r in _section(rows, "decode"):
        if r.get("cache", "bf16") != "bf16" or (r.get("T") or 0) < 32768:
            continue
        found = _first(r, "chain_pct_of_copy_bw", "graph_pct_of_copy_bw")
        if found:
            shape = f"B={r.get('B')} T={r.get('T')}"
            yield _check(3, "decode % of copy BW", shape, found, ">= 90%", lambda v: v >= 90, r)


def decode_vs_sdpa(rows):
    """Decode, bf16 cache: >= 1.0x SDPA (cuDNN), both as one-call CUDA graphs."""
    for r in _section(rows, "decode"):
        if r.get("cache", "bf16") != "bf16":
            continue
        ours, peer = r.get("ours_graph_us"), r.get("cudnn_graph_us")
        if isinstance(ours, (int, float)) and isinstance(peer, (int, float)) and ours > 0:
            shape = f"B={r.get('B')} T={r.get('T')}"
            found = ("cudnn_graph_us / ours_graph_us", peer / ours)
            yield _check(3, "decode vs SDPA", shape, found, ">= 1.00x", lambda v: v >= 1.0, r)


def int8_vs_bf16(rows):
    """INT8 cache >= 1.7x faster than BF16 at T = 128K (the default build)."""
    for r in _section(rows, "cache"):
        if r.get("cache") == "int8" and r.get("T") == K128 and "budget" not in r.data:
            found = _first(r, "speedup_vs_bf16")
            if found:
                shape = f"B={r.get('B')} T={r.get('T')}"
                yield _check(3, "int8 vs bf16 decode", shape, found, ">= 1.70x",
                             lambda v: v >= 1.7, r)  # fmt: skip


def fp16_cache_vs_bf16(rows):
    """FP16 cache with BF16 activations within 5% of BF16 (speedup >= 1 / 1.05)."""
    for r in _section(rows, "cache"):
        if r.get("cache") == "fp16" and "budget" not in r.data:
            found = _first(r, "speedup_vs_bf16")
            if found:
                shape = f"B={r.get('B')} T={r.get('T')}"
                yield _check(3, "fp16-for-bf16 cache", shape, found, ">= 0.952x",
                             lambda v: v >= 1 / 1.05, r)  # fmt: skip


def features_vs_flex(rows):
    """Softcap / window / sink (and plain causal): >= 1.2x FlexAttention."""
    for r in _section(rows, "features"):
        found = _first(r, "speedup_vs_flex")
        if found:
            shape = f"{r.get('phase')} {r.get('feature')} B={r.get('B')} S|T={r.get('S_or_T')}"
            yield _check(3, "features vs Flex", shape, found, ">= 1.20x", lambda v: v >= 1.2, r)


# --- issue 5: sparse attention -------------------------------------------------------------


def _sparse_shape(r: Row) -> str:
    return f"B={r.get('B')} S={r.get('S')} T={r.get('T')} {r.get('cache')}"


def layer_vs_dense(rows):
    """Indexer + DSA >= 10x faster than our dense GQA decode at T = 128K, >= 20x at 256K
    (chained: the layer op where measured, else the two ops)."""
    want = {K128: 10.0, K256: 20.0}
    for r in _section(rows, "layer"):
        if r.get("T") not in want:
            continue
        goal = want[r.get("T")]
        found = _first(r, "chain_dense_over_layer_op", "chain_dense_over_sparse",
                       "dense_over_sparse")  # fmt: skip
        if found:
            yield _check(5, "indexer + DSA vs dense", _sparse_shape(r), found,
                         f">= {goal:.0f}x", lambda v, g=goal: v >= g, r,
                         _bytes_bound(r, found[0]))  # fmt: skip


def _bytes_bound(r: Row, column: str) -> float | None:
    """Dense time / (the DSA's bytes at the run's copy bandwidth): the ratio's ceiling."""
    dense = r.get("chain_dense_us" if column.startswith("chain") else "dense_gqa_us")
    mb, tbps = r.get("dsa_MB"), r.meta.get("copy_TBps")
    if not all(isinstance(x, (int, float)) and x > 0 for x in (dense, mb, tbps)):
        return None
    return dense / (mb / tbps)  # MB / (TB/s) = us


def dsa_flat_in_t(rows):
    """DSA time flat in T: slowest / fastest within 1.10 from 32K to 256K, per (B, S, cache)
    and file (only where a file holds both ends of the range)."""
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for r in _section(rows, "layer"):
        if 32768 <= (r.get("T") or 0) <= K256:
            groups[(r.source, r.get("B"), r.get("S"), r.get("cache"), r.get("budget"))].append(r)
    for (_, b, s, cache, _), group in groups.items():
        ts = {r.get("T") for r in group}
        if not {32768, K256} <= ts:
            continue
        column = "chain_dsa_us" if all(_first(r, "chain_dsa_us") for r in group) else "dsa_us"
        times = [r.get(column) for r in group if isinstance(r.get(column), (int, float))]
        if len(times) == len(group) and min(times) > 0:
            found = (f"max / min {column} over T", max(times) / min(times))
            shape = f"B={b} S={s} {cache} T=32K..256K"
            yield _check(5, "DSA flat in T", shape, found, "<= 1.10", lambda v: v <= 1.10,
                         group[0])  # fmt: skip


def dsa_bandwidth(rows):
    """DSA's achieved bandwidth on the bytes it must read >= 70% of copy bandwidth."""
    for r in _section(rows, "layer"):
        found = _first(r, "dsa_vs_copy_BW")
        if found:
            yield _check(5, "DSA % of copy BW", _sparse_shape(r), found, ">= 0.70",
                         lambda v: v >= 0.70, r)  # fmt: skip


def sparse_fp16_le_bf16(rows):
    """DSA with an FP16 main cache no slower than with a BF16 one (time ratio <= 1)."""
    for r in _section(rows, "cache"):
        if r.get("cache") == "float16" and "budget" in r.data:
            found = _first(r, "vs_bf16")
            if found:
                shape = _sparse_shape(r) + f" budget={r.get('budget')}"
                yield _check(5, "DSA fp16 cache <= bf16 time", shape, found, "<= 1.00",
                             lambda v: v <= 1.0, r)  # fmt: skip


GOALS: list[tuple[int, str, Callable]] = [
    (3, "prefill vs best SDPA", prefill_vs_sdpa),
    (3, "decode % of copy BW", decode_bandwidth),
    (3, "decode vs SDPA", decode_vs_sdpa),
    (3, "int8 vs bf16 decode", int8_vs_bf16),
    (3, "fp16-for-bf16 cache", fp16_cache_vs_bf16),
    (3, "features vs Flex", features_vs_flex),
    (5, "indexer + DSA vs dense", layer_vs_dense),
    (5, "DSA flat in T", dsa_flat_in_t),
    (5, "DSA % of copy BW", dsa_bandwidth),
    (5, "DSA fp16 cache <= bf16 time", sparse_fp16_le_bf16),
]


def evaluate(rows: list[Row]) -> list[Check]:
    """Every goal at every shape the rows measure, in the order of ``GOALS``."""
    return [c for _, _, fn in GOALS for c in fn(rows)]


def report(checks: list[Check]) -> str:
    """Markdown: a table per issue, each goal's shapes, and the goals nothing measured."""
    lines = []
    for issue in sorted({g[0] for g in GOALS}):
        mine = [c for c in checks if c.issue == issue]
        met = sum(c.ok and c.on_target for c in mine)
        lines += [f"## issue {issue}: {met} of {len(mine)} shapes met on the {TARGET_GPU}", ""]
        if mine:
            lines += ["| goal | shape | value | target | verdict | bound | GPU | column | file |",
                      "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
            lines += [
                f"| {c.goal} | {c.shape} | {c.value:.3g} | {c.target} | {c.verdict} "
                f"| {'' if c.bound is None else f'{c.bound:.3g}'} | {c.gpu} | {c.column} "
                f"| {Path(c.source).name} |"
                for c in mine
            ]
        seen = {c.goal for c in mine}
        missing = [name for i, name, _ in GOALS if i == issue and name not in seen]
        if missing:
            lines += ["", "not measured: " + ", ".join(missing)]
        lines.append("")
    lines.append(
        f"verdicts in brackets: measured on another GPU than the issues' {TARGET_GPU}; "
        "bound: the best the metric could be at that shape (see goals.py)"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="result JSON files or folders")
    ap.add_argument("--json", action="store_true", help="one JSON object per checked shape")
    args = ap.parse_args(argv)
    checks = evaluate(load_rows(args.paths))
    if args.json:
        for c in checks:
            print(json.dumps(dict(asdict(c), on_target=c.on_target, verdict=c.verdict)))
    else:
        print(report(checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
