"""Statistics of the raw records; parent side, torch-free.

A record (from a rank) holds raw loop times: ``loop_s[repeat][rank]`` seconds for
``iters`` calls, and in blocking mode ``call_s[repeat][call]``, each call's seconds (max over
ranks). Per repeat the time of one call is ``max over ranks / iters``; the reported time is
the median over repeats. algbw = S / t, busbw = algbw * factor (collectives.py), in GB/s =
1e9 bytes/s as in nccl-tests.
"""
from __future__ import annotations

import math
import statistics
from typing import List


def percentile(values: List[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least q% of the values <= it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(rec: dict) -> dict:
    """Add per_repeat_us, time_us, algbw, busbw (GB/s), and p50_us/p99_us over every call
    (blocking mode; else None) to a raw record (returns a copy)."""
    out = dict(rec)
    per_repeat = [max(ranks) / rec["iters"] for ranks in rec["loop_s"]]
    t = statistics.median(per_repeat)
    out["per_repeat_us"] = [x * 1e6 for x in per_repeat]
    out["time_us"] = t * 1e6
    out["algbw"] = rec["bytes"] / t / 1e9 if t > 0 else float("inf")
    out["busbw"] = out["algbw"] * rec["busbw_factor"]
    calls = [c * 1e6 for repeat in rec.get("call_s") or [] for c in repeat]
    out["p50_us"] = percentile(calls, 50) if calls else None
    out["p99_us"] = percentile(calls, 99) if calls else None
    return out


def total_wrong(results: List[dict], lossy=()) -> int:
    """Wrong elements of the backends not in ``lossy`` (labels of lossily compressed
    backends, whose results may be off the exact sum: see backends.lossy_labels)."""
    return sum(r["wrong"] for r in results if r["wrong"] > 0 and r["backend"] not in lossy)
