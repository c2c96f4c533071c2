"""One run of PyTorch's own distributed suite for one backend at one world size.

    BACKEND=pycomm WORLD_SIZE=2 python bench/conformance_suite.py --json out.json [-k PATTERN]

The suite is `DistributedTest._DistTestBase` from the installed torch wheel
(torch/testing/_internal/distributed/distributed_test.py), combined with `TestDistBackend`
as PyTorch's test/distributed/test_distributed_spawn.py does: every test spawns WORLD_SIZE
processes that join a group of BACKEND through a file store. `bench/conformance.py` runs
this for each backend and world size and compares.

A plugin backend is declared in `DistTestCases.backend_feature` ("plugin", "ddp",
"subgroup", and "gpu" and "cuda": pycomm serves CUDA tensors in a CUDA build, as Gloo does),
as the suite expects of one. Tests whose decorators admit only Gloo by name
(`BACKEND != "gloo"`, `require_backend_is_available({"gloo"})`) are admitted for pycomm too,
by rewriting those conditions as the suite module is loaded, except LEFT_GATED: tests whose
subject is a Gloo-only torch API. So is the one helper body that picks its CPU set-up by
the name (`BACKEND == "gloo"`); nothing else in a test body is changed.

Ranks are spawned processes that re-execute this file as `__mp_main__`: everything the
suite needs is defined at import; only the driver below is under `__main__`. With
`--start fork` they are forked from the driver instead, which has imported torch, pycomm
and the suite once (a spawned rank imports them again: about 4 s of CPU per rank, most of
a short test); the driver touches no CUDA and starts no group, so a fork inherits neither.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
import unittest

SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"
BACKEND = os.environ.get("BACKEND", "")
# How the driver starts each test's ranks (--start); only the driver's setUp reads it.
START_METHOD = "spawn"
GLOO_LIKE = ("gloo", "pycomm")

# Tests whose Gloo gate stays: `dist.monitored_barrier` raises "monitored_barrier is only
# implemented for GLOO backend" for every other backend (torch checks the group's backend
# name in Python before any backend is called).
LEFT_GATED = re.compile(r"test_monitored_barrier")

if BACKEND == "pycomm":
    import pycomm  # noqa: F401  (registers the backend, in the driver and in every rank)


# The tests whose Gloo gate _lift_gloo_gates rewrote, in the suite's order.
LIFTED: list[str] = []


def _lift_gloo_gates(source: str) -> str:
    """The suite's source with every decorator condition that admits Gloo by name
    admitting pycomm too, except on the tests LEFT_GATED names; LIFTED names the tests."""
    lines = source.splitlines(keepends=True)
    out = []
    pending: list[int] = []  # indices in `out` of gate conditions since the last def
    for line in lines:
        stripped = line.lstrip()
        if stripped.startswith("def "):
            name = stripped[4:].split("(", 1)[0]
            if pending and not LEFT_GATED.match(name):
                LIFTED.append(name)
                for i in pending:
                    out[i] = (out[i]
                              .replace('BACKEND != "gloo"', f"BACKEND not in {GLOO_LIKE!r}")
                              .replace('require_backend_is_available({"gloo"})',
                                       f"require_backend_is_available({set(GLOO_LIKE)!r})"))
            pending = []
        elif stripped.startswith("@") or stripped.startswith("BACKEND"):
            if 'BACKEND != "gloo"' in line or 'require_backend_is_available({"gloo"})' in line:
                pending.append(len(out))
        out.append(line)
    # One helper's body picks its CPU set-up by name (`BACKEND == "mpi" or BACKEND == "gloo"`,
    # _test_accumulate_gradients_no_sync); no test's body compares with "gloo" otherwise.
    return "".join(out).replace('BACKEND == "gloo"', f"BACKEND in {GLOO_LIKE!r}")


def _load_suite():
    from torch.testing._internal.common_distributed import DistTestCases

    if BACKEND not in ("gloo", "nccl", "ucc", "mpi"):
        # pycomm serves CUDA tensors too (in a CUDA build), as Gloo: "gpu" and "cuda".
        for feature in ("plugin", "ddp", "subgroup", "gpu", "cuda"):
            DistTestCases.backend_feature[feature].add(BACKEND)
    spec = importlib.util.find_spec(SUITE_MODULE)
    with open(spec.origin) as f:
        source = f.read()
    if BACKEND == "pycomm":
        source = _lift_gloo_gates(source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[SUITE_MODULE] = module
    # dont_inherit: this file's `from __future__ import annotations` must not turn the
    # suite's annotations into strings (DDP checks a comm hook's annotation's type).
    exec(compile(source, spec.origin, "exec", dont_inherit=True), module.__dict__)
    return module


def _skipped_at_once(method) -> str:
    """Why the ranks would skip `method` as soon as they start, on a host without
    accelerators, read from the suite's own skip decorators (found by name down the
    method's __wrapped__ chain, with the values they closed over); "" when they would not
    or when it cannot tell, and the test runs. Such a test is reported skipped with the
    ranks' reason without spawning them: half the suite's time here, the same outcomes."""
    import torch
    from torch.testing._internal.common_distributed import TEST_SKIPS

    if torch.cuda.is_available() or torch.xpu.is_available():
        return ""
    world_size = int(os.environ["WORLD_SIZE"])
    fn = method
    while fn is not None:
        decorator = getattr(getattr(fn, "__code__", None), "co_qualname", "").split(".", 1)[0]
        if decorator == "skip_if_no_gpu":
            return TEST_SKIPS["no_cuda"].message
        if decorator == "skip_if_lt_x_gpu":
            closed = inspect.getclosurevars(fn).nonlocals
            if not closed.get("allow_cpu", False):
                x = closed["x"]
                return TEST_SKIPS[f"multi-gpu-{x}"].message if f"multi-gpu-{x}" in TEST_SKIPS else ""
        if decorator == "skip_if_small_worldsize" and BACKEND != "mpi" and world_size < 8:
            return TEST_SKIPS["small_worldsize"].message
        if decorator == "skip_if_odd_worldsize" and BACKEND != "mpi" and world_size % 2 == 1:
            return TEST_SKIPS["odd_worldsize"].message
        fn = getattr(fn, "__wrapped__", None)
    return ""


if BACKEND:
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="pycomm-conformance-"))
    # As PyTorch's CI runs the suite with an init file: the tests that re-initialise the
    # default group (test_barrier_timeout_*) need a file:// rendezvous.
    os.environ.setdefault("INIT_METHOD", "file://" + os.path.join(os.environ["TEMP_DIR"], "shared_init_file"))
    _suite = _load_suite()

    class TestDistBackendWithSpawn(_suite.TestDistBackend, _suite.DistributedTest._DistTestBase):
        def setUp(self):
            reason = _skipped_at_once(getattr(type(self), self._testMethodName))
            if reason:
                raise unittest.SkipTest(reason)
            super().setUp()
            if START_METHOD == "fork":
                self._start_processes(multiprocessing.get_context("fork").Process)
            else:
                self._spawn_processes()


def _summary(text: str) -> str:
    """A failure's telling line: the last exception line of its traceback (a rank's
    traceback is reported inside the parent's), else its last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b", line)]
    return (errors or lines or [""])[-1][:400]


class _Recorder(unittest.TextTestResult):
    """Each test's outcome ("passed", "failed", "skipped") with its reason and duration."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict] = {}
        self._started = 0.0

    def startTest(self, test):
        self._started = time.monotonic()
        super().startTest(test)

    def _record(self, test, outcome, reason=""):
        self.outcomes[test.id().rsplit(".", 1)[-1]] = {
            "outcome": outcome, "reason": _summary(reason),
            "seconds": round(time.monotonic() - self._started, 2)}

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "failed", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._record(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._record(test, "failed", "unexpected success")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write each test's outcome")
    parser.add_argument("-k", dest="pattern", default="", help="only tests whose name matches this regex")
    parser.add_argument("--start", choices=("spawn", "fork"), default="spawn",
                        help="how each test's ranks start: spawned as PyTorch's CI does, or forked from this process")
    args = parser.parse_args()
    global START_METHOD
    START_METHOD = args.start
    if not BACKEND or "WORLD_SIZE" not in os.environ:
        parser.error("set BACKEND and WORLD_SIZE")
    loader = unittest.TestLoader()
    suite = loader.loadTestsFromTestCase(TestDistBackendWithSpawn)
    if args.pattern:
        pattern = re.compile(args.pattern)
        suite = unittest.TestSuite(t for t in suite if pattern.search(t.id().rsplit(".", 1)[-1]))
    runner = unittest.TextTestRunner(resultclass=_Recorder, verbosity=1, stream=sys.stderr)
    result = runner.run(suite)
    with open(args.json, "w") as f:
        json.dump({"backend": BACKEND, "world_size": int(os.environ["WORLD_SIZE"]),
                   "tests": result.outcomes, "lifted": LIFTED}, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
