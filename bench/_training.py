"""What the training benches (exact_dp.py, ddp_hooks.py) share: the model they train and
a world of spawned ranks under one deadline.

An MLP of about 10.5 M float32 parameters (1024 -> 2048 -> 2048 -> 2048 -> 16, GELU).
"""

import multiprocessing as mp
import os
import tempfile
import time

WIDTHS = (1024, 2048, 2048, 2048, 16)


def model(torch):
    torch.manual_seed(0)
    layers = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1])


def run_world(rank_fn, world, args, timeout, what):
    """Runs ``rank_fn(rank, world, *args, init_file, queue)`` on ``world`` spawned ranks
    (``init_file``: a file:// rendezvous of their own) and returns the first thing one of
    them puts on ``queue``; kills what is left after ``timeout`` seconds and exits naming
    ``what`` if a rank failed."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=rank_fn, args=(r, world, *args, os.path.join(d, "init"), queue), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            result = queue.get(timeout=timeout)
            for p in procs:
                p.join(max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank of the {what} world failed: {[p.exitcode for p in procs]}")
    return result
