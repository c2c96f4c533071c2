"""busbw (or latency) against size from a ``python -m pycomm.bench --json`` file, and the
best backend at each size.

    python -m pycomm.bench.plot RUN.json [-o busbw.png] [--latency latency.png]
                                [--auto LABEL] [--tolerance 0.1]

Prints, per size, every backend's busbw, the best one, the reference backend's busbw
(``--auto``: the label "auto" when the run has one, else the run's subject) and its ratio
to the best, flagging sizes where the reference is more than ``--tolerance`` below the
best. Meant for runs whose backends are the algorithms of one library, e.g. ``--backends
auto=pycomm:algorithm=auto,ring=pycomm:algorithm=ring,tree=pycomm:algorithm=tree``, where a
flag says the automatic selection missed. With ``-o`` also draws busbw (GB/s) over a log
size axis, one line per backend and one panel per (collective, dtype, op, placement), with
matplotlib's Agg backend (no display needed); ``--latency`` draws the time per call (us,
log axis) the same way.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, Optional, Tuple

from .config import format_bytes

Panel = Tuple[str, str, str, str]     # (collective, dtype, op, placement)

# What can be drawn: name -> (record field, axis label, log y axis).
METRICS = {"busbw": ("busbw", "busbw (GB/s)", False),
           "latency": ("time_us", "time per call (us)", True)}


def panels(doc: dict) -> Dict[Panel, Dict[str, Dict[int, dict]]]:
    """(collective, dtype, op, placement) -> label -> size -> result, labels in the run's
    order (records from before placements were recorded are in place)."""
    order = [b["label"] for b in doc["config"]["backends"]]
    out: Dict[Panel, Dict[str, Dict[int, dict]]] = {}
    for r in sorted(doc["results"], key=lambda r: (order.index(r["backend"]), r["bytes"])):
        key = (r["collective"], r["dtype"], r["op"],
               "in-place" if r.get("inplace", True) else "out-of-place")
        out.setdefault(key, {}).setdefault(r["backend"], {})[r["bytes"]] = r
    return out


def reference_label(doc: dict, wanted: Optional[str]) -> str:
    labels = [b["label"] for b in doc["config"]["backends"]]
    if wanted is not None:
        if wanted not in labels:
            raise ValueError("no backend %r in this run (have: %s)" % (wanted, ", ".join(labels)))
        return wanted
    return "auto" if "auto" in labels else doc["subject"]


def best_table(doc: dict, ref: str, tolerance: float) -> str:
    lines = []
    for panel, by_label in panels(doc).items():
        labels = list(by_label)
        sizes = sorted({s for per_size in by_label.values() for s in per_size})
        lines += ["# best busbw per size: %s, %d ranks, %s (GB/s; %s/best below %.2f "
                  "flagged)" % (" ".join(panel), doc["config"]["nranks"], doc["mode"]["name"],
                                ref, 1.0 - tolerance),
                  "# %12s " % "size" + " ".join("%9s" % l[:9] for l in labels)
                  + " %12s %9s %9s" % ("best", ref[:9], ref[:5] + "/best")]
        behind = []
        for size in sizes:
            bw = {l: by_label[l][size]["busbw"] for l in labels if size in by_label[l]}
            best = max(bw, key=bw.get)
            line = "  %12d " % size + " ".join(
                "%9s" % ("%.4f" % bw[l] if l in bw else "-") for l in labels)
            line += " %12s" % best[:12]
            if ref in bw and bw[best] > 0:
                ratio = bw[ref] / bw[best]
                line += " %9.4f %9.3f" % (bw[ref], ratio)
                if ratio < 1.0 - tolerance:
                    behind.append("%s (%s x%.2f)" % (format_bytes(size), best, 1 / ratio))
                    line += "  <- %s %.0f%% below %s" % (ref, 100 * (1 - ratio), best)
            lines.append(line)
        lines.append("# %s within %.0f%% of the best at %d of %d sizes%s" % (
            ref, 100 * tolerance, len(sizes) - len(behind), len(sizes),
            "; behind at: " + ", ".join(behind) if behind else ""))
    return "\n".join(lines)


def draw(doc: dict, ref: str, path: str, metric: str = "busbw") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    field, axis_label, log_y = METRICS[metric]
    groups = panels(doc)
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, 5 * len(groups)), squeeze=False)
    for ax, (panel, by_label) in zip(axes[:, 0], groups.items()):
        sizes = sorted({s for per_size in by_label.values() for s in per_size})
        for label, per_size in by_label.items():
            xs = sorted(per_size)
            ax.plot(xs, [per_size[s][field] for s in xs], marker="o", markersize=3,
                    linewidth=2.5 if label == ref else 1.2, label=label,
                    zorder=3 if label == ref else 2)
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        ticks = sizes[:: max(1, len(sizes) // 12)]
        ax.set_xticks(ticks)
        ax.set_xticklabels([format_bytes(s).replace(" ", "") for s in ticks], rotation=45)
        ax.minorticks_off()
        ax.set_xlabel("size (bytes of the array)")
        ax.set_ylabel(axis_label)
        ax.set_title("%s, %d ranks, %s (%s)" % (
            " ".join(panel), doc["config"]["nranks"], doc["mode"]["name"],
            doc["host"]["hostname"]))
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pycomm.bench.plot",
                                description="busbw-versus-size plot and best backend per size "
                                            "from a pycomm.bench JSON file")
    p.add_argument("json", help="a file written by python -m pycomm.bench --json")
    p.add_argument("-o", "--output", help="busbw PNG to draw (default: print the table only)")
    p.add_argument("--latency", metavar="PNG", help="latency (time per call) PNG to draw")
    p.add_argument("--auto", default=None, metavar="LABEL",
                   help="the backend compared with the best (default: 'auto' if present, "
                        "else the run's subject)")
    p.add_argument("--tolerance", type=float, default=0.10,
                   help="flag sizes where it is more than this fraction below the best (0.10)")
    args = p.parse_args(argv)
    with open(args.json) as f:
        doc = json.load(f)
    try:
        ref = reference_label(doc, args.auto)
    except ValueError as e:
        p.error(str(e))
    print(best_table(doc, ref, args.tolerance))
    for path, metric in ((args.output, "busbw"), (args.latency, "latency")):
        if path:
            draw(doc, ref, path, metric)
            print("# plot: %s" % path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
