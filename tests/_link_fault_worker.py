"""A rank of test_multihost.py's link-fault tests (run under torchrun, one rank per host).

It all-reduces in a loop until the link between the hosts fails, then reports the error
as one JSON line, waits for the test to restore the link and tears the group down.
Markers in --marker-dir (the namespaces share the filesystem) pace the test:
ready-<rank> (looping), fault (written by the test: CLOCK_MONOTONIC when it broke the
link, system-wide), failed-<rank> (this rank saw its error), restored (the link is back).
"""

import argparse
import datetime
import faulthandler
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import pycomm  # noqa: F401  (registers the backend)

LOOP_LIMIT_S = 60  # no fault by then: report it and stop


def touch(path, text=""):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def wait_for(path, limit_s):
    end = time.monotonic() + limit_s
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)
    return os.path.exists(path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--marker-dir", required=True)
    ap.add_argument("--pg-timeout", type=float, required=True)
    ap.add_argument("--deadline", type=float, default=150.0)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.deadline, exit=True)
    marker = lambda name: os.path.join(args.marker_dir, name)  # noqa: E731

    dist.init_process_group("pycomm", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    t = torch.ones(1 << 16)
    dist.all_reduce(t)  # every connection is up before the test breaks one
    touch(marker("ready-%d" % rank))
    report = {"rank": rank}
    start = time.monotonic()
    try:
        while time.monotonic() - start < LOOP_LIMIT_S:
            dist.all_reduce(t)
        report["raised"] = False
    except RuntimeError as e:
        seen = time.monotonic()
        with open(marker("fault")) as f:
            report.update(raised=True, after_fault_s=seen - float(f.read()), message=str(e))
    touch(marker("failed-%d" % rank))
    report["restored"] = wait_for(marker("restored"), 60)
    dist.destroy_process_group()
    os.write(1, ("RESULT " + json.dumps(report) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
