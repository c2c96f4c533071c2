"""The nccl-tests-style formatter: the header, one table per backend, the side-by-side
comparison, torch.distributed's dispatch overhead, the summary, the correctness verdict and
the per-size progress line; parent side, torch-free.

Every table has one (headers, units, rows of cells) shape, rendered as text (the report on
stdout) or Markdown (writers.write_markdown).
"""
from __future__ import annotations

import os
import platform
import socket
from typing import Dict, List, Optional, Tuple

from .backends import dispatch_pairs, lossy_labels
from .comparisons import dispatch, result_key
from .config import MODES, Config, format_bytes
from .run_metadata import usable_cpus
from .stats import summarize, total_wrong


# --------------------------------------------------------------------------------------
# tables: one (headers, units, rows) shape, rendered as text or Markdown
# --------------------------------------------------------------------------------------

def place(in_place: bool) -> str:
    return "in" if in_place else "out"


def _us(us: Optional[float]) -> str:
    if us is None:
        return "-"
    return "%.2f" % us if us < 1e6 else "%.0f" % us


def _ratio(x: Optional[float]) -> str:
    return "-" if x is None else "%.2f" % x


def _range(pair: Optional[List[float]]) -> str:
    return "-" if pair is None else "%.2f-%.2f" % tuple(pair)


def _match(flag: Optional[bool]) -> str:
    return "n/a" if flag is None else ("same" if flag else "DIFF")


def _relerr(r: dict) -> str:
    return "n/a" if r.get("relerr") is None else "%.2e" % r["relerr"]


# The per-backend columns: (name, unit, value of a summarized record, blocking mode only).
COLUMNS = (
    ("collective", "", lambda r: r["collective"], False),
    ("size", "(B)", lambda r: "%d" % r["bytes"], False),
    ("count", "(elements)", lambda r: "%d" % r["count"], False),
    ("type", "", lambda r: r["dtype"], False),
    ("redop", "", lambda r: r["op"], False),
    ("place", "", lambda r: place(r["inplace"]), False),
    ("time_us", "(us)", lambda r: _us(r["time_us"]), False),
    ("algbw", "(GB/s)", lambda r: "%.2f" % r["algbw"], False),
    ("busbw", "(GB/s)", lambda r: "%.2f" % r["busbw"], False),
    ("p50_us", "(us)", lambda r: _us(r["p50_us"]), True),
    ("p99_us", "(us)", lambda r: _us(r["p99_us"]), True),
    ("#wrong", "", lambda r: "%d" % r["wrong"] if r["wrong"] >= 0 else "n/a", False),
    ("relerr", "(rms)", _relerr, False),
    ("hash", "(sha256)", lambda r: r.get("hash") or "n/a", False),
    ("ranks", "", lambda r: _match(r.get("ranks_match")), False),
    ("repeats", "", lambda r: _match(r.get("repeats_match")), False),
    ("xbase", "", lambda r: _ratio(r["x_baseline"]), False),
    ("paired", "(min-max)", lambda r: _range(r["x_baseline_paired"]), False),
)

Table = Tuple[List[str], List[str], List[List[str]]]   # headers, units, rows of cells


def backend_rows(results: List[dict], label: str, blocking: bool) -> Table:
    cols = [c for c in COLUMNS if blocking or not c[3]]
    return ([c[0] for c in cols], [c[1] for c in cols],
            [[c[2](r) for c in cols] for r in results if r["backend"] == label])


def comparison_rows(rows: List[dict], subject: str, peers: List[str]) -> Table:
    backends = [subject] + peers
    headers = (["collective", "size", "type", "redop", "place"] + [b + "_us" for b in backends]
               + [b + "_bus" for b in backends]
               + [h for p in peers for h in ("x" + p, "paired")])
    units = (["", "(B)", "", "", ""] + ["(us)"] * len(backends) + ["(GB/s)"] * len(backends)
             + ["", "(min-max)"] * len(peers))
    cells = []
    for row in rows:
        line = [row["collective"], "%d" % row["bytes"], row["dtype"], row["op"],
                place(row["inplace"])]
        line += [_us(row["time_us"].get(b)) for b in backends]
        line += ["-" if row["busbw"].get(b) is None else "%.2f" % row["busbw"][b]
                 for b in backends]
        for p in peers:
            line += [_ratio(row["speedup"].get(p)), _range(row["paired"].get(p))]
        cells.append(line)
    return headers, units, cells


def text_table(table: Table) -> str:
    headers, units, rows = table
    widths = [max(len(x) for x in col) for col in zip(headers, units, *rows)]

    def line(prefix, cells):
        return prefix + " ".join(c.rjust(w) for c, w in zip(cells, widths))

    return "\n".join([line("# ", headers), line("# ", units)] + [line("  ", r) for r in rows])


def markdown_table(table: Table) -> str:
    headers, units, rows = table
    head = ["%s %s" % (h, u) if u else h for h, u in zip(headers, units)]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


# --------------------------------------------------------------------------------------
# text
# --------------------------------------------------------------------------------------

def header(cfg: Config, versions: Dict[str, str]) -> str:
    lines = [
        "# pycomm.bench: %s, nccl-tests conventions" % ", ".join(cfg.collectives),
        "# command   : %s" % cfg.command,
        "# world     : %d ranks (%s, %s rendezvous)"
        % (cfg.nranks, _launcher_text(cfg), "env://" if cfg.launcher == "torchrun"
           else cfg.init + "://"),
        "# backends  : %s  (ratios: each backend over %s; harness barriers/timing on a "
        "separate gloo group)" % (", ".join(b.describe() for b in cfg.backends),
                                  cfg.subject.label),
        "# mode      : %s" % MODES[cfg.mode],
        "# placement : %s (where the collective has it)"
        % " and ".join("in-place" if p else "out-of-place" for p in cfg.placements),
        "# repeats   : %d, median reported; backends interleaved per repeat" % cfg.repeats,
        "# iterations: %s; warm-up: %s" % (
            cfg.iters if cfg.iters is not None else "auto (about %s per repeat, %d..%d calls)"
            % (format_bytes(cfg.iter_bytes), cfg.min_iters, cfg.max_iters),
            cfg.warmup if cfg.warmup is not None else "auto (iters/10, 1..5)"),
        "# timeouts  : run %gs (then ranks are killed), process groups %gs"
        % (cfg.timeout_s, cfg.pg_timeout_s),
        "# check     : %s" % ("on (integer-valued inputs, exact expectation; #wrong summed "
                              "over ranks); relerr and hash on Gaussian data, seed %d"
                              % cfg.seed if cfg.check else "off"),
        "# host      : %s, %s cpus (%s usable), %s %s, python %s, %s" % (
            socket.gethostname(), os.cpu_count(), usable_cpus(), platform.system(),
            platform.release(), platform.python_version(),
            ", ".join("%s %s" % kv for kv in versions.items())),
    ]
    return "\n".join(lines)


def _launcher_text(cfg: Config) -> str:
    if cfg.launcher == "mpirun":
        from .launch import mpirun_command

        return "%s; rank and size from OMPI_COMM_WORLD_RANK/SIZE" % " ".join(
            ["mpirun"] + mpirun_command(cfg.nranks)[1:])
    if cfg.launcher == "torchrun":
        return "torchrun; rank and size from RANK/WORLD_SIZE"
    return "local, python -m pycomm.bench.worker per rank"


def backend_table(results: List[dict], label: str, cfg: Config) -> str:
    return "\n".join(["#", "# backend: %s, %s; xbase = time / %s time (> 1: %s is faster), "
                      "paired = range of per-repeat ratios"
                      % (label, cfg.mode, cfg.subject.label, cfg.subject.label),
                      text_table(backend_rows(results, label, cfg.mode == "blocking"))])


def comparison_table(rows: List[dict], subject: str, peers: List[str]) -> str:
    if not peers:
        return ""
    return "\n".join(["#", "# comparison: speed-up x<peer> = peer time_us / %s time_us (> 1: %s "
                      "is faster); it equals %s busbw / peer busbw" % (subject, subject, subject),
                      "# paired = range over repeats of (peer repeat k / %s repeat k), run side "
                      "by side" % subject, text_table(comparison_rows(rows, subject, peers))])


def dispatch_table(rows: List[dict]) -> str:
    lines = []
    for via_torch, direct in dict.fromkeys((r["torch"], r["direct"]) for r in rows):
        lines += ["#", "# torch.distributed dispatch: %s (through torch.distributed) against %s "
                  "(the same backend through its direct API); overhead = difference of the "
                  "medians, ratio = %s / %s, paired = range of per-repeat differences"
                  % (via_torch, direct, via_torch, direct)]
        cells = [[r["collective"], "%d" % r["bytes"], r["dtype"], r["op"], place(r["inplace"]),
                  _us(r["torch_us"]), _us(r["direct_us"]), "%+.2f" % r["overhead_us"],
                  "-" if r["ratio"] is None else "%.3f" % r["ratio"],
                  "%+.1f..%+.1f" % tuple(r["paired_us"])]
                 for r in rows if (r["torch"], r["direct"]) == (via_torch, direct)]
        lines.append(text_table((
            ["collective", "size", "type", "redop", "place", via_torch + "_us", direct + "_us",
             "overhead_us", "ratio", "paired_us"],
            ["", "(B)", "", "", "", "(us)", "(us)", "(us)", "", "(us)"],
            cells)))
    return "\n".join(lines)


# The summary's size classes: (name, size, what is quoted).
SUMMARY_POINTS = (("small", 4 << 10, "latency"), ("medium", 1 << 20, "busbw"),
                  ("large", 64 << 20, "busbw"))


def summary(results: List[dict], rows: List[dict], subject: str, peers: List[str],
            cfg: Config, overhead: List[dict]) -> str:
    by = {(r["backend"],) + result_key(r): r for r in results}
    cmp_by = {result_key(c): c for c in rows}
    overhead_by = {(r["torch"], r["direct"]) + result_key(r): r for r in overhead}
    lines = []
    points = {size for _, size, _ in SUMMARY_POINTS}
    for combo in dict.fromkeys(result_key(r)[:4] for r in results if r["bytes"] in points):
        coll, in_place, dtype, op = combo
        lines.append("# summary %s %s %s %s, %d ranks, %s:" % (
            coll, "in-place" if in_place else "out-of-place", dtype, op, cfg.nranks, cfg.mode))
        for name, size, what in SUMMARY_POINTS:
            text = "#   %-6s %-7s @ %-7s:" % (name, what, format_bytes(size))
            if (subject,) + combo + (size,) not in by:
                lines.append(text + " not in this sweep")
                continue
            parts = []
            for b in [subject] + peers:
                r = by.get((b,) + combo + (size,))
                if r is None:
                    continue
                parts.append("%s %s" % (b, "%.1f us" % r["time_us"] if what == "latency"
                                        else "%.2f GB/s" % r["busbw"]))
            ratios = cmp_by.get(combo + (size,), {}).get("speedup", {})
            rtext = ", ".join("x%.2f vs %s" % (x, p) for p, x in ratios.items() if x is not None)
            lines.append(text + " " + " | ".join(parts) + ("  (%s: %s)" % (subject, rtext)
                                                           if rtext else ""))
        for pair in dict.fromkeys((r["torch"], r["direct"]) for r in overhead):
            parts = []
            for _, size, _ in SUMMARY_POINTS:
                r = overhead_by.get(pair + combo + (size,))
                if r is not None and r["ratio"] is not None:
                    parts.append("%+.1f us @ %s (x%.3f)"
                                 % (r["overhead_us"], format_bytes(size), r["ratio"]))
            if parts:
                lines.append("#   dispatch: %s (torch.distributed) over %s (direct API): %s"
                             % (pair + (", ".join(parts),)))
    return "\n".join(["#"] + lines) if lines else ""

def correctness(cfg: Config, results: List[dict]) -> str:
    if not cfg.check:
        return ""
    lossy = lossy_labels(cfg.backends)
    wrong = total_wrong(results, lossy)
    off = {r["backend"] for r in results if r["backend"] in lossy and r["wrong"] > 0}
    unstable = [r for r in results if False in (r["ranks_match"], r["repeats_match"])]
    rounded = ("lossy compression (%s): %d elements rounded off the exact result, as a codec "
               "may (see relerr)" % (", ".join(sorted(off)), total_wrong(
                   [r for r in results if r["backend"] in off]))) if off else ""
    if wrong:
        verdict = "%d WRONG elements (see #wrong) -- FAILED" % wrong + ("; " + rounded if off else "")
    else:
        verdict = "all results exact but those of " + rounded if off else "all results exact"
    lines = ["# correctness: %s" % verdict]
    if unstable:
        lines.append("# determinism: %d rows whose hash differs across ranks or repeats "
                     "(ranks/repeats = DIFF)" % len(unstable))
    return "\n".join(lines)


def render(cfg: Config, results: List[dict], rows: List[dict]) -> str:
    labels = [b.label for b in cfg.backends]
    peers = [b.label for b in cfg.peers]
    overhead = dispatch(results, dispatch_pairs(cfg.backends))
    parts = [backend_table(results, b, cfg) for b in labels]
    parts.append(comparison_table(rows, cfg.subject.label, peers))
    parts.append(dispatch_table(overhead))
    parts.append(summary(results, rows, cfg.subject.label, peers, cfg, overhead))
    parts.append(correctness(cfg, results))
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
    return "# .. %s %s %s %s %10d B  n=%d: %s" % (
        first["collective"], place(first["inplace"]), first["dtype"], first["op"],
        first["bytes"], first["iters"], "  ".join(parts))
