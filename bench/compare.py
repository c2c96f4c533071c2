#!/usr/bin/env python3
"""Diff two ``python -m pycomm.bench`` runs and flag the rows that got slower beyond noise.

    python bench/compare.py OLD NEW [--threshold 5]

OLD and NEW are ``--json`` documents or ``--jsonl`` files (either kind on either side).
Rows match on (backend label, collective, placement, dtype, op, size, mode). For each
matched row the change is new time / old time - 1, and the noise is the larger of
``--threshold`` (percent) and each run's spread over its repeats ((max - min) / median of
``per_repeat_us``): a change above the noise is a regression, one below minus the noise an
improvement, anything between is "same".

With ``--relative-to LABEL`` every other backend's times are first divided by LABEL's in
the same run, repeat by repeat, and those ratios are compared: a slower machine slows both.

Prints one line per matched row (times in us, or ratios), then the rows found on one side
only. Exit status: 0 no
regression; 1 at least one regression; 2 bad input (unreadable file, no row in common).
Needs nothing but the standard library.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Dict, List, Tuple

Key = Tuple[str, str, bool, str, str, int, str]


def load(path: str) -> Dict[Key, dict]:
    """The run's result rows by key; ValueError when the file is neither format."""
    with open(path) as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and "results" in doc:
        mode = doc["mode"]["name"]
        rows = [dict(r, mode=r.get("mode", mode)) for r in doc["results"]]
    else:
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError("%s: neither a pycomm.bench JSON document nor JSON lines (%s)"
                             % (path, e)) from None
    out = {}
    for r in rows:
        if not isinstance(r, dict) or "per_repeat_us" not in r:
            raise ValueError("%s: not pycomm.bench results (a row without per_repeat_us)" % path)
        # Runs from before placements were recorded measured all-reduce in place.
        key = (r["backend"], r["collective"], r.get("inplace", True), r["dtype"], r["op"],
               r["bytes"], r["mode"])
        out[key] = r
    return out


def spread(row: dict) -> float:
    """(max - min) / median of the per-repeat times: this row's own noise."""
    times = row["per_repeat_us"]
    return (max(times) - min(times)) / row["time_us"] if row["time_us"] > 0 else 0.0


def relative_to(rows: Dict[Key, dict], peer: str) -> Dict[Key, dict]:
    """Each other backend's rows as times relative to ``peer``'s at the same point of the
    same run: per repeat, its time over the peer's (they ran side by side), and the median
    of those. A machine that is slower on the day slows both and leaves the ratio."""
    out = {}
    for key, r in rows.items():
        p = rows.get((peer,) + key[1:])
        if key[0] == peer or p is None:
            continue
        ratios = [a / b for a, b in zip(r["per_repeat_us"], p["per_repeat_us"]) if b > 0]
        if ratios:
            out[key] = dict(r, per_repeat_us=ratios, time_us=statistics.median(ratios))
    if not out:
        raise ValueError("no row to set against backend %r" % peer)
    return out


def compare(old: Dict[Key, dict], new: Dict[Key, dict], threshold: float) -> List[dict]:
    """One verdict per key present in both runs, in NEW's order."""
    verdicts = []
    for key in (k for k in new if k in old):
        o, n = old[key], new[key]
        change = n["time_us"] / o["time_us"] - 1 if o["time_us"] > 0 else 0.0
        noise = max(threshold, spread(o), spread(n))
        verdict = "REGRESSION" if change > noise else ("faster" if change < -noise else "same")
        verdicts.append(dict(key=key, old_us=o["time_us"], new_us=n["time_us"], change=change,
                             noise=noise, verdict=verdict))
    return verdicts


def table(verdicts: List[dict]) -> str:
    headers = ["backend", "collective", "place", "type", "redop", "size", "mode", "old",
               "new", "change", "noise", "verdict"]
    rows = [[v["key"][0], v["key"][1], "in" if v["key"][2] else "out", v["key"][3],
             v["key"][4], str(v["key"][5]), v["key"][6], "%.2f" % v["old_us"],
             "%.2f" % v["new_us"], "%+.1f%%" % (100 * v["change"]), "%.1f%%" % (100 * v["noise"]),
             v["verdict"]] for v in verdicts]
    widths = [max(len(x) for x in col) for col in zip(headers, *rows)]
    return "\n".join(" ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [headers] + rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/compare.py",
        description="Flag rows of NEW slower than OLD by more than max(threshold, the spread "
                    "of either run's repeats).")
    p.add_argument("old", help="baseline run: --json document or --jsonl file")
    p.add_argument("new", help="run to check, same formats")
    p.add_argument("--threshold", type=float, default=5.0,
                   help="smallest change flagged, percent (default 5)")
    p.add_argument("--relative-to", metavar="LABEL", default=None,
                   help="compare each backend's time relative to this backend's in the same "
                        "run (e.g. gloo), not absolute times: runs from different days or "
                        "machine loads stay comparable")
    args = p.parse_args(argv)
    try:
        old, new = load(args.old), load(args.new)
        if args.relative_to:
            old, new = relative_to(old, args.relative_to), relative_to(new, args.relative_to)
    except (OSError, ValueError, KeyError) as e:
        print("compare: %s" % e, file=sys.stderr)
        return 2
    verdicts = compare(old, new, args.threshold / 100)
    if not verdicts:
        print("compare: no row in common between %s and %s" % (args.old, args.new),
              file=sys.stderr)
        return 2
    print(table(verdicts))
    for side, mine, other in (("old", old, new), ("new", new, old)):
        alone = [k for k in mine if k not in other]
        if alone:
            print("# only in %s: %d rows, e.g. %s"
                  % (side, len(alone), " ".join(map(str, alone[0]))))
    regressions = sum(v["verdict"] == "REGRESSION" for v in verdicts)
    print("# %d rows compared: %d regressions, %d faster, %d within noise" % (
        len(verdicts), regressions, sum(v["verdict"] == "faster" for v in verdicts),
        sum(v["verdict"] == "same" for v in verdicts)))
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
