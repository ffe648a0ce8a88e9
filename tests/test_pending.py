"""benchmarks/pending.py: the pending GPU checks as one device call (CPU: its plan and commands)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import pending  # noqa: E402


def test_every_check_runs_a_script_of_this_repository():
    for name in pending.CHECKS:
        argv = pending.command(name, Path("/tmp/x"), "ref.py")
        script = next(a for a in argv[1:] if a.endswith(".py"))
        assert (ROOT / script).exists(), (name, script)


def test_prefill_checks_name_existing_variants():
    """A variant name that ``prefill_tma_ab.variants`` lacks would be skipped silently."""
    import prefill_tma_ab

    for name in ("prefill_ab", "prefill_h256"):
        argv = pending.command(name, Path("/tmp/x"), "ref.py")
        heads = int(argv[argv.index("--heads") + 1])
        known = {v for v, _ in prefill_tma_ab.variants(heads)}
        wanted = argv[argv.index("--variants") + 1].split(",")
        assert set(wanted) <= known, (name, set(wanted) - known)


def test_plan_skips_what_does_not_fit_and_keeps_later_checks_that_do():
    est = {n: c[0] for n, c in pending.CHECKS.items()}
    big = max(est, key=est.get)
    small = min(est, key=est.get)
    assert pending.plan([big, small], budget=est[small] + 1, spent=0) == [small]
    assert pending.plan([small, big], budget=est[small] + est[big], spent=0) == [small, big]
    assert pending.plan([small], budget=est[small], spent=1) == []


def test_without_a_reference_source_the_ab_runs_without_ref_src():
    with_ref = pending.command("prefill_ab", Path("/tmp/x"), "ref.py")
    without = pending.command("prefill_ab", Path("/tmp/x"), "")
    assert with_ref[with_ref.index("--ref-src") + 1] == "ref.py"
    assert "--ref-src" not in without and len(without) == len(with_ref) - 2


def test_unknown_check_is_an_error(capsys):
    with pytest.raises(SystemExit):
        pending.main(["no_such_check", "--list"])
    assert "unknown checks" in capsys.readouterr().err
