"""Every algorithm x every collective it serves x dtypes/ops x world sizes 1-4, over shared
memory, TCP and mixed topologies (PYCOMM_RANKS_PER_NODE), through the per-call API.

One world launch per (world size, environment) runs every algorithm; an algorithm that
cannot serve a call (hierarchical on one node or on uneven nodes, twoshot for
reduce-scatter and all-gather) must fall back and still give the exact result. Some worlds use 4 KiB
chunks and the minimum pipeline depth, so that the pipelined paths and their deadlock
freedom are exercised with small tensors.
"""

import os

import pytest
import torch
import torch.distributed as dist

from _harness import capture_stderr, is_gloo, run_world, world_marks
from _values import (DTYPES, FLOATING, check_avg, check_equal, int_valued, ops_for,
                     random_float, red_op, reduce_exact, seed_of)

ALGORITHMS = ["auto", "ring", "tree", "hierarchical", "oneshot", "twoshot"]
COUNTS = [0, 1, 7, 1001, 65537]
RS_AG_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
# An algorithm moves the same bytes whatever the op, and reduces them with the op's kernel
# whatever the size: below 65537 elements (empty, single, odd and uneven segments, vector
# tails) an all-reduce takes every dtype and op; at 65537 (past 2^16: several chunks at
# 4 KiB, auto's choice for larger messages) every dtype of RS_AG_DTYPES once, for its chunk
# geometry, and every other op on bfloat16, whose partials are wider (float32), for the
# op's partial and final stages from chunk to chunk.
SMALL_CHUNKS = {"PYCOMM_SHM_CHUNK_BYTES": "4096", "PYCOMM_TCP_CHUNK_BYTES": "4096",
                "PYCOMM_PIPELINE_DEPTH": "2"}

WORLDS = [
    (1, {}),
    (2, {}),
    (2, {"PYCOMM_TRANSPORT": "tcp"}),
    (2, {"PYCOMM_RANKS_PER_NODE": "1"}),
    (3, dict(SMALL_CHUNKS)),
    (3, {"PYCOMM_RANKS_PER_NODE": "2"}),                       # uneven nodes: 2 + 1
    (3, {"PYCOMM_TRANSPORT": "tcp", "PYCOMM_RANKS_PER_NODE": "1"}),
    (4, {}),
    (4, dict(SMALL_CHUNKS, PYCOMM_RANKS_PER_NODE="2")),        # 2 nodes x 2: shm + tcp
    (4, {"PYCOMM_TRANSPORT": "tcp"}),
]


def _world_id(w):
    ws, env = w
    return "ws%d-%s" % (ws, "-".join("%s=%s" % (k[7:].lower(), v) for k, v in env.items()) or "shm")


def _case(problems, label, body):
    try:
        problems += ["%s: %s" % (label, p) for p in body()]
    except Exception as e:  # noqa: BLE001 - recorded, the group is poisoned anyway
        problems.append("%s: raised %s: %s" % (label, type(e).__name__, e))


def _shard_inputs(shard, rank, ws):
    """A reduce-scatter's inputs made of ws shards each, shard(r, j) the j-th of rank r's:
    (this rank's input, every rank's shard ``rank``: the operands of this rank's output).
    A rank regenerates 2 ws shards, not the ws * ws of every rank's whole input."""
    return torch.cat([shard(rank, j) for j in range(ws)]), [shard(r, rank) for r in range(ws)]


def algorithms_world(rank, ws):
    import pycomm

    problems = []
    side = dist.new_group(backend="gloo")
    all_reduces = [(dtype, op, n) for dtype in DTYPES for op in ops_for(dtype) for n in COUNTS[:4]]
    all_reduces += [(dtype, "SUM", COUNTS[4]) for dtype in RS_AG_DTYPES]
    all_reduces += [(torch.bfloat16, op, COUNTS[4]) for op in ops_for(torch.bfloat16) if op != "SUM"]
    for algo in ALGORITHMS:
        for dtype, op, n in all_reduces:
            label = "all_reduce %s %s %s n=%d" % (algo, dtype, op, n)

            def body():
                inputs = [int_valued(seed_of(label), r, n, dtype, op, ws) for r in range(ws)]
                t = inputs[rank].clone()
                pycomm.all_reduce(t, red_op(op), algorithm=algo)
                exp = reduce_exact(inputs, dtype, op, ws)
                return check_avg(t, exp) if op == "AVG" else check_equal(t, exp)
            _case(problems, label, body)
        # Every rank must hold the same bits, also for rounded floating sums.
        for dtype in FLOATING:
            label = "all_reduce %s %s random floats agree across ranks" % (algo, dtype)

            def body():
                t = random_float(seed_of(label), rank, 65537, dtype, "SUM")
                pycomm.all_reduce(t, algorithm=algo)
                everyone = [torch.empty_like(t) for _ in range(ws)]
                dist.all_gather(everyone, t, group=side)
                return [] if all(torch.equal(everyone[0], e) for e in everyone) else ["ranks differ"]
            _case(problems, label, body)
        for dtype in RS_AG_DTYPES:
            for op in ["SUM", "MAX"] + (["AVG"] if dtype in FLOATING else []):
                for n in COUNTS:
                    label = "reduce_scatter %s %s %s n=%d" % (algo, dtype, op, n)

                    def body():
                        mine, shards = _shard_inputs(
                            lambda r, j: int_valued(seed_of(label), r, n, dtype, op, ws, tag=j), rank, ws)
                        out = torch.zeros(n, dtype=dtype)
                        pycomm.reduce_scatter_tensor(out, mine, red_op(op), algorithm=algo)
                        exp = reduce_exact(shards, dtype, op, ws)
                        return check_avg(out, exp) if op == "AVG" else check_equal(out, exp)
                    _case(problems, label, body)
            for n in COUNTS:
                label = "all_gather %s %s n=%d" % (algo, dtype, n)

                def body():
                    inputs = [int_valued(seed_of(label), r, n, dtype, "MAX", ws) for r in range(ws)]
                    out = torch.zeros(ws * n, dtype=dtype)
                    pycomm.all_gather_into_tensor(out, inputs[rank], algorithm=algo)
                    return check_equal(out, torch.cat(inputs))
                _case(problems, label, body)
        if len(problems) > 20:
            break
    return problems


def _no_problems(world_fn, ws, env):
    """Runs ``world_fn`` (pycomm's algorithms: skipped on gloo) on ``ws`` ranks and fails
    with the first problems any rank reports."""
    if is_gloo():
        pytest.skip("algorithms are pycomm's")
    results = run_world(world_fn, ws, env=env, pg_timeout=30, timeout=300)
    problems = ["rank %d: %s" % (r, p) for r, ps in enumerate(results) for p in ps]
    assert not problems, "%d problems, first ones:\n%s" % (len(problems), "\n".join(problems[:20]))


@pytest.mark.parametrize("world", [pytest.param(w, marks=world_marks(w[0])) for w in WORLDS],
                         ids=_world_id)
def test_every_algorithm(world):
    _no_problems(algorithms_world, *world)


# Recursive doubling (the tree family's variant for latency-bound all-reduces over TCP)
# where the world is not a power of two: ranks pair up before the butterfly and take the
# result back after it; with 4 KiB frames, several chunks run one after the other. The
# exactly representable inputs of _values serve up to 4 ranks; 5 and 6 take small
# integers, and random floats whose sum every rank must hold alike. Link costs where a
# frame costs a millisecond make the plan pick the variant with the fewest frames:
# recursive doubling for a buffer of one frame, and at 5 ranks for some of several.
RECURSIVE_DOUBLING_WORLDS = [(3, dict(SMALL_CHUNKS, PYCOMM_TRANSPORT="tcp")),
                             (5, dict(SMALL_CHUNKS, PYCOMM_TRANSPORT="tcp")), (6, {"PYCOMM_TRANSPORT": "tcp"})]


def recursive_doubling_world(rank, ws):
    import pycomm

    problems = []
    side = dist.new_group(backend="gloo")

    several_frames = [0]  # recursive doublings of a buffer of several frames

    def ran(work, n):
        work.wait()
        if work.algorithm == "recursive-doubling":
            several_frames[0] += n * 8 > 4096 and "PYCOMM_TCP_CHUNK_BYTES" in os.environ
            return []
        return [] if n > 7 else ["ran as %s" % work.algorithm]

    cases = [(dtype, op) for dtype in DTYPES for op in ops_for(dtype)] if ws <= 4 else \
        [(torch.int64, op) for op in ("SUM", "MIN", "MAX")] + [(torch.float32, "AVG")]
    for dtype, op in cases:
        for n in (1, 7, 1001, 2500):
            label = "recursive doubling %s %s n=%d" % (dtype, op, n)

            def body():
                if ws <= 4:
                    inputs = [int_valued(seed_of(label), r, n, dtype, op, ws) for r in range(ws)]
                else:
                    g = torch.Generator().manual_seed(seed_of(label))
                    inputs = [torch.randint(-64, 64, (n,), generator=g).to(dtype) for _ in range(ws)]
                t = inputs[rank].clone()
                problems = ran(pycomm.all_reduce(t, red_op(op), algorithm="tree", async_op=True), n)
                exp = reduce_exact(inputs, dtype, op, ws)
                return problems + (check_avg(t, exp) if op == "AVG" else check_equal(t, exp))
            _case(problems, label, body)
    for codec in [None, "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]:
        for dtype in FLOATING:
            label = "recursive doubling %s %s random floats" % (codec, dtype)

            def body():
                inputs = [random_float(seed_of(label), r, 2500, dtype, "SUM") for r in range(ws)]
                t = inputs[rank].clone()
                work = pycomm.all_reduce(t, algorithm="tree", compression=codec, async_op=True)
                problems = ran(work, t.numel())
                everyone = [torch.empty_like(t) for _ in range(ws)]
                dist.all_gather(everyone, t, group=side)
                if not all(torch.equal(everyone[0], e) for e in everyone):
                    problems.append("ranks differ")
                # The one-shot's sum of the same quantized contributions, in rank order.
                exp = inputs[rank].clone()
                pycomm.all_reduce(exp, algorithm="oneshot", compression=codec)
                if work.algorithm == "recursive-doubling" and \
                        not torch.allclose(t.double(), exp.double(), rtol=1e-2, atol=1e-2):
                    problems.append("far from the one-shot's result")
                return problems
            _case(problems, label, body)
    if ws == 5 and not several_frames[0]:
        problems.append("no recursive doubling of several frames ran")
    return problems


@pytest.mark.parametrize("world", [pytest.param(w, marks=world_marks(w[0])) for w in RECURSIVE_DOUBLING_WORLDS],
                         ids=_world_id)
def test_recursive_doubling_at_any_world_size(world, tmp_path):
    ws, env = world
    costs = tmp_path / "costs"
    costs.write_text("intra 1000 1000000\ninter 1000 1000000\n")
    _no_problems(recursive_doubling_world, ws, dict(env, PYCOMM_LINK_COSTS=str(costs)))


def _ran(work, variant):
    work.wait()
    return [] if work.algorithm == variant else ["ran as %s, not %s" % (work.algorithm, variant)]


def _exact_shard_cases(problems, rank, ws, algorithm, variants, counts):
    """Reduce-scatter and all-gather with ``algorithm`` of small integers (exact in every
    dtype, against int64/float64), for ``counts`` elements per rank; Work.algorithm must
    name ``variants`` (the reduce-scatter's, the all-gather's)."""
    import pycomm

    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for op in ("SUM", "MAX", "AVG") if dtype != torch.int64 else ("SUM", "MIN"):
            for n in counts:
                label = "%s %s %s n=%d" % (algorithm, dtype, op, n)

                def shard(r, j):
                    g = torch.Generator().manual_seed(seed_of("%s rank %d shard %d" % (label, r, j)))
                    return torch.randint(-64, 64, (n,), generator=g).to(dtype)

                def body():
                    mine, shards = _shard_inputs(shard, rank, ws)
                    out = torch.zeros(n, dtype=dtype)
                    found = _ran(pycomm.reduce_scatter_tensor(out, mine, red_op(op), algorithm=algorithm,
                                                              async_op=True), variants[0])
                    exp = reduce_exact(shards, dtype, op, ws)
                    found += check_avg(out, exp) if op == "AVG" else check_equal(out, exp)
                    gathered = torch.zeros(ws * n, dtype=dtype)
                    found += _ran(pycomm.all_gather_into_tensor(gathered, mine[:n], algorithm=algorithm,
                                                                async_op=True), variants[1])
                    return found + check_equal(gathered, torch.cat([shard(r, 0) for r in range(ws)]))
                _case(problems, label, body)


# Hierarchical reduce-scatter and all-gather on nodes of several ranks (2 x 3, 3 x 2 with
# TCP between, 3 x 3), uneven lengths, and 4 KiB frames where 20000 elements run in several
# slices (the inter-node phase on its helper thread): exact results, the variant that
# ran named by Work.algorithm; under a codec the all-gather's bits equal the ring's (each
# segment quantized once by its owner) and the reduce-scatter stays within the codec's
# error bound (node partials quantized once).
TWO_LEVEL_WORLDS = [(6, dict(SMALL_CHUNKS, PYCOMM_RANKS_PER_NODE="3")),
                    (6, dict(SMALL_CHUNKS, PYCOMM_RANKS_PER_NODE="2", PYCOMM_TRANSPORT="tcp")),
                    (9, {"PYCOMM_RANKS_PER_NODE": "3"})]
CODEC_ERROR = {"fp16": 1e-3, "bf16": 5e-3, "fp8_e4m3": 6e-2, "fp8_e5m2": 1.2e-1}


def two_level_world(rank, ws):
    import pycomm

    problems = []
    _exact_shard_cases(problems, rank, ws, "hierarchical", ("hierarchical", "hierarchical"),
                       (0, 1, 7, 1001, 20000))  # 20000: several slices at 4 KiB frames
    m = 20000  # several slices under every codec at 4 KiB frames
    for codec, bound in CODEC_ERROR.items():
        label = "two-level %s" % codec

        def body():
            mine, shards = _shard_inputs(
                lambda r, j: random_float(seed_of(label), r, m, torch.float32, "SUM", tag=j), rank, ws)
            ring, two_level = torch.zeros(ws * m), torch.zeros(ws * m)
            pycomm.all_gather_into_tensor(ring, mine[:m], algorithm="ring", compression=codec)
            found = _ran(pycomm.all_gather_into_tensor(two_level, mine[:m], algorithm="hierarchical",
                                                       compression=codec, async_op=True), "hierarchical")
            if not torch.equal(ring, two_level):
                found.append("all-gather: bits differ from the ring's")
            out = torch.zeros(m)
            found += _ran(pycomm.reduce_scatter_tensor(out, mine, algorithm="hierarchical", compression=codec,
                                                       async_op=True), "hierarchical")
            exact = torch.stack([x.double() for x in shards]).sum(0)
            error = ((out.double() - exact).norm() / exact.norm()).item()
            return found + (["reduce-scatter: error %.2e over %.0e" % (error, bound)] if error > bound else [])
        _case(problems, label, body)
    return problems


@pytest.mark.parametrize("world", [pytest.param(w, marks=world_marks(w[0])) for w in TWO_LEVEL_WORLDS],
                         ids=_world_id)
def test_two_level_reduce_scatter_and_all_gather(world):
    _no_problems(two_level_world, *world)


# The tree family's reduce-scatter (recursive halving) and all-gather (Bruck) at the world
# sizes test_every_algorithm does not reach, powers of two and not (a pair's first rank
# hands its input over and takes its segment back), with 4 KiB frames (several per step),
# on shared memory, TCP and 2-5 nodes of one host: exact results for integer-valued
# inputs, the variant named by Work.algorithm; random floats within n-1 float32 roundings
# of the float64 sum; in deterministic modes and under every codec, where contributions
# travel unsummed and each segment's owner folds them all, the same bits as the direct
# reduce-scatter (in deterministic modes as every reduce-scatter, and followed by the
# all-gather, as the all-reduce); under a codec the all-gather's bits equal the ring's.
# Where the world has several nodes, hierarchical reduce-scatter and all-gather too.
LOG_STEP_WORLDS = [(5, dict(SMALL_CHUNKS, PYCOMM_TRANSPORT="tcp", PYCOMM_RANKS_PER_NODE="1")),  # 5 nodes of 1
                   (6, dict(SMALL_CHUNKS, PYCOMM_RANKS_PER_NODE="3")),
                   (7, dict(SMALL_CHUNKS)),
                   (8, dict(SMALL_CHUNKS, PYCOMM_RANKS_PER_NODE="4")),
                   (9, {"PYCOMM_RANKS_PER_NODE": "3"})]


def log_step_world(rank, ws):
    import pycomm

    problems = []
    _exact_shard_cases(problems, rank, ws, "tree", ("recursive-halving", "bruck"),
                       (0, 1, 7, 1001, 3000))  # 3000 float32: several frames per step
    if int(os.environ.get("PYCOMM_RANKS_PER_NODE", ws)) < ws:  # several nodes
        _exact_shard_cases(problems, rank, ws, "hierarchical", ("hierarchical", "hierarchical"), (0, 7, 3000))
    m = 3001
    label = "log-step random floats"

    def body():
        mine, shards = _shard_inputs(
            lambda r, j: random_float(seed_of(label), r, m, torch.float32, "SUM", tag=j), rank, ws)
        out = torch.zeros(m)
        pycomm.reduce_scatter_tensor(out, mine, algorithm="tree")
        terms = torch.stack([x.double() for x in shards])
        # Each of the n-1 float32 additions rounds once: |error| <= (n-1) u sum |x|.
        bound = (ws - 1) * 2.0 ** -24 * terms.abs().sum(0)
        excess = ((out.double() - terms.sum(0)).abs() - bound).max().item()
        return ["error exceeds (n-1) u sum|x| by %.2e" % excess] if excess > 0 else []
    _case(problems, label, body)
    settings = [(None, d) for d in (True, "exact")] + [(c, d) for c in CODEC_ERROR for d in (False, True)]
    for codec, deterministic in settings:
        label = "log-step %s deterministic=%s" % (codec, deterministic)

        def body():
            mine = random_float(seed_of(label), rank, ws * m, torch.float32, "SUM")
            algos = ("tree", "oneshot") + (("ring", "hierarchical") if deterministic else ())
            outs = {}
            for algo in algos:
                outs[algo] = torch.zeros(m)
                pycomm.reduce_scatter_tensor(outs[algo], mine, algorithm=algo, compression=codec,
                                             deterministic=deterministic)
            found = ["reduce-scatter: %s's bits differ from tree's" % a for a in algos
                     if not torch.equal(outs[a], outs["tree"])]
            if deterministic and not codec:  # the contract: reduce-scatter + all-gather == all-reduce
                gathered, reduced = torch.zeros(ws * m), mine.clone()
                pycomm.all_gather_into_tensor(gathered, outs["tree"], algorithm="tree")
                pycomm.all_reduce(reduced, deterministic=deterministic)
                if not torch.equal(gathered, reduced):
                    found.append("reduce-scatter + all-gather: bits differ from the all-reduce's")
            if codec:
                gathered = {a: torch.zeros(ws * m) for a in ("tree", "ring")}
                for algo, t in gathered.items():
                    pycomm.all_gather_into_tensor(t, mine[:m], algorithm=algo, compression=codec)
                if not torch.equal(gathered["tree"], gathered["ring"]):
                    found.append("all-gather: bits differ from the ring's")
            return found
        _case(problems, label, body)
    return problems


@pytest.mark.parametrize("world", [pytest.param(w, marks=world_marks(w[0])) for w in LOG_STEP_WORLDS],
                         ids=_world_id)
def test_log_step_reduce_scatter_and_all_gather(world):
    _no_problems(log_step_world, *world)


def _choice_lines(calls):
    """Runs calls() and returns the INFO lines pycomm wrote to stderr about collectives."""
    _, text = capture_stderr(calls)
    return [line for line in text.splitlines() if "allreduce #" in line]


def info_log_world(rank, ws):
    """The stderr lines pycomm writes during three all-reduces at PYCOMM_DEBUG=INFO."""
    import pycomm

    t = torch.ones(1000)

    def calls():
        pycomm.all_reduce(t)
        pycomm.all_reduce(t, algorithm="tree")
        pycomm.all_reduce(t, algorithm="hierarchical")
    return _choice_lines(calls)


def test_info_log_names_each_choice_and_fallback():
    if is_gloo():
        pytest.skip("PYCOMM_DEBUG is a pycomm knob")
    logs = run_world(info_log_world, 2, env={"PYCOMM_DEBUG": "INFO"}, timeout=120)
    lines = logs[0]
    assert len(lines) == 3, lines
    assert "(float32, sum, 1000 elements, " in lines[0] and "): selected, 4000 B, " in lines[0], lines[0]
    assert "tree): requested, 4000 B, algorithm tree, " in lines[1], lines[1]
    assert "hierarchical cannot serve this call (hierarchical needs more than one node), using " in lines[2], lines[2]
    assert logs[1] == [], "one line per collective, from rank 0 only: %s" % logs[1]


def link_costs_world(rank, ws, nbytes):
    """The algorithm auto selects for an all-reduce of nbytes, from the INFO line."""
    import pycomm

    lines = _choice_lines(lambda: pycomm.all_reduce(torch.ones(nbytes // 4)))
    return lines[0].split("elements, ")[1].split(")")[0] if lines else None


def test_link_costs_file_is_written_then_read(tmp_path):
    """PYCOMM_LINK_COSTS: measured and written when missing, read (and obeyed) when present."""
    if is_gloo():
        pytest.skip("PYCOMM_LINK_COSTS is a pycomm knob")
    path = tmp_path / "costs"
    env = {"PYCOMM_LINK_COSTS": str(path), "PYCOMM_DEBUG": "INFO"}
    run_world(link_costs_world, 2, args=(4096,), env=env, timeout=120)
    written = path.read_text().split("\n")
    assert written[0].startswith("intra ") and len(written[0].split()) == 3, written
    # Costs that make every frame a millisecond: the fewest frames win (one chunk, 128 KiB).
    path.write_text("intra 1000 10000\ninter 1000 100\n")
    assert run_world(link_costs_world, 3, args=(1 << 17,), env=env, timeout=120)[0] == "oneshot"
    # Free frames, slow memory: the least traffic wins even for a small message.
    path.write_text("intra 0 10\ninter 1000 100\n")
    assert run_world(link_costs_world, 3, args=(4096,), env=env, timeout=120)[0] == "twoshot"


def test_malformed_link_costs_file_is_an_error(tmp_path):
    if is_gloo():
        pytest.skip("PYCOMM_LINK_COSTS is a pycomm knob")
    path = tmp_path / "costs"
    path.write_text("intra fast\n")
    with pytest.raises(AssertionError, match="malformed link costs"):
        run_world(link_costs_world, 2, args=(4096,), env={"PYCOMM_LINK_COSTS": str(path)}, timeout=120)


def _sockets():
    """TCP sockets (and the listener) this process holds."""
    fds = os.listdir("/proc/self/fd")
    count = 0
    for fd in fds:
        try:
            count += os.readlink("/proc/self/fd/" + fd).startswith("socket:")
        except OSError:  # the listing's own descriptor, gone
            pass
    return count


def _scale_values(rank, count, salt):
    return (torch.arange(count, dtype=torch.int64) * 13 + rank * 7 + salt) % 1000


def scale_world(rank, ws, count):
    import pycomm

    created = _sockets()
    dist.barrier()  # no rank connects on demand before every rank counted (the barrier uses eager peers)
    problems = []
    everyone = torch.stack([_scale_values(r, ws * count, 1) for r in range(ws)])
    total = everyone.sum(0)
    for algo in ALGORITHMS:
        def all_reduce():
            t = everyone[rank].clone()
            pycomm.all_reduce(t, algorithm=algo)
            return check_equal(t, total)

        def reduce_scatter():
            out = torch.zeros(count, dtype=torch.int64)
            pycomm.reduce_scatter_tensor(out, everyone[rank].clone(), algorithm=algo)
            return check_equal(out, total[rank * count:(rank + 1) * count])

        def all_gather():
            out = torch.zeros(ws * count, dtype=torch.int64)
            pycomm.all_gather_into_tensor(out, everyone[rank, :count].clone(), algorithm=algo)
            return check_equal(out, everyone[:, :count].reshape(-1))
        for body in (all_reduce, reduce_scatter, all_gather):
            _case(problems, "%s %s" % (body.__name__, algo), body)
    return problems, created, _sockets()


@pytest.mark.slow
@pytest.mark.large
@pytest.mark.parametrize("env", [{"PYCOMM_TRANSPORT": "tcp"}, {"PYCOMM_RANKS_PER_NODE": "8"}],
                         ids=["tcp", "4-nodes-of-8"])
def test_32_ranks(env):
    """32 ranks on this host: every algorithm exact. A rank connects at creation to its TCP
    peers at a power-of-two distance around the ring (at most 9 of 31: O(log n)) and to the
    others when an algorithm first needs them: the direct ones need every TCP peer."""
    if is_gloo():
        pytest.skip("algorithms are pycomm's")
    ws = 32
    count = 65537 if os.environ.get("PYCOMM_SOAK") == "1" else 37
    results = run_world(scale_world, ws, args=(count,), env=env, pg_timeout=120, timeout=500)
    problems = ["rank %d: %s" % (r, p) for r, (ps, _, _) in enumerate(results) for p in ps]
    assert not problems, "%d problems, first ones:\n%s" % (len(problems), "\n".join(problems[:20]))
    per_node = int(env.get("PYCOMM_RANKS_PER_NODE", ws))
    tcp_peers = ws - 1 if "PYCOMM_TRANSPORT" in env else ws - per_node
    eager = 9   # at most: distances 1, 2, 4, 8, 16 ahead and behind, 16 counted once
    listener = 1  # every rank with TCP peers listens: either rank of a pair may connect
    for rank, (_, created, used) in enumerate(results):
        assert created <= eager + listener, "rank %d holds %d sockets after creation" % (rank, created)
        assert used == tcp_peers + listener, "rank %d holds %d sockets, %d TCP peers" % (rank, used, tcp_peers)
