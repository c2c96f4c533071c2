"""What each rank runs: the control group, one group per backend, the sweep.

A rank reads the run (config, rendezvous) from the launcher's private directory and
connects back to the parent's socket there; it sends ("hello", (rank, pid)) first, then
("phase", text) before each step (so a hang can be located), ("row", records) from rank 0
after each size, then ("ok", records) or ("err", traceback). Raw times only; statistics
are the parent's job.

Started by multiprocessing (``rank_main``) or by mpirun (``python -m pycomm.bench.worker
DIR``, rank and size from Open MPI's environment).
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import signal
import socket
import sys
import traceback

# Names inside the launcher's directory.
RUN_FILE = "run.pickle"        # (Config, init_method), written before any rank starts
CONTROL_SOCKET = "control.sock"


def stack_path(rundir: str, rank: int) -> str:
    return os.path.join(rundir, "stacks-rank%d.txt" % rank)


def _connect(rundir: str):
    from multiprocessing.connection import Connection

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(os.path.join(rundir, CONTROL_SOCKET))
    return Connection(s.detach())


def rank_main(rundir: str, rank: int, world: int) -> None:
    # Python stacks go to this rank's file, which the parent adds to the failure story:
    # on a fatal signal (segfault in an extension), and on SIGUSR1, which the parent sends
    # to a rank that missed the deadline before killing it.
    stack_file = open(stack_path(rundir, rank), "w")
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    with open(os.path.join(rundir, RUN_FILE), "rb") as f:
        cfg, init_method = pickle.load(f)
    conn = _connect(rundir)
    phase = "start"

    def say(kind, payload):
        conn.send((kind, payload))

    def at(text):
        nonlocal phase
        phase = text
        say("phase", text)

    say("hello", (rank, os.getpid()))
    try:
        at("import torch")
        import torch.distributed as dist

        from .backends import open_comm

        timeout = datetime.timedelta(seconds=cfg.pg_timeout_s)
        at("init_process_group(gloo) via %s" % init_method.split(":", 1)[0])
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world, timeout=timeout)
        control = dist.group.WORLD
        comms = []
        for spec in cfg.backends:
            at("new_group(%s)" % spec.describe())
            comms.append(open_comm(spec, timeout, world))
        records = sweep(cfg, rank, world, comms, control, at, say)
    except BaseException:
        say("err", "[rank %d, phase: %s]\n%s" % (rank, phase, traceback.format_exc()))
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)   # never run a possibly stuck destroy after a failure
    say("ok", records if rank == 0 else None)
    try:
        at("destroy_process_group")
        for comm in comms:
            comm.close()
        dist.destroy_process_group()
        say("destroyed", None)
    except BaseException:
        say("destroy_err", traceback.format_exc())
    conn.close()


def sweep(cfg, rank, world, comms, control, at, say):
    """Every (dtype, op, size) of the run; returns the raw records (one per backend)."""
    from .collectives import COLLECTIVES
    from .config import DTYPES

    coll = COLLECTIVES[cfg.collective]
    records = []
    for dtype in cfg.dtypes:
        elem = DTYPES[dtype][1]
        for op in (cfg.ops if coll.takes_op else ["none"]):
            done = set()
            for size in cfg.sizes:
                count = size // elem       # sizes round down to whole elements
                if count == 0 or count in done:
                    continue
                done.add(count)
                row = measure(cfg, coll, comms, control, count, dtype, op, rank, world, at)
                if rank == 0:
                    say("row", row)
                records.extend(row)
    return records


def measure(cfg, coll, comms, control, count, dtype, op, rank, world, at):
    """One size: prepare every backend, check each, warm each up, then the repeats with the
    backends interleaved. Returns one raw record per backend."""
    import torch
    import torch.distributed as dist

    from .timing import iterations, timed_repeat, warm_up

    prepared = []
    for comm in comms:
        at("%s %s %s count %d: prepare %s" % (coll.name, dtype, op, count, comm.label))
        prepared.append(coll.prepare(comm, count, dtype, op, rank, world))
    where = "%s %s %s %d B" % (coll.name, dtype, op, prepared[0].nbytes)
    wrong = [-1] * len(comms)
    if cfg.check:
        local = []
        for comm, p in zip(comms, prepared):
            at("%s: check %s" % (where, comm.label))
            local.append(p.check())
        total = torch.tensor(local, dtype=torch.int64)
        dist.all_reduce(total, group=control)
        wrong = total.tolist()
    n, w = iterations(cfg, prepared[0].nbytes)
    for comm, p in zip(comms, prepared):
        at("%s: warm-up %s (%d calls)" % (where, comm.label, w))
        warm_up(p.run, w)
    loops = [[] for _ in comms]
    for rep in range(cfg.repeats):
        for i, (comm, p) in enumerate(zip(comms, prepared)):
            at("%s: repeat %d/%d %s (%d calls)" % (where, rep + 1, cfg.repeats, comm.label, n))
            loops[i].append(timed_repeat(p.run, n, control, world, cfg.mode))
    return [dict(backend=comm.label, collective=coll.name, dtype=dtype, op=op,
                 bytes=p.nbytes, count=p.count, iters=n, warmup=w,
                 busbw_factor=coll.busbw_factor(world), loop_s=loops[i], wrong=wrong[i])
            for i, (comm, p) in enumerate(zip(comms, prepared))]


if __name__ == "__main__":
    rank_main(sys.argv[1], int(os.environ["OMPI_COMM_WORLD_RANK"]),
              int(os.environ["OMPI_COMM_WORLD_SIZE"]))
