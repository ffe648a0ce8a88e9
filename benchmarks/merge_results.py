"""Merge the sections of a new benchmark run into the kept results file.

    python benchmarks/merge_results.py NEW.json [--into benchmarks/results] [--note "..."]

Rows of every section present in NEW replace that section's rows in ``<into>/<op>.json``; other
sections are kept. The kept meta gains ``run_<sections>`` (the new run's meta: GPU, versions,
ceilings) and the note; the markdown is regenerated with ``_harness.write_results``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS_DIR, write_results  # noqa: E402


def merge(new: dict, old: dict | None, note: str | None) -> dict:
    if old is None:  # nothing kept yet: the new run as it is, with the note
        return dict(new, notes=list(new.get("notes", [])) + ([note] if note else []))
    sections = sorted({str(r.get("section", "")) for r in new["rows"]})
    rows = [r for r in old["rows"] if str(r.get("section", "")) not in sections] + new["rows"]
    meta = dict(old["meta"])
    meta["run_" + "+".join(s or "results" for s in sections)] = json.dumps(
        {k: v for k, v in new["meta"].items() if not k.startswith("run_")}
    )
    notes = list(old.get("notes", []))
    notes += [n for n in new.get("notes", []) if n not in notes]
    if note:
        notes.append(note)
    return dict(op=old["op"], meta=meta, notes=notes, rows=rows)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("new")
    ap.add_argument("--into", default=str(RESULTS_DIR))
    ap.add_argument("--note", default=None)
    args = ap.parse_args(argv)
    new = json.loads(Path(args.new).read_text())
    kept = Path(args.into) / f"{new['op']}.json"
    old = json.loads(kept.read_text()) if kept.exists() else None
    res = merge(new, old, args.note)
    print(
        *write_results(res["op"], res["meta"], res["rows"], notes=res["notes"], out_dir=args.into)
    )


if __name__ == "__main__":
    main()
