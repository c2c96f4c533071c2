"""Command line of ``python -m pycomm.bench`` (nccl-tests flag names where they exist).

Exit status: 0 on success; 1 when the run failed (a rank raised, died or missed the
deadline: its traceback is printed); 2 when it finished but a check found wrong results
(not counting backends with lossy compression, whose results may be rounded);
3 when results are complete but a rank did not tear down cleanly; 64 on bad flags (checked
before any rank starts, including what a backend cannot run). Under torchrun every rank
exits with the same status, and a failure is torchrun's to report.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
import time

from .backends import (BACKENDS, DEFAULT_BACKENDS, device_of, lossy_labels, parse_backends,
                       required_launcher, unsupported)
from .collectives import ALIASES, COLLECTIVES, canonical_collectives
from .config import (MODES, PLACEMENTS, Config, canonical_dtype, canonical_op, parse_bytes,
                     parse_size_list, size_sweep)
from .launch import LAUNCHERS

# torchrun's environment: with all of it present, --launcher auto means torchrun.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pycomm.bench",
        description="nccl-tests-style benchmark of torch.distributed backends on local "
                    "CPU ranks; every backend runs in the same processes, interleaved.",
        epilog="Backends spec: [label=]kind[:mover][:opt=val...], kinds: %s. Examples: "
               "--backends pycomm,ring=pycomm:algorithm=ring,gloo; --backends "
               "gloo,fp8=pycomm-over:gloo:compression=fp8_e4m3 (pycomm's layered path over a "
               "gloo group). See bench/README.md."
               % ", ".join(BACKENDS))
    p.add_argument("--np", type=int, default=None, metavar="N",
                   help="local ranks (default 4; under torchrun its WORLD_SIZE)")
    p.add_argument("-b", "--minbytes", default="8", help="smallest size in bytes (K/M/G ok)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest size in bytes (K/M/G ok)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier (default 2)")
    p.add_argument("-i", "--stepbytes", default="0",
                   help="size increment instead of -f when non-zero")
    p.add_argument("--sizes", default=None, metavar="LIST",
                   help="explicit sizes instead of -b/-e/-f/-i, comma-separated (e.g. 4K,1M,64M)")
    p.add_argument("-d", "--dtype", default="float32",
                   help="element type(s), comma-separated: float32, float16, bfloat16, int32")
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
                   help="correctness check (#wrong) and, for floating types, relative error "
                        "and hash on Gaussian data, per size and backend (default 1)")
    p.add_argument("--no-check", dest="check", action="store_const", const=0,
                   help="same as --check 0")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the Gaussian inputs of the relative-error/hash call (default 0)")
    p.add_argument("--backends", default=DEFAULT_BACKENDS,
                   help="backends under test (default %s)" % DEFAULT_BACKENDS)
    p.add_argument("--baseline", default=None, metavar="LABEL",
                   help="the backend the ratios are about (default: the first listed)")
    p.add_argument("--collective", default="all_reduce", metavar="LIST",
                   help="collective(s), comma-separated, or all: %s"
                        % ", ".join(sorted(ALIASES)))
    p.add_argument("--inplace", default="both", choices=tuple(PLACEMENTS),
                   help="1: in place, 0: out of place, both (default); each collective runs "
                        "the forms torch.distributed has")
    p.add_argument("--mode", default="b2b", choices=tuple(MODES),
                   help="b2b: back-to-back async calls (throughput); blocking: each call waited (latency)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="deadline in seconds for the whole run; stragglers are killed (default 900)")
    p.add_argument("--pg-timeout", type=float, default=None,
                   help="process-group timeout in seconds, so a hung collective fails inside "
                        "the ranks with the backend's own error (default min(300, timeout/2))")
    p.add_argument("--init", default="file", choices=("file", "tcp"), help="rendezvous")
    p.add_argument("--launcher", default="auto",
                   choices=("auto",) + tuple(LAUNCHERS) + ("torchrun",),
                   help="how ranks start: spawn (a process per rank), mpirun, or torchrun (this "
                        "process is one of torchrun's ranks); auto: torchrun when its "
                        "environment is set, mpirun when a backend needs it (mpi), else spawn")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write raw per-repeat times and the summary here (e.g. bench/results/x.json)")
    p.add_argument("--jsonl", metavar="PATH", default=None,
                   help="write one JSON object per result row, each with the environment")
    p.add_argument("--markdown", metavar="PATH", default=None, help="write a Markdown report")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="write DIR/run.json, run.jsonl, report.md, busbw.png and latency.png")
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
    collectives = canonical_collectives(args.collective)
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
    if not sizes or not dtypes or not ops or not collectives:
        raise ValueError("nothing to run (empty size range, collective, dtype or op list)")
    backends = parse_backends(args.backends)
    labels = [b.label for b in backends]
    if args.baseline is not None and args.baseline not in labels:
        raise ValueError("--baseline %s is not a backend of this run (have: %s)"
                         % (args.baseline, ", ".join(labels)))
    placements = PLACEMENTS[args.inplace]
    check_supported(backends, collectives, placements, dtypes, ops)
    launcher = choose_launcher(args.launcher, backends)
    nranks = world_size(args.np, launcher)
    out = args.out
    if out and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--out draws plots with matplotlib: pip install -r requirements.txt")
    return Config(
        collectives=collectives, placements=placements, nranks=nranks, sizes=sizes,
        dtypes=dtypes, ops=ops, backends=backends, launcher=launcher, iters=args.iters,
        warmup=args.warmup_iters, iter_bytes=parse_bytes(args.iter_bytes),
        max_iters=max(1, args.max_iters), min_iters=min(2, max(1, args.max_iters)),
        repeats=args.repeats, check=bool(args.check), mode=args.mode, timeout_s=args.timeout,
        pg_timeout_s=pg_timeout, init=args.init, seed=args.seed,
        baseline=args.baseline or labels[0],
        json_path=args.json or (out and os.path.join(out, "run.json")),
        jsonl_path=args.jsonl or (out and os.path.join(out, "run.jsonl")),
        markdown_path=args.markdown or (out and os.path.join(out, "report.md")),
        plot_dir=out, quiet=args.quiet,
        command="python -m pycomm.bench" + ("" if not argv else " " + shlex.join(argv)))


def world_size(np_flag, launcher: str) -> int:
    if launcher != "torchrun":
        nranks = 4 if np_flag is None else np_flag
    else:
        nranks = int(os.environ["WORLD_SIZE"])
        if np_flag is not None and np_flag != nranks:
            raise ValueError("--np %d, but torchrun started %d ranks" % (np_flag, nranks))
    if nranks < 1:
        raise ValueError("--np must be >= 1")
    return nranks


def check_supported(backends, collectives, placements, dtypes, ops=("sum",)) -> None:
    """ValueError naming the first (collective, placement, backend, dtype, op) that cannot run."""
    for name in collectives:
        coll = COLLECTIVES[name]
        forms = [p for p in placements if p in coll.placements]
        if not forms:
            raise ValueError("%s has no %s form in torch.distributed: use --inplace %d or both"
                             % (name, "in-place" if placements[0] else "out-of-place",
                                not placements[0]))
        for spec in backends:
            for in_place in forms:
                for dtype in dtypes:
                    for op in (ops if coll.takes_op else [None]):
                        why = unsupported(spec, coll.call, in_place, dtype, op)
                        if why:
                            raise ValueError("%s: %s" % (name, why))


def choose_launcher(choice: str, backends) -> str:
    """The launcher to use; ValueError when the backends cannot run under it or it is
    missing. Checked here, before anything starts (no MPI is initialised in this process)."""
    import shutil

    needed = required_launcher(backends)
    if choice == "auto":
        under_torchrun = all(k in os.environ for k in TORCHRUN_ENV)
        launcher = "torchrun" if under_torchrun else (needed or "spawn")
    else:
        launcher = choice
    if needed and launcher != needed:
        raise ValueError("backend %s needs --launcher %s"
                         % (", ".join(b.kind for b in backends
                                      if BACKENDS[b.kind].launcher == needed), needed))
    if launcher == "torchrun":
        missing = [k for k in TORCHRUN_ENV if k not in os.environ]
        if missing:
            raise ValueError("--launcher torchrun: %s not set; start with torchrun "
                             "--nproc-per-node N -m pycomm.bench ..." % ", ".join(missing))
    if launcher == "mpirun" and not shutil.which("mpirun"):
        raise ValueError("mpirun not found: install Open MPI (Debian: apt-get install "
                         "openmpi-bin libopenmpi-dev; `make bench-mpi` does it as root)")
    for b in backends:
        module = BACKENDS[b.kind].module
        if module and importlib.util.find_spec(module) is None:
            raise ValueError("backend %s needs the Python module %s (%s)" % (b.kind, module, BACKENDS[b.kind].install))
        if device_of(b) == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("backend %s needs a CUDA device; torch %s sees none"
                                 % (b.kind + (":" + b.mover if b.mover else ""), torch.__version__))
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

    from .comparisons import against_baseline
    from .launch import WorldFailed, run_here, run_world
    from .render import header, progress_line
    from .stats import summarize, total_wrong

    leader = cfg.launcher != "torchrun" or int(os.environ["RANK"]) == 0
    versions = _versions(cfg)
    if leader:
        print(header(cfg, versions), flush=True)

    def on_row(row):
        if not cfg.quiet:
            print(progress_line(row, cfg.subject.label), file=sys.stderr, flush=True)

    t0 = time.monotonic()
    try:
        outcome = (run_here if cfg.launcher == "torchrun" else run_world)(cfg, on_row)
    except WorldFailed as e:
        print("# FAILED after %.1f s" % (time.monotonic() - t0), flush=True)
        print("pycomm.bench: %s" % e, file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("pycomm.bench: interrupted; ranks killed", file=sys.stderr)
        return 130
    elapsed = time.monotonic() - t0

    results = against_baseline([summarize(r) for r in outcome["records"]], cfg.subject.label)
    if leader:
        write_outputs(cfg, versions, results, outcome["warnings"], elapsed)
    for w in outcome["warnings"]:
        print("pycomm.bench: warning: %s" % w, file=sys.stderr)
    if total_wrong(results, lossy_labels(cfg.backends)):
        return 2
    return 3 if outcome["warnings"] else 0


def write_outputs(cfg: Config, versions, results, warnings, elapsed: float) -> None:
    """The report on stdout, then every file asked for."""
    from . import plot
    from .comparisons import compare
    from .render import render
    from .run_metadata import environment
    from .writers import document, write_json, write_jsonl, write_markdown

    rows = compare(results, cfg.subject.label, [b.label for b in cfg.peers])
    text = render(cfg, results, rows)
    print(text)
    print("# elapsed: %.1f s" % elapsed, flush=True)
    env = environment(cfg, versions)
    doc = document(cfg, env, results, rows, warnings, elapsed)
    if cfg.json_path:
        write_json(cfg.json_path, doc)
        print("# json: %s" % cfg.json_path)
    if cfg.jsonl_path:
        write_jsonl(cfg.jsonl_path, env, results)
        print("# json lines: %s" % cfg.jsonl_path)
    plots = []
    if cfg.plot_dir:
        for metric in plot.METRICS:
            path = os.path.join(cfg.plot_dir, metric + ".png")
            os.makedirs(cfg.plot_dir, exist_ok=True)
            plot.draw(doc, cfg.subject.label, path, metric)
            plots.append(path)
            print("# plot: %s" % path)
    if cfg.markdown_path:
        write_markdown(cfg.markdown_path, cfg, env, results, rows, text, plots)
        print("# markdown: %s" % cfg.markdown_path)
