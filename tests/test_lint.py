"""ruff (lint + format check) is part of the test command."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    exe = shutil.which("ruff")
    if exe:
        return [exe]
    pytest.importorskip("ruff")
    return [sys.executable, "-m", "ruff"]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(args):
    proc = subprocess.run([*_ruff(), *args, "src", "tests", "benchmarks"], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
