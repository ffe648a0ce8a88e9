"""Merge the sections of a new benchmark run into the kept results file.

    python benchmarks/merge_results.py NEW.json [--into benchmarks/results] [--note "..."]
        [--keys section,cache,B,S,T]

Rows of every section present in NEW replace that section's rows in ``<into>/<op>.json``; other
sections are kept. With ``--keys``, a new row replaces only the kept row with the same values of
those keys (in its place; unmatched new rows are appended), so a run of some shapes of a section
leaves its other shapes. The kept meta gains ``run_<sections>`` (the new run's meta: GPU, versions,
ceilings) and the note; the markdown is regenerated with ``_harness.write_results``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS_DIR, write_results  # noqa: E402


def _merge_rows(old_rows: list, new_rows: list, keys: list[str] | None) -> list:
    if not keys:  # whole sections
        sections = {str(r.get("section", "")) for r in new_rows}
        return [r for r in old_rows if str(r.get("section", "")) not in sections] + new_rows
    missing = sorted({k for r in new_rows for k in keys if k not in r})
    if missing:  # a misspelt key would make every row match every other
        raise ValueError(f"--keys {','.join(keys)}: the new rows lack {missing}")
    ident = lambda r: tuple(r.get(k) for k in keys)  # noqa: E731
    fresh = {ident(r): r for r in new_rows}
    rows = [fresh.pop(ident(r), r) for r in old_rows]
    return rows + [r for r in new_rows if ident(r) in fresh]


def merge(new: dict, old: dict | None, note: str | None, keys: list[str] | None = None) -> dict:
    if old is None:  # nothing kept yet: the new run as it is, with the note
        return dict(new, notes=list(new.get("notes", [])) + ([note] if note else []))
    sections = sorted({str(r.get("section", "")) for r in new["rows"]})
    rows = _merge_rows(old["rows"], new["rows"], keys)
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
    ap.add_argument("--keys", default=None, help="e.g. section,cache,B,S,T: replace rows by key")
    args = ap.parse_args(argv)
    new = json.loads(Path(args.new).read_text())
    kept = Path(args.into) / f"{new['op']}.json"
    old = json.loads(kept.read_text()) if kept.exists() else None
    res = merge(new, old, args.note, args.keys.split(",") if args.keys else None)
    print(
        *write_results(res["op"], res["meta"], res["rows"], notes=res["notes"], out_dir=args.into)
    )


if __name__ == "__main__":
    main()
