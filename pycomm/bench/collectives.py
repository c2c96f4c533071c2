"""One function per collective: it prepares the buffers for one (backend, size, dtype, op)
and returns a :class:`Prepared` holding the callables the timing loop and the correctness
check need. Backends, dtypes and ops are parameters, never copies of the code.

Timing buffers hold zeros: torch collectives work in place, so timed calls feed on each
other's results, and only zeros stay finite and unchanged under any number of SUMs (a
growing or overflowing payload would time something else than the copy and the adds).

The check uses separate buffers filled with :func:`pattern`: small integers in [-8, 8]
that depend on the rank and on the element index (with no short period, so a chunk sent
to the wrong offset shows). Any partial sum over N ranks is an integer of magnitude
<= 8N, exact in float32 (N < 2**21), float16 (N <= 256) and bfloat16 (N <= 32), so the
result must equal the expectation bit for bit whatever the reduction order.

To add a collective (reduce_scatter, all_gather, broadcast, all_to_all): write its
``prepare`` and ``expected`` and add a row to COLLECTIVES with its busbw factor.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict

import torch
import torch.distributed as dist

from .backends import Comm
from .config import DTYPES, OPS

# Elements per slice when computing the pattern/expectation (bounds temporary memory).
_CHUNK = 1 << 20


@dataclass
class Prepared:
    count: int                      # elements per rank's input (nccl-tests "count")
    nbytes: int                     # S in algbw = S / t
    run: Callable[[bool], object]   # one call on the timing buffers -> Work (async) or None
    check: Callable[[], int]        # one call on pattern data -> #wrong on this rank


@dataclass(frozen=True)
class Collective:
    name: str
    prepare: Callable[..., Prepared]
    busbw_factor: Callable[[int], float]   # busbw = algbw * factor(world size)
    takes_op: bool = True


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, DTYPES[name][0])


def reduce_op(name: str):
    return getattr(dist.ReduceOp, OPS[name])


def pattern(rank: int, start: int, stop: int) -> torch.Tensor:
    """int64 values in [-8, 8] for elements [start, stop) of ``rank``'s input."""
    # An integer hash of (rank, index) (multiply/xor-shift rounds, wrapping int64), so the
    # values look random at every lag: a chunk at a wrong offset or from a wrong rank shows.
    h = torch.arange(start, stop, dtype=torch.int64) * 0x9E3779B1 + (rank + 1) * 0x85EBCA77
    h = h ^ (h >> 15)
    h = h * 0x2C1B3C6D
    h = h ^ (h >> 12)
    return torch.remainder(h, 17) - 8


_COMBINE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def _reduced_pattern(op: str, world: int, start: int, stop: int) -> torch.Tensor:
    acc = pattern(0, start, stop)
    for r in range(1, world):
        acc = _COMBINE[op](acc, pattern(r, start, stop))
    return acc


def fill_pattern(t: torch.Tensor, rank: int) -> torch.Tensor:
    for s in range(0, t.numel(), _CHUNK):
        e = min(s + _CHUNK, t.numel())
        t[s:e].copy_(pattern(rank, s, e))
    return t


def count_wrong(result: torch.Tensor, expected_slice: Callable[[int, int], torch.Tensor]) -> int:
    """Elements of ``result`` that differ from ``expected_slice(start, stop)`` (NaN counts)."""
    wrong = 0
    flat = result.reshape(-1)
    for s in range(0, flat.numel(), _CHUNK):
        e = min(s + _CHUNK, flat.numel())
        wrong += int((flat[s:e] != expected_slice(s, e).to(flat.dtype)).sum())
    return wrong


@functools.lru_cache(maxsize=1)
def _all_reduce_expected(op: str, world: int, count: int) -> torch.Tensor:
    # Shared by every backend at one size (the cache holds the latest size only).
    return _reduced_pattern(op, world, 0, count)


# --------------------------------------------------------------------------------------
# all_reduce: S = count * element size; busbw = algbw * 2(n-1)/n
# --------------------------------------------------------------------------------------

def all_reduce(comm: Comm, count: int, dtype: str, op: str, rank: int, world: int) -> Prepared:
    tdtype, torch_op = torch_dtype(dtype), reduce_op(op)
    buf = torch.zeros(count, dtype=tdtype, device=comm.device)

    def run(async_op: bool = True):
        return comm.call("all_reduce", buf, op=torch_op, async_op=async_op)

    def check() -> int:
        t = fill_pattern(torch.empty(count, dtype=tdtype, device=comm.device), rank)
        comm.call("all_reduce", t, op=torch_op, async_op=False)
        expected = _all_reduce_expected(op, world, count)
        return count_wrong(t.cpu(), lambda s, e: expected[s:e])

    return Prepared(count, count * DTYPES[dtype][1], run, check)


COLLECTIVES: Dict[str, Collective] = {c.name: c for c in (
    Collective("all_reduce", all_reduce, lambda n: 2.0 * (n - 1) / n),
)}
