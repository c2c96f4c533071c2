"""What each rank runs: the control group, one group per backend, the sweep.

A rank reads the run (config, rendezvous) from the launcher's private directory and
connects back to the parent's socket there; it sends ("hello", (rank, pid)) first, then
("phase", text) before each step (so a hang can be located), ("row", records) from rank 0
after each size, then ("ok", records) or ("err", traceback). Raw times only; statistics
are the parent's job.

Started as ``python -m pycomm.bench.worker DIR RANK WORLD`` by the spawn launcher, or as
``python -m pycomm.bench.worker DIR`` by mpirun (rank and size from Open MPI's
environment). Under torchrun every process runs the command line itself and calls
:func:`run_rank` directly (cli.py), with no parent.
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

from .._launch import stack_path

# Names inside the launcher's directory.
RUN_FILE = "run.pickle"        # (Config, init_method), written before any rank starts
CONTROL_SOCKET = "control.sock"


def _connect(rundir: str):
    from multiprocessing.connection import Connection

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(os.path.join(rundir, CONTROL_SOCKET))
    return Connection(s.detach())


def rank_main(rundir: str, rank: int, world: int, local_rank: int) -> None:
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
        comms, records = run_rank(cfg, rank, world, local_rank, init_method, at, say)
    except BaseException:
        say("err", "[rank %d, phase: %s]\n%s" % (rank, phase, traceback.format_exc()))
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)   # never run a possibly stuck destroy after a failure
    say("ok", records if rank == 0 else None)
    try:
        at("destroy_process_group")
        close(comms)
        say("destroyed", None)
    except BaseException:
        say("destroy_err", traceback.format_exc())
    conn.close()


def run_rank(cfg, rank, world, local_rank, init_method, at, say):
    """The control group, one group per backend, the sweep: (comms, records). ``at(text)``
    names each step, ``say("row", records)`` is called on rank 0 after each size."""
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
        comms.append(open_comm(spec, timeout, world, local_rank))
    return comms, sweep(cfg, rank, world, comms, control, at, say)


def close(comms) -> None:
    import torch.distributed as dist

    for comm in comms:
        comm.close()
    dist.destroy_process_group()


def sweep(cfg, rank, world, comms, control, at, say):
    """Every (collective, dtype, op, placement, size) of the run; returns the raw records
    (one per backend)."""
    from .collectives import COLLECTIVES

    records = []
    for coll in (COLLECTIVES[c] for c in cfg.collectives):
        for dtype in cfg.dtypes:
            for op in (cfg.ops if coll.takes_op else ["none"]):
                for in_place in (p for p in cfg.placements if p in coll.placements):
                    done = set()
                    for size in cfg.sizes:
                        total, _ = coll.elements(size, dtype, world)
                        if total == 0 or total in done:
                            continue
                        done.add(total)
                        row = measure(cfg, coll, comms, control, size, dtype, op, in_place,
                                      rank, world, at)
                        if rank == 0:
                            say("row", row)
                        records.extend(row)
    return records


def measure(cfg, coll, comms, control, size, dtype, op, in_place, rank, world, at):
    """One size: prepare every backend, check each, warm each up, then the repeats with the
    backends interleaved. Returns one raw record per backend."""
    from .backends import BACKENDS
    from .collectives import prepare
    from .timing import iterations, timed_repeat, warm_up

    prepared = []
    for comm in comms:
        at("%s %s %s %d B: prepare %s" % (coll.name, dtype, op, size, comm.label))
        prepared.append(prepare(coll, comm, size, dtype, op, in_place, rank, world, cfg.seed))
    where = "%s %s %s %s %d B" % (coll.name, "in-place" if in_place else "out-of-place",
                                  dtype, op, prepared[0].nbytes)
    accuracy = [dict(wrong=-1, relerr=None, hash=None, ranks_match=None,
                     repeats_match=None) for _ in comms]
    is_collective = [BACKENDS[comm.spec.kind].collective for comm in comms]  # else a yardstick: unchecked, factor 1
    if cfg.check:
        for comm, p, acc, checked in zip(comms, prepared, accuracy, is_collective):
            if not checked:
                continue
            at("%s: check %s" % (where, comm.label))
            acc.update(_accuracy(p, coll, control, world))
    n, w = iterations(cfg, prepared[0].nbytes)
    for comm, p in zip(comms, prepared):
        at("%s: warm-up %s (%d calls)" % (where, comm.label, w))
        warm_up(p.run, w)
    loops = [[] for _ in comms]
    calls = [[] for _ in comms]
    for rep in range(cfg.repeats):
        for i, (comm, p) in enumerate(zip(comms, prepared)):
            at("%s: repeat %d/%d %s (%d calls)" % (where, rep + 1, cfg.repeats, comm.label, n))
            loop_s, call_s = timed_repeat(p.run, n, control, world, cfg.mode, comm.synchronize)
            loops[i].append(loop_s)
            calls[i].append(call_s)
    return [dict(backend=comm.label, collective=coll.name, inplace=in_place, dtype=dtype,
                 op=op, bytes=p.nbytes, count=p.count, mode=cfg.mode, iters=n, warmup=w,
                 busbw_factor=coll.busbw_factor(world) if is_collective[i] else 1.0,
                 loop_s=loops[i],
                 call_s=calls[i] if cfg.mode == "blocking" else None, **accuracy[i])
            for i, (comm, p) in enumerate(zip(comms, prepared))]


# Calls on Gaussian data per backend and size: the hash must not change between them.
SAMPLE_CALLS = 2


def _accuracy(p, coll, control, world) -> dict:
    """#wrong on pattern data, summed over ranks; on Gaussian data (floating dtypes) the
    relative RMS error against the float64 reference over every rank's output, rank 0's
    output hash, whether every rank got that hash (collectives whose ranks all get the same
    output; None for the others) and whether every call gave every rank the same bytes."""
    import math

    import torch
    import torch.distributed as dist

    wrong = torch.tensor([p.check()], dtype=torch.int64)
    dist.all_reduce(wrong, group=control)
    out = dict(wrong=int(wrong))
    if p.sample is None:
        return out
    samples = [p.sample() for _ in range(SAMPLE_CALLS)]
    err2, ref2, digest = samples[0]
    mine = (err2, ref2, digest, all(s[2] == digest for s in samples))
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=control)
    err2, ref2 = (sum(e[k] for e in everyone) for k in (0, 1))
    out.update(relerr=math.sqrt(err2 / ref2) if ref2 > 0 else None,
               hash=everyone[0][2],
               ranks_match=(all(e[2] == everyone[0][2] for e in everyone)
                            if coll.replicated else None),
               repeats_match=all(e[3] for e in everyone))
    return out


if __name__ == "__main__":
    if len(sys.argv) == 4:  # the spawn launcher: every rank is local
        rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[2]))
    else:
        rank_main(sys.argv[1], int(os.environ["OMPI_COMM_WORLD_RANK"]),
                  int(os.environ["OMPI_COMM_WORLD_SIZE"]),
                  int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]))
