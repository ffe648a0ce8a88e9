"""The pending GPU checks (DEVELOPERS.md, "Pending GPU checks") as one device call.

Device time is scarce and calls are capped at 10 minutes, so the checks run in the order given
(default: the order below, most wanted first), each under its own timeout, and none starts once
``--budget`` seconds minus its estimate are spent. Each writes its log (and results folder)
under ``--out``; ``summary.txt`` says what ran, how long, and the exit status, and
``goals.md`` sets what the call measured against the issues' goals (``goals.py``).

    PYTHONPATH=src python benchmarks/pending.py --out $OUT --budget 560
    PYTHONPATH=src python benchmarks/pending.py --out $OUT gqa_cache prefill_ab
    python benchmarks/pending.py --list

``prefill_ab`` times the Gluon prefill's defaults against the session-40 source (``--ref-src``,
extracted with ``git show`` of commit ``REF_COMMIT``, or given as ``--ref FILE``); where neither
is at hand it runs without the reference build and says so in the summary.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REF_COMMIT = "e15af3c"  # session 40's HEAD: the Gluon prefill before the mask and PINGPONG
REF_SRC = "src/longattn/gqa/triton/prefill_gluon.py"
_PY = sys.executable


def _gpu_tests(selector: str) -> list[str]:
    """``pytest -m gpu -k selector`` over the GQA Triton tests on 8 workers."""
    return [_PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-n", "8", "-k",
            selector, "tests/test_gqa_triton.py"]  # fmt: skip


def _gqa_sections(sections: str) -> list[str]:
    """``bench_gqa.py --sections sections`` into the check's folder."""
    return [_PY, "benchmarks/bench_gqa.py", "--sections", sections, "--out", "{out}"]


def _prefill_ab(heads: int, rounds: int, variants: str, ref: bool = False) -> list[str]:
    """``prefill_tma_ab.py`` at S = 2K / 4K / 8K / 32K (against the reference source: ``ref``)."""
    cmd = [_PY, "benchmarks/prefill_tma_ab.py", "--out", "{out}", "--rounds", str(rounds),
           "--heads", str(heads), "--seqs", "2048,4096,8192,32768", "--variants", variants]  # fmt: skip
    return cmd + ["--ref-src", "{ref}"] if ref else cmd


# name -> (estimated seconds, timeout seconds, command with {out} / {ref} placeholders, what)
CHECKS: dict[str, tuple[int, int, list[str], str]] = {
    "gqa_cache": (75, 150, _gqa_sections("cache"),
                  "int8 decode options (V_PAIRS / K_PAIRS / K_SHIFT / V_SHIFT rows; issue 3's 1.7x "
                  "goal)"),
    "prefill_ab": (70, 160, _prefill_ab(128, 9, "gluon,gluon_nopp,gluon_ekr,gluon_ekr_pp,"
                                                "gluon_cross", ref=True),
                   "H=128 defaults (mask, PINGPONG, CROSS_ITEM) vs the session-40 source"),
    "prefill": (15, 60, _gqa_sections("prefill"), "prefill vs cuDNN / flash SDPA (issue 3's table)"),
    # session 42 (H100) timed the ring / ping-pong / 128-key-tile variants: all lost; session
    # 43 (H100) made LAZY_RESCALE the H=256 default (-1.4 to -3.8% at S=8K, ties elsewhere)
    "prefill_h256": (45, 120, _prefill_ab(256, 7, "gluon,gluon_nolazy,gluon_long"),
                     "H=256: the LAZY_RESCALE default (session 43, H100 only) and the long-item "
                     "ring shape"),
    "tests_h256": (60, 150, _gpu_tests("256"),
                   "GPU tests of the H=256 builds (LAZY_RESCALE their default since session 43, "
                   "which ran only its option variants)"),
    "prefill_h64": (30, 90, _prefill_ab(64, 7, "gluon,gluon_lazy"),
                    "H=64: LAZY_RESCALE (untimed there; SASS tile loop 643 -> 657, 625 skipped)"),
    "tests_k_shift": (40, 120, _gpu_tests("k_shift"),
                      "GPU tests of the int8 K_SHIFT / V_SHIFT builds"),
    "tests_prefill": (175, 280, _gpu_tests("prefill_gluon"),
                      "GPU tests of the Gluon prefill (127 passed on the H100, session 43)"),
    "gqa_decode": (100, 220, _gqa_sections("decode"),
                   "GQA decode vs copy bandwidth and SDPA (B=1 T=32K: 81% chained vs the 90% "
                   "goal); the 'direct' rows A/B DIRECT_OUT at B=32 (one split, no merge)"),
    "tests_direct": (45, 120, _gpu_tests("direct_out"),
                     "GPU tests of DIRECT_OUT (session 44, interpreter-tested only)"),
    "paged_int8": (60, 150, [_PY, "benchmarks/bench_paged.py", "--sections", "int8", "--out",
                             "{out}"],
                   "paged int8 decode: the I2F-free tile conversion (default since session 44, "
                   "untimed) vs the I8_I2F build (ours_int8_i2f_us) and the V_PAIRS option "
                   "(ours_int8_v_pairs_us), B=8 / 64 ragged"),
    "tests_paged": (40, 120, [_PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                              "-n", "4", "tests/test_paged_triton.py", "tests/test_paged.py"],
                    "GPU tests of the paged kernels (int8 tiles without I2F since session 44; "
                    "the I8_I2F and V_PAIRS builds: test_int8_tile_builds_gpu)"),
    "sparse_layer": (
        150, 300,
        [_PY, "benchmarks/bench_sparse.py", "--sections", "layer,cache", "--B", "1,4", "--S",
         "8,1", "--T", "131072,262144", "--variants", "prefetch,tiles_any_rows,again",
         "--out", "{out}"],
        "session-34 sparse defaults (PREFETCH, groups floor) and the layer table's rows",
    ),
}  # fmt: skip


def _ref_source(out: Path, given: str) -> str:
    """The reference ``prefill_gluon.py``: ``given``, else session 40's by ``git show`` (written
    under ``out``); "" where neither is at hand."""
    if given:
        return given
    got = subprocess.run(["git", "show", f"{REF_COMMIT}:{REF_SRC}"], cwd=ROOT,
                         capture_output=True, text=True)  # fmt: skip
    if got.returncode != 0:
        return ""
    path = out / "ref_prefill_gluon.py"
    path.write_text(got.stdout)
    return str(path)


def command(name: str, folder: Path, ref: str) -> list[str]:
    """The argv of check ``name`` writing under ``folder``; without a reference source
    (``ref`` "") the ``--ref-src`` option is left out."""
    cmd = CHECKS[name][2]
    if not ref and "{ref}" in cmd:
        i = cmd.index("{ref}")
        cmd = cmd[: i - 1] + cmd[i + 1 :]
    return [c.format(out=folder, ref=ref) for c in cmd]


def plan(names: list[str], budget: float, spent: float) -> list[str]:
    """The checks of ``names`` (in order) whose estimate still fits ``budget - spent``; a check
    that does not fit is skipped, and later (shorter) ones may still run."""
    chosen = []
    for name in names:
        est = CHECKS[name][0]
        if spent + est <= budget:
            chosen.append(name)
            spent += est
    return chosen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checks", nargs="*", help=f"default: all, in this order: {list(CHECKS)}")
    ap.add_argument("--out", default=os.environ.get("OUT", "pending_out"))
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for the whole call")
    ap.add_argument("--list", action="store_true", help="print the checks and exit")
    ap.add_argument("--ref", default="", help="reference prefill_gluon.py for prefill_ab")
    args = ap.parse_args(argv)
    names = args.checks or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        ap.error(f"unknown checks {unknown}; known: {list(CHECKS)}")
    if args.list:
        for name in names:
            est, limit, cmd, what = CHECKS[name]
            print(f"{name}: ~{est} s (timeout {limit} s): {what}\n    {' '.join(cmd[1:])}")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1")
    lines = []
    for name in names:
        spent = time.time() - t0
        if not plan([name], args.budget, spent):
            lines.append(f"{name}: skipped (~{CHECKS[name][0]} s left no room)")
            continue
        est, limit, cmd, _ = CHECKS[name]
        folder = out / name
        folder.mkdir(exist_ok=True)
        ref = _ref_source(out, args.ref) if "{ref}" in cmd else ""
        if "{ref}" in cmd and not ref:
            lines.append(f"{name}: no reference source (git history or --ref): run without it")
        argv_ = command(name, folder, ref)
        limit = min(limit, max(1.0, args.budget - spent))
        start = time.time()
        with open(out / f"{name}.log", "w") as log:
            try:
                rc = subprocess.run(argv_, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=limit).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                rc = "timeout"
        lines.append(f"{name}: rc {rc}, {time.time() - start:.0f} s (estimate {est} s)")
        print(lines[-1], flush=True)
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    _write_goals(out)
    return 0


def _write_goals(out: Path) -> None:
    """``goals.md``: the issues' goals against what this call measured (``goals.py``)."""
    try:
        import goals  # beside this script (its folder is sys.path[0] when run)

        report = goals.report(goals.evaluate(goals.load_rows([str(out)])))
    except Exception as exc:  # a report must never cost the call its results
        report = f"goals.py failed: {type(exc).__name__}: {exc}"
    (out / "goals.md").write_text(report + "\n")


if __name__ == "__main__":
    sys.exit(main())
