"""torch.distributed.shrink_group on pycomm groups: the survivors of a healthy group (one
rank leaves) and of a group a SIGKILLed peer poisoned get a group of their own, renumbered,
over shared memory and over TCP; exact collectives run on it; shrinking the default group
makes the new one the default; nothing is left behind (conftest checks /dev/shm)."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from _harness import is_gloo, run_world

pytestmark = pytest.mark.skipif(is_gloo(), reason="gloo does not support shrink_group")

WS = 4
GONE = 3  # the rank that leaves or dies


def shrink_world(rank, ws, killed, subgroup):
    group = dist.new_group(backend="pycomm") if subgroup else None  # of every rank
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t, group=group)  # a healthy collective first: every connection is in use
    if rank == GONE:
        if killed:
            os.kill(os.getpid(), signal.SIGKILL)
        return None
    failed = None
    if killed:
        try:
            dist.all_reduce(torch.ones(4096), group=group)
        except dist.DistBackendError as e:
            failed = str(e)
    start = time.perf_counter()
    new = dist.shrink_group([GONE], group, shrink_flags=dist.distributed_c10d.SHRINK_ABORT if killed else 0)
    shrink_s = time.perf_counter() - start
    x = torch.arange(1000, dtype=torch.float32) * (rank + 1) + 0.1
    dist.all_reduce(x, group=new)
    y = torch.arange(1000, dtype=torch.float32) * (rank + 1) + 0.1
    if subgroup:
        dist.all_reduce(y, group=new)
    else:  # the new group is the default one: a group of its ranks works like it
        dist.all_reduce(y, group=dist.new_group([0, 1, 2]))
    return {"rank": new.rank(), "size": new.size(), "default": dist.get_world_size(), "failed": failed,
            "x": x.tolist(), "equal": torch.equal(x, y), "shrink_s": shrink_s}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("killed", [False, True], ids=["healthy", "poisoned"])
@pytest.mark.parametrize("subgroup", [False, True], ids=["default", "subgroup"])
def test_survivors_shrink_to_a_working_group(transport, killed, subgroup):
    results = run_world(shrink_world, WS, args=(killed, subgroup), env={"PYCOMM_TRANSPORT": transport},
                        expect_killed=(GONE,) if killed else (), timeout=120, pg_timeout=30)
    want = (torch.arange(1000, dtype=torch.float32) * 1 + 0.1) + (torch.arange(1000, dtype=torch.float32) * 2 + 0.1) \
        + (torch.arange(1000, dtype=torch.float32) * 3 + 0.1)
    for rank, got in enumerate(results[:GONE]):
        assert (got["rank"], got["size"], got["default"]) == (rank, WS - 1, WS if subgroup else WS - 1), got
        assert got["equal"] and got["x"] == want.tolist(), rank
        if killed:
            assert got["failed"] and "rank 3" in got["failed"], got["failed"]
