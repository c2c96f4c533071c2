"""pycomm.bench: an nccl-tests-style benchmark for torch.distributed backends.

``python -m pycomm.bench --np 4 -b 8 -e 64M`` starts 4 local ranks, creates one process
group per backend under test in the same processes (pycomm and gloo by default; Open MPI
through mpi4py on request), sweeps all-reduce sizes and prints, per backend, the
nccl-tests columns (size, count, type, redop, time_us, algbw, busbw, #wrong), then a
side-by-side comparison. See bench/README.md.

Layout (each piece is written once and shared by every backend, dtype and collective):

* ``cli``         flags -> :class:`~pycomm.bench.config.Config`, runs the world, prints.
* ``config``      the plain, picklable description of a run (sizes, dtypes, backends...).
* ``backends``    the backend table (gloo, pycomm, ...) and ``label=kind:opt=val`` specs.
* ``collectives`` one function per collective: prepares buffers, returns the callables.
* ``timing``      iteration policy and the one timing loop (back-to-back mode).
* ``worker``      what each rank runs: groups, the sweep, the correctness check.
* ``launch``      starts the ranks (multiprocessing spawn, or mpirun for MPI peers),
                  enforces the deadline, collects results or tracebacks.
* ``report``      the formatter (tables, comparison, dispatch overhead, summary) and the
                  JSON writer.
* ``plot``        ``python -m pycomm.bench.plot run.json -o busbw.png``: busbw against size,
                  and the best backend per size.

Nothing here imports ``pycomm`` (the backend) at module level: a rank imports it only when a
backend under test needs it, so ``--backends gloo`` runs without the extension.
"""

__all__ = ["main"]


def main(argv=None):
    """Entry point of ``python -m pycomm.bench``; returns the process exit status."""
    from .cli import main as _main

    return _main(argv)
