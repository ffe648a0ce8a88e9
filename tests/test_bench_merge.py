"""benchmarks/merge_results.py: a new run's sections replace the kept ones, others stay."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import merge_results  # noqa: E402


def test_merge_replaces_only_new_sections(tmp_path):
    old = dict(op="x", meta={"gpu": "A"}, notes=["n1"],
               rows=[{"section": "a", "v": 1}, {"section": "b", "v": 2}])  # fmt: skip
    new = dict(op="x", meta={"gpu": "B"}, notes=["n2"], rows=[{"section": "b", "v": 3}])
    (tmp_path / "x.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    merge_results.main([str(tmp_path / "new.json"), "--into", str(tmp_path), "--note", "run 2"])
    got = json.loads((tmp_path / "x.json").read_text())
    assert got["rows"] == [{"section": "a", "v": 1}, {"section": "b", "v": 3}]
    assert got["meta"]["gpu"] == "A" and json.loads(got["meta"]["run_b"])["gpu"] == "B"
    assert got["notes"] == ["n1", "n2", "run 2"]
    md = (tmp_path / "x.md").read_text()
    assert "## a" in md and "## b" in md and "| 3 |" in md


def test_merge_into_nothing_keeps_the_note(tmp_path):
    new = dict(op="y", meta={"gpu": "B"}, notes=["n2"], rows=[{"section": "b", "v": 3}])
    (tmp_path / "new.json").write_text(json.dumps(new))
    merge_results.main([str(tmp_path / "new.json"), "--into", str(tmp_path), "--note", "run 1"])
    got = json.loads((tmp_path / "y.json").read_text())
    assert got["rows"] == new["rows"] and got["notes"] == ["n2", "run 1"]


def test_merge_by_keys_replaces_matching_rows_only(tmp_path):
    old = dict(op="z", meta={"gpu": "A"}, notes=[],
               rows=[{"section": "a", "T": 1, "v": 1}, {"section": "a", "T": 2, "v": 2},
                     {"section": "b", "T": 1, "v": 5}])  # fmt: skip
    new = dict(op="z", meta={"gpu": "B"}, notes=[],
               rows=[{"section": "a", "T": 2, "v": 3}, {"section": "a", "T": 4, "v": 4}])  # fmt: skip
    (tmp_path / "z.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    merge_results.main([str(tmp_path / "new.json"), "--into", str(tmp_path), "--keys", "section,T"])
    got = json.loads((tmp_path / "z.json").read_text())
    assert [r["v"] for r in got["rows"]] == [1, 3, 5, 4]


def test_merge_by_keys_names_a_key_the_rows_lack(tmp_path):
    old = dict(op="w", meta={}, notes=[], rows=[{"section": "a", "T": 1, "v": 1}])
    new = dict(op="w", meta={}, notes=[], rows=[{"section": "a", "T": 1, "v": 2}])
    (tmp_path / "w.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    with pytest.raises(ValueError, match="lack \\['S'\\]"):
        merge_results.main([str(tmp_path / "new.json"), "--into", str(tmp_path), "--keys", "T,S"])
    assert json.loads((tmp_path / "w.json").read_text()) == old
