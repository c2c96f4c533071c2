"""The collectives: one :class:`Collective` row each in COLLECTIVES. Buffers, calls, the
correctness check and the accuracy call are written once, for every collective, backend,
dtype and op.

Sizes follow nccl-tests: S (``bytes``) is the whole array of N elements, rounded down to
whole elements, and to a multiple of n (the world size) where the array is split into one
chunk per rank. ``count`` is nccl-tests' count argument:

    collective       input   output  count  busbw factor
    all_reduce       N       N       N      2(n-1)/n
    reduce_scatter   N       N/n     N/n    (n-1)/n
    all_gather       N/n     N       N/n    (n-1)/n
    broadcast        N       N       N      1          (root: rank 0)
    all_to_all       N       N       N/n    (n-1)/n

In place (as in nccl-tests), the smaller buffer is the rank's chunk of the larger one
(reduce_scatter's output, all_gather's input), and all_reduce and broadcast use one buffer.
torch.distributed has all_reduce and broadcast only in place and all_to_all only out of
place; ``placements`` says which forms a collective has.

Timing buffers hold zeros: in-place calls feed on each other's results, and only zeros stay
finite and unchanged under any number of SUMs.

The check fills separate buffers: each rank's input with :func:`pattern`, small integers in
[-8, 8] drawn from a generator seeded by the rank (with no short period, so a chunk at the
wrong offset shows), and the output first with POISON (so an element the collective
does not write shows). Any partial sum over n ranks is an integer of magnitude <= 8n, exact
in float32 (n < 2**21), float16 (n <= 256) and bfloat16 (n <= 32), so the output must equal
the expectation bit for bit whatever the reduction order.

The accuracy call (floating dtypes) runs on seeded Gaussian inputs that every rank can
regenerate for every rank, compares the output with a float64 reference computed from the
inputs as sent (already rounded to the dtype), and hashes the output bytes.

To add a collective: one row in COLLECTIVES (its torch.distributed function, the shape of
its buffers, its expected output, its busbw factor).
"""
from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .config import DTYPES, OPS

ROOT = 0
# Outside the pattern's [-8, 8] and exact in every dtype of config.DTYPES.
POISON = 100
# Test-only: "1" makes rank 0 count one element of its checked output as wrong, so that a
# test can see the whole path from the check to #wrong and exit status 2.
PLANT_ERROR_ENV = "PYCOMM_BENCH_PLANT_ERROR"

Source = Callable[[int], torch.Tensor]   # rank -> that rank's input (int32 or float64)


@dataclass
class Prepared:
    count: int                      # nccl-tests "count" (see the table above)
    nbytes: int                     # S in algbw = S / t
    run: Callable[[bool], object]   # one call on the timing buffers -> Work (async) or None
    check: Callable[[], int]        # one call on pattern data -> #wrong on this rank
    # One call on Gaussian data -> (squared error sum, squared reference sum, hash) on this
    # rank; None for integer dtypes.
    sample: Optional[Callable[[], Tuple[float, float, str]]]


_COMBINE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def _reduce(op: str, tensors) -> torch.Tensor:
    return functools.reduce(_COMBINE[op], tensors)


def _chunk(t: torch.Tensor, world: int, i: int) -> torch.Tensor:
    return t.view(world, -1)[i]


@dataclass(frozen=True)
class Collective:
    name: str
    call: str                               # the torch.distributed function
    busbw_factor: Callable[[int], float]    # busbw = algbw * factor(world size)
    # (source, rank, world, op) -> this rank's output, from every rank's input.
    expected: Callable[[Source, int, int, str], torch.Tensor]
    placements: Tuple[bool, ...]            # the forms torch.distributed has (True: in place)
    in_chunk: bool = False                  # the input is one chunk of the array
    out_chunk: bool = False                 # the output is one chunk of the array
    chunked: bool = False                   # the array splits into n chunks
    takes_op: bool = True
    replicated: bool = True                 # every rank gets the same output
    rooted: bool = False                    # only ROOT's input matters
    aliases: Tuple[str, ...] = ()

    def elements(self, nbytes: int, dtype: str, world: int) -> Tuple[int, int]:
        """(N, count) for an array of ``nbytes``."""
        total = nbytes // DTYPES[dtype][1]
        if not self.chunked:
            return total, total
        chunk = total // world
        return chunk * world, chunk

    def buffers(self, total: int, world: int, rank: int, dtype: str, device: str,
                in_place: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """Zeroed (input, output) for an array of ``total`` elements."""
        chunk = total // world
        n_in = chunk if self.in_chunk else total
        n_out = chunk if self.out_chunk else total
        zeros = functools.partial(torch.zeros, dtype=torch_dtype(dtype), device=device)
        if not in_place:
            return zeros(n_in), zeros(n_out)
        whole = zeros(max(n_in, n_out))
        if n_in == n_out:
            return whole, whole
        part = _chunk(whole, world, rank)
        return (part, whole) if n_in < n_out else (whole, part)

    def load(self, inp: torch.Tensor, out: torch.Tensor, source: Source, rank: int) -> None:
        """The output poisoned, then this rank's input (in place, the input overlaps it)."""
        out.fill_(POISON)
        if self.rooted and rank != ROOT:
            inp.fill_(POISON)
        else:
            inp.copy_(source(rank))

    def issue(self, comm, inp: torch.Tensor, out: torch.Tensor, op: Optional[str],
              async_op: bool):
        tensors = (out,) if out is inp else (out, inp)
        kwargs = {}
        if self.takes_op:
            kwargs["op"] = getattr(dist.ReduceOp, OPS[op])
        if self.rooted:
            kwargs["src"] = ROOT
        return comm.call(self.call, *tensors, async_op=async_op, **kwargs)


COLLECTIVES: Dict[str, Collective] = {c.name: c for c in (
    Collective("all_reduce", "all_reduce", lambda n: 2.0 * (n - 1) / n,
               lambda src, rank, world, op: _reduce(op, (src(r) for r in range(world))),
               placements=(True,), aliases=("allreduce",)),
    Collective("reduce_scatter", "reduce_scatter_single", lambda n: (n - 1) / n,
               lambda src, rank, world, op: _reduce(
                   op, (_chunk(src(r), world, rank) for r in range(world))),
               placements=(True, False), out_chunk=True, chunked=True,
               replicated=False, aliases=("reducescatter",)),
    Collective("all_gather", "all_gather_single", lambda n: (n - 1) / n,
               lambda src, rank, world, op: torch.cat([src(r) for r in range(world)]),
               placements=(True, False), in_chunk=True, chunked=True, takes_op=False,
               aliases=("allgather",)),
    Collective("broadcast", "broadcast", lambda n: 1.0,
               lambda src, rank, world, op: src(ROOT),
               placements=(True,), takes_op=False, rooted=True, aliases=("bcast",)),
    Collective("all_to_all", "all_to_all_single", lambda n: (n - 1) / n,
               lambda src, rank, world, op: torch.cat(
                   [_chunk(src(r), world, rank) for r in range(world)]),
               placements=(False,), chunked=True, takes_op=False, replicated=False,
               aliases=("alltoall",)),
)}
ALIASES = {a: c.name for c in COLLECTIVES.values() for a in (c.name,) + c.aliases}


def canonical_collectives(text: str):
    """'allreduce,all_gather' -> ['all_reduce', 'all_gather']; 'all' -> every collective."""
    names = []
    for item in (s.strip().lower() for s in text.split(",")):
        if item == "all":
            names += list(COLLECTIVES)
        elif item in ALIASES:
            names.append(ALIASES[item])
        elif item:
            raise ValueError("unknown collective %r (have: %s, or all)"
                             % (item, ", ".join(sorted(ALIASES))))
    return list(dict.fromkeys(names))


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, DTYPES[name][0])


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pattern(rank: int, numel: int) -> torch.Tensor:
    """int32 values in [-8, 8] for ``rank``'s input of ``numel`` elements: random-looking at
    every lag, so a chunk at a wrong offset or from a wrong rank shows."""
    return torch.randint(-8, 9, (numel,), generator=_generator(rank), dtype=torch.int32)


def gaussian(seed: int, rank: int, numel: int, dtype: str) -> torch.Tensor:
    """``rank``'s Gaussian input as float64, rounded to ``dtype`` as it is sent."""
    g = _generator(seed * 1_000_003 + rank)
    return torch.randn(numel, generator=g).to(torch_dtype(dtype)).double()


def digest(t: torch.Tensor) -> str:
    """sha256 of the tensor's bytes, first 8 hex digits."""
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:8]


# Expectations are shared by every backend at one size; each cache holds the latest only.
@functools.lru_cache(maxsize=1)
def _pattern_expected(name: str, op: str, world: int, rank: int, n_in: int) -> torch.Tensor:
    return COLLECTIVES[name].expected(lambda r: pattern(r, n_in), rank, world, op)


@functools.lru_cache(maxsize=1)
def _gaussian_expected(name: str, op: str, world: int, rank: int, n_in: int, dtype: str,
                       seed: int) -> torch.Tensor:
    return COLLECTIVES[name].expected(lambda r: gaussian(seed, r, n_in, dtype), rank, world, op)


def prepare(coll: Collective, comm, nbytes: int, dtype: str, op: str, in_place: bool,
            rank: int, world: int, seed: int) -> Prepared:
    """Buffers and callables for one (backend, size, dtype, op, placement)."""
    total, count = coll.elements(nbytes, dtype, world)
    inp, out = coll.buffers(total, world, rank, dtype, comm.device, in_place)
    n_in = inp.numel()

    def run(async_op: bool = True):
        return coll.issue(comm, inp, out, op, async_op)

    def call_on(source: Source) -> torch.Tensor:
        i, o = coll.buffers(total, world, rank, dtype, comm.device, in_place)
        coll.load(i, o, source, rank)
        coll.issue(comm, i, o, op, False)
        comm.synchronize()
        return o.cpu()

    def check() -> int:
        got = call_on(lambda r: pattern(r, n_in))
        if os.environ.get(PLANT_ERROR_ENV) == "1" and rank == 0:
            got.view(-1)[0] += 1
        expected = _pattern_expected(coll.name, op, world, rank, n_in)
        return int((got != expected.to(got.dtype)).sum())

    def sample() -> Tuple[float, float, str]:
        got = call_on(lambda r: gaussian(seed, r, n_in, dtype))
        ref = _gaussian_expected(coll.name, op, world, rank, n_in, dtype, seed)
        return (float((got.double() - ref).square().sum()), float(ref.square().sum()),
                digest(got))

    return Prepared(count, total * DTYPES[dtype][1], run, check,
                    sample if torch_dtype(dtype).is_floating_point else None)
