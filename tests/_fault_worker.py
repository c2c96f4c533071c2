"""One process of a fault-matrix world (test_fault_matrix.py), run as a script:

    python _fault_worker.py <plan.json> <index>

A plan lists scenarios that the processes of one world run in turn; <index> is this
process's place in the world. Each scenario says how each process takes part: as
[rank, world size] (wrong on purpose in some scenarios), "absent" (it never joins the
faulty group but joins the recovery) or null (not at all). For each scenario it takes part
in, this process:

1. creates the default group, with the scenario's environment (PYCOMM_FAULT, transport,
   ...) in place for that group only, then sets the group's timeout;
2. runs `calls` collectives of ones (all_reduce, or the scenario's `collective`), checking
   each result, until one raises;
3. after an error, calls once more: a poisoned group must refuse at once;
4. recovers, when it is listed in `recover`: destroys the group and creates a fresh one
   with the others listed, whose all_reduce must be correct (and lines the processes up
   for the next scenario);
5. appends its record (a JSON line, flushed) to records-<index>.jsonl next to the plan, so
   that a process that dies later still leaves the records before it.

It then exits through the interpreter's normal teardown: the test expects status 0.
Why a script and not _harness.run_world: run_world accepts SIGKILL as the only way for a
rank to end without reporting, and faults here also stop ranks and make them exit.
"""

import datetime
import faulthandler
import json
import os
import signal
import sys
import time

from _fault_checks import first_lines, second_call

# Timeout of the recovery groups: they must form even after a scenario's victim slept.
RECOVERY_TIMEOUT_S = 30
_T0 = time.monotonic()


def _log(what):
    """A progress line in this process's log, for the story of a failed test."""
    print("[%6.2fs] %s" % (time.monotonic() - _T0, what), flush=True)


def _seconds(s):
    return datetime.timedelta(seconds=s)


def _error(e, t0, **fields):
    return dict(fields, type=type(e).__name__, msg=first_lines(e), elapsed=time.monotonic() - t0)


def _init(url, rank, world, timeout_s):
    import torch.distributed as dist

    try:
        dist.init_process_group("pycomm", init_method=url, rank=rank, world_size=world,
                                timeout=_seconds(timeout_s))
    except BaseException:
        # torch names the default group's store keys by its count of groups, which a failed
        # start-up leaves one up (destroying a group resets it): undo that, or every later
        # group's keys differ from those of processes that did not fail (an absent rank, a
        # fresh victim) and start-up hangs.
        dist.distributed_c10d._world.group_count = 0
        raise


def _faulty_group(sc, rank, world):
    """Step 1. Returns the start-up record."""
    import torch.distributed as dist

    saved = {k: os.environ.get(k) for k in sc["env"]}
    os.environ.update(sc["env"])  # pycomm reads its knobs when a group is created
    t0 = time.monotonic()
    try:
        _init(sc["url"], rank, world, sc["init_timeout"])
        dist.group.WORLD.set_timeout(_seconds(sc["timeout"]))
        return {"joined": True, "ok": True, "elapsed": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001 - the outcome is the record
        return _error(e, t0, joined=True, ok=False)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _calls(sc, world):
    """Steps 2 and 3. Returns (error or None, the calls that completed)."""
    import torch
    import torch.distributed as dist

    t = torch.ones(sc["count"])
    whole = torch.ones(sc["count"] * world)
    # The call, and the value every element of its result must have (inputs are ones).
    call, result, value = {
        "allreduce": (lambda: dist.all_reduce(t), t, world),
        "reduce_scatter": (lambda: dist.reduce_scatter_tensor(t, whole), t, world),
        "allgather": (lambda: dist.all_gather_into_tensor(whole, t), whole, 1),
    }[sc["collective"]]
    done = []
    for seq in range(1, sc["calls"] + 1):
        t.fill_(1.0)
        whole.fill_(1.0)
        t0 = time.monotonic()
        try:
            call()
        except Exception as e:  # noqa: BLE001
            err = _error(e, t0, seq=seq)
            err["second"] = second_call(t)
            return err, done
        done.append({"seq": seq, "elapsed": time.monotonic() - t0,
                     "correct": bool(torch.all(result == value))})
    return None, done


def _recover(sc, index):
    """Step 4: a fresh group of the processes that recover, in the same processes."""
    import torch
    import torch.distributed as dist

    members = sc["recover"]
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
        _init(sc["recovery_url"], members.index(index), len(members), RECOVERY_TIMEOUT_S)
        t = torch.ones(8)
        dist.all_reduce(t)
        dist.destroy_process_group()
        return "ok" if torch.all(t == len(members)) else "wrong result %s" % t.tolist()
    except Exception as e:  # noqa: BLE001
        return "%s: %s" % (type(e).__name__, first_lines(e))


def main(plan_path, index):
    # Stacks of every thread on SIGUSR1: the test asks for them before killing a straggler.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    with open(plan_path) as f:
        plan = json.load(f)
    import pycomm  # noqa: F401  (registers the backend)

    _log("imported")
    with open(os.path.join(os.path.dirname(plan_path), "records-%d.jsonl" % index), "w") as out:
        for sc in plan:
            start = sc["start"][index]
            if start is None:
                continue
            _log("%s: start-up" % sc["name"])
            record = {"scenario": sc["name"], "index": index,
                      "init": {"joined": False} if start == "absent" else _faulty_group(sc, *start)}
            if record["init"].get("ok"):
                _log("%s: calls" % sc["name"])
                record["error"], record["calls"] = _calls(sc, start[1])
            if index in sc["recover"]:
                _log("%s: recovery" % sc["name"])
                record["recovered"] = _recover(sc, index)
            out.write(json.dumps(record) + "\n")
            out.flush()
    _log("done")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
