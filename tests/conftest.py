"""Session-wide checks and markers for the pycomm test suite.

* No /dev/shm/pycomm* segment may outlive the session (the contract says segments are
  removed on destroy and after a crash): a leak fails the session. Entries present before
  the session are ignored.
* Marker `slow`: soak tests. They always run, briefly; with PYCOMM_SOAK=1 they run long.
* PYCOMM_TEST_BACKEND=gloo runs the suite against gloo (validates the harness and the test
  logic without pycomm).
"""

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import BACKEND  # noqa: E402

SHM_DIR = "/dev/shm"
SHM_PREFIX = "pycomm"
# Segments are unlinked by the ranks as they exit; give stragglers a moment.
_SHM_SETTLE_S = 2.0


def soak():
    """True when long soak runs are requested (PYCOMM_SOAK=1)."""
    return os.environ.get("PYCOMM_SOAK") == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: soak test; runs a short version unless PYCOMM_SOAK=1 is set")
    config.addinivalue_line(
        "markers",
        "cuda: needs a CUDA GPU and a CUDA build of pycomm; skipped without them")


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
