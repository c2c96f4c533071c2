"""Every collective x every dtype x world sizes 1-4 x sizes 0, 1, odd, non-divisible, MiB.

Spawning a torch process costs seconds, so there is ONE world launch per world size (a
module-scoped fixture) that runs every family of checks (see _collective_checks.py) and
returns a per-family report; the parametrized tests below only read that report, so a
failure is reported per (world size, collective) with the exact failing cases.

Checks are (a) exact results from integer-valued inputs every rank regenerates from a
seed, and (b) agreement with gloo, in the same world, on random inputs (tolerances are
stated in _values.py).
"""

import os
import random

import pytest
import torch
import torch.distributed as dist

from _collective_checks import FAMILIES, report_failures, run_families
from _harness import BACKEND, is_gloo, run_world
from _values import (DTYPES, FLOATING, check_avg, check_equal, dname, int_valued, payload,
                     random_float, red_op, reduce_exact)

FAMILY_NAMES = list(FAMILIES)

# Group timeout for the backend under test: a one-sided failure costs this much, then the
# remaining cases continue. The side gloo group outlives it.
PG_TIMEOUT_S = 30
SIDE_TIMEOUT_S = 3 * PG_TIMEOUT_S
# Harness deadline per world (all families); generous for 4 ranks on 2 cores.
DEADLINE_S = 540


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda ws: "ws%d" % ws)
def world_report(request):
    ws = request.param
    reports = run_world(run_families, ws, args=(FAMILY_NAMES, SIDE_TIMEOUT_S),
                        pg_timeout=PG_TIMEOUT_S, timeout=DEADLINE_S)
    return ws, reports


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_collective(world_report, family):
    ws, reports = world_report
    fams = [rep[family] for rep in reports]
    if all(f["skipped"] for f in fams) and not any(f["failures"] for f in fams):
        pytest.skip(fams[0]["skipped"])
    failures = report_failures(reports, [family])
    cases = fams[0]["cases"]
    assert not failures, "%s on %d ranks (backend %s): %d cases, failures:\n%s" % (
        family, ws, BACKEND, cases, "\n".join(failures))
    assert cases > 0, "no cases ran for %s" % family


# --------------------------------------------------------------------------------------
# algorithms chosen through the PYCOMM_ALGO knob: test_algorithms.py runs every algorithm,
# by the per-call option, over every dtype, op and size; here the knob, whole and per
# collective, must give the exact results too
# --------------------------------------------------------------------------------------


def _run_with_algo(algo_knob, families):
    # 3 ranks; hierarchical with 2 ranks per "node" gives uneven nodes (2 + 1).
    env = {"PYCOMM_ALGO": algo_knob, "PYCOMM_RANKS_PER_NODE": "2"}
    reports = run_world(run_families, 3, args=(families, SIDE_TIMEOUT_S, True),
                        env=env, pg_timeout=PG_TIMEOUT_S, timeout=240)
    failures = report_failures(reports, families)
    assert not failures, "PYCOMM_ALGO=%s:\n%s" % (algo_knob, "\n".join(failures))


def test_all_reduce_algorithm_knob():
    if is_gloo():
        pytest.skip("PYCOMM_ALGO is a pycomm knob")
    _run_with_algo("hierarchical", ["all_reduce"])


def test_per_collective_algorithm_knob():
    """docs/design.md, 'Public surface': PYCOMM_ALGO also takes per-collective settings."""
    if is_gloo():
        pytest.skip("PYCOMM_ALGO is a pycomm knob")
    _run_with_algo("allreduce=ring,reducescatter=ring",
                   ["all_reduce", "reduce_scatter_tensor"])


# --------------------------------------------------------------------------------------
# soak: a random sequence of collectives (the same seed on every rank), sync and async
# mixed, and on pycomm random per-call options (algorithm, compression, determinism)
# --------------------------------------------------------------------------------------

SOAK_ITERATIONS = 20000 if os.environ.get("PYCOMM_SOAK") == "1" else 300
SOAK_WS = 4
SOAK_ALGORITHMS = [None, "ring", "tree", "oneshot", "twoshot", "hierarchical"]
# docs/design.md, 'Numerics': relative RMS error against float64 on Gaussian data, per codec.
CODEC_BOUNDS = {"fp16": 1e-3, "bf16": 5e-3, "fp8_e4m3": 6e-2, "fp8_e5m2": 1.2e-1}
# Codecs that shrink a dtype's elements (others leave the call uncompressed).
CODECS_FOR = {torch.float32: list(CODEC_BOUNDS), torch.float16: ["fp8_e4m3", "fp8_e5m2"],
              torch.bfloat16: ["fp8_e4m3", "fp8_e5m2"]}


def _soak_options(rng, dtype):
    """pycomm per-call options for one call ({} for gloo or the group's defaults)."""
    if is_gloo() or rng.random() < 0.3:
        return {}
    codecs = CODECS_FOR.get(dtype, [])
    return {"algorithm": rng.choice(SOAK_ALGORITHMS),
            "deterministic": rng.choice([None, True, "exact"]),
            "compression": rng.choice([None] * 2 + codecs) if codecs else None}


def _check_compressed(got, contributions, bound):
    """[] if a compressed result is within the codec's bound of the float64 sum of the
    contributions (one per rank; a single one for all-gather). The bound is the contract's
    relative RMS error on Gaussian data of some size. On a few elements sums can cancel and
    a single element can meet its worst case, so there the bound (with a quarter more for
    the codecs whose unit roundoff comes close to it, and the output's own rounding) applies
    to what the quantizations work on: each contribution, then the result."""
    if got.numel() == 0:
        return []
    stack = torch.stack([c.double() for c in contributions])
    exp = stack.sum(0)
    if got.numel() >= 4096:
        scale = exp.norm().item()
    else:
        scale = (stack.abs().sum(0) + exp.abs()).norm().item()
        bound *= 1.25
    err = (got.double() - exp).norm().item()
    if torch.isfinite(got).all() and err <= bound * (scale or 1.0):
        return []
    return ["relative RMS error %.3g > %.3g" % (err / (scale or 1.0), bound)]


def _soak_step(rng, rank, ws, step):
    """Issue one random collective; return (description, work or None, check) where
    check() -> list."""
    import pycomm

    dtype = rng.choice(DTYPES)
    n = rng.choice([0, 1, rng.randint(2, 5000), rng.randint(5000, 300000)])
    kind = rng.choice(["all_reduce", "broadcast", "all_gather_into_tensor",
                       "reduce_scatter_tensor", "all_to_all_single"])
    async_op = rng.random() < 0.5
    seed = step
    options = _soak_options(rng, dtype) if kind in ("all_reduce", "all_gather_into_tensor",
                                                    "reduce_scatter_tensor") else {}
    what = "%s of %d %s %s" % (kind, n, dname(dtype), options or "")
    api = pycomm if options else dist
    codec = options.get("compression")
    bound = CODEC_BOUNDS.get(codec)  # compressed: Gaussian inputs, checked against float64
    if kind == "all_reduce":
        op = "SUM" if codec else rng.choice(["SUM", "MAX", "MIN"] + (["AVG"] if dtype in FLOATING else []))
        inputs = [(random_float if codec else int_valued)(seed, r, n, dtype, op, ws) for r in range(ws)]
        t = inputs[rank].clone()
        w = api.all_reduce(t, op=red_op(op), async_op=async_op, **options)
        if codec:
            return what, w, lambda: _check_compressed(t, inputs, bound)
        exp = reduce_exact(inputs, dtype, op, ws)
        return what, w, lambda: check_avg(t, exp) if op == "AVG" else check_equal(t, exp)
    if kind == "broadcast":
        root = rng.randrange(ws)
        exp = payload(seed, root, n, dtype)
        t = exp.clone() if rank == root else torch.zeros_like(exp)
        w = dist.broadcast(t, src=root, async_op=async_op)
        return what, w, lambda: check_equal(t, exp)
    if kind == "all_gather_into_tensor":
        inputs = [payload(seed, r, n, dtype) for r in range(ws)]
        out = torch.zeros(ws * n, dtype=dtype)
        w = api.all_gather_into_tensor(out, inputs[rank], async_op=async_op, **options)
        exp = torch.cat(inputs)
        return what, w, lambda: _check_compressed(out, [exp], bound) if codec else check_equal(out, exp)
    if kind == "reduce_scatter_tensor":
        inputs = [(random_float if codec else int_valued)(seed, r, ws * n, dtype, "SUM", ws)
                  for r in range(ws)]
        out = torch.zeros(n, dtype=dtype)
        w = api.reduce_scatter_tensor(out, inputs[rank], async_op=async_op, **options)
        mine = slice(rank * n, (rank + 1) * n)
        if codec:
            return what, w, lambda: _check_compressed(out, [x[mine] for x in inputs], bound)
        exp = reduce_exact(inputs, dtype, "SUM", ws)[mine]
        return what, w, lambda: check_equal(out, exp)
    inputs = [payload(seed, r, ws * n, dtype) for r in range(ws)]
    out = torch.zeros(ws * n, dtype=dtype)
    w = dist.all_to_all_single(out, inputs[rank], async_op=async_op)
    exp = torch.cat([inputs[src][rank * n:(rank + 1) * n] for src in range(ws)])
    return what, w, lambda: check_equal(out, exp)


def soak_world(rank, ws, iterations, seed):
    """Returns (operations run, failures)."""
    import warnings

    warnings.simplefilter("ignore", FutureWarning)
    rng = random.Random(seed)  # same sequence of choices on every rank
    failures, pending, done = [], [], 0
    for step in range(iterations):
        pending.append((step, _soak_step(rng, rank, ws, step)))
        # Let up to 4 async works pile up, then drain in issue order.
        if len(pending) >= rng.randint(1, 4) or step == iterations - 1:
            for s, (what, w, check) in pending:
                if w is not None:
                    w.wait()
                failures += ["step %d, %s: %s" % (s, what, p) for p in check()]
                done += 1
            pending = []
        if len(failures) > 20:
            break
    return done, failures


SOAK_DEADLINE_S = 300 if SOAK_ITERATIONS <= 1000 else 7200


@pytest.mark.slow
@pytest.mark.timeout(SOAK_DEADLINE_S + 60)  # beyond the harness's own deadline
def test_soak_random_collectives():
    iterations = SOAK_ITERATIONS
    results = run_world(soak_world, SOAK_WS, args=(iterations, 12345), pg_timeout=PG_TIMEOUT_S,
                        timeout=SOAK_DEADLINE_S)
    print("soak: %d ranks, %d operations per rank, %d failures"
          % (SOAK_WS, results[0][0], sum(len(f) for _, f in results)))
    failures = ["rank %d: %s" % (r, f) for r, (_, fs) in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)
    assert all(done == iterations for done, _ in results), [done for done, _ in results]
