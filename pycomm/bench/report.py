"""Statistics, the nccl-tests-style formatter and the JSON writer (parent side, torch-free).

A record (from a rank) holds raw loop times: ``loop_s[repeat][rank]`` seconds for
``iters`` calls. Per repeat the time of one call is ``max over ranks / iters``; the
reported time is the median over repeats. algbw = S / t, busbw = algbw * factor (all-reduce:
2(n-1)/n), in GB/s = 1e9 bytes/s as in nccl-tests.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

from .backends import dispatch_pairs
from .config import MODES, Config, format_bytes

# The summary's size classes: (name, size, what is quoted).
SUMMARY_POINTS = (("small", 4 << 10, "latency"), ("medium", 1 << 20, "busbw"),
                  ("large", 64 << 20, "busbw"))


# --------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------

def summarize(rec: dict) -> dict:
    """Add per_repeat_us, time_us, algbw, busbw (GB/s) to a raw record (returns a copy)."""
    out = dict(rec)
    per_repeat = [max(ranks) / rec["iters"] for ranks in rec["loop_s"]]
    t = statistics.median(per_repeat)
    out["per_repeat_us"] = [x * 1e6 for x in per_repeat]
    out["time_us"] = t * 1e6
    out["algbw"] = rec["bytes"] / t / 1e9 if t > 0 else float("inf")
    out["busbw"] = out["algbw"] * rec["busbw_factor"]
    return out


def _key(rec: dict) -> Tuple[str, str, str, int]:
    return (rec["collective"], rec["dtype"], rec["op"], rec["bytes"])


def compare(results: List[dict], subject: str, peers: List[str]) -> List[dict]:
    """Per size: each backend's time and busbw, and the subject's speed-up over each peer
    (peer time / subject time, median over repeats; and the range of the per-repeat paired
    ratios, repeat k of the peer over repeat k of the subject, which ran next to it)."""
    by_key: Dict[tuple, Dict[str, dict]] = {}
    for r in results:
        by_key.setdefault(_key(r), {})[r["backend"]] = r
    rows = []
    for key, recs in by_key.items():
        if subject not in recs:
            continue
        s = recs[subject]
        row = dict(collective=key[0], dtype=key[1], op=key[2], bytes=key[3],
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
    by = {(r["backend"],) + _key(r): r for r in results}
    rows = []
    for via_torch, direct in pairs:
        for d in (r for r in results if r["backend"] == direct):
            t = by.get((via_torch,) + _key(d))
            if t is None:
                continue
            diffs = [a - b for a, b in zip(t["per_repeat_us"], d["per_repeat_us"])]
            rows.append(dict(collective=d["collective"], dtype=d["dtype"], op=d["op"],
                             bytes=d["bytes"], torch=via_torch, direct=direct,
                             torch_us=t["time_us"], direct_us=d["time_us"],
                             overhead_us=t["time_us"] - d["time_us"],
                             ratio=t["time_us"] / d["time_us"] if d["time_us"] > 0 else None,
                             paired_us=[min(diffs), max(diffs)]))
    return rows


# --------------------------------------------------------------------------------------
# text
# --------------------------------------------------------------------------------------

def header(cfg: Config, versions: Dict[str, str]) -> str:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    lines = [
        "# pycomm.bench: %s, nccl-tests conventions" % cfg.collective,
        "# command   : %s" % cfg.command,
        "# world     : %d local ranks (%s, %s:// rendezvous)"
        % (cfg.nranks, _launcher_text(cfg), cfg.init),
        "# backends  : %s  (ratios: %s over each peer; harness barriers/timing on a separate "
        "gloo group)" % (", ".join(b.describe() for b in cfg.backends), cfg.subject.label),
        "# mode      : %s" % MODES[cfg.mode],
        "# repeats   : %d, median reported; backends interleaved per repeat" % cfg.repeats,
        "# iterations: %s; warm-up: %s" % (
            cfg.iters if cfg.iters is not None else "auto (about %s per repeat, %d..%d calls)"
            % (format_bytes(cfg.iter_bytes), cfg.min_iters, cfg.max_iters),
            cfg.warmup if cfg.warmup is not None else "auto (iters/10, 1..5)"),
        "# timeouts  : run %gs (then ranks are killed), process groups %gs"
        % (cfg.timeout_s, cfg.pg_timeout_s),
        "# check     : %s" % ("on (integer-valued inputs, exact expectation; #wrong summed "
                              "over ranks)" if cfg.check else "off"),
        "# host      : %s, %s cpus (%s usable), %s %s, python %s, %s" % (
            socket.gethostname(), os.cpu_count(), usable, platform.system(),
            platform.release(), platform.python_version(),
            ", ".join("%s %s" % kv for kv in versions.items())),
    ]
    return "\n".join(lines)


def _launcher_text(cfg: Config) -> str:
    if cfg.launcher == "mpirun":
        from .launch import mpirun_command

        return "%s; rank and size from OMPI_COMM_WORLD_RANK/SIZE" % " ".join(
            ["mpirun"] + mpirun_command(cfg.nranks)[1:])
    return "multiprocessing spawn"


def _fmt_time(us: float) -> str:
    return "%10.2f" % us if us < 1e6 else "%10.0f" % us


def backend_table(results: List[dict], label: str) -> str:
    lines = ["#", "# backend: %s" % label,
             "# %12s %12s %8s %6s %12s %8s %8s %7s"
             % ("size", "count", "type", "redop", "time_us", "algbw", "busbw", "#wrong"),
             "# %12s %12s %8s %6s %12s %8s %8s %7s"
             % ("(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "")]
    for r in results:
        if r["backend"] != label:
            continue
        lines.append("  %12d %12d %8s %6s %12s %8.2f %8.2f %7s" % (
            r["bytes"], r["count"], r["dtype"], r["op"], _fmt_time(r["time_us"]),
            r["algbw"], r["busbw"], r["wrong"] if r["wrong"] >= 0 else "n/a"))
    return "\n".join(lines)


def comparison_table(rows: List[dict], subject: str, peers: List[str]) -> str:
    if not peers:
        return ""
    backends = [subject] + peers
    head1 = "# %12s %8s %6s" % ("size", "type", "redop")
    head2 = "# %12s %8s %6s" % ("(B)", "", "")
    for b in backends:
        head1 += " %12s" % _clip(b + "_us", 12)
        head2 += " %12s" % "(us)"
    for b in backends:
        head1 += " %10s" % _clip(b + "_bus", 10)
        head2 += " %10s" % "(GB/s)"
    for p in peers:
        head1 += " %9s %13s" % (_clip("x" + p, 9), "paired")
        head2 += " %9s %13s" % ("", "(min-max)")
    lines = ["#", "# comparison: speed-up x<peer> = peer time_us / %s time_us (> 1: %s is "
             "faster); it equals %s busbw / peer busbw" % (subject, subject, subject),
             "# paired = range over repeats of (peer repeat k / %s repeat k), run side by side"
             % subject, head1, head2]
    for row in rows:
        line = "  %12d %8s %6s" % (row["bytes"], row["dtype"], row["op"])
        for b in backends:
            t = row["time_us"].get(b)
            line += " %12s" % ("-" if t is None else _fmt_time(t).strip())
        for b in backends:
            bw = row["busbw"].get(b)
            line += " %10s" % ("-" if bw is None else "%.2f" % bw)
        for p in peers:
            x, pr = row["speedup"].get(p), row["paired"].get(p)
            line += " %9s %13s" % ("-" if x is None else "%.2f" % x,
                                   "-" if pr is None else "%.2f-%.2f" % tuple(pr))
        lines.append(line)
    return "\n".join(lines)


def dispatch_table(rows: List[dict]) -> str:
    lines = []
    for via_torch, direct in dict.fromkeys((r["torch"], r["direct"]) for r in rows):
        lines += ["#", "# torch.distributed dispatch: %s (through torch.distributed) against %s "
                  "(the same backend through its direct API); overhead = difference of the "
                  "medians, ratio = %s / %s, paired = range of per-repeat differences"
                  % (via_torch, direct, via_torch, direct),
                  "# %12s %8s %6s %12s %12s %12s %7s %17s"
                  % ("size", "type", "redop", via_torch[:7] + "_us", direct[:7] + "_us",
                     "overhead_us", "ratio", "paired_us")]
        for r in rows:
            if (r["torch"], r["direct"]) != (via_torch, direct):
                continue
            lines.append("  %12d %8s %6s %12s %12s %+12.2f %7s %17s" % (
                r["bytes"], r["dtype"], r["op"], _fmt_time(r["torch_us"]).strip(),
                _fmt_time(r["direct_us"]).strip(), r["overhead_us"],
                "-" if r["ratio"] is None else "%.3f" % r["ratio"],
                "%+.1f..%+.1f" % tuple(r["paired_us"])))
    return "\n".join(lines)


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "~"


def summary(results: List[dict], rows: List[dict], subject: str, peers: List[str],
            cfg: Config, overhead: List[dict]) -> str:
    by = {(r["backend"], r["collective"], r["dtype"], r["op"], r["bytes"]): r for r in results}
    cmp_by = {(c["collective"], c["dtype"], c["op"], c["bytes"]): c for c in rows}
    overhead_by = {(r["torch"], r["direct"]) + _key(r): r for r in overhead}
    lines = ["#"]
    combos = []
    for r in results:
        c = (r["collective"], r["dtype"], r["op"])
        if c not in combos:
            combos.append(c)
    for coll, dtype, op in combos:
        lines.append("# summary %s %s %s, %d ranks, %s:" % (coll, dtype, op, cfg.nranks, cfg.mode))
        for name, size, what in SUMMARY_POINTS:
            text = "#   %-6s %-7s @ %-7s:" % (name, what, format_bytes(size))
            if (subject, coll, dtype, op, size) not in by:
                lines.append(text + " not in this sweep")
                continue
            parts = []
            for b in [subject] + peers:
                r = by.get((b, coll, dtype, op, size))
                if r is None:
                    continue
                parts.append("%s %s" % (b, "%.1f us" % r["time_us"] if what == "latency"
                                        else "%.2f GB/s" % r["busbw"]))
            ratios = cmp_by.get((coll, dtype, op, size), {}).get("speedup", {})
            rtext = ", ".join("x%.2f vs %s" % (x, p) for p, x in ratios.items() if x is not None)
            lines.append(text + " " + " | ".join(parts) + ("  (%s: %s)" % (subject, rtext)
                                                           if rtext else ""))
        for pair in dict.fromkeys((r["torch"], r["direct"]) for r in overhead):
            parts = []
            for _, size, _ in SUMMARY_POINTS:
                r = overhead_by.get(pair + (coll, dtype, op, size))
                if r is not None and r["ratio"] is not None:
                    parts.append("%+.1f us @ %s (x%.3f)"
                                 % (r["overhead_us"], format_bytes(size), r["ratio"]))
            if parts:
                lines.append("#   dispatch: %s (torch.distributed) over %s (direct API): %s"
                             % (pair + (", ".join(parts),)))
    return "\n".join(lines)


def total_wrong(results: List[dict]) -> int:
    return sum(r["wrong"] for r in results if r["wrong"] > 0)


def render(cfg: Config, results: List[dict], rows: List[dict]) -> str:
    labels = [b.label for b in cfg.backends]
    overhead = dispatch(results, dispatch_pairs(cfg.backends))
    parts = [backend_table(results, b) for b in labels]
    parts.append(comparison_table(rows, labels[0], labels[1:]))
    parts.append(dispatch_table(overhead))
    parts.append(summary(results, rows, labels[0], labels[1:], cfg, overhead))
    wrong = total_wrong(results)
    if cfg.check:
        parts.append("# correctness: %s" % ("all results exact" if wrong == 0 else
                                            "%d WRONG elements (see #wrong) -- FAILED" % wrong))
    return "\n".join(p for p in parts if p)


def progress_line(row: List[dict], subject: str) -> str:
    """One stderr line per size while the sweep runs (rows are raw records)."""
    stats = [summarize(r) for r in row]
    first = stats[0]
    s_time = next((r["time_us"] for r in stats if r["backend"] == subject), None)
    parts = []
    for r in stats:
        x = ""
        if s_time and r["backend"] != subject:
            x = " (x%.2f)" % (r["time_us"] / s_time)
        bad = " WRONG=%d" % r["wrong"] if r["wrong"] > 0 else ""
        parts.append("%s %.1f us%s%s" % (r["backend"], r["time_us"], x, bad))
    return "# .. %s %s %s %10d B  n=%d: %s" % (first["collective"], first["dtype"], first["op"],
                                             first["bytes"], first["iters"], "  ".join(parts))


# --------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------

def _git_state() -> Optional[dict]:
    """Commit and dirtiness of the checkout this package runs from (best effort)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--", ".."],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def write_json(path: str, cfg: Config, versions: Dict[str, str], results: List[dict],
               rows: List[dict], warnings: List[str], elapsed_s: float) -> None:
    from dataclasses import asdict

    doc = {
        "format": "pycomm.bench/1",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": _git_state(),
        "command": cfg.command,
        "config": asdict(cfg),
        "host": {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(),
                 "platform": platform.platform(), "python": sys.version.split()[0],
                 "versions": versions},
        "mode": {"name": cfg.mode, "meaning": MODES[cfg.mode]},
        "units": {"loop_s": "seconds per repeat per rank for `iters` calls",
                  "per_repeat_us": "max over ranks of loop_s / iters, microseconds",
                  "time_us": "median of per_repeat_us", "algbw": "GB/s (1e9 B/s) = bytes/time",
                  "busbw": "algbw * busbw_factor"},
        "subject": cfg.subject.label,
        "results": results,
        "comparison": rows,
        "dispatch": dispatch(results, dispatch_pairs(cfg.backends)),
        "warnings": warnings,
        "elapsed_s": elapsed_s,
    }
    tmp = path + ".tmp"
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
