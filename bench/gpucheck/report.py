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
    thr = results.get("throughput", {}).get("rows")
    if thr:
        lines += ["", "## Kernel throughput, %d float32 elements in (target: %d%% of copy bandwidth)" % (
            results["throughput"]["elements"], 100 * COPY_TARGET), "",
            "| kernels | op | us | GB/s | share of copy |", "|---|---|---|---|---|"]
        lines += ["| %s | %s | %.1f | %.0f | %.0f%% |" % (r["kernels"], r["op"], r["seconds"] * 1e6, r["GBps"],
                                                       100 * r["share"]) for r in thr]
    pa = results.get("patterns")
    if pa and pa.get("rows"):
        lines += ["", "## Every bit pattern through the codecs, against the CPU ops", "",
                  "| codec | input | layout | kernels | patterns | other bits than the CPU's |",
                  "|---|---|---|---|---|---|"]
        lines += ["| %s | %s | %s | %s | %d | %s |" % (
            r["codec"], r["input"], r["layout"], r["kernels"], r["patterns"],
            "; ".join("%s: %d, the first at %s" % (what, n, where) for what, (n, where) in r["differences"].items())
            or "none") for r in pa["rows"]]
    ar = results.get("allreduce")
    if ar and ar.get("rows"):
        lines += ["", "## All-reduce, float32 SUM, blocking (median; native rows: slowest rank; %s)" % ar["mps"], "",
                  "| backend | ranks | bytes | us |", "|---|---|---|---|"]
        lines += ["| %s | %d | %d | %.1f |" % (r["backend"], r["ranks"], r["bytes"], r["us"])
                  for r in ar["rows"] + ar.get("native", [])]
    hc = results.get("host-cost")
    if hc and hc.get("rows"):
        lines += ["", "## Host time per call, the stream held (1 rank)", "",
                  "| backend | bytes | host us per call | values |", "|---|---|---|---|"]
        lines += ["| %s | %d | %.1f | %s |" % (r["backend"], r["bytes"], r["host us"],
                                               "right" if r["right values"] else "WRONG") for r in hc["rows"]]
    gr = results.get("graphs")
    if gr and gr.get("rows"):
        lines += ["", "## Layered collectives in CUDA graphs (1 rank)", "",
                  "| collective | options | replays | other bits than the eager call |", "|---|---|---|---|"]
        lines += ["| %s | %s | %d | %d |" % (r["collective"], r["options"], r["replays"], r["wrong"])
                  for r in gr["rows"]]
    ca = results.get("capture")
    if ca and ca.get("rows"):
        lines += ["", "## pycomm's collectives in CUDA graphs (2 ranks, %s)" % ca["mps"], "",
                  "| collective | options | captured | replays | other bits than the eager call |",
                  "|---|---|---|---|---|"]
        lines += ["| %s | %s | %s | %d | %d |" % (r["collective"], r["options"], r["captured"], r["replays"],
                                                 r["wrong"]) for r in ca["rows"]]
    sw = results.get("stream-wait")
    if sw and sw.get("rows"):
        lines += ["", "## Work.wait() behind a queued kernel", "",
                  "| path | kernel queued ms | wait() returned ms | complete ms | waits | values |",
                  "|---|---|---|---|---|---|"]
        lines += ["| %s | %.0f | %.1f | %.1f | %s | %s |" % (
            k, 1e3 * r["queued kernel s"], 1e3 * r["wait returned s"], 1e3 * r["complete s"], r["holds"],
            "right" if r["right values"] else "WRONG") for k, r in sw["rows"].items()]
    return "\n".join(lines) + "\n"
