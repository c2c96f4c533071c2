"""Command line of ``python -m pycomm.bench`` (nccl-tests flag names where they exist).

Exit status: 0 on success; 1 when the run failed (a rank raised, died or missed the
deadline: its traceback is printed); 2 when it finished but a check found wrong results;
3 when results are complete but a rank did not tear down cleanly; 64 on bad flags.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time

from .backends import BACKENDS, DEFAULT_BACKENDS, parse_backends, required_launcher
from .collectives import COLLECTIVES
from .config import (MODES, Config, canonical_dtype, canonical_op, parse_bytes,
                     parse_size_list, size_sweep)
from .launch import LAUNCHERS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pycomm.bench",
        description="nccl-tests-style benchmark of torch.distributed backends on local "
                    "CPU ranks; every backend runs in the same processes, interleaved.",
        epilog="Backends spec: [label=]kind[:opt=val...], kinds: %s. Example: "
               "--backends pycomm,ring=pycomm:algorithm=ring,gloo. See bench/README.md."
               % ", ".join(BACKENDS))
    p.add_argument("--np", type=int, default=4, metavar="N", help="local ranks (default 4)")
    p.add_argument("-b", "--minbytes", default="8", help="smallest size in bytes (K/M/G ok)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest size in bytes (K/M/G ok)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier (default 2)")
    p.add_argument("-i", "--stepbytes", default="0",
                   help="size increment instead of -f when non-zero")
    p.add_argument("--sizes", default=None, metavar="LIST",
                   help="explicit sizes instead of -b/-e/-f/-i, comma-separated (e.g. 4K,1M,64M)")
    p.add_argument("-d", "--dtype", default="float32",
                   help="element type(s), comma-separated: float32, int32")
    p.add_argument("-o", "--op", default="sum", help="reduction op(s), comma-separated: sum, max, min")
    p.add_argument("-n", "--iters", type=int, default=None,
                   help="timed calls per repeat (default: by size, about --iter-bytes per repeat)")
    p.add_argument("-w", "--warmup_iters", type=int, default=None,
                   help="warm-up calls per size and backend (default: iters/10, 1..5)")
    p.add_argument("-r", "--repeats", type=int, default=5,
                   help="timed repeats per size and backend; the median is reported (default 5)")
    p.add_argument("--iter-bytes", default="32M",
                   help="auto iterations: payload bytes per repeat (default 32M)")
    p.add_argument("--max-iters", type=int, default=100, help="auto iterations: upper bound")
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                   help="correctness check per size and backend (default 1)")
    p.add_argument("--no-check", dest="check", action="store_const", const=0,
                   help="same as --check 0")
    p.add_argument("--backends", default=DEFAULT_BACKENDS,
                   help="backends under test; the first is the one the ratios are about "
                        "(default %s)" % DEFAULT_BACKENDS)
    p.add_argument("--collective", default="all_reduce", choices=tuple(COLLECTIVES))
    p.add_argument("--mode", default="b2b", choices=tuple(MODES),
                   help="b2b: back-to-back async calls (throughput); blocking: each call waited (latency)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="deadline in seconds for the whole run; stragglers are killed (default 900)")
    p.add_argument("--pg-timeout", type=float, default=None,
                   help="process-group timeout in seconds, so a hung collective fails inside "
                        "the ranks with the backend's own error (default min(300, timeout/2))")
    p.add_argument("--init", default="file", choices=("file", "tcp"), help="rendezvous")
    p.add_argument("--launcher", default="auto", choices=("auto",) + tuple(LAUNCHERS),
                   help="how ranks start: spawn (multiprocessing) or mpirun; auto: mpirun "
                        "when a backend needs it (mpi), else spawn")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write raw per-repeat times and the summary here (e.g. bench/results/x.json)")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-size progress on stderr")
    return p


def config_from_args(args, argv) -> Config:
    if args.sizes is not None:
        sizes = parse_size_list(args.sizes)
    else:
        sizes = size_sweep(parse_bytes(args.minbytes), parse_bytes(args.maxbytes),
                           args.stepfactor, parse_bytes(args.stepbytes))
    dtypes = list(dict.fromkeys(canonical_dtype(d) for d in args.dtype.split(",") if d.strip()))
    ops = list(dict.fromkeys(canonical_op(o) for o in args.op.split(",") if o.strip()))
    if args.np < 1:
        raise ValueError("--np must be >= 1")
    if args.repeats < 1:
        raise ValueError("-r must be >= 1")
    if args.iters is not None and args.iters < 1:
        raise ValueError("-n must be >= 1")
    if args.warmup_iters is not None and args.warmup_iters < 0:
        raise ValueError("-w must be >= 0")
    if args.timeout <= 0:
        raise ValueError("--timeout must be > 0")
    pg_timeout = args.pg_timeout if args.pg_timeout is not None else min(300.0, args.timeout / 2)
    if pg_timeout <= 0:
        raise ValueError("--pg-timeout must be > 0")
    if not sizes or not dtypes or not ops:
        raise ValueError("nothing to run (empty size range, dtype or op list)")
    backends = parse_backends(args.backends)
    launcher = choose_launcher(args.launcher, backends)
    return Config(
        collective=args.collective, nranks=args.np, sizes=sizes, dtypes=dtypes, ops=ops,
        backends=backends, launcher=launcher, iters=args.iters, warmup=args.warmup_iters,
        iter_bytes=parse_bytes(args.iter_bytes), max_iters=max(1, args.max_iters),
        min_iters=min(2, max(1, args.max_iters)), repeats=args.repeats,
        check=bool(args.check), mode=args.mode, timeout_s=args.timeout,
        pg_timeout_s=pg_timeout, init=args.init,
        json_path=args.json, quiet=args.quiet,
        command="python -m pycomm.bench" + ("" if not argv else " " + shlex.join(argv)))


def choose_launcher(choice: str, backends) -> str:
    """The launcher to use; ValueError when the backends cannot run under it or it is
    missing. Checked here, before anything starts (no MPI is initialised in this process)."""
    import importlib.util
    import shutil

    needed = required_launcher(backends)
    launcher = (needed or "spawn") if choice == "auto" else choice
    if needed and launcher != needed:
        raise ValueError("backend %s needs --launcher %s"
                         % (", ".join(b.kind for b in backends
                                      if BACKENDS[b.kind].launcher == needed), needed))
    if launcher == "mpirun" and not shutil.which("mpirun"):
        raise ValueError("mpirun not found: install Open MPI (Debian: apt-get install "
                         "openmpi-bin libopenmpi-dev; `make bench-mpi` does it as root)")
    for b in backends:
        module = BACKENDS[b.kind].module
        if module and importlib.util.find_spec(module) is None:
            raise ValueError("backend %s needs the Python module %s (pip install -r "
                             "requirements-bench.txt)" % (b.kind, module))
    return launcher


def _versions(cfg: Config) -> dict:
    from importlib import metadata

    out = {}
    names = ["torch", "pycomm"] + [BACKENDS[b.kind].module for b in cfg.backends]
    for dist_name in dict.fromkeys(n for n in names if n):
        try:
            out[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            pass
    if cfg.launcher == "mpirun":
        from .launch import mpirun_version

        out["mpirun"] = mpirun_version() or "unknown"
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args, argv)
    except ValueError as e:
        parser.print_usage(sys.stderr)
        print("%s: error: %s" % (parser.prog, e), file=sys.stderr)
        return 64

    from . import report
    from .launch import WorldFailed, run_world

    versions = _versions(cfg)
    print(report.header(cfg, versions), flush=True)

    def on_row(row):
        if not cfg.quiet:
            print(report.progress_line(row, cfg.subject.label), file=sys.stderr, flush=True)

    t0 = time.monotonic()
    try:
        outcome = run_world(cfg, on_row)
    except WorldFailed as e:
        print("# FAILED after %.1f s" % (time.monotonic() - t0), flush=True)
        print("pycomm.bench: %s" % e, file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("pycomm.bench: interrupted; ranks killed", file=sys.stderr)
        return 130
    elapsed = time.monotonic() - t0

    results = [report.summarize(r) for r in outcome["records"]]
    labels = [b.label for b in cfg.backends]
    rows = report.compare(results, labels[0], labels[1:])
    print(report.render(cfg, results, rows))
    print("# elapsed: %.1f s" % elapsed, flush=True)
    for w in outcome["warnings"]:
        print("pycomm.bench: warning: %s" % w, file=sys.stderr)
    if cfg.json_path:
        report.write_json(cfg.json_path, cfg, versions, results, rows, outcome["warnings"],
                          elapsed)
        print("# json: %s" % cfg.json_path)
    if report.total_wrong(results):
        return 2
    return 3 if outcome["warnings"] else 0
