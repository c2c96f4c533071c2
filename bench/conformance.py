"""pycomm against Gloo on PyTorch's own distributed suite, at several world sizes.

    python bench/conformance.py --world-sizes 2,3,4 --out bench/results/conformance/conformance.md

Runs bench/conformance_suite.py (the suite of the installed torch wheel, one process per
backend and world size, each test spawning its ranks) for Gloo and for pycomm, then writes
a Markdown report: the counts per backend, every test that passes on Gloo and not on
pycomm (with pycomm's outcome and reason), the tests whose Gloo-only gate the runner
lifted for pycomm (with their outcome on each backend), and the tests left to Gloo by name
with why.
Exit status 1 when a test passes on Gloo and not on pycomm, other than those.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
SUITE = os.path.join(HERE, "conformance_suite.py")

# Tests that pass on Gloo and cannot on pycomm, and why. Keys are test names.
EXPECTED_GAPS = {
    "test_monitored_barrier_gloo":
        "`dist.monitored_barrier` raises \"monitored_barrier is only implemented for GLOO "
        "backend\" for any other backend: torch checks the group's backend name in Python "
        "before calling the backend",
    "test_monitored_barrier_gloo_subgroup": "as test_monitored_barrier_gloo",
    "test_monitored_barrier_gloo_rank_0_timeout": "as test_monitored_barrier_gloo",
    "test_monitored_barrier_failure_order": "as test_monitored_barrier_gloo",
    "test_monitored_barrier_wait_all_ranks": "as test_monitored_barrier_gloo",
    "test_monitored_barrier_allreduce_hang": "as test_monitored_barrier_gloo",
    "test_monitored_barrier_allreduce_hang_wait_all_ranks": "as test_monitored_barrier_gloo",
}


def run_suite(backend: str, world_size: int, out_dir: str, pattern: str, timeout: float) -> dict:
    """One backend at one world size: the suite's JSON outcome (see conformance_suite.py)."""
    result = os.path.join(out_dir, f"{backend}-np{world_size}.json")
    log = os.path.join(out_dir, f"{backend}-np{world_size}.log")
    env = dict(os.environ, BACKEND=backend, WORLD_SIZE=str(world_size),
               TEMP_DIR=tempfile.mkdtemp(prefix=f"pycomm-conformance-{backend}-"))
    cmd = [sys.executable, SUITE, "--json", result] + (["-k", pattern] if pattern else [])
    started = time.monotonic()
    with open(log, "w") as f:
        try:
            subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            f.write(f"\nconformance: the suite ran past {timeout:.0f} s and was stopped\n")
    print(f"{backend} at {world_size} ranks: {time.monotonic() - started:.0f} s (log: {log})", flush=True)
    if not os.path.exists(result):
        raise SystemExit(f"conformance: {backend} at {world_size} ranks wrote no results; see {log}")
    with open(result) as f:
        return json.load(f)


def counts(tests: dict) -> dict:
    c = {"passed": 0, "failed": 0, "skipped": 0}
    for t in tests.values():
        c[t["outcome"]] += 1
    return c


def report(runs: dict, world_sizes: list[int], torch_version: str) -> tuple[str, int]:
    """The Markdown report and the number of unexpected gaps."""
    lines = ["# PyTorch's distributed suite: pycomm against Gloo", "",
             f"torch {torch_version}; `DistributedTest._DistTestBase` combined with `TestDistBackend` "
             "as test/distributed/test_distributed_spawn.py does, run by `make conformance` "
             "(bench/conformance.py). Tests whose decorators admit only Gloo by name run "
             "against pycomm too, except the ones listed at the end.", ""]
    unexpected = 0
    for ws in world_sizes:
        gloo, ours = runs[("gloo", ws)]["tests"], runs[("pycomm", ws)]["tests"]
        cg, cp = counts(gloo), counts(ours)
        lines += [f"## {ws} ranks", "",
                  "| backend | passed | failed | skipped |", "|---|---|---|---|",
                  f"| gloo | {cg['passed']} | {cg['failed']} | {cg['skipped']} |",
                  f"| pycomm | {cp['passed']} | {cp['failed']} | {cp['skipped']} |", ""]
        gaps = sorted(name for name, t in gloo.items()
                      if t["outcome"] == "passed" and ours.get(name, {}).get("outcome") != "passed")
        expected = [g for g in gaps if g in EXPECTED_GAPS]
        others = [g for g in gaps if g not in EXPECTED_GAPS]
        unexpected += len(others)
        lines.append(f"Passed on Gloo and not on pycomm: {len(others)}"
                     + (f" (and {len(expected)} left to Gloo, below: {', '.join(expected)})" if expected else "")
                     + ".")
        lines.append("")
        if others:
            lines += ["| test | pycomm | reason |", "|---|---|---|"]
            for name in others:
                t = ours.get(name, {"outcome": "not run", "reason": ""})
                reason = t["reason"].replace("|", "\\|")
                lines.append(f"| {name} | {t['outcome']} | {reason} |")
            lines.append("")
        better = sorted(name for name, t in ours.items()
                        if t["outcome"] == "passed" and gloo.get(name, {}).get("outcome") != "passed")
        if better:
            lines += [f"Passed on pycomm and not on Gloo: {', '.join(better)}.", ""]
    lifted = runs[("pycomm", world_sizes[0])].get("lifted", [])
    lines += ["## Gates lifted", "",
              f"Tests the suite admits only for Gloo by name, run against pycomm by the runner "
              f"(bench/conformance_suite.py), with their outcome (Gloo / pycomm) at each world size: "
              f"{len(lifted)}.", "",
              "| test | " + " | ".join(f"{ws} ranks" for ws in world_sizes) + " |",
              "|---|" + "---|" * len(world_sizes)]
    for name in lifted:
        cells = []
        for ws in world_sizes:
            g = runs[("gloo", ws)]["tests"].get(name, {}).get("outcome", "not run")
            p = runs[("pycomm", ws)]["tests"].get(name, {}).get("outcome", "not run")
            cells.append(f"{g} / {p}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Left to Gloo", ""]
    lines += [f"- `{name}`: {why}" for name, why in EXPECTED_GAPS.items()]
    return "\n".join(lines) + "\n", unexpected


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,3,4")
    parser.add_argument("--out", default="bench/results/conformance/conformance.md", help="the Markdown report")
    parser.add_argument("--work-dir", default="bench/out/conformance", help="per-run JSON results and logs")
    parser.add_argument("-k", dest="pattern", default="", help="only tests whose name matches this regex")
    parser.add_argument("--jobs", type=int, default=1, help="suite runs at once")
    parser.add_argument("--timeout", type=float, default=5400, help="seconds for one suite run")
    parser.add_argument("--report-only", action="store_true",
                        help="write the report from the results already in --work-dir")
    args = parser.parse_args()
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    os.makedirs(args.work_dir, exist_ok=True)
    combos = [(b, ws) for ws in world_sizes for b in ("gloo", "pycomm")]
    if args.report_only:
        runs = {}
        for backend, ws in combos:
            with open(os.path.join(args.work_dir, f"{backend}-np{ws}.json")) as f:
                runs[(backend, ws)] = json.load(f)
    else:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {c: pool.submit(run_suite, c[0], c[1], args.work_dir, args.pattern, args.timeout) for c in combos}
            runs = {c: f.result() for c, f in futures.items()}
    import torch

    text, unexpected = report(runs, world_sizes, torch.__version__)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
