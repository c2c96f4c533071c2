"""The GPU check's Markdown summary of its report (the JSON is the report itself)."""
from gpucheck.common import COPY_TARGET


def summary_markdown(report):
    info = report["versions"]
    lines = ["# GPU check: %s" % (report.get("device") or ("no GPU (dry run)" if report["dry"] else "no GPU")), "",
             "`%s` at commit %s, %s, %.0f s of a %.0f s budget." % (
                 report["command"], info.get("commit", "unknown"), report["date"], report["elapsed_s"],
                 report["budget_s"]), ""]
    lines += ["| | |", "|---|---|"] + ["| %s | %s |" % kv for kv in info.items()] + [""]
    lines += ["| step | verdict | seconds (limit) | what |", "|---|---|---|---|"]
    for s in report["steps"]:
        lines.append("| %s | %s | %s | %s |" % (s["name"], s["verdict"].replace("|", "/"),
                                                "%.0f (%.0f)" % (s["seconds"], s["limit_s"]) if "seconds" in s else "-",
                                                s["what"]))
    results = {s["name"]: s.get("result") or {} for s in report["steps"]}

    def section(name, heading, columns, cells):
        """The table of step `name`'s rows, if it has any: cells(rows) -> one tuple per row."""
        rows = results.get(name, {}).get("rows")
        if rows:
            lines.extend(["", "## " + heading, "", "| %s |" % " | ".join(columns), "|" + "---|" * len(columns)]
                         + ["| %s |" % " | ".join(str(c) for c in row) for row in cells(rows)])

    section("throughput", "Kernel throughput, %d float32 elements in (target: %d%% of copy bandwidth)" % (
        results.get("throughput", {}).get("elements", 0), 100 * COPY_TARGET),
        ["kernels", "op", "us", "GB/s", "share of copy"],
        lambda rows: [(r["kernels"], r["op"], "%.1f" % (r["seconds"] * 1e6), "%.0f" % r["GBps"],
                       "%.0f%%" % (100 * r["share"])) for r in rows])
    section("patterns", "Every bit pattern through the codecs, against the CPU ops",
            ["codec", "input", "layout", "kernels", "patterns", "other bits than the CPU's"],
            lambda rows: [(r["codec"], r["input"], r["layout"], r["kernels"], r["patterns"],
                           "; ".join("%s: %d, the first at %s" % (what, n, where)
                                     for what, (n, where) in r["differences"].items()) or "none") for r in rows])
    section("allreduce", "All-reduce, float32 SUM, blocking (median; native rows: slowest rank; %s)" % (
        results.get("allreduce", {}).get("mps")), ["backend", "ranks", "bytes", "us"],
        lambda rows: [(r["backend"], r["ranks"], r["bytes"], "%.1f" % r["us"])
                      for r in rows + results["allreduce"].get("native", [])])
    section("host-cost", "Host time per call, the stream held (1 rank)",
            ["backend", "bytes", "host us per call", "values"],
            lambda rows: [(r["backend"], r["bytes"], "%.1f" % r["host us"],
                           "right" if r["right values"] else "WRONG") for r in rows])
    section("graphs", "Layered collectives in CUDA graphs (1 rank)",
            ["collective", "options", "replays", "other bits than the eager call"],
            lambda rows: [(r["collective"], r["options"], r["replays"], r["wrong"]) for r in rows])
    section("capture", "pycomm's collectives in CUDA graphs (2 ranks, %s)" % results.get("capture", {}).get("mps"),
            ["collective", "options", "captured", "replays", "other bits than the eager call"],
            lambda rows: [(r["collective"], r["options"], r["captured"], r["replays"], r["wrong"]) for r in rows])
    section("stream-wait", "Work.wait() behind a queued kernel",
            ["path", "kernel queued ms", "wait() returned ms", "complete ms", "waits", "values"],
            lambda rows: [(k, "%.0f" % (1e3 * r["queued kernel s"]), "%.1f" % (1e3 * r["wait returned s"]),
                           "%.1f" % (1e3 * r["complete s"]), r["holds"], "right" if r["right values"] else "WRONG")
                          for k, r in rows.items()])
    return "\n".join(lines) + "\n"
