"""Fault contract (DESIGN.md section 5): a dead peer fails the collective promptly on every
survivor, a hung peer fails it at the group timeout, errors name the collective, its
sequence number and the peer, errors are sticky (later calls fail fast with the cause), and
new groups can be created in the same processes afterwards. No /dev/shm leak either way.
"""

import datetime
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from _fault_checks import contract_problems, first_lines, second_call, sticky_problems
from _harness import BACKEND, WORLD, is_gloo, new_file_init_method, run_world

WS = 3            # odd, and every survivor is a ring neighbour of the victim
VICTIM = 2
BIG = 3 * 2 ** 18  # floats per all_reduce: 3 MiB
# Detection bound for a dead peer, measured by the survivors from the victim's own
# timestamp (CLOCK_MONOTONIC is system-wide, so the clocks agree across processes).
DEAD_PEER_BOUND_S = 10.0
# Group timeout for the dead-peer test: large, so a pass proves detection, not timeout.
DEAD_PEER_PG_TIMEOUT_S = 300
# Survivors give up (and the test fails) if nothing happened for this long.
LOOP_LIMIT_S = 45


def _die(stamp_path):
    """Write the time of death (atomically), then SIGKILL ourselves: no cleanup runs."""
    tmp = stamp_path + ".tmp"
    with open(tmp, "w") as f:
        f.write(repr(time.monotonic()))
    os.replace(tmp, stamp_path)
    os.kill(os.getpid(), signal.SIGKILL)


def killed_peer_world(rank, ws, stamp_path, mode):
    t = torch.ones(BIG)
    start = time.monotonic()
    if rank == VICTIM:
        go = threading.Event()
        if mode == "during":
            # Die from another thread a moment after iteration 3 starts: the main thread
            # is then inside all_reduce (3 MiB takes milliseconds), i.e. mid-transfer.
            def killer():
                go.wait()
                time.sleep(0.002)
                _die(stamp_path)
            threading.Thread(target=killer, daemon=True).start()
        for i in range(10 ** 6):
            if i == 3:
                if mode == "between":
                    _die(stamp_path)
                go.set()
            t.fill_(1.0)
            dist.all_reduce(t)
        raise AssertionError("victim survived")
    try:
        while time.monotonic() - start < LOOP_LIMIT_S:
            t.fill_(1.0)
            dist.all_reduce(t)
        return {"raised": False}
    except Exception as e:  # noqa: BLE001
        t_err = time.monotonic()
        out = {"raised": True, "type": type(e).__name__,
               "runtime_error": isinstance(e, RuntimeError), "msg": first_lines(e)}
    try:
        with open(stamp_path) as f:
            out["delay"] = t_err - float(f.read())
    except FileNotFoundError:
        out["delay"] = None  # failed before the victim died
    out["second"] = second_call(t)
    return out


# transport -> (world size, environment). "hierarchical": 2 nodes x 2 ranks, shm within
# and TCP across, with the inter-node phase on a helper thread of each rank.
LAYOUTS = {
    "shm": (WS, {"PYCOMM_TRANSPORT": "shm"}),
    "tcp": (WS, {"PYCOMM_TRANSPORT": "tcp"}),
    "hierarchical": (4, {"PYCOMM_ALGO": "hierarchical", "PYCOMM_RANKS_PER_NODE": "2"}),
}


@pytest.mark.parametrize("mode", ["between", "during"])
@pytest.mark.parametrize("transport", list(LAYOUTS))
def test_dead_peer_detected(tmp_path, shm_guard, transport, mode):
    if transport == "hierarchical" and is_gloo():
        pytest.skip("PYCOMM_ALGO is a pycomm knob")
    stamp = str(tmp_path / "victim-died-at")
    ws, env = LAYOUTS[transport]
    results = run_world(killed_peer_world, ws, args=(stamp, mode), env=env,
                        pg_timeout=DEAD_PEER_PG_TIMEOUT_S, timeout=90,
                        expect_killed={VICTIM})
    problems = []
    for rank, r in enumerate(results):
        if rank == VICTIM:
            continue
        print("rank %d: %s" % (rank, r))
        if not r["raised"]:
            problems.append("rank %d: no error within %ss of looping" % (rank, LOOP_LIMIT_S))
            continue
        if not r["runtime_error"]:
            problems.append("rank %d raised %s, expected RuntimeError/DistBackendError"
                            % (rank, r["type"]))
        if r["delay"] is None:
            problems.append("rank %d failed before the victim died: %s" % (rank, r["msg"]))
        elif r["delay"] >= DEAD_PEER_BOUND_S:
            problems.append("rank %d noticed the death after %.1fs (bound %ss)"
                            % (rank, r["delay"], DEAD_PEER_BOUND_S))
        problems += ["rank %d: message %s: %r" % (rank, p, r["msg"])
                     for p in contract_problems(r["msg"], r"rank %d\b" % VICTIM)]
        if not is_gloo():  # stickiness is pycomm's contract
            problems += sticky_problems(rank, r["second"], r"rank %d\b" % VICTIM)
    assert not problems, "dead peer, transport=%s, kill %s collectives (backend %s):\n%s" % (
        transport, mode, BACKEND, "\n".join(problems))


# --------------------------------------------------------------------------------------
# hung peer
# --------------------------------------------------------------------------------------

SLEEPER = 1
HUNG_PG_TIMEOUT_S = 3
# The sleeper must outlast the detection bound, so that "the others failed" cannot be
# explained by the sleeper turning up late; longer only slows the suite.
HUNG_SLEEP_S = 15
HUNG_BOUND_S = 10.0
RECOVERY_TIMEOUT_S = 60


def _all_reduce_ok(group=None):
    t = torch.arange(5, dtype=torch.float32)
    dist.all_reduce(t, group=group)
    ws = dist.get_world_size(group)
    return torch.equal(t, torch.arange(5, dtype=torch.float32) * ws)


def hung_peer_world(rank, ws, reinit_url):
    long = datetime.timedelta(seconds=RECOVERY_TIMEOUT_S)
    # Side channel that outlives the sleep, to line the ranks up again afterwards.
    side = dist.new_group(backend="gloo", timeout=long)
    t = torch.ones(1000)
    dist.all_reduce(t)  # warm-up: connections are up before anyone hangs
    out = {}
    if rank == SLEEPER:
        time.sleep(HUNG_SLEEP_S)  # never calls the collective
    else:
        t0 = time.monotonic()
        try:
            dist.all_reduce(t)
            out.update(raised=False, elapsed=time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001
            out.update(raised=True, elapsed=time.monotonic() - t0, type=type(e).__name__,
                       runtime_error=isinstance(e, RuntimeError), msg=first_lines(e))
            out["second"] = second_call(t)
    dist.barrier(group=side)
    # Recovery 1: a new group in the same processes, next to the poisoned default group.
    g = dist.new_group(timeout=long)
    out["new_group_ok"] = _all_reduce_ok(g)
    dist.barrier(group=side)
    # Recovery 2: tear everything down and initialise a fresh default group.
    dist.destroy_process_group()
    dist.init_process_group(WORLD["backend"], init_method=reinit_url,
                            rank=rank, world_size=ws, timeout=long)
    out["reinit_ok"] = _all_reduce_ok()
    return out


def test_hung_peer_times_out_then_recovers(tmp_path, shm_guard):
    results = run_world(hung_peer_world, WS, args=(new_file_init_method(str(tmp_path)),),
                        pg_timeout=HUNG_PG_TIMEOUT_S, timeout=120)
    problems = []
    for rank, r in enumerate(results):
        print("rank %d: %s" % (rank, r))
        if not r["new_group_ok"]:
            problems.append("rank %d: all_reduce on a new group gave a wrong result" % rank)
        if not r["reinit_ok"]:
            problems.append("rank %d: all_reduce after re-init gave a wrong result" % rank)
        if rank == SLEEPER:
            continue
        if not r["raised"]:
            problems.append("rank %d: all_reduce returned after %.1fs with rank %d asleep"
                            % (rank, r["elapsed"], SLEEPER))
            continue
        if not r["runtime_error"]:
            problems.append("rank %d raised %s, expected RuntimeError" % (rank, r["type"]))
        if "timed out" not in r["msg"].lower():
            problems.append("rank %d: message lacks 'timed out': %r" % (rank, r["msg"]))
        if not HUNG_PG_TIMEOUT_S - 0.5 <= r["elapsed"] <= HUNG_BOUND_S:
            problems.append("rank %d failed after %.1fs; expected %ss..%ss"
                            % (rank, r["elapsed"], HUNG_PG_TIMEOUT_S, HUNG_BOUND_S))
        # In a ring the waiting rank may be blocked on a neighbour, not the sleeper itself:
        # require some peer, not a particular one.
        problems += ["rank %d: message %s: %r" % (rank, p, r["msg"])
                     for p in contract_problems(r["msg"], r"rank \d+")]
        if not is_gloo():
            problems += sticky_problems(rank, r["second"], r"timed out")
    assert not problems, "hung peer (backend %s):\n%s" % (BACKEND, "\n".join(problems))


# --------------------------------------------------------------------------------------
# a peer that dies before a new group is created
# --------------------------------------------------------------------------------------

MISSING_PEER_TIMEOUT_S = 3
MISSING_PEER_BOUND_S = MISSING_PEER_TIMEOUT_S + 10


def missing_peer_world(rank, ws, stamp_path):
    """Rank 2 dies before new_group; the others' group creation must fail in bounded time
    and leave nothing behind (segments created for the absent peer included)."""
    if rank == VICTIM:
        _die(stamp_path)
    t0 = time.monotonic()
    try:
        g = dist.new_group(timeout=datetime.timedelta(seconds=MISSING_PEER_TIMEOUT_S))
        return {"raised": False, "elapsed": time.monotonic() - t0, "group": repr(g)}
    except Exception as e:  # noqa: BLE001
        return {"raised": True, "elapsed": time.monotonic() - t0, "type": type(e).__name__,
                "msg": first_lines(e)}


def test_peer_dead_before_group_creation(tmp_path, shm_guard):
    # The default group's timeout (also the store's) is kept apart from the new group's
    # 3 s, so the test tells which one the backend honours, without waiting a minute.
    results = run_world(missing_peer_world, WS, args=(str(tmp_path / "died"),),
                        pg_timeout=20, timeout=90, expect_killed={VICTIM})
    problems = []
    for rank, r in enumerate(results):
        if rank == VICTIM:
            continue
        print("rank %d: %s" % (rank, r))
        if not r["raised"]:
            problems.append("rank %d: new_group succeeded without rank %d" % (rank, VICTIM))
        elif r["elapsed"] > MISSING_PEER_BOUND_S:
            problems.append("rank %d: new_group failed only after %.1fs (bound %ss)"
                            % (rank, r["elapsed"], MISSING_PEER_BOUND_S))
    assert not problems, "\n".join(problems)
