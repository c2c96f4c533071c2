"""Session-wide checks and markers for the pycomm test suite.

* No /dev/shm/pycomm* segment may outlive the session (the contract says segments are
  removed on destroy and after a crash): a leak fails the session. Entries present before
  the session are ignored.
* Marker `slow`: soak tests. They always run, briefly; with PYCOMM_SOAK=1 they run long.
* Marker `large`: a world over 4 ranks or a training run. `make test` runs it, the quick
  run does not.
* PYCOMM_TEST_BACKEND=gloo runs the suite against gloo (validates the harness and the test
  logic without pycomm).
* Scheduling: tests/durations.json holds every test's seconds (setup, call and teardown)
  from a full run on 2 cores (`make test-durations` writes it). Tests run longest first, in
  units: the tests that share a module- or class-scoped fixture (a world started once) are
  one unit, per value of that fixture's parameters, and every other test is a unit of its
  own; pytest-xdist hands the units to its workers (those of several tests first, by their
  number of tests: ByUnit), so that the longest do not start last and a heavy file's
  worlds run on both workers.
* `--quick` (make test-quick): the edit loop's subset, every unit with no test marked
  `large` whose recorded time is at most QUICK_MAX_S; a world over 4 ranks in it fails
  (_harness), so that a test starting one is marked.
"""

import json
import os
import shutil
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402
# Triton reads its mode (TRITON_INTERPRET) when it is imported, and the session's zygote
# imports it (with torch._dynamo): set here, before any world starts, so that every world
# runs the Triton kernels as tests/_triton_env.py says, whichever test file runs first.
import _triton_env  # noqa: E402, F401
from _harness import BACKEND  # noqa: E402

DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
# A test missing from DURATIONS (new since it was written) is taken to last this long.
UNKNOWN_DURATION_S = 2.0
QUICK_MAX_S = 5.0

SHM_DIR = "/dev/shm"
SHM_PREFIX = "pycomm"
# Segments are unlinked by the ranks as they exit; give stragglers a moment.
_SHM_SETTLE_S = 2.0


def soak():
    """True when long soak runs are requested (PYCOMM_SOAK=1)."""
    return os.environ.get("PYCOMM_SOAK") == "1"


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="the edit loop's subset: nothing marked large, no unit recorded over %g s" % QUICK_MAX_S)
    parser.addoption("--record-durations", metavar="PATH", default=None,
                     help="write every test's seconds (setup + call + teardown) to PATH as JSON")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: soak test; runs a short version unless PYCOMM_SOAK=1 is set")
    config.addinivalue_line(
        "markers",
        "large: a world over 4 ranks or a training run; make test runs it, make test-quick does not")
    config.addinivalue_line(
        "markers",
        "cuda: needs a CUDA GPU and a CUDA build of pycomm; skipped without them")
    _harness.QUICK = config.getoption("--quick")
    if not _is_worker() and getattr(config.option, "numprocesses", None):
        os.environ[_UNITS_FILE] = os.path.join(tempfile.mkdtemp(prefix="pycomm-test-units-"), "units.json")


def pytest_report_header(config):
    return "pycomm tests: backend under test = %s (PYCOMM_TEST_BACKEND)%s" % (
        BACKEND, ", soak" if soak() else "")


def _shm_entries():
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


def _new_entries(before):
    """Entries not in `before`, after letting exiting ranks unlink theirs."""
    deadline = time.monotonic() + _SHM_SETTLE_S
    leaked = _shm_entries() - before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked = _shm_entries() - before
    return sorted(leaked)


_SHM_BEFORE = pytest.StashKey[set]()


def _is_worker():
    """A pytest-xdist worker: its tests run beside other workers' (make test runs two)."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


# The session's check runs in the process that started it: the only one when tests run in
# one process; under pytest-xdist, the controller, after every worker has finished (a
# worker would see the others' live segments).
def pytest_sessionstart(session):
    if not _is_worker():
        session.config.stash[_SHM_BEFORE] = _shm_entries()


def pytest_sessionfinish(session, exitstatus):
    _write_recorded(session.config)
    if not _is_worker() and _UNITS_FILE in os.environ:
        shutil.rmtree(os.path.dirname(os.environ.pop(_UNITS_FILE)), ignore_errors=True)
    if _is_worker() or _SHM_BEFORE not in session.config.stash:
        return
    leaked = _new_entries(session.config.stash[_SHM_BEFORE])
    if leaked:
        print("\nleaked shared-memory entries in %s: %s" % (SHM_DIR, leaked), file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def flight_recorder_files(tmp_path_factory):
    """Flight recorders that fault tests make ranks write go to pytest's temp directory,
    not the system's."""
    os.environ.setdefault("PYCOMM_FLIGHT_RECORDER_DIR", str(tmp_path_factory.mktemp("flight-recorder")))


@pytest.fixture
def shm_guard():
    """Per-test version, for tests that crash or kill ranks: pins a leak on the test."""
    before = _shm_entries()
    yield
    leaked = _new_entries(before)
    assert not leaked, "leaked shared-memory entries in %s: %s" % (SHM_DIR, leaked)


def _recorded_durations():
    try:
        with open(DURATIONS, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def _unit(item):
    """The scheduling unit of `item`: its file and the parameters of the module- or
    class-scoped fixtures it uses (their worlds are started once per unit), or its own
    nodeid when it uses none (it can run anywhere)."""
    shared = []
    for name in item.fixturenames:
        defs = item._fixtureinfo.name2fixturedefs.get(name)
        if defs and defs[-1].scope in ("module", "class", "package"):
            param = getattr(item, "callspec", None) and item.callspec.params.get(name)
            shared.append(name if param is None else "%s=%s" % (name, param))
    if not shared:
        return item.nodeid
    return "%s[%s]" % (item.nodeid.split("::")[0], ",".join(sorted(shared)))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    durations = _recorded_durations()
    units = {}
    for index, item in enumerate(items):
        units.setdefault(_unit(item), []).append((index, item))

    def seconds(unit):
        return sum(durations.get(item.nodeid, UNKNOWN_DURATION_S) for _, item in unit)

    if config.getoption("--quick"):
        dropped = {k for k, u in units.items()
                   if seconds(u) > QUICK_MAX_S or any(item.get_closest_marker("large") for _, item in u)}
        config.hook.pytest_deselected(items=[item for k in dropped for _, item in units.pop(k)])
    # Longest unit first; a unit's tests keep their order (its fixtures' set-up and reuse).
    # pytest-xdist hands out the units of several tests first (most tests first), then the
    # single tests in this order.
    order = sorted(units.values(), key=lambda unit: (-seconds(unit), unit[0][0]))
    items[:] = [item for unit in order for _, item in unit]
    if _is_worker() and _UNITS_FILE in os.environ:
        with open(os.environ[_UNITS_FILE], "w", encoding="utf-8") as f:
            json.dump({item.nodeid: unit for unit, u in units.items() for _, item in u}, f)


# pytest-xdist's workers collect, its controller hands out the tests: each worker writes
# the units it found (the same in every worker) to the file named by _UNITS_FILE, which
# the controller's scheduler reads when it splits the collection into units.
_UNITS_FILE = "PYCOMM_TEST_UNITS_FILE"


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        """pytest-xdist's scope scheduling with this suite's units for scopes (its own
        loadgroup names groups in nodeids, which pytest 9 no longer lets it change). It
        hands out the units of several tests first, most tests first, then the others in
        the order collected: longest first."""

        units = None

        def _split_scope(self, nodeid):
            if self.units is None:
                with open(os.environ[_UNITS_FILE], encoding="utf-8") as f:
                    self.units = json.load(f)
            return self.units.get(nodeid, nodeid.split("::")[0])

    return ByUnit(config, log)


# Every test's seconds, when --record-durations asks for them: collected in the process
# that started the session (under pytest-xdist, the controller, which receives every
# worker's reports) and written when it ends.
_RECORDED = {}


def pytest_runtest_logreport(report):
    _RECORDED[report.nodeid] = _RECORDED.get(report.nodeid, 0.0) + report.duration


def _write_recorded(config):
    path = config.getoption("--record-durations")
    if path and not _is_worker():
        with open(path, "w", encoding="utf-8") as f:
            json.dump({k: round(v, 2) for k, v in sorted(_RECORDED.items())}, f, indent=0)
            f.write("\n")
