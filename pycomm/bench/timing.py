"""Iteration policy and the one timing loop.

Two modes. Back-to-back (b2b): after a barrier on the control group (gloo, never the group
under test), each rank issues ``n`` calls with ``async_op=True`` and then waits for all of
them (a barrier-free completion: each rank stops its clock when its own calls are done).
Blocking: the same loop, but each call is synchronous (``async_op=False``), as in a
training step that needs the result at once; this is the per-call latency. The ranks' loop times are then
gathered on the control group; the repeat's time is the slowest rank's loop divided by
``n``. The caller interleaves backends per repeat and reports the median over repeats.
"""
from __future__ import annotations

import math
import time
from typing import List, Tuple

import torch
import torch.distributed as dist

from .config import Config


def iterations(cfg: Config, nbytes: int) -> Tuple[int, int]:
    """(timed calls per repeat, warm-up calls) for one size. The same for every backend.

    Auto policy: about ``cfg.iter_bytes`` of payload per repeat, clamped to
    [min_iters, max_iters], so small sizes get many calls and 64 MiB gets a couple.
    Warm-up: about a tenth of that, at least 1 and at most 5.
    """
    if cfg.iters is not None:
        n = cfg.iters
    else:
        n = math.ceil(cfg.iter_bytes / max(nbytes, 1))
        n = max(cfg.min_iters, min(cfg.max_iters, n))
    w = cfg.warmup if cfg.warmup is not None else max(1, min(5, n // 10))
    return n, w


def _wait_all(works) -> None:
    for w in works:
        if w is not None:
            w.wait()


def warm_up(run, w: int) -> None:
    _wait_all([run(True) for _ in range(w)])


def timed_repeat(run, n: int, control, world: int, mode: str = "b2b") -> List[float]:
    """Seconds each rank spent issuing and completing ``n`` calls in ``mode``."""
    dist.barrier(group=control)
    t0 = time.perf_counter()
    if mode == "blocking":
        for _ in range(n):
            run(False)
    else:
        _wait_all([run(True) for _ in range(n)])
    elapsed = time.perf_counter() - t0
    mine = torch.tensor([elapsed], dtype=torch.float64)
    everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(everyone, mine, group=control)
    return [float(t) for t in everyone]
