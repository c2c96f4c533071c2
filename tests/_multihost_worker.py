"""One rank of a multi-host correctness job, started by torchrun inside a host namespace
(see test_multihost.py). Checks, against exact expectations:

* pycomm.all_reduce for every algorithm of ALGORITHMS, float32/bfloat16/int32,
  SUM/MAX (and AVG for floats), at sizes 0, 1, 7, odd, ~1 MiB;
* pycomm.reduce_scatter_tensor and pycomm.all_gather_into_tensor with RS_AG_ALGORITHMS;
* dist.all_reduce, dist.broadcast and dist.all_gather_into_tensor once each.

Inputs are small integers, so every sum is exact in any order and in bfloat16:
rank r holds x[i] = ((r + i) % n + 1) * (i % 7 + 1), hence SUM = n(n+1)/2 * (i % 7 + 1),
MAX = n * (i % 7 + 1) (reached on a different rank per element), AVG = SUM / n (exact
for these values: at most 70 / 4).

Prints "OK rank=<r>" at the end; exits non-zero with a message naming the case on the first mismatch.
"""

import argparse
import datetime
import faulthandler
import os
import sys
import warnings

import torch
import torch.distributed as dist

import pycomm

ALGORITHMS = ("auto", "ring", "tree", "hierarchical", "oneshot", "twoshot")
RS_AG_ALGORITHMS = ("auto", "ring", "oneshot")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int32": torch.int32}
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}


def pattern(rank, n, count):
    """((rank + i) % n + 1) * (i % 7 + 1) for i < count, as int64."""
    i = torch.arange(count, dtype=torch.int64)
    return ((rank + i) % n + 1) * (i % 7 + 1)


def expected(op, n, count):
    k = torch.arange(count, dtype=torch.int64) % 7 + 1
    if op == "sum":
        return (k * (n * (n + 1) // 2)).to(torch.float64)
    if op == "max":
        return (k * n).to(torch.float64)
    return k.to(torch.float64) * (n + 1) / 2  # avg: sum / n


def gather_pattern(rank, count):
    """Rank r's all-gather contribution: 16 r + (j % 13) + 1, exact in bfloat16 for r < 15."""
    return 16 * rank + torch.arange(count, dtype=torch.int64) % 13 + 1


def first_difference(got, want):
    bad = (got.to(torch.float64) != want.to(torch.float64)).nonzero()
    i = int(bad[0]) if bad.numel() else -1
    return "%d of %d elements differ; first at [%d]: got %s, want %s" % (
        bad.numel(), want.numel(), i, got[i].item(), want[i].item())


def check(name, got, want):
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError("%s: got %s %s, want %s %s" % (
            name, got.dtype, tuple(got.shape), want.dtype, tuple(want.shape)))
    if not torch.equal(got, want):
        raise AssertionError("%s: %s" % (name, first_difference(got, want)))


def ops_for(dtype):
    return ("sum", "max", "avg") if dtype.is_floating_point else ("sum", "max")


def check_all_reduce(rank, n, algorithm, sizes, dtypes):
    for dname in dtypes:
        dtype = DTYPES[dname]
        for op in ops_for(dtype):
            for count in sizes:
                t = pattern(rank, n, count).to(dtype)
                pycomm.all_reduce(t, OPS[op], algorithm=algorithm)
                check("all_reduce(algorithm=%s, %s, %s, count=%d)" % (algorithm, dname, op, count),
                      t, expected(op, n, count).to(dtype))


def check_reduce_scatter(rank, n, algorithm, sizes, dtypes):
    for dname in dtypes:
        dtype = DTYPES[dname]
        for op in ("sum", "max"):
            for count in sizes:
                inp = pattern(rank, n, n * count).to(dtype)
                out = torch.full((count,), -1, dtype=dtype)
                pycomm.reduce_scatter_tensor(out, inp, OPS[op], algorithm=algorithm)
                want = expected(op, n, n * count)[rank * count:(rank + 1) * count].to(dtype)
                check("reduce_scatter_tensor(algorithm=%s, %s, %s, count=%d per rank)" % (
                    algorithm, dname, op, count), out, want)


def check_all_gather(rank, n, algorithm, sizes, dtypes):
    for dname in dtypes:
        dtype = DTYPES[dname]
        for count in sizes:
            inp = gather_pattern(rank, count).to(dtype)
            out = torch.full((n * count,), -1, dtype=dtype)
            pycomm.all_gather_into_tensor(out, inp, algorithm=algorithm)
            want = torch.cat([gather_pattern(r, count) for r in range(n)]).to(dtype)
            check("all_gather_into_tensor(algorithm=%s, %s, count=%d per rank)" % (
                algorithm, dname, count), out, want)


def check_torch_api(rank, n):
    count = 1001
    t = pattern(rank, n, count).to(torch.float32)
    dist.all_reduce(t)
    check("dist.all_reduce(float32, sum)", t, expected("sum", n, count).to(torch.float32))

    src = n - 1
    b = gather_pattern(rank, count).to(torch.int32) if rank == src else torch.zeros(count, dtype=torch.int32)
    dist.broadcast(b, src=src)
    check("dist.broadcast(int32, src=%d)" % src, b, gather_pattern(src, count).to(torch.int32))

    inp = gather_pattern(rank, count).to(torch.float32)
    out = torch.empty(n * count, dtype=torch.float32)
    with warnings.catch_warnings():  # torch 2.13 calls it deprecated; it is what users call
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(out, inp)
    check("dist.all_gather_into_tensor(float32)", out,
          torch.cat([gather_pattern(r, count) for r in range(n)]).to(torch.float32))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--rs-ag-algorithms", default=",".join(RS_AG_ALGORITHMS))
    ap.add_argument("--sizes", default="0,1,7,1001,262147",
                    help="element counts (per rank for reduce-scatter/all-gather outputs)")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--pg-timeout", type=float, default=60.0, help="process-group timeout, s")
    ap.add_argument("--deadline", type=float, default=150.0,
                    help="dump every thread's stack and exit after this many seconds")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.deadline, exit=True)

    dist.init_process_group("pycomm", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    dtypes = [d for d in args.dtypes.split(",") if d]
    for a in [a for a in args.algorithms.split(",") if a]:
        check_all_reduce(rank, n, a, sizes, dtypes)
    for a in [a for a in args.rs_ag_algorithms.split(",") if a]:
        check_reduce_scatter(rank, n, a, sizes, dtypes)
        check_all_gather(rank, n, a, sizes, dtypes)
    check_torch_api(rank, n)

    dist.barrier()
    dist.destroy_process_group()
    # One write of the whole line: the ranks of a host share one output file, and print()
    # on an unbuffered stream writes the text and its newline separately.
    os.write(1, ("OK rank=%d world=%d host=%s\n"
                 % (rank, n, os.environ.get("PYCOMM_SOCKET_IFNAME", "?"))).encode())
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except AssertionError as e:
        print("MISMATCH rank=%s: %s" % (os.environ.get("RANK", "?"), e), file=sys.stderr, flush=True)
        code = 1
    except BaseException:  # noqa: BLE001 - any other failure: report it, exit at once
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        code = 1
    # On failure, exit without tearing the group down: the peers notice at once (connection
    # lost) rather than waiting on a rank stuck in a collective the others never call.
    if code:
        os._exit(code)
    sys.exit(code)
