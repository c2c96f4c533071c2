"""A /dev/shm too small for the group (Docker's default is a 64 MiB tmpfs; 16 ranks take
240 MiB at the default chunk): group creation finds it out, since the segments' pages are
allocated when they are made, and the ranks agree on smaller rings, then on TCP over
loopback, or, with PYCOMM_TRANSPORT=shm, raise a clear error on every rank. Never a
SIGBUS; nothing left in /dev/shm. The world runs in a mount namespace of its own whose
/dev/shm is a 64 MiB tmpfs (tests/_shm_room.py)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from _harness import is_gloo

HERE = os.path.dirname(os.path.abspath(__file__))
MOUNT = "mount -t tmpfs -o size=64m tmpfs /dev/shm"


def _private_mounts_allowed():
    try:
        return subprocess.run(["unshare", "-m", "sh", "-c", MOUNT], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.large
@pytest.mark.skipif(is_gloo(), reason="pycomm's shared memory")
@pytest.mark.skipif(not _private_mounts_allowed(), reason="needs a private mount namespace (unshare -m, as root)")
def test_sixteen_ranks_fit_a_64_mib_dev_shm():
    command = "%s && exec %s %s 150" % (MOUNT, sys.executable, os.path.join(HERE, "_shm_room.py"))
    proc = subprocess.Popen(["unshare", "-m", "sh", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail("the world passed its deadline:\n" + err[-4000:])
    assert proc.returncode == 0, err[-4000:]
    world = json.loads(out.strip().splitlines()[-1])
    assert world["left"] == [], world["left"]  # nothing in /dev/shm once the ranks are gone
    # The fallbacks are named once, by rank 0, on stderr.
    assert err.count("rings of 65536-byte slots instead") + err.count("rings of 131072-byte slots instead") == 1, err
    assert err.count("TCP on loopback between the ranks of a node instead") == 1, err
    for rank, got in enumerate(world["results"]):
        assert got["default_right"] and got["full_right"], (rank, got)
        smaller, tcp = got["default"], got["full"]
        assert smaller["transports"].startswith("shm: ") and smaller["chunk_bytes"] < 262144, (rank, smaller)
        assert "/dev/shm has" in smaller["fallback"] and "--shm-size" in smaller["fallback"], (rank, smaller)
        assert tcp["transports"].startswith("tcp: ") and "TCP on loopback" in tcp["fallback"], (rank, tcp)
        forced = got["forced"]
        assert forced is not None and forced.startswith("ValueError: pycomm: creating group"), (rank, forced)
        for words in ("/dev/shm has", "free", "needed", "PYCOMM_TRANSPORT=shm", "--shm-size", "PYCOMM_SHM_CHUNK_BYTES"):
            assert words in forced, (rank, words, forced)
