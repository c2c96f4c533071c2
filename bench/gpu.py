"""GPU benchmarks of pycomm on one CUDA device.

    python bench/gpu.py [--out DIR] [--ranks 2,4] [--sizes 4K,1M,64M] [--iters 20]

1. Kernels (one process): the device-to-device copy bandwidth of a 256 MiB tensor
   (bytes read plus written per second, torch's copy), then pycomm's reduction and codec
   kernels on 256 MiB of float32 input (pycomm._C.reduce, encode, decode), each as a
   fraction of that copy bandwidth, counting the bytes each kernel must read and write.
   A kernel call is timed from the host and includes its launch and its stream
   synchronization (pycomm's ops synchronize their stream before returning).
2. All-reduce, several processes on this one GPU (CUDA tensors): pycomm (CUDA IPC), gloo
   on the same CUDA tensors, and NCCL at the world sizes it accepts (one process per GPU:
   1 here). Blocking calls (each call's latency: the slowest rank's, median over
   --iters), busbw as nccl-tests computes it (2(n-1)/n S/t). Up to 256 KiB pycomm runs
   oneshot, up to PYCOMM_CUDA_FLAG_BYTES as the flag-synchronized kernel where the ranks'
   kernels run at once (MPS); "pycomm host-driven" is the same one-shot driven by the
   host (PYCOMM_CUDA_FLAG_BYTES=0), in the same processes.
Writes gpu-kernels.json, gpu-allreduce.json and a text summary (stdout) under --out.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pycomm.bench.config import format_bytes, parse_size_list  # noqa: E402


def timed(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_kernels(iters):
    import pycomm

    n = 64 << 20  # 256 MiB of float32
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    out = torch.empty_like(x)
    copy_s = timed(lambda: out.copy_(x), iters)
    copy_bw = 2 * x.nbytes / copy_s
    rows = [{"kernel": "copy (torch, device to device)", "bytes": 2 * x.nbytes, "seconds": copy_s,
             "GBps": copy_bw / 1e9, "fraction": 1.0}]

    def add(name, fn, nbytes):
        s = timed(fn, iters)
        rows.append({"kernel": name, "bytes": nbytes, "seconds": s, "GBps": nbytes / s / 1e9,
                     "fraction": nbytes / s / copy_bw})

    add("reduce float32 SUM, 2 terms", lambda: pycomm._C.reduce([x, y], dist.ReduceOp.SUM, 1, False, out), 3 * x.nbytes)
    add("reduce float32 SUM, 2 terms, exact", lambda: pycomm._C.reduce([x, y], dist.ReduceOp.SUM, 1, True, out),
        3 * x.nbytes)
    xb, yb = x.bfloat16(), y.bfloat16()
    ob = torch.empty_like(xb)
    add("reduce bfloat16 SUM, 2 terms", lambda: pycomm._C.reduce([xb, yb], dist.ReduceOp.SUM, 1, False, ob),
        3 * xb.nbytes)
    for codec in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2"):
        enc = pycomm._C.encode(x, codec, 256)
        add("encode float32 -> %s" % codec, lambda: pycomm._C.encode(x, codec, 256, enc), x.nbytes + enc.nbytes)
        add("decode %s -> float32" % codec,
            lambda: pycomm._C.decode(enc, codec, 256, n, torch.float32, out), x.nbytes + enc.nbytes)
    return rows


ONESHOT_BYTES = 262144  # the largest all-reduce that runs oneshot on CUDA tensors of one host


def allreduce_rank(rank, ws, sizes, iters, init_file, queue):
    import pycomm  # noqa: F401

    torch.cuda.set_device(0)
    dist.init_process_group("pycomm", init_method="file://" + init_file, rank=rank, world_size=ws)
    gloo = dist.new_group(backend="gloo")
    timer = dist.new_group(backend="gloo")
    # The same one-shot driven by the host (a group that reads its knobs now).
    os.environ["PYCOMM_CUDA_FLAG_BYTES"] = "0"
    host_driven = dist.new_group(backend="pycomm")
    results = []
    for size in sizes:
        t = torch.ones(size // 4, device="cuda")
        variants = [("pycomm", lambda: pycomm.all_reduce(t)),
                    ("pycomm torch.distributed", lambda: dist.all_reduce(t)),
                    ("gloo", lambda: dist.all_reduce(t, group=gloo))]
        if size <= ONESHOT_BYTES:
            variants.append(("pycomm host-driven", lambda: pycomm.all_reduce(t, group=host_driven)))
        for name, call in variants:
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            times = []
            for _ in range(iters):
                dist.barrier(group=timer)
                t0 = time.perf_counter()
                call()
                torch.cuda.synchronize()
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=timer)
                times.append(elapsed.item())
            ok = bool(torch.all(t > 0).item())
            results.append({"backend": name, "ranks": ws, "bytes": size, "seconds": statistics.median(times), "ok": ok})
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def nccl_rank(sizes, iters, init_file, queue):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="file://" + init_file, rank=0, world_size=1)
    results = []
    for size in sizes:
        t = torch.ones(size // 4, device="cuda")
        s = timed(lambda: dist.all_reduce(t), iters)
        results.append({"backend": "nccl", "ranks": 1, "bytes": size, "seconds": s, "ok": True})
    queue.put(results)
    dist.destroy_process_group()


def run_spawned(target, nprocs, args, timeout_s=600):
    """Runs target in nprocs spawned processes; returns what the first of them puts on the
    queue. A process that dies first, or the deadline, ends the wait with an error and
    kills the rest."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=((r,) if nprocs else ()) + args + (queue,)) for r in range(max(nprocs, 1))]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                results = queue.get(timeout=1)
                break
            except Exception:  # queue.Empty: see whether a rank died or time ran out
                dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError("%s: %s" % (target.__name__, "ranks exited: %s" % dead if dead else
                                                   "no result within %d s" % timeout_s))
        for p in procs:
            p.join(timeout=60)
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out"))
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--sizes", default="4K,1M,64M")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skip-kernels", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sizes = parse_size_list(args.sizes)
    env = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "host": platform.node(), "cpus": os.cpu_count()}
    print("device: %(device)s, torch %(torch)s, CUDA %(cuda)s, %(cpus)d CPUs" % env)
    if not args.skip_kernels:
        rows = bench_kernels(args.iters)
        with open(os.path.join(args.out, "gpu-kernels.json"), "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
        print("\n%-40s %10s %10s %9s" % ("kernel (256 MiB float32 input)", "time us", "GB/s", "x copy"))
        for r in rows:
            print("%-40s %10.1f %10.1f %8.0f%%" % (r["kernel"], r["seconds"] * 1e6, r["GBps"], 100 * r["fraction"]))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows += run_spawned(nccl_rank, 0, (sizes, args.iters, os.path.join(tmp, "nccl")))
        for ws in [int(r) for r in args.ranks.split(",")]:
            rows += run_spawned(allreduce_rank, ws, (ws, sizes, args.iters, os.path.join(tmp, "ws%d" % ws)))
    for r in rows:
        n = r["ranks"]
        r["busbw_GBps"] = r["bytes"] / r["seconds"] * (2 * (n - 1) / n if n > 1 else 1) / 1e9
    gloo = {(r["ranks"], r["bytes"]): r for r in rows if r["backend"] == "gloo"}
    for r in rows:
        g = gloo.get((r["ranks"], r["bytes"]))
        r["x_gloo"] = g["seconds"] / r["seconds"] if g else None
    with open(os.path.join(args.out, "gpu-allreduce.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print("\nall-reduce float32 SUM, blocking, one GPU (median of %d, slowest rank)" % args.iters)
    print("%-26s %5s %9s %12s %12s %9s %4s" % ("backend", "ranks", "size", "time us", "busbw GB/s", "x gloo", "ok"))
    for r in rows:
        print("%-26s %5d %9s %12.1f %12.2f %9s %4s" % (
            r["backend"], r["ranks"], format_bytes(r["bytes"]), r["seconds"] * 1e6, r["busbw_GBps"],
            "%.1f" % r["x_gloo"] if r["x_gloo"] else "-", "yes" if r["ok"] else "NO"))


if __name__ == "__main__":
    main()
