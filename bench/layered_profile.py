"""Where a small layered all-reduce's host time goes: pycomm's layered path over a gloo
group against gloo's own all-reduce, in the same processes, contenders interleaved.

    .venv/bin/python bench/layered_profile.py [--np 2] [--size 4K] [--iters 200] [--rounds 7]

Per contender (gloo's all-reduce; the layered all-reduce in the default mode, exact and
fp8_e4m3), float32 SUM of --size bytes: the wall time per call (median over rounds of the
slowest rank's loop time / iters), and the CPU time per call of the calling thread and of
the whole process (every thread: gloo's loop and workers too), which a shared machine's
other load does not inflate the way it inflates wall time. Then a cProfile of rank 0's
layered calls (default mode): the mover's operations per call (torch's c10d builtins) and
the functions by their own time.
"""

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONTENDERS = ("gloo", "layered", "exact", "fp8_e4m3")


def _bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _rank(rank, args, init, queue):
    torch.set_num_threads(1)
    import pycomm

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=args.np)
    t = torch.zeros(_bytes(args.size) // 4)  # zeros: the sums stay zero, whatever the number of calls
    calls = {"gloo": lambda: dist.all_reduce(t), "layered": lambda: pycomm.all_reduce(t),
             "exact": lambda: pycomm.all_reduce(t, deterministic="exact"),
             "fp8_e4m3": lambda: pycomm.all_reduce(t, compression="fp8_e4m3")}
    for call in calls.values():
        for _ in range(max(2, args.iters // 10)):
            call()
    rounds = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            dist.barrier()
            wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
            for _ in range(args.iters):
                call()
            rounds[name].append(((time.perf_counter() - wall) / args.iters, (time.thread_time() - thread) / args.iters,
                                 (time.process_time() - process) / args.iters))
    profile = None
    dist.barrier()
    if rank == 0:
        profiler = cProfile.Profile()
        profiler.enable()
    for _ in range(args.iters):
        calls["layered"]()
    if rank == 0:
        profiler.disable()
        profile = pstats.Stats(profiler)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
        mover = {name: n / args.iters for (file, _, name), (_, n, *_) in profile.stats.items()
                 if file == "~" and "_distributed_c10d." in name and "_get_backend" not in name}
        profile = (mover, text.getvalue())
    queue.put((rank, rounds, profile))
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--size", default="4K")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--top", type=int, default=20, help="functions of the profile shown")
    args = ap.parse_args()
    context = mp.get_context("spawn")
    queue = context.Queue()
    init = "file://" + tempfile.mktemp(prefix="pycomm-layered-profile-")
    ranks = [context.Process(target=_rank, args=(r, args, init, queue)) for r in range(args.np)]
    for p in ranks:
        p.start()
    results = sorted(queue.get(timeout=600) for _ in ranks)
    for p in ranks:
        p.join()
    print("# layered all-reduce over gloo against gloo's, %d ranks, %s float32 SUM, %d calls x %d rounds" % (
        args.np, args.size, args.iters, args.rounds))
    print("%-10s %10s %8s %14s %14s" % ("contender", "wall us", "x gloo", "thread CPU us", "process CPU us"))
    wall = {name: statistics.median(max(r[1][name][i][0] for r in results) for i in range(args.rounds)) * 1e6
            for name in CONTENDERS}
    for name in CONTENDERS:
        cpu = [statistics.median(x[k] for r in results for x in r[1][name]) * 1e6 for k in (1, 2)]
        print("%-10s %10.1f %8.2f %14.1f %14.1f" % (name, wall[name], wall[name] / wall["gloo"], *cpu))
    mover, text = results[0][2]
    print("\nmover operations per layered call (rank 0): " +
          ", ".join("%s %.2g" % (name.split()[1].strip("'").rsplit(".", 1)[-1] if name.startswith("<method")
                                 else name.rsplit(".", 1)[-1].rstrip(">"), n) for name, n in sorted(mover.items())))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
