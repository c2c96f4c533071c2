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
from _values import (DTYPES, FLOATING, check_avg, check_equal, int_valued, payload,
                     red_op, reduce_exact)

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
# algorithms chosen through the PYCOMM_ALGO knob (test_algorithms.py covers the per-call
# option): the whole all-reduce family must give the exact results
# --------------------------------------------------------------------------------------

ALGORITHMS = ["ring", "tree", "oneshot", "twoshot", "hierarchical"]


def _run_with_algo(algo_knob, families):
    # 3 ranks; hierarchical with 2 ranks per "node" gives uneven nodes (2 + 1).
    env = {"PYCOMM_ALGO": algo_knob, "PYCOMM_RANKS_PER_NODE": "2"}
    reports = run_world(run_families, 3, args=(families, SIDE_TIMEOUT_S, True),
                        env=env, pg_timeout=PG_TIMEOUT_S, timeout=240)
    failures = report_failures(reports, families)
    assert not failures, "PYCOMM_ALGO=%s:\n%s" % (algo_knob, "\n".join(failures))


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_all_reduce_algorithm(algo):
    if is_gloo():
        pytest.skip("PYCOMM_ALGO is a pycomm knob")
    _run_with_algo(algo, ["all_reduce"])


def test_per_collective_algorithm_knob():
    """DESIGN.md section 3: PYCOMM_ALGO also takes per-collective settings."""
    if is_gloo():
        pytest.skip("PYCOMM_ALGO is a pycomm knob")
    _run_with_algo("allreduce=ring,reducescatter=ring",
                   ["all_reduce", "reduce_scatter_tensor"])


# --------------------------------------------------------------------------------------
# soak: random sequence of collectives (same seed on every rank), sync and async mixed
# --------------------------------------------------------------------------------------

SOAK_ITERATIONS = 20000 if os.environ.get("PYCOMM_SOAK") == "1" else 300


def _soak_step(rng, rank, ws, step):
    """Issue one random collective; return (work or None, check) where check() -> list."""
    dtype = rng.choice(DTYPES)
    n = rng.choice([0, 1, rng.randint(2, 5000), rng.randint(5000, 300000)])
    kind = rng.choice(["all_reduce", "broadcast", "all_gather_into_tensor",
                       "reduce_scatter_tensor", "all_to_all_single"])
    async_op = rng.random() < 0.5
    seed = step
    if kind == "all_reduce":
        op = rng.choice(["SUM", "MAX", "MIN"] + (["AVG"] if dtype in FLOATING else []))
        inputs = [int_valued(seed, r, n, dtype, op, ws) for r in range(ws)]
        t = inputs[rank].clone()
        w = dist.all_reduce(t, op=red_op(op), async_op=async_op)
        exp = reduce_exact(inputs, dtype, op, ws)
        return w, lambda: check_avg(t, exp) if op == "AVG" else check_equal(t, exp)
    if kind == "broadcast":
        root = rng.randrange(ws)
        exp = payload(seed, root, n, dtype)
        t = exp.clone() if rank == root else torch.zeros_like(exp)
        w = dist.broadcast(t, src=root, async_op=async_op)
        return w, lambda: check_equal(t, exp)
    if kind == "all_gather_into_tensor":
        inputs = [payload(seed, r, n, dtype) for r in range(ws)]
        out = torch.zeros(ws * n, dtype=dtype)
        w = dist.all_gather_into_tensor(out, inputs[rank], async_op=async_op)
        return w, lambda: check_equal(out, torch.cat(inputs))
    if kind == "reduce_scatter_tensor":
        inputs = [int_valued(seed, r, ws * n, dtype, "SUM", ws) for r in range(ws)]
        out = torch.zeros(n, dtype=dtype)
        w = dist.reduce_scatter_tensor(out, inputs[rank], async_op=async_op)
        exp = reduce_exact(inputs, dtype, "SUM", ws)[rank * n:(rank + 1) * n]
        return w, lambda: check_equal(out, exp)
    inputs = [payload(seed, r, ws * n, dtype) for r in range(ws)]
    out = torch.zeros(ws * n, dtype=dtype)
    w = dist.all_to_all_single(out, inputs[rank], async_op=async_op)
    exp = torch.cat([inputs[src][rank * n:(rank + 1) * n] for src in range(ws)])
    return w, lambda: check_equal(out, exp)


def soak_world(rank, ws, iterations, seed):
    import warnings

    warnings.simplefilter("ignore", FutureWarning)
    rng = random.Random(seed)  # same sequence of choices on every rank
    failures, pending = [], []
    for step in range(iterations):
        pending.append((step, _soak_step(rng, rank, ws, step)))
        # Let up to 4 async works pile up, then drain in issue order.
        if len(pending) >= rng.randint(1, 4) or step == iterations - 1:
            for s, (w, check) in pending:
                if w is not None:
                    w.wait()
                failures += ["step %d: %s" % (s, p) for p in check()]
            pending = []
        if len(failures) > 20:
            break
    return failures


@pytest.mark.slow
def test_soak_random_collectives():
    iterations = SOAK_ITERATIONS
    results = run_world(soak_world, 3, args=(iterations, 12345), pg_timeout=PG_TIMEOUT_S,
                        timeout=240 if iterations <= 1000 else 3600)
    failures = ["rank %d: %s" % (r, f) for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)
