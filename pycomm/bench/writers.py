"""The writers: the ``--json`` document, JSON lines and the Markdown report (with the
plots, when drawn); parent side, torch-free.

Each file is written atomically; in the JSON files non-finite floats are strings ("inf",
"nan"), which JSON has no number for. A file written under ``bench/results`` gets its row in
that folder's index, ``INDEX.md`` (``pycomm.bench.index``).
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import List

from . import index
from .backends import dispatch_pairs
from .comparisons import dispatch
from .config import MODES, Config
from .render import backend_rows, comparison_rows, markdown_table

UNITS = {"loop_s": "seconds per repeat per rank for `iters` calls",
         "call_s": "blocking mode: seconds of each call per repeat, max over ranks",
         "per_repeat_us": "max over ranks of loop_s / iters, microseconds",
         "time_us": "median of per_repeat_us", "algbw": "GB/s (1e9 B/s) = bytes/time",
         "busbw": "algbw * busbw_factor", "p50_us/p99_us": "percentiles of call_s (us)",
         "relerr": "||got - ref|| / ||ref|| over every rank's output, Gaussian inputs, "
                   "float64 reference",
         "hash": "sha256 of rank 0's output bytes of the Gaussian call, 8 hex digits",
         "x_baseline": "time_us / the baseline's time_us at the same size"}


def _finite(obj):
    """The object with non-finite floats as strings ("inf", "nan"), so that it is JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _write(path: str, text: str) -> None:
    """Write atomically (a reader never sees half a file); under ``bench/results``, update
    the file's row of the index."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    if index.results_root(path) is not None:
        try:
            index.update([path])
        except (OSError, ValueError) as e:
            print("pycomm.bench: %s written, but its row of the results index was not: %s"
                  % (path, e), file=sys.stderr)


def document(cfg: Config, env: dict, results: List[dict], rows: List[dict],
             warnings: List[str], elapsed_s: float) -> dict:
    """The ``--json`` document: the environment, every result, the comparison."""
    return dict(env, format="pycomm.bench/2", units=UNITS, subject=cfg.subject.label,
                results=results, comparison=rows,
                dispatch=dispatch(results, dispatch_pairs(cfg.backends)),
                warnings=warnings, elapsed_s=elapsed_s)


def write_json(path: str, doc: dict) -> None:
    _write(path, json.dumps(_finite(doc), indent=1) + "\n")


def write_jsonl(path: str, env: dict, results: List[dict]) -> None:
    """One JSON object per result row, each with the whole environment under "env"."""
    _write(path, "".join(json.dumps(_finite(dict(r, env=env))) + "\n" for r in results))


def write_markdown(path: str, cfg: Config, env: dict, results: List[dict], rows: List[dict],
                   text_report: str, plots: List[str]) -> None:
    host = env["host"]
    lines = ["# pycomm.bench: %s" % ", ".join(cfg.collectives), "",
             "`%s`" % cfg.command, "",
             "| | |", "|---|---|",
             "| date (UTC) | %s |" % env["date_utc"],
             "| git | %s |" % ("%s%s" % (env["git"]["commit"][:12], " (dirty)"
                                         if env["git"]["dirty"] else "")
                              if env["git"] else "unknown"),
             "| host | %s, %s cpus (%s usable), %s, python %s |"
             % (host["hostname"], host["cpu_count"], host["usable_cpus"], host["platform"],
                host["python"]),
             "| versions | %s |" % ", ".join("%s %s" % kv for kv in host["versions"].items()),
             "| world | %d ranks, %s |" % (cfg.nranks, cfg.launcher),
             "| mode | %s |" % MODES[cfg.mode],
             "| backends | %s (baseline %s) |"
             % (", ".join("`%s`" % b.describe() for b in cfg.backends), cfg.subject.label),
             ""]
    for b in cfg.backends:
        lines += ["## %s" % b.label, "",
                  "xbase = time / %s time (> 1: %s is faster)."
                  % (cfg.subject.label, cfg.subject.label), "",
                  markdown_table(backend_rows(results, b.label, cfg.mode == "blocking")), ""]
    if cfg.peers:
        lines += ["## Comparison", "", "x<peer> = peer time / %s time (> 1: %s is faster)."
                  % (cfg.subject.label, cfg.subject.label), "",
                  markdown_table(comparison_rows(rows, cfg.subject.label,
                                                 [b.label for b in cfg.peers])), ""]
    if plots:
        lines += ["## Plots", ""] + ["![%s](%s)" % (os.path.splitext(os.path.basename(p))[0],
                                                    os.path.relpath(p, os.path.dirname(
                                                        os.path.abspath(path))))
                                     for p in plots] + [""]
    lines += ["## Text report", "", "```", text_report, "```", ""]
    _write(path, "\n".join(lines))
