"""Ratios between backends of summarized records (stats.summarize) at the same key (collective,
place, dtype, redop, size): each backend against the baseline, the subject against its peers,
and torch.distributed's dispatch overhead; parent side, torch-free.

Besides the ratio of the medians, each comparison gives the range over repeats of the
paired ratios (or differences): repeat k of one backend against repeat k of the other, which
ran next to it (backends are interleaved per repeat).
"""
from __future__ import annotations

from typing import Dict, List, Tuple


def result_key(rec: dict) -> Tuple[str, bool, str, str, int]:
    """What two backends' records must share to be compared."""
    return (rec["collective"], rec["inplace"], rec["dtype"], rec["op"], rec["bytes"])


def against_baseline(results: List[dict], baseline: str) -> List[dict]:
    """Add ``baseline``, ``x_baseline`` = time / the baseline's time at the same key (> 1:
    the baseline is faster) and ``x_baseline_paired`` = the range over repeats of (repeat k
    / the baseline's repeat k, run side by side) to each summarized record (copies)."""
    base = {result_key(r): r for r in results if r["backend"] == baseline}
    out = []
    for r in results:
        b = base.get(result_key(r))
        if b is None or b["time_us"] <= 0:
            out.append(dict(r, baseline=baseline, x_baseline=None, x_baseline_paired=None))
            continue
        pairs = [a / c for a, c in zip(r["per_repeat_us"], b["per_repeat_us"]) if c > 0]
        out.append(dict(r, baseline=baseline, x_baseline=r["time_us"] / b["time_us"],
                        x_baseline_paired=[min(pairs), max(pairs)] if pairs else None))
    return out


def compare(results: List[dict], subject: str, peers: List[str]) -> List[dict]:
    """Per size: each backend's time and busbw, and the subject's speed-up over each peer
    (peer time / subject time, median over repeats; and the range of the per-repeat paired
    ratios, repeat k of the peer over repeat k of the subject, which ran next to it)."""
    by_key: Dict[tuple, Dict[str, dict]] = {}
    for r in results:
        by_key.setdefault(result_key(r), {})[r["backend"]] = r
    rows = []
    for key, recs in by_key.items():
        if subject not in recs:
            continue
        s = recs[subject]
        row = dict(collective=key[0], inplace=key[1], dtype=key[2], op=key[3], bytes=key[4],
                   time_us={b: r["time_us"] for b, r in recs.items()},
                   busbw={b: r["busbw"] for b, r in recs.items()}, speedup={}, paired={})
        for peer in peers:
            if peer not in recs:
                continue
            p = recs[peer]
            row["speedup"][peer] = p["time_us"] / s["time_us"] if s["time_us"] > 0 else None
            pairs = [a / b for a, b in zip(p["per_repeat_us"], s["per_repeat_us"]) if b > 0]
            row["paired"][peer] = [min(pairs), max(pairs)] if pairs else None
        rows.append(row)
    return rows


def dispatch(results: List[dict], pairs: List[Tuple[str, str]]) -> List[dict]:
    """Per size and (torch label, direct label) pair: torch.distributed's dispatch overhead,
    as the difference of the medians (us), their ratio, and the range over repeats of the
    paired differences (repeat k through torch minus repeat k direct, run side by side)."""
    by = {(r["backend"],) + result_key(r): r for r in results}
    rows = []
    for via_torch, direct in pairs:
        for d in (r for r in results if r["backend"] == direct):
            t = by.get((via_torch,) + result_key(d))
            if t is None:
                continue
            diffs = [a - b for a, b in zip(t["per_repeat_us"], d["per_repeat_us"])]
            rows.append(dict(collective=d["collective"], inplace=d["inplace"], dtype=d["dtype"],
                             op=d["op"], bytes=d["bytes"], torch=via_torch, direct=direct,
                             torch_us=t["time_us"], direct_us=d["time_us"],
                             overhead_us=t["time_us"] - d["time_us"],
                             ratio=t["time_us"] / d["time_us"] if d["time_us"] > 0 else None,
                             paired_us=[min(diffs), max(diffs)]))
    return rows
