"""torch.distributed.shrink_group on pycomm groups: the survivors of a healthy group (one
rank leaves) and of a group a SIGKILLed peer poisoned get a group of their own, renumbered,
over shared memory, over TCP and across two nodes; collectives on it give exact values
(sums of quarters, exact in any order); shrinking the default group makes the new one the
default; nothing is left behind (conftest checks /dev/shm). The new group is a pycomm group
as the old one was, whatever backend type torch registered it under: DDP, FSDP2 and a group
made under it train on it as a single process does."""

import os
import re
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
    x = torch.arange(1000, dtype=torch.float32) * (rank + 1) + 0.25
    dist.all_reduce(x, group=new)
    y = torch.arange(1000, dtype=torch.float32) * (rank + 1) + 0.25
    if subgroup:
        dist.all_reduce(y, group=new)
    else:  # the new group is the default one: a group of its ranks works like it
        dist.all_reduce(y, group=dist.new_group([0, 1, 2]))
    pids = [None] * new.size()
    dist.all_gather_object(pids, os.getpid(), group=new)
    return {"rank": new.rank(), "size": new.size(), "default": dist.get_world_size(), "failed": failed,
            "x": x.tolist(), "equal": torch.equal(x, y), "shrink_s": shrink_s, "held": _held_of_others(pids),
            "backend": (str(dist.get_backend(new)), new.name())}


def _held_of_others(pids):
    """What this process still holds of processes outside ``pids``: mappings of their
    shared-memory segments, pidfds beyond one per peer in ``pids``."""
    mapped = {int(p) for p in re.findall(r"/pycomm-(\d+)-", open("/proc/self/maps").read())}
    links = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
             if os.path.exists(f"/proc/self/fd/{fd}")]
    return {"segments of": sorted(mapped - set(pids)), "pidfds": sum("pidfd" in link for link in links)}


# Shared memory, TCP, and two "nodes" of 2 (shared memory within, TCP across).
LAYOUTS = {"shm": {"PYCOMM_TRANSPORT": "shm"}, "tcp": {"PYCOMM_TRANSPORT": "tcp"},
           "nodes": {"PYCOMM_RANKS_PER_NODE": "2"}}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("killed", [False, True], ids=["healthy", "poisoned"])
@pytest.mark.parametrize("subgroup", [False, True], ids=["default", "subgroup"])
def test_survivors_shrink_to_a_working_group(layout, killed, subgroup):
    results = run_world(shrink_world, WS, args=(killed, subgroup), env=LAYOUTS[layout],
                        expect_killed=(GONE,) if killed else (), timeout=120, pg_timeout=30)
    want = (torch.arange(1000, dtype=torch.float32) * 1 + 0.25) + (torch.arange(1000, dtype=torch.float32) * 2 + 0.25) \
        + (torch.arange(1000, dtype=torch.float32) * 3 + 0.25)
    for rank, got in enumerate(results[:GONE]):
        assert (got["rank"], got["size"], got["default"]) == (rank, WS - 1, WS if subgroup else WS - 1), got
        assert got["equal"] and got["x"] == want.tolist(), rank
        assert got["backend"] == ("pycomm", "pycomm"), got["backend"]  # not torch's "gloo"
        if not subgroup:  # the old group, destroyed, held the only resources of the lost rank
            # Left: one pidfd per peer of each live group (the new default one and the
            # group made on it) where they share memory, none over TCP.
            assert got["held"]["segments of"] == [] and got["held"]["pidfds"] <= 2 * (WS - 2), got["held"]
        if killed:
            assert got["failed"] and "rank 3" in got["failed"], got["failed"]


# ---- training on the shrunk group ----

TRAIN_STEPS = 3
SUBGROUPS = [[0, 2], [1]]  # of the survivors
# Float32 gradients averaged in another order than the reference's differ by a few ulps.
RTOL, ATOL = 1e-5, 1e-6


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(ranks, step):
    """The batches of ``ranks`` at ``step``, concatenated: a rank's own, or all of them for
    the single-process reference (whose mean loss is the mean of the ranks' mean losses)."""
    x = torch.cat([torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + r)) for r in ranks])
    return x, torch.sin(x[:, :4])


def _train(model, ranks):
    """TRAIN_STEPS SGD steps on the batches of ``ranks``; the parameters after them."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(TRAIN_STEPS):
        x, y = _batch(ranks, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def training_world(rank, ws, killed):
    """The survivors shrink the default group (after rank GONE left, or died by SIGKILL and
    failed their next collective), then train on the new one with DDP and FSDP2, and with
    DDP on their groups of SUBGROUPS made under it. Returns every trained model's parameters
    and what torch, DDP's logger and the groups name the backend; rank 0 also the parameters
    of the single-process references, by the ranks whose batches they train on (computed
    here, where the training code is warm: the first backward in the test's own process
    costs seconds)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.all_reduce(torch.ones(4))
    if rank == GONE:
        if killed:
            os.kill(os.getpid(), signal.SIGKILL)
        return None
    if killed:
        with pytest.raises(dist.DistBackendError):
            dist.all_reduce(torch.ones(4096))
    new = dist.shrink_group([GONE], shrink_flags=dist.distributed_c10d.SHRINK_ABORT if killed else 0)
    ddp = DDP(_net())  # on the default group, the new one
    fsdp = _net()
    fully_shard(fsdp, mesh=DeviceMesh.from_group(new, "cpu"))
    sub, _ = dist.new_subgroups_by_enumeration(SUBGROUPS)  # each made by dist.new_group; this rank's
    got = {"default": dist.distributed_c10d._get_default_group() is new,
           "names": [(str(dist.get_backend(new)), new.name(), ddp._get_ddp_logging_data()["backend_name"]),
                     (str(dist.get_backend(sub)), sub.name())],
           "ddp": _train(ddp, [new.rank()]),
           "fsdp": [p.full_tensor() for p in _train(fsdp, [new.rank()])],
           "sub": _train(DDP(_net(), process_group=sub), [new.rank()])}
    if new.rank() == 0:
        got["references"] = {tuple(ranks): _train(_net(), ranks) for ranks in [range(new.size()), *SUBGROUPS]}
    return got


@pytest.mark.large
@pytest.mark.parametrize("killed", [False, True], ids=["healthy", "poisoned"])
def test_ddp_fsdp2_and_subgroups_train_on_a_shrunk_group(killed):
    results = run_world(training_world, WS, args=(killed,), expect_killed=(GONE,) if killed else (), timeout=120,
                        pg_timeout=30)
    references, survivors = results[0]["references"], tuple(range(WS - 1))
    for rank, got in enumerate(results[:GONE]):
        assert got["default"], rank
        assert all(names == ("pycomm",) * len(names) for names in got["names"]), (rank, got["names"])
        group = next(tuple(ranks) for ranks in SUBGROUPS if rank in ranks)
        for kind, ranks in [("ddp", survivors), ("fsdp", survivors), ("sub", group)]:
            for i, (p, q) in enumerate(zip(got[kind], references[ranks], strict=True)):
                assert torch.allclose(p, q, rtol=RTOL, atol=ATOL), f"rank {rank} {kind} param {i}: {p - q}"
                assert torch.equal(p, results[ranks[0]][kind][i]), f"rank {rank} {kind} param {i}: not rank " \
                    f"{ranks[0]}'s"


# ---- recovery with unchanged bits ----

STEPS = 10
MICRO_BATCHES = 12  # the global batch of every step
KILLED_AT = 5       # the step in whose gradient reduction rank GONE is SIGKILLed


def recovery_world(rank, ws, kill_at, clock_file):
    """exact_data_parallel training of STEPS steps on the global batch of MICRO_BATCHES
    micro-batches, each rank computing its contiguous share. Where ``kill_at`` is set, rank
    GONE dies in that step's gradient reduction (PYCOMM_FAULT, between its two
    all-reduces); the survivors catch the error, shrink the default group, rebuild the
    accumulator on it, redo the step with the same global batch over the ranks left, and
    go on. Returns the parameters' digest after every step and, on a survivor, the seconds
    from rank GONE entering the reduction it dies in to the end of the step redone."""
    from test_exact_data_parallel import _digest, _micro_batch, _model

    import pycomm

    torch.set_num_threads(1)  # the same local kernels whatever the number of processes
    model = _model("mlp")
    edp = pycomm.exact_data_parallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    digests, resumed_s, step = [], None, 0
    while step < STEPS:
        r, n = dist.get_rank(), dist.get_world_size()
        for m in range(r * MICRO_BATCHES // n, (r + 1) * MICRO_BATCHES // n):
            x, y = _micro_batch("mlp", step, m)
            torch.nn.functional.mse_loss(model(x), y).backward()
        if step == kill_at and rank == GONE:  # PYCOMM_FAULT kills it in the reduction below
            with open(clock_file, "w") as f:
                f.write(repr(time.time()))
        try:
            edp.reduce_gradients()
        except dist.DistBackendError as e:
            assert step == kill_at and f"rank {GONE} (pid" in str(e), (step, str(e))
            dist.shrink_group([GONE], shrink_flags=dist.distributed_c10d.SHRINK_ABORT)
            edp.remove()  # its state holds the failed step's share: start afresh on the new group
            edp = pycomm.exact_data_parallel(model, broadcast_parameters=False)
            opt.zero_grad()
            continue  # the same step again, its batch shared by the ranks left
        opt.step()
        opt.zero_grad()
        digests.append(_digest(model))
        if step == kill_at and kill_at is not None and resumed_s is None and dist.get_world_size() < ws:
            with open(clock_file) as f:
                resumed_s = time.time() - float(f.read())
        step += 1
    return digests, resumed_s


@pytest.mark.large
def test_recovery_after_a_lost_rank_keeps_the_bits_of_the_uninterrupted_run(tmp_path):
    clock = str(tmp_path / "killed-at")
    one = run_world(recovery_world, 1, args=(None, clock), timeout=120)[0][0]
    four = run_world(recovery_world, WS, args=(None, clock), timeout=120)
    # The group's operations: a broadcast per parameter (the accumulator's start), then five
    # per step (the counts' all-reduce, the indices' MAX all-reduce, the two bins'
    # reduce-scatters, the values' all-gather). Rank GONE dies before its first frame of
    # step KILLED_AT's MAX, the counts of that step added.
    from test_exact_data_parallel import _model

    seq = len(list(_model("mlp").parameters())) + 5 * KILLED_AT + 2
    recovered = run_world(recovery_world, WS, args=(KILLED_AT, clock), expect_killed=(GONE,), timeout=120,
                          pg_timeout=30, env={"PYCOMM_FAULT": f"{GONE}:allreduce:{seq}:during:kill"})
    assert all(digests == one for digests, _ in four), "4 ranks differ from 1"
    for rank, (digests, resumed_s) in enumerate(recovered[:GONE]):
        assert len(digests) == STEPS
        assert digests == one, f"rank {rank}: parameters differ from the uninterrupted run after step " \
            f"{next(i for i, (a, b) in enumerate(zip(digests, one)) if a != b)}"
        assert resumed_s is not None
        print(f"rank {rank}: from the kill to the end of the redone step on the shrunk group: {resumed_s:.3f} s")


def disagreeing_world(rank, ws):
    """Survivors that name different ranks to exclude (rank 2 also excludes rank 1)."""
    dist.all_reduce(torch.ones(4))
    if rank == GONE:
        return None
    try:
        dist.shrink_group([1, GONE] if rank == 2 else [GONE])
        return "shrunk"
    except (dist.DistBackendError, ValueError) as e:
        return str(e)


def test_survivors_that_disagree_on_the_excluded_ranks_get_an_error():
    results = run_world(disagreeing_world, WS, timeout=120, pg_timeout=30)
    for rank, got in enumerate(results[:GONE]):
        assert "excludes ranks [1,3] and rank" in got or ("rank 2 excludes" in got and "excludes [1,3]" in got), \
            (rank, got)
