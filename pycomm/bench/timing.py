"""Iteration policy and the one timing loop.

Two modes. Back-to-back (b2b): after a barrier on the control group (gloo, never the group
under test), each rank issues ``n`` calls with ``async_op=True`` and then waits for all of
them (a barrier-free completion: each rank stops its clock when its own calls are done).
Blocking: the same loop, but each call is synchronous (``async_op=False``), as in a
training step that needs the result at once; this is the per-call latency, and each call is
also timed on its own (for the median and p99 per call). The ranks' times are then gathered
on the control group; the repeat's time is the slowest rank's loop divided by ``n``, a
call's time the slowest rank's. The caller interleaves backends per repeat and reports the
median over repeats. On a CUDA device the clock stops after the device is synchronized.
"""
from __future__ import annotations

import math
import time
from typing import List, Optional, Tuple

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


def timed_repeat(run, n: int, control, world: int, mode: str,
                 synchronize) -> Tuple[List[float], Optional[List[float]]]:
    """Run ``n`` calls in ``mode``: (seconds each rank spent on the loop, and in blocking
    mode the seconds of each call, max over ranks; None in b2b mode)."""
    synchronize()
    dist.barrier(group=control)
    calls = []
    t0 = time.perf_counter()
    if mode == "blocking":
        for _ in range(n):
            c0 = time.perf_counter()
            run(False)
            synchronize()
            calls.append(time.perf_counter() - c0)
    else:
        _wait_all([run(True) for _ in range(n)])
        synchronize()
    elapsed = time.perf_counter() - t0
    mine = torch.tensor([elapsed] + calls, dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=control)
    loops = [float(t[0]) for t in everyone]
    per_call = torch.stack(everyone)[:, 1:].max(dim=0).values.tolist() if calls else None
    return loops, per_call
