"""pycomm past one host's worth of ranks: 16 and 32 local ranks, over TCP and as several
"nodes", and the cost model's prediction for 64 to 16384 ranks.

    .venv/bin/python bench/scale.py [--worlds tcp:16,tcp:32,nodes4:16,nodes8:32] [--json out.json]
        [--latency-size 4K] [--bandwidth-size 1M] [--iters 20]

A world "tcp:N" is N ranks with PYCOMM_TRANSPORT=tcp (one node, every pair over TCP);
"nodesL:N" is N ranks with PYCOMM_RANKS_PER_NODE=L (N/L nodes: shared memory within a
node, TCP between nodes). Each world is started afresh (spawned interpreters, file://
rendezvous) and reports, per rank, as the slowest rank or the mean over ranks:

* set-up: init_process_group's time (slowest rank), then the first all-reduce of each
  algorithm (connections a group makes when first used are in it);
* what a rank holds: open file descriptors, threads and resident memory (RSS) after
  `import torch` (the baseline), after group creation and after every algorithm ran once;
* per algorithm (auto, ring, tree, oneshot, twoshot, and hierarchical where there are
  nodes): the exact result of a SUM of small integers (checked on every rank), the
  latency of --latency-size (blocking calls, slowest rank's loop time / --iters) and the
  busbw of --bandwidth-size (nccl-tests: S/t * 2(n-1)/n);
* reduce-scatter and all-gather of --latency-size in all (auto, ring, tree, oneshot): the
  variant that ran, the exact result and the blocking latency, with the model's prediction.

Then the model: pycomm's own plan (csrc/runtime/plan.cc, through pycomm._C.plan) with the
link costs each world calibrated at creation (PYCOMM_LINK_COSTS makes rank 0 write them),
for the measured worlds (predicted against measured, per algorithm and size) and for
64 ... 16384 ranks in 8-rank nodes with the "nodes" world's costs (the chosen algorithm
and its predicted time per size, and every algorithm's prediction), and its choices for
reduce-scatter and all-gather at the same scales.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ALGORITHMS = ("auto", "ring", "tree", "oneshot", "twoshot", "hierarchical")
SHARD_ALGORITHMS = ("auto", "ring", "tree", "oneshot")  # oneshot: the direct reduce-scatter and all-gather
MODEL_WORLDS = (64, 256, 1024, 4096, 16384)
MODEL_SIZES = ("4K", "64K", "1M", "16M", "256M")


def _bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _world_env(spec):
    kind, n = spec.split(":")
    if kind == "tcp":
        return int(n), {"PYCOMM_TRANSPORT": "tcp"}
    if kind.startswith("nodes"):
        return int(n), {"PYCOMM_RANKS_PER_NODE": kind[len("nodes"):]}
    raise SystemExit(f"scale: unknown world {spec!r} (tcp:N or nodesL:N)")


def _held():
    """(descriptors, threads, RSS in MiB) of this process now."""
    fds = len(os.listdir("/proc/self/fd")) - 1  # the listing's own descriptor
    threads = len(os.listdir("/proc/self/task"))
    with open("/proc/self/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return fds, threads, rss_kib / 1024.0


# ---- one rank ----

def _rank(rank, world, rundir, args):
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    import pycomm

    out = {"held": {"baseline": _held()}}
    t0 = time.perf_counter()
    dist.init_process_group("pycomm", init_method="file://" + os.path.join(rundir, "rdv"), rank=rank,
                            world_size=world)
    out["init_s"] = time.perf_counter() - t0
    out["held"]["created"] = _held()
    nodes = int(os.environ.get("PYCOMM_RANKS_PER_NODE", "0") or 0)
    algorithms = [a for a in ALGORITHMS if a != "hierarchical" or nodes]

    def slowest(seconds):
        t = torch.tensor([seconds], dtype=torch.float64)
        pycomm.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    first, wrong, latency, busbw = {}, {}, {}, {}
    lat_n, bw_n = _bytes(args.latency_size) // 4, _bytes(args.bandwidth_size) // 4
    expected = world * (world + 1) // 2
    for a in algorithms:
        small = torch.full((lat_n,), float(rank + 1))
        t0 = time.perf_counter()
        pycomm.all_reduce(small, algorithm=a)
        first[a] = slowest(time.perf_counter() - t0)
        big = torch.full((bw_n,), float(rank + 1))
        pycomm.all_reduce(big, algorithm=a)
        bad = int((small != expected).sum()) + int((big != expected).sum())
        wrong[a] = int(slowest(float(bad)))
    out["held"]["used"] = _held()
    for a in algorithms:
        for n, store, iters in ((lat_n, latency, args.iters), (bw_n, busbw, max(2, args.iters // 4))):
            t = torch.zeros(n)
            pycomm.all_reduce(t, algorithm=a)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                pycomm.all_reduce(t, algorithm=a)
            store[a] = slowest(time.perf_counter() - t0) / iters
    out.update(first_s=first, wrong=wrong, latency_s=latency,
               busbw_gbs={a: 4 * bw_n / t * 2 * (world - 1) / world / 1e9 for a, t in busbw.items()})
    out["shards"] = _shards_latency(rank, world, lat_n, args.iters, slowest)
    dist.destroy_process_group()
    with open(os.path.join(rundir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def _shards_latency(rank, world, total, iters, slowest):
    """Reduce-scatter and all-gather of ``total`` float32 elements in all (the input of a
    reduce-scatter, the output of an all-gather), per algorithm of SHARD_ALGORITHMS: the
    variant that ran, elements wrong (checked on every rank), and the blocking latency
    (slowest rank's loop time / iters)."""
    import torch
    import torch.distributed as dist

    import pycomm

    shard = max(1, total // world)
    calls = {
        "reduce_scatter": (lambda a, big, small: pycomm.reduce_scatter_tensor(small, big, algorithm=a, async_op=True),
                           lambda big, small: small, float(world * (world + 1) // 2)),
        "all_gather": (lambda a, big, small: pycomm.all_gather_into_tensor(big, small, algorithm=a, async_op=True),
                       lambda big, small: big, None),
    }
    result = {}
    for name, (call, checked, sum_value) in calls.items():
        for a in SHARD_ALGORITHMS:
            big = torch.full((shard * world,), float(rank + 1))
            small = torch.full((shard,), float(rank + 1))
            work = call(a, big, small)
            work.wait()
            expected = (torch.full_like(small, sum_value) if sum_value is not None
                        else torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(shard))
            wrong = int(slowest(float((checked(big, small) != expected).sum())))
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call(a, big, small).wait()
            result[f"{name} {a}"] = {"variant": work.algorithm, "wrong": wrong,
                                     "latency_us": slowest(time.perf_counter() - t0) / iters * 1e6}
    return result


# ---- the parent ----

def _run_world(spec, args):
    from pycomm._launch import Processes

    world, env_extra = _world_env(spec)
    with tempfile.TemporaryDirectory() as rundir, Processes() as procs:
        costs = os.path.join(rundir, "link-costs.txt")
        env = dict(os.environ, PYCOMM_LINK_COSTS=costs, OMP_NUM_THREADS="1", **env_extra)
        for r in range(world):
            procs.start([sys.executable, os.path.abspath(__file__), "--rank", str(r), "--world", str(world),
                         "--rundir", rundir, "--latency-size", args.latency_size,
                         "--bandwidth-size", args.bandwidth_size, "--iters", str(args.iters)], env=env)
        if not procs.wait(args.timeout):
            procs.kill()
            raise SystemExit(f"scale: world {spec} did not finish within {args.timeout} s")
        failed = [r for r in range(world) if procs.exit_code(r) != 0]
        if failed:
            raise SystemExit(f"scale: world {spec}: ranks {failed} failed ({procs.ending(failed[0])})")
        ranks = []
        for r in range(world):
            with open(os.path.join(rundir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        with open(costs) as f:
            link_costs = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in f if line.strip()}
    r0 = ranks[0]
    held = {phase: {"fds": statistics.mean(r["held"][phase][0] for r in ranks),
                    "threads": statistics.mean(r["held"][phase][1] for r in ranks),
                    "rss_mib": statistics.mean(r["held"][phase][2] for r in ranks)} for phase in r0["held"]}
    return {"world": spec, "ranks": world, "env": env_extra, "link_costs": link_costs,
            "init_s": max(r["init_s"] for r in ranks), "first_s": r0["first_s"], "wrong": r0["wrong"],
            "latency_us": {a: t * 1e6 for a, t in r0["latency_s"].items()}, "busbw_gbs": r0["busbw_gbs"],
            "shards": r0["shards"], "held": held}


def _plan(collective_bytes, world, per_node, costs, algorithm="auto", collective="allreduce"):
    from pycomm import _C

    return _C.plan(collective, collective_bytes, world=world, ranks_per_node=per_node,
                   intra=tuple(costs["intra"]), inter=tuple(costs["inter"]), algorithm=algorithm)


def _report(results, args):
    lines = ["# pycomm at 16 and 32 local ranks (bench/scale.py)",
             f"# command : python bench/scale.py --worlds {args.worlds} --latency-size {args.latency_size} "
             f"--bandwidth-size {args.bandwidth_size} --iters {args.iters}",
             f"# host    : {os.cpu_count()} cpus; ranks outnumber cores, so latency is mostly scheduling", ""]
    for w in results:
        lines.append(f"## {w['world']}: {w['ranks']} ranks, {w['env']}")
        lines.append(f"set-up: init_process_group {w['init_s']:.2f} s (slowest rank); first call per algorithm "
                     + ", ".join(f"{a} {t * 1e3:.1f} ms" for a, t in w["first_s"].items()))
        lines.append("held per rank (mean): " + "; ".join(
            f"{phase}: {h['fds']:.1f} fds, {h['threads']:.1f} threads, {h['rss_mib']:.0f} MiB RSS"
            for phase, h in w["held"].items()))
        lines.append(f"link costs calibrated: {w['link_costs']}")
        lines.append(f"{'algorithm':>13} {'#wrong':>7} {args.latency_size + ' us':>10} {'predicted':>10} "
                     f"{'err':>6}   {args.bandwidth_size + ' busbw':>11} {'predicted':>10} {'err':>6}")
        per_node = int(w["env"].get("PYCOMM_RANKS_PER_NODE", 0)) or w["ranks"]
        for a, lat in w["latency_us"].items():
            p_lat = _plan(_bytes(args.latency_size), w["ranks"], per_node, w["link_costs"], a)
            p_bw = _plan(_bytes(args.bandwidth_size), w["ranks"], per_node, w["link_costs"], a)
            n = w["ranks"]
            bw_pred = _bytes(args.bandwidth_size) / (p_bw["predicted_us"] * 1e-6) * 2 * (n - 1) / n / 1e9
            label = a if a != "auto" else f"auto={p_lat['variant']}"
            lines.append(f"{label:>13} {w['wrong'][a]:>7} {lat:10.1f} {p_lat['predicted_us']:10.1f} "
                         f"{p_lat['predicted_us'] / lat - 1:+6.0%}   {w['busbw_gbs'][a]:11.3f} {bw_pred:10.3f} "
                         f"{bw_pred / w['busbw_gbs'][a] - 1:+6.0%}")
        lines.append(f"reduce-scatter and all-gather of {args.latency_size} in all (blocking, us):")
        lines.append(f"{'call':>22} {'ran':>18} {'#wrong':>7} {'us':>9} {'predicted':>10}")
        for call, m in w["shards"].items():
            name, a = call.split()
            p = _plan(_bytes(args.latency_size), w["ranks"], per_node, w["link_costs"], a,
                      "reduce_scatter" if name == "reduce_scatter" else "allgather")
            lines.append(f"{call:>22} {m['variant']:>18} {m['wrong']:>7} {m['latency_us']:9.1f} "
                         f"{p['predicted_us']:10.1f}")
        lines.append("")
    nodes = [w for w in results if "PYCOMM_RANKS_PER_NODE" in w["env"]]
    if nodes:
        costs = nodes[-1]["link_costs"]
        lines.append(f"## model: all-reduce on 8-rank nodes, link costs of {nodes[-1]['world']}: {costs}")
        lines.append("predicted us of the chosen algorithm (and its name) per size; every family below")
        lines.append(f"{'ranks':>7} " + "".join(f"{s:>26}" for s in MODEL_SIZES))
        for n in MODEL_WORLDS:
            cells = []
            for s in MODEL_SIZES:
                p = _plan(_bytes(s), n, 8, costs)
                cells.append(f"{p['variant']} {p['predicted_us']:.4g}")
            lines.append(f"{n:>7} " + "".join(f"{c:>26}" for c in cells))
        lines.append("")
        lines.append(f"{'ranks':>7} {'size':>6} " + "".join(f"{a:>14}" for a in ALGORITHMS[1:]))
        for n in MODEL_WORLDS:
            for s in MODEL_SIZES:
                cells = [f"{_plan(_bytes(s), n, 8, costs, a)['predicted_us']:.4g}" for a in ALGORITHMS[1:]]
                lines.append(f"{n:>7} {s:>6} " + "".join(f"{c:>14}" for c in cells))
        for collective in ("reduce_scatter", "allgather"):
            lines.append("")
            lines.append(f"## model: {collective} on 8-rank nodes (size: the whole buffer), the same costs")
            lines.append(f"{'ranks':>7} " + "".join(f"{s:>30}" for s in MODEL_SIZES))
            for n in MODEL_WORLDS:
                cells = []
                for s in MODEL_SIZES:
                    p = _plan(_bytes(s), n, 8, costs, collective=collective)
                    cells.append(f"{p['variant']} {p['predicted_us']:.4g}")
                lines.append(f"{n:>7} " + "".join(f"{c:>30}" for c in cells))
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="tcp:16,tcp:32,nodes4:16,nodes8:32")
    p.add_argument("--latency-size", default="4K")
    p.add_argument("--bandwidth-size", default="1M")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--timeout", type=float, default=900.0, help="deadline of each world in seconds")
    p.add_argument("--json", help="write every world's numbers here")
    p.add_argument("--out", help="also write the report here")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rundir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        return _rank(args.rank, args.world, args.rundir, args)
    sys.path.insert(0, ROOT)
    results = [_run_world(spec, args) for spec in args.worlds.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    report = _report(results, args)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    bad = sum(v for w in results for v in w["wrong"].values()) + sum(
        m["wrong"] for w in results for m in w["shards"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
