"""Session-wide checks and markers for the pycomm test suite.

* No /dev/shm/pycomm* segment may outlive the session (the contract says segments are
  removed on destroy and after a crash). Entries present before the session are ignored.
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


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shm():
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Parallel workers see each other's live segments; whoever started them checks
        # once all are done (bench/gpu_check.py does).
        yield
        return
    before = _shm_entries()
    yield
    leaked = _new_entries(before)
    if leaked:
        pytest.fail("leaked shared-memory entries in %s: %s" % (SHM_DIR, leaked),
                    pytrace=False)


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
