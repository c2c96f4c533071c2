"""Determinism contract (docs/design.md, 'Determinism levels', D0-D5), proved bit for bit.

Every world runs with PYCOMM_TEST_PERTURB: each rank sleeps a pseudo-random time before
every frame it sends, so arrival orders differ from call to call and from world to world.
Each rank returns hashes of its results; the parent compares them:
* D0/D1: every rank, and every repeat of a call under different delays (10 for the
  short tensors), the same bits, in every mode including the default.
* D2: an element's bits do not depend on the tensor's length or the chunk size
  (deterministic=1 and exact: a prefix of a longer tensor; worlds with other chunks).
* D3: ring = tree = oneshot = twoshot = hierarchical (requested algorithms that cannot
  hold the mode fall back), compressed or not.
* D4 (exact): the same bits whatever the grouping into nodes and the transport.
* D5 (exact): x0..x3 on 4 ranks = x0..x3 plus four zero contributions on 8 ranks = any
  permutation of which rank holds which contribution. D4 and D5 also with compression.
* Reduce-scatter then all-gather = all-reduce, and each shard = its slice of the
  all-reduce, in both deterministic modes.
* Accuracy against fp64: deterministic modes at least as accurate as the default; exact
  within its stated bound (k * 2^-36 of the largest term, plus the final rounding).
"""

import hashlib
import itertools

import pytest
import torch
import torch.distributed as dist

from _harness import group_timeout, is_gloo, run_world, world_marks

pytestmark = pytest.mark.skipif(is_gloo(), reason="deterministic modes are pycomm's")

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
OPS = ["SUM", "AVG", "PREMUL_SUM", "PRODUCT"]
ALGORITHMS = ["ring", "tree", "oneshot", "twoshot", "hierarchical"]
MODES = [True, "exact"]
LONG, SHORT = 20011, 1000  # the short tensor is a prefix of the long one
REPEATS = {LONG: 2, SHORT: 10}  # calls per case, each under other delays
# Where the proof is between worlds (late ranks, topologies), each world itself another
# schedule of the same calls: a repeat of the short call keeps D1 checked in each.
REPEATS_ACROSS_WORLDS = {LONG: 1, SHORT: 2}
PERTURB_US = 40


def _hash(t):
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _op(name):
    return dist._make_nccl_premul_sum(0.375) if name == "PREMUL_SUM" else getattr(dist.ReduceOp, name)


def _contribution(index, n, dtype, op):
    """Contribution number `index` (None: zeros), wide dynamic range, cancellation."""
    if index is None:
        return torch.zeros(n, dtype=dtype)
    g = torch.Generator().manual_seed(1000 + index)
    m = max(n, LONG)  # drawn at one length and cut, so shorter tensors are prefixes
    if op == "PRODUCT":  # near 1, so that 8 factors stay in range
        return (1 + 0.05 * torch.randn(m, generator=g, dtype=torch.float64))[:n].to(dtype)
    x = torch.randn(m, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-12, 12, (m,), generator=g))
    return x[:n].to(dtype)


def hash_world(rank, ws, holds, modes, algorithms, ops, dtypes, codecs, repeats):
    """holds[r]: the contribution index rank r holds (None: zeros). Returns
    {case: hash} from rank 0 after checking D0/D1 here."""
    import pycomm

    side = dist.new_group(backend="gloo", timeout=group_timeout())
    out, problems, mine = {}, [], {}
    for mode, dtype, op, codec in itertools.product(modes, dtypes, ops, codecs):
        if codec and (dtype not in (torch.float32, torch.float16, torch.bfloat16) or op != "SUM"):
            continue
        for algo in algorithms:
            for n in (LONG, SHORT):
                x = _contribution(holds[rank], n, dtype, op)
                seen = set()
                for _ in range(repeats[n]):
                    t = x.clone()
                    pycomm.all_reduce(t, _op(op), algorithm=algo, deterministic=mode, compression=codec)
                    seen.add(_hash(t))
                case = (str(mode), str(dtype), op, codec or "none", n)
                if len(seen) != 1:
                    problems.append("%s %s: repeats differ" % (case, algo))
                mine[case, algo] = seen.pop()
                # D2: the prefix of the long result equals the short result.
                key = case[:4] + ("prefix",)
                prefix = _hash(t[:SHORT])
                out.setdefault(key, {})[(algo, n)] = prefix
    # D0 across ranks, every case at once: one gather, not one per case (each a barrier
    # that would cost more than the calls it checks).
    everyone = [None] * ws
    dist.all_gather_object(everyone, mine, group=side)
    for case, algo in mine:
        if len({hashes[case, algo] for hashes in everyone}) != 1:
            problems.append("%s %s: ranks differ" % (case, algo))
        out.setdefault(case[:4] + ("full", case[4]), {})[algo] = everyone[0][case, algo]
    return out, problems


# The default mode reduces in rank order where each element's owner folds every
# contribution (oneshot, twoshot), so those two agree with each other and across lengths.
RANK_ORDER_BY_DEFAULT = ("oneshot", "twoshot")


def _check_world(results, problems):
    """Within one world: D3 (one hash per case across algorithms) and D2 (prefixes) in the
    deterministic modes; in the default mode (held to D0 and D1 in hash_world) only among
    RANK_ORDER_BY_DEFAULT, uncompressed."""
    problems = list(problems)
    for key, by in results.items():
        if key[0] == "False":
            if key[3] != "none":
                continue
            by = {a: h for a, h in by.items() if (a[0] if isinstance(a, tuple) else a) in RANK_ORDER_BY_DEFAULT}
        if key[4] == "prefix" and key[3] != "none":
            # Compressed: the last, short block of the short tensor holds other values
            # than the long tensor's block at the same place, so its scale may differ.
            continue
        if len(set(by.values())) != 1:
            problems.append("%s: %s" % (key, by))
    return problems


def _run(ws, env, holds=None, modes=[False] + MODES, algorithms=ALGORITHMS, ops=OPS, dtypes=FLOATS, codecs=(None,),
         repeats=REPEATS, timeout=300):
    holds = holds or list(range(ws))
    env = dict(env, PYCOMM_TEST_PERTURB=env.get("PYCOMM_TEST_PERTURB", "7:%d" % PERTURB_US))
    reports = run_world(hash_world, ws, args=(holds, modes, algorithms, ops, dtypes, codecs, repeats), env=env,
                        timeout=timeout)
    results, problems = reports[0]
    for _, p in reports[1:]:
        problems += p
    return results, problems


def _exact_hashes(results):
    return {k: v for k, v in results.items() if k[0] == "exact" and k[4] == "full"}


# ws -> environment: 2 "nodes" of one rank (TCP between them), small chunks (many
# pipeline steps per call), the default.
WORLDS = {2: {"PYCOMM_RANKS_PER_NODE": "1"}, 3: {"PYCOMM_SHM_CHUNK_BYTES": "4096"}, 5: {}}


@pytest.mark.parametrize("ws", [pytest.param(ws, marks=world_marks(ws)) for ws in WORLDS])
def test_orders_timing_lengths_and_algorithms(ws):
    results, problems = _run(ws, WORLDS[ws])
    problems = _check_world(results, problems)
    assert not problems, "\n".join(problems[:40])


def test_a_late_rank_changes_no_bit():
    """D1 with PYCOMM_TEST_PERTURB's chosen step: in each world one rank sleeps 10 ms before
    the same frame of every collective (the first rank before its first frame, the last
    rank before its second), so it is the last to arrive there; every mode and algorithm
    gives the bits of a world without delays."""
    env = {"PYCOMM_RANKS_PER_NODE": "2"}  # hierarchical runs for real, not through auto
    kw = dict(ops=["SUM"], dtypes=[torch.float32], repeats=REPEATS_ACROSS_WORLDS)
    worlds = {"no delay": _run(4, dict(env, PYCOMM_TEST_PERTURB="0:0"), **kw)}
    for late, step in ((0, 0), (3, 1)):
        spec = "0:10000:%d:%d" % (late, step)
        worlds["rank %d late at step %d" % (late, step)] = _run(4, dict(env, PYCOMM_TEST_PERTURB=spec), **kw)
    (_, (reference, problems)), others = next(iter(worlds.items())), list(worlds.items())[1:]
    problems = _check_world(reference, problems)
    for name, (results, world_problems) in others:
        problems += ["%s: %s" % (name, p) for p in world_problems]
        for key, by in results.items():
            if by != reference[key]:
                problems.append("%s: %s: %s, without delays %s" % (name, key, by, reference[key]))
    assert not problems, "\n".join(problems[:40])


def test_compressed_deterministic_modes_agree_across_algorithms():
    results, problems = _run(4, {"PYCOMM_RANKS_PER_NODE": "2"}, ops=["SUM"],
                             dtypes=[torch.float32, torch.bfloat16], codecs=(None, "fp8_e4m3", "fp16"))
    problems = _check_world(results, problems)
    assert not problems, "\n".join(problems[:40])


@pytest.mark.large
def test_exact_across_topology_transports_chunks_and_world_sizes():
    """D4 and D5: one set of contributions x0..x3, every way of running it, with and without
    compression (a contribution's quantization depends on itself alone)."""
    kw = dict(modes=["exact"], algorithms=["ring", "twoshot", "hierarchical"], ops=["SUM", "PREMUL_SUM"],
              dtypes=[torch.float32, torch.float64, torch.bfloat16], codecs=(None, "fp8_e4m3"),
              repeats=REPEATS_ACROSS_WORLDS)
    runs = {
        "4 ranks, one node, shm": _run(4, {}, **kw),
        "4 ranks, 2 nodes x 2": _run(4, {"PYCOMM_RANKS_PER_NODE": "2"}, **kw),
        "4 ranks, tcp, 4 KiB chunks": _run(4, {"PYCOMM_TRANSPORT": "tcp", "PYCOMM_TCP_CHUNK_BYTES": "4096"}, **kw),
        "8 ranks, x0..x3 and zeros": _run(8, {}, holds=[0, 1, 2, 3, None, None, None, None], **kw),
        "8 ranks, permuted, zeros between": _run(8, {"PYCOMM_RANKS_PER_NODE": "4"},
                                                 holds=[None, 3, None, 0, 2, None, 1, None], **kw),
    }
    problems = []
    for name, (results, world_problems) in runs.items():
        problems += ["%s: %s" % (name, p) for p in _check_world(results, world_problems)]
    reference_name, (reference, _) = next(iter(runs.items()))
    for name, (results, _) in runs.items():
        for key, by in _exact_hashes(results).items():
            if set(by.values()) != set(_exact_hashes(reference)[key].values()):
                problems.append("%s differs from %s: %s" % (name, reference_name, key))
    assert not problems, "\n".join(problems[:40])


# --------------------------------------------------------------------------------------
# reduce-scatter + all-gather = all-reduce, and accuracy
# --------------------------------------------------------------------------------------

def composition_world(rank, ws):
    import pycomm

    problems = []
    for mode, dtype, codec in itertools.product(MODES, FLOATS, (None, "fp8_e4m3")):
        if codec and dtype == torch.float64:
            continue
        count = 1024 * 3  # a multiple of the codec's block: shards start on a block
        xs = [_contribution(r, count * ws, dtype, "SUM") for r in range(ws)]
        full = xs[rank].clone()
        pycomm.all_reduce(full, deterministic=mode, compression=codec)
        for algo in ("ring", "oneshot"):
            shard = torch.empty(count, dtype=dtype)
            pycomm.reduce_scatter_tensor(shard, xs[rank], algorithm=algo, deterministic=mode, compression=codec)
            if not torch.equal(shard.view(torch.uint8), full[rank * count:(rank + 1) * count].view(torch.uint8)):
                problems.append("%s %s %s %s: shard differs from the all-reduce slice" % (mode, dtype, codec, algo))
            gathered = torch.empty(count * ws, dtype=dtype)
            pycomm.all_gather_into_tensor(gathered, shard, algorithm=algo)
            if not torch.equal(gathered.view(torch.uint8), full.view(torch.uint8)):
                problems.append("%s %s %s %s: RS + AG differs from the all-reduce" % (mode, dtype, codec, algo))
    return problems


def test_reduce_scatter_then_all_gather_is_all_reduce():
    problems = run_world(composition_world, 3, env={"PYCOMM_TEST_PERTURB": "3:%d" % PERTURB_US}, timeout=180)
    assert not any(problems), "\n".join(sum(problems, [])[:40])


def accuracy_world(rank, ws):
    import pycomm

    report = {}
    for dtype in (torch.float32, torch.bfloat16):
        xs = [_contribution(r, LONG, dtype, "SUM") for r in range(ws)]
        ref = torch.stack([x.double() for x in xs]).sum(0)
        largest = torch.stack([x.double().abs() for x in xs]).max(0).values
        for mode in (False, True, "exact"):
            t = xs[rank].clone()
            pycomm.all_reduce(t, deterministic=mode)
            err = (t.double() - ref).abs()
            # exact mode's bound: k * 2^-36 of the largest term, plus half an ulp of the result
            ulp = torch.finfo(dtype).eps * t.double().abs()
            bound = ws * 2.0 ** -36 * 2 * largest + 0.5 * ulp
            report[str(dtype), str(mode)] = (((err ** 2).mean().sqrt() / ref.norm() * LONG ** 0.5).item(),
                                             bool((err <= bound).all()))
    return report


def test_deterministic_modes_are_accurate():
    report = run_world(accuracy_world, 4, timeout=120)[0]
    problems = []
    for dtype in ("torch.float32", "torch.bfloat16"):
        default = report[dtype, "False"][0]
        for mode in ("True", "exact"):
            err, within = report[dtype, mode]
            print("%s deterministic=%s: relative RMS error %.3e (default %.3e)" % (dtype, mode, err, default))
            if err > default * 1.0001:
                problems.append("%s %s: error %.3e above the default's %.3e" % (dtype, mode, err, default))
        if not report[dtype, "exact"][1]:
            problems.append("%s exact: an element outside the stated bound" % dtype)
    assert not problems, "\n".join(problems)
