"""pycomm.bench: an nccl-tests-style benchmark for torch.distributed backends.

``python -m pycomm.bench --np 4 -b 8 -e 64M`` starts 4 local ranks, creates one process
group per backend under test in the same processes (pycomm and gloo by default; Open MPI
through mpi4py, or NCCL on CUDA devices, on request), sweeps the sizes of each collective
asked for (all_reduce, reduce_scatter, all_gather, broadcast, all_to_all; in place and out
of place) and prints, per backend, the nccl-tests columns (size, count, type, redop,
time_us, algbw, busbw, #wrong) plus the relative error against a float64 reference, a hash
of the result and the ratio to a baseline backend, then a side-by-side comparison; it can
write JSON, JSON lines, a Markdown report and plots. See bench/README.md.

Layout (each piece is written once and shared by every backend, dtype and collective):

* ``cli``         flags -> :class:`~pycomm.bench.config.Config`, runs the world, prints and
                  writes the outputs.
* ``config``      the plain, picklable description of a run (sizes, dtypes, backends...).
* ``backends``    the backend table (gloo, pycomm, mpi, nccl) and ``label=kind:opt=val``
                  specs, and what each backend cannot run.
* ``collectives`` the collective table: buffers, calls, expected results, busbw factors;
                  the correctness check and the accuracy call.
* ``timing``      iteration policy and the one timing loop (both modes).
* ``worker``      what each rank runs: groups, the sweep, the checks.
* ``launch``      starts the ranks (a process per rank, or mpirun for MPI peers),
                  enforces the deadline, collects results or tracebacks; or runs this
                  process as one of torchrun's ranks.
* ``stats``       raw loop times -> time, algbw, busbw, p50/p99; the wrong-element count.
* ``comparisons`` ratios at the same size: against the baseline, the subject against its
                  peers, torch.distributed's dispatch overhead.
* ``run_metadata`` where and how the run was made: host, git state, command, config.
* ``render``      the formatter: header, per-backend tables, comparison, dispatch overhead,
                  summary, correctness verdict, progress line (as text or Markdown tables).
* ``writers``     the JSON document, JSON-lines and Markdown writers.
* ``plot``        ``python -m pycomm.bench.plot run.json -o busbw.png``: busbw (and latency)
                  against size, and the best backend per size.
* ``netns``       simulated hosts (a network namespace each, on one bridge, links shaped
                  with tc) and torchrun jobs across them: tests/test_multihost.py and
                  bench/multihost.py (root only).

The parent-side output modules are layered without cycles: ``stats``, ``comparisons`` and
``run_metadata`` import none of the others, ``render`` builds on them, ``writers`` on
``render``; ``cli`` imports each piece it uses.

Nothing here imports ``pycomm`` (the backend) at module level: a rank imports it only when a
backend under test needs it, so ``--backends gloo`` runs without the extension.
"""

__all__ = ["main"]


def main(argv=None):
    """Entry point of ``python -m pycomm.bench``; returns the process exit status."""
    from .cli import main as _main

    return _main(argv)
