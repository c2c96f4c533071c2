"""Small-message all-reduce latency as a user measures it: a tight loop of blocking float32
SUM all-reduces, Open MPI (mpi4py) in the same processes, interleaved.

    .venv/bin/python bench/small_allreduce.py [--np 2] [--size 4K] [--iters 20000] [--rounds 3]

mpirun starts --np ranks (mpi4py needs them in one MPI_COMM_WORLD); each rank creates a
pycomm group (file:// rendezvous) and, per round, times every contender in turn over
--iters calls on the same tensor of zeros (the sum stays zero: no NaN, Inf or subnormal
in the timing), after 10% warm-up calls. A contender's time is the slowest rank's loop time
/ iters; a round is one time per contender; printed: every round, the best and the median
over rounds, and each contender's best over MPI's best.

Contenders:
  mpi          comm.Allreduce(MPI.IN_PLACE, array, MPI.SUM) on a numpy view of the tensor
  pycomm       pycomm.all_reduce(t) on the pycomm group
  torch        dist.all_reduce(t) on the same group
  binding      pycomm._C.all_reduce called as pycomm.all_reduce calls it, without the
               Python wrapper (what the wrapper costs)
  solo         pycomm.all_reduce on a group of this rank alone (entry, checks, plan and
               bookkeeping without any transfer or waiting)
  torch-floor  dist.all_reduce on a group of torch's "fake" backend, which moves nothing
               and returns a completed Work: what torch.distributed's own path costs
  python-call  a Python call of a no-op with the same arguments (the loop's own cost)
"""

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time

CONTENDERS = ("mpi", "pycomm", "torch", "binding", "solo", "torch-floor", "python-call")


def _bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _rank(args):
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import pycomm

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    dist.init_process_group("pycomm", init_method="file://" + args.rendezvous, rank=rank, world_size=world)
    solo = [dist.new_group([r], backend="pycomm") for r in range(world)][rank]
    from torch.testing._internal.distributed import fake_pg  # noqa: F401  registers the "fake" backend
    fake = dist.new_group(backend="fake")
    world_group = dist.group.WORLD

    t = torch.zeros(_bytes(args.size) // 4, dtype=torch.float32)
    array = t.numpy()
    check = torch.full_like(t, rank + 1.0)
    pycomm.all_reduce(check)
    assert bool((check == world * (world + 1) / 2).all()), "wrong sum"

    def noop(*_args):
        return None

    sum_op = dist.ReduceOp.SUM
    calls = {
        "mpi": lambda: comm.Allreduce(MPI.IN_PLACE, array, MPI.SUM),
        "pycomm": lambda: pycomm.all_reduce(t),
        "torch": lambda: dist.all_reduce(t),
        "binding": lambda: pycomm._C.all_reduce(world_group, t, sum_op, None, None, None, False),
        "solo": lambda: pycomm.all_reduce(t, group=solo),
        "torch-floor": lambda: dist.all_reduce(t, group=fake),
        "python-call": lambda: noop(world_group, t, sum_op, None, None, None, False),
    }
    rounds = []
    for _ in range(args.rounds):
        times = {}
        for name in args.contenders.split(","):
            call = calls[name]
            for _ in range(max(1, args.iters // 10)):
                call()
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                call()
            mine = time.perf_counter() - t0
            times[name] = comm.allreduce(mine, op=MPI.MAX) / args.iters * 1e6
        rounds.append(times)
    dist.destroy_process_group()
    return rounds if rank == 0 else None


def _report(args, rounds):
    import torch

    try:
        from mpi4py import MPI
        mpi_version = MPI.Get_library_version().rstrip("\0 \n").splitlines()[0]
    except Exception as e:  # reported, not fatal: the table says which MPI ran
        mpi_version = f"unknown ({e})"
    names = [c for c in CONTENDERS if c in rounds[0]]
    lines = [
        "# small all-reduce latency: tight loop of blocking float32 SUM all-reduces",
        f"# command : python bench/small_allreduce.py --np {args.np} --size {args.size} "
        f"--iters {args.iters} --rounds {args.rounds} --contenders {','.join(names)}",
        f"# host    : {os.cpu_count()} cpus, torch {torch.__version__}, {mpi_version}",
        "# time    : slowest rank's loop time / iters (us); contenders interleaved per round",
        "#",
        "# round " + "".join(f"{c:>12}" for c in names),
    ]
    for i, r in enumerate(rounds):
        lines.append(f"  {i:5d} " + "".join(f"{r[c]:12.2f}" for c in names))
    best = {c: min(r[c] for r in rounds) for c in names}
    median = {c: statistics.median(r[c] for r in rounds) for c in names}
    lines.append("  best  " + "".join(f"{best[c]:12.2f}" for c in names))
    lines.append("  median" + "".join(f"{median[c]:12.2f}" for c in names))
    if "mpi" in names:
        lines.append("  /mpi  " + "".join(f"{best[c] / best['mpi']:11.2f}x" for c in names))
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--size", default="4K")
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated, of: " + ", ".join(CONTENDERS))
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of the whole run in seconds")
    p.add_argument("--out", help="also write the table to this file")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rendezvous", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.rank:
        rounds = _rank(args)
        if rounds is not None:
            import json
            with open(args.result, "w") as f:
                json.dump(rounds, f)
        return

    import json

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pycomm._launch import Processes
    from pycomm.bench.launch import mpirun_command

    with tempfile.TemporaryDirectory() as d, Processes() as procs:
        result = os.path.join(d, "result.json")
        argv = [sys.executable, os.path.abspath(__file__), "--rank", "--rendezvous", os.path.join(d, "rdv"),
                "--result", result, "--size", args.size, "--iters", str(args.iters), "--rounds", str(args.rounds),
                "--contenders", args.contenders]
        procs.start(mpirun_command(args.np) + argv)
        if not procs.wait(args.timeout):
            # mpirun puts each rank in a process group of its own: SIGTERM lets it end them.
            os.kill(procs.pid(0), signal.SIGTERM)
            procs.wait(10.0)
        if procs.exit_code(0) != 0:
            sys.exit(f"small_allreduce: the ranks failed: {procs.ending(0)}")
        with open(result) as f:
            rounds = json.load(f)
    table = _report(args, rounds)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
