"""Collective correctness checks that run inside a rank (see test_collectives.py).

One world launch runs many "families" (one per collective). Each family runs on its own
fresh process group (all_reduce on the default group, so that one is exercised too), so a
group poisoned by a failure in one family cannot fail the others. Each case is one
collective call plus its checks; exceptions are recorded, not raised, and every case ends
with a barrier on a side gloo group, so that a one-sided failure (one rank raised, the others
waited until the group timeout) does not desynchronise the following cases.
"""

import datetime
import time
import warnings

import torch
import torch.distributed as dist

from _harness import WORLD, group_timeout, is_gloo
from _values import (COUNTS, DTYPES, FLOATING, PREMUL_FACTOR, SHAPES, check_avg,
                     check_close, check_equal, dname, int_valued, ops_for, payload,
                     random_float, red_op, reduce_exact, seed_of, tolerance_vs_gloo)

# Big sizes ("a few MiB"), restricted to a few dtypes to keep the suite fast on 2 cores.
BIG_ALL_REDUCE = 3 * 2 ** 20 + 5          # elements (12 MiB of float32)
BIG_PER_RANK = 2 ** 20 + 3                # elements per rank for gather/scatter families
BIG_PER_PEER = 2 ** 18 + 1                # elements per peer for all_to_all_single

_MAX_FAILURES_KEPT = 12

# Compact mode: one type per kind of arithmetic (fp32, 16-bit float, wide/narrow/unsigned
# integers, bool) and sizes that still cross chunk boundaries and world-size remainders.
COMPACT_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
COMPACT_COUNTS = [0, 7, 1001, 65537]


class SkipFamily(Exception):
    """The whole family does not apply (e.g. torch lacks the API)."""


def _short(exc):
    text = str(exc).strip().splitlines()
    return "%s: %s" % (type(exc).__name__, " | ".join(text[:4])[:400])


class Ctx:
    """Per-rank state of a checking session."""

    def __init__(self, rank, ws, side_timeout_s, compact=False):
        self.rank = rank
        self.ws = ws
        # compact: fewer dtypes and sizes, for reruns under other knobs (transport, ...)
        self.dtypes = COMPACT_DTYPES if compact else DTYPES
        self.floating = [d for d in self.dtypes if d in FLOATING]
        self.counts = COMPACT_COUNTS if compact else COUNTS
        # Side channel for lock-step barriers and reference results. Its timeout is longer
        # than the group under test's, so it outlives a one-sided hang there.
        self.gloo = dist.new_group(backend="gloo",
                                   timeout=datetime.timedelta(seconds=side_timeout_s))
        self.group = None
        self.report = {}
        self._cur = None

    def begin(self, family, group):
        self.group = group
        self._cur = self.report[family] = {"cases": 0, "failures": [], "more": 0,
                                           "skipped": None}

    def skip(self, reason):
        self._cur["skipped"] = reason

    def fail(self, msg):
        if len(self._cur["failures"]) < _MAX_FAILURES_KEPT:
            self._cur["failures"].append(msg)
        else:
            self._cur["more"] += 1

    def case(self, label, body):
        """Run one case (a collective plus checks) on every rank, in lock step."""
        self._cur["cases"] += 1
        t0 = time.monotonic()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # deprecated-name notices
                problems = body() or []
        except Exception as e:  # noqa: BLE001 - recorded and reported by the test
            problems = ["raised " + _short(e)]
        dist.barrier(group=self.gloo)
        # The slowest cases, to keep an eye on suite time (printed by the test on failure).
        slow = self._cur.setdefault("slowest", [])
        slow.append((round(time.monotonic() - t0, 3), label))
        slow.sort(reverse=True)
        del slow[5:]
        for p in problems:
            self.fail("%s: %s" % (label, p))

    def inputs(self, make, *args, **kw):
        """Every rank's input, regenerated locally: make(seed, rank, ...)."""
        return [make(*args[:1], r, *args[1:], **kw) for r in range(self.ws)]


# --------------------------------------------------------------------------------------
# reductions
# --------------------------------------------------------------------------------------

def _check_reduced(got, exp, op):
    return check_avg(got, exp) if op == "AVG" else check_equal(got, exp)


def _reduction_inputs(ctx, label, dtype, op, shape, exact):
    """Per-rank inputs: integer valued (exact expected) or random (compared with gloo)."""
    seed = seed_of(label)
    if exact or dtype not in FLOATING:
        return ctx.inputs(int_valued, seed, shape, dtype, op, ctx.ws)
    return ctx.inputs(random_float, seed, shape, dtype, op)


def _vs_gloo(ctx, op, dtype, inputs, run, select=lambda full: full, same_everywhere=False):
    """Run `run(group, op_name, my_input)` on the group under test and on gloo; compare.

    gloo has no PREMUL_SUM: its reference is SUM over inputs pre-multiplied by the factor
    (a power of two, so the pre-multiplication is exact). select(full) maps a full-size
    per-element tensor to the part this rank receives (for the tolerance).
    same_everywhere: the result must also be bit-identical on every rank (determinism
    level D0, promised in every mode), checked through the gloo side channel.
    """
    mine = run(ctx.group, op, inputs[ctx.rank].clone())
    if op == "PREMUL_SUM":
        ref = run(ctx.gloo, "SUM", inputs[ctx.rank] * PREMUL_FACTOR)
    else:
        ref = run(ctx.gloo, op, inputs[ctx.rank].clone())
    problems = []
    if same_everywhere:
        everyone = [torch.empty_like(mine) for _ in range(ctx.ws)]
        dist.all_gather(everyone, mine, group=ctx.gloo)
        differ = [r for r in range(ctx.ws) if not torch.equal(everyone[r], everyone[0])]
        if differ:
            problems.append("result bits differ between rank 0 and ranks %s" % differ)
    if dtype not in FLOATING:
        return problems + check_equal(mine, ref)  # integer types: bit for bit
    tol = tolerance_vs_gloo(dtype, op, ctx.ws, [select(t) for t in inputs], ref)
    return problems + check_close(mine, ref, tol)


def _ar_run(group, op, t):
    dist.all_reduce(t, op=red_op(op), group=group)
    return t


def fam_all_reduce(ctx):
    ws = ctx.ws
    for dtype in ctx.dtypes:
        for op in ops_for(dtype):
            for n in ctx.counts:
                label = "exact %s %s n=%d" % (dname(dtype), op, n)

                def body():
                    inputs = _reduction_inputs(ctx, label, dtype, op, SHAPES.get(n, n), True)
                    out = _ar_run(ctx.group, op, inputs[ctx.rank].clone())
                    return _check_reduced(out, reduce_exact(inputs, dtype, op, ws), op)
                ctx.case(label, body)
    # Several MiB: a few dtypes only (time on 2 cores).
    for dtype, op in [(torch.float32, "SUM"), (torch.float32, "MAX"),
                      (torch.bfloat16, "SUM"), (torch.int64, "SUM")]:
        label = "exact big %s %s n=%d" % (dname(dtype), op, BIG_ALL_REDUCE)

        def body():
            inputs = _reduction_inputs(ctx, label, dtype, op, BIG_ALL_REDUCE, True)
            out = _ar_run(ctx.group, op, inputs[ctx.rank].clone())
            return check_equal(out, reduce_exact(inputs, dtype, op, ws))
        ctx.case(label, body)
    # Same random inputs through gloo: catches rounding/ordering bugs that integer-valued
    # inputs cannot see (e.g. accumulating 16-bit types in 16 bits).
    for dtype in ctx.dtypes:
        for op in ops_for(dtype):
            for n in (1001, 65537):
                label = "vs-gloo %s %s n=%d" % (dname(dtype), op, n)
                ctx.case(label, lambda: _vs_gloo(
                    ctx, op, dtype, _reduction_inputs(ctx, label, dtype, op, n, False),
                    _ar_run, same_everywhere=True))
    for dtype, op in [(torch.float32, "SUM"), (torch.bfloat16, "SUM")]:
        label = "vs-gloo big %s %s n=%d" % (dname(dtype), op, BIG_ALL_REDUCE)
        ctx.case(label, lambda: _vs_gloo(
            ctx, op, dtype, _reduction_inputs(ctx, label, dtype, op, BIG_ALL_REDUCE, False),
            _ar_run))


def fam_all_reduce_coalesced(ctx):
    if not hasattr(dist, "all_reduce_coalesced"):
        raise SkipFamily("torch.distributed.all_reduce_coalesced is not available")
    shapes = [7, 1001, (3, 5), 1]
    for dtype in ctx.dtypes:
        for op in ops_for(dtype):
            label = "%s %s shapes=%s" % (dname(dtype), op, shapes)

            def body():
                seed = seed_of(label)
                per_tensor = [ctx.inputs(int_valued, seed, s, dtype, op, ctx.ws, tag=i)
                              for i, s in enumerate(shapes)]
                mine = [inputs[ctx.rank].clone() for inputs in per_tensor]
                dist.all_reduce_coalesced(mine, op=red_op(op), group=ctx.group)
                problems = []
                for i, inputs in enumerate(per_tensor):
                    exp = reduce_exact(inputs, dtype, op, ctx.ws)
                    problems += ["tensor %d: %s" % (i, p)
                                 for p in _check_reduced(mine[i], exp, op)]
                return problems
            ctx.case(label, body)


def fam_reduce(ctx):
    ws = ctx.ws
    for root in range(ws):
        for dtype in ctx.dtypes:
            for op in ops_for(dtype):
                for n in (0, 1, 1001):
                    label = "root=%d %s %s n=%d" % (root, dname(dtype), op, n)

                    def body():
                        inputs = _reduction_inputs(ctx, label, dtype, op,
                                                   SHAPES.get(n, n), True)
                        t = inputs[ctx.rank].clone()
                        dist.reduce(t, dst=root, op=red_op(op), group=ctx.group)
                        if ctx.rank != root:
                            return []  # non-root contents are unspecified
                        return _check_reduced(t, reduce_exact(inputs, dtype, op, ws), op)
                    ctx.case(label, body)
        for dtype in ctx.floating:
            label = "vs-gloo root=%d %s SUM n=1001" % (root, dname(dtype))

            def run(group, op, t, root=root):
                dist.reduce(t, dst=root, op=red_op(op), group=group)
                return t if ctx.rank == root else torch.zeros(0, dtype=t.dtype)

            def body():
                inputs = _reduction_inputs(ctx, label, dtype, "SUM", 1001, False)
                if ctx.rank == root:
                    return _vs_gloo(ctx, "SUM", dtype, inputs, run)
                run(ctx.group, "SUM", inputs[ctx.rank].clone())
                run(ctx.gloo, "SUM", inputs[ctx.rank].clone())
                return []
            ctx.case(label, body)


def _rs_chunk(t, rank, ws):
    n = t.shape[0] // ws
    return t[rank * n:(rank + 1) * n]


def _reduced_chunk(inputs, dtype, op, rank, ws):
    """Chunk ``rank`` of the exact reduction (a reduce-scatter's output on ``rank``), from
    that chunk of every input alone: reductions are elementwise."""
    return reduce_exact([_rs_chunk(t, rank, ws) for t in inputs], dtype, op, ws)


def fam_reduce_scatter_tensor(ctx):
    ws, rank = ctx.ws, ctx.rank
    variants = ["out-of-place", "in-place"] + ([] if is_gloo() else ["stacked"])

    def run_variant(fn, variant, group, op, inp):
        """inp: this rank's full input, concatenated along dim 0 (ws * n rows)."""
        if variant == "in-place":  # output aliases this rank's chunk of the input
            out = _rs_chunk(inp, rank, ws)
        else:
            out = torch.empty_like(_rs_chunk(inp, rank, ws))
        if variant == "stacked":  # input shaped (ws, n, ...)
            inp = inp.reshape((ws, inp.shape[0] // ws) + tuple(inp.shape[1:]))
        fn(out, inp, op=red_op(op), group=group)
        return out.clone()

    for dtype in ctx.dtypes:
        for op in ops_for(dtype):
            for n in ctx.counts:
                for variant in variants:
                    label = "%s %s n=%d %s" % (dname(dtype), op, n, variant)
                    # concatenation of ws outputs of shape SHAPES.get(n, (n,)) along dim 0
                    rows = SHAPES[n] if n in SHAPES else (n,)
                    shape = (ws * rows[0],) + tuple(rows[1:])

                    def body():
                        inputs = _reduction_inputs(ctx, label, dtype, op, shape, True)
                        out = run_variant(dist.reduce_scatter_tensor, variant, ctx.group, op,
                                          inputs[rank].clone())
                        exp = _reduced_chunk(inputs, dtype, op, rank, ws)
                        return _check_reduced(out, exp, op)
                    ctx.case(label, body)
    if hasattr(dist, "reduce_scatter_single"):  # torch's newer name for the same op
        label = "reduce_scatter_single float32 SUM n=7"

        def body():
            inputs = _reduction_inputs(ctx, label, torch.float32, "SUM", 7 * ws, True)
            out = run_variant(dist.reduce_scatter_single, "out-of-place", ctx.group, "SUM",
                              inputs[rank].clone())
            return check_equal(out, _reduced_chunk(inputs, torch.float32, "SUM", rank, ws))
        ctx.case(label, body)
    big = BIG_PER_RANK * ws
    label = "big float32 SUM n=%d per rank" % BIG_PER_RANK

    def body():
        inputs = _reduction_inputs(ctx, label, torch.float32, "SUM", big, True)
        out = run_variant(dist.reduce_scatter_tensor, "out-of-place", ctx.group, "SUM",
                          inputs[rank].clone())
        return check_equal(out, _reduced_chunk(inputs, torch.float32, "SUM", rank, ws))
    ctx.case(label, body)
    select = lambda full: _rs_chunk(full, rank, ws)  # noqa: E731
    for dtype in ctx.dtypes:
        for op in ops_for(dtype):
            # several MiB for float32 SUM only (time on 2 cores)
            big = dtype == torch.float32 and op == "SUM"
            for n in (1001, BIG_PER_RANK if big else 65537):
                label = "vs-gloo %s %s n=%d" % (dname(dtype), op, n)
                ctx.case(label, lambda: _vs_gloo(
                    ctx, op, dtype, _reduction_inputs(ctx, label, dtype, op, ws * n, False),
                    lambda g, o, t: run_variant(dist.reduce_scatter_tensor, "out-of-place",
                                                g, o, t), select))


def fam_reduce_scatter(ctx):
    ws, rank = ctx.ws, ctx.rank

    def run(group, op, inp):
        out = torch.empty_like(_rs_chunk(inp, rank, ws))
        dist.reduce_scatter(out, list(inp.chunk(ws)) if inp.numel() else
                            [inp[:0] for _ in range(ws)], op=red_op(op), group=group)
        return out

    for dtype in ctx.dtypes:
        for op in ops_for(dtype):
            for n in ctx.counts:
                label = "%s %s n=%d" % (dname(dtype), op, n)

                def body():
                    inputs = _reduction_inputs(ctx, label, dtype, op, ws * n, True)
                    out = run(ctx.group, op, inputs[rank].clone())
                    exp = _reduced_chunk(inputs, dtype, op, rank, ws)
                    return _check_reduced(out, exp, op)
                ctx.case(label, body)
    for dtype in ctx.floating:
        for op in ops_for(dtype):
            label = "vs-gloo %s %s n=1001" % (dname(dtype), op)
            ctx.case(label, lambda: _vs_gloo(
                ctx, op, dtype, _reduction_inputs(ctx, label, dtype, op, ws * 1001, False),
                run, lambda full: _rs_chunk(full, rank, ws)))


def fam_coalesced_reduce_scatter_tensor(ctx):
    ws, rank = ctx.ws, ctx.rank
    for dtype in ctx.dtypes:
        label = "%s SUM n=7,1001" % dname(dtype)

        def body():
            seed = seed_of(label)
            per = [ctx.inputs(int_valued, seed, ws * n, dtype, "SUM", ws, tag=n)
                   for n in (7, 1001)]
            outs = [torch.empty(n, dtype=dtype) for n in (7, 1001)]
            with dist._coalescing_manager(group=ctx.group, async_ops=False):
                for out, inputs in zip(outs, per):
                    dist.reduce_scatter_tensor(out, inputs[rank].clone(), group=ctx.group)
            problems = []
            for i, (out, inputs) in enumerate(zip(outs, per)):
                exp = _reduced_chunk(inputs, dtype, "SUM", rank, ws)
                problems += ["tensor %d: %s" % (i, p) for p in check_equal(out, exp)]
            return problems
        ctx.case(label, body)


# --------------------------------------------------------------------------------------
# data movement
# --------------------------------------------------------------------------------------

def _shape(n):
    return SHAPES.get(n, (n,))


def fam_broadcast(ctx):
    for root in range(ctx.ws):
        for dtype in ctx.dtypes:
            for n in ctx.counts + ([3 * 2 ** 20 + 5] if dtype == torch.float32 else []):
                label = "root=%d %s n=%d" % (root, dname(dtype), n)

                def body():
                    exp = payload(seed_of(label), root, _shape(n), dtype)
                    t = exp.clone() if ctx.rank == root else torch.zeros_like(exp)
                    dist.broadcast(t, src=root, group=ctx.group)
                    return check_equal(t, exp)
                ctx.case(label, body)


def fam_all_gather(ctx):
    ws, rank = ctx.ws, ctx.rank
    for dtype in ctx.dtypes:
        for n in ctx.counts:
            for variant in ("out-of-place", "in-place"):
                label = "%s n=%d %s" % (dname(dtype), n, variant)

                def body():
                    inputs = ctx.inputs(payload, seed_of(label), _shape(n), dtype)
                    outs = [torch.zeros_like(t) for t in inputs]
                    inp = inputs[rank].clone()
                    if variant == "in-place":  # this rank's output slot is the input
                        outs[rank] = inp
                    dist.all_gather(outs, inp, group=ctx.group)
                    problems = []
                    for r in range(ws):
                        problems += ["from rank %d: %s" % (r, p)
                                     for p in check_equal(outs[r], inputs[r])]
                    return problems
                ctx.case(label, body)


def fam_all_gather_into_tensor(ctx):
    ws, rank = ctx.ws, ctx.rank
    variants = ["out-of-place", "in-place"] + ([] if is_gloo() else ["stacked"])

    def run(fn, variant, inp):
        if variant == "stacked":
            out = torch.zeros((ws,) + tuple(inp.shape), dtype=inp.dtype)
        else:
            out = torch.zeros((ws * inp.shape[0],) + tuple(inp.shape[1:]), dtype=inp.dtype)
        if variant == "in-place":  # input is a view of this rank's slice of the output
            rows = inp.shape[0]
            out[rank * rows:(rank + 1) * rows] = inp
            inp = out[rank * rows:(rank + 1) * rows]
        fn(out, inp, group=ctx.group)
        return out.reshape((-1,) + tuple(out.shape[2:])) if variant == "stacked" else out

    cases = [(dtype, n, v) for dtype in ctx.dtypes for n in ctx.counts for v in variants]
    cases.append((torch.float32, BIG_PER_RANK, "out-of-place"))
    for dtype, n, variant in cases:
        label = "%s n=%d %s" % (dname(dtype), n, variant)

        def body():
            inputs = ctx.inputs(payload, seed_of(label), _shape(n), dtype)
            out = run(dist.all_gather_into_tensor, variant, inputs[rank].clone())
            return check_equal(out, torch.cat(inputs))
        ctx.case(label, body)
    if hasattr(dist, "all_gather_single"):
        label = "all_gather_single float32 n=7"

        def body():
            inputs = ctx.inputs(payload, seed_of(label), 7, torch.float32)
            out = run(dist.all_gather_single, "out-of-place", inputs[rank].clone())
            return check_equal(out, torch.cat(inputs))
        ctx.case(label, body)


def fam_coalesced_all_gather_into_tensor(ctx):
    ws, rank = ctx.ws, ctx.rank
    for dtype in ctx.dtypes:
        label = "%s n=7,1001" % dname(dtype)

        def body():
            per = [ctx.inputs(payload, seed_of(label), n, dtype, tag=n) for n in (7, 1001)]
            outs = [torch.zeros(ws * n, dtype=dtype) for n in (7, 1001)]
            with dist._coalescing_manager(group=ctx.group, async_ops=False):
                for out, inputs in zip(outs, per):
                    dist.all_gather_into_tensor(out, inputs[rank].clone(), group=ctx.group)
            problems = []
            for i, (out, inputs) in enumerate(zip(outs, per)):
                problems += ["tensor %d: %s" % (i, p) for p in check_equal(out, torch.cat(inputs))]
            return problems
        ctx.case(label, body)


def _uneven_splits(ws, k):
    """split[src][dst] elements sent from src to dst; includes zeros and asymmetry."""
    return [[((src * 3 + dst * 5) % 4) * k + (1 if src == dst else 0) for dst in range(ws)]
            for src in range(ws)]


def fam_all_to_all_single(ctx):
    ws, rank = ctx.ws, ctx.rank
    cases = [(dtype, n, "equal") for dtype in ctx.dtypes for n in (0, 1, 7, 1001)]
    cases += [(dtype, k, "uneven") for dtype in ctx.dtypes for k in (1, 37)]
    cases += [(torch.float32, 7, "equal-2d"), (torch.float32, BIG_PER_PEER, "equal")]
    for dtype, n, kind in cases:
        label = "%s n=%d %s" % (dname(dtype), n, kind)

        def body():
            if kind == "uneven":
                split = _uneven_splits(ws, n)
            else:
                split = [[n] * ws for _ in range(ws)]
            trailing = (3,) if kind == "equal-2d" else ()
            inputs = [payload(seed_of(label), r, (sum(split[r]),) + trailing, dtype)
                      for r in range(ws)]
            # chunk src sends to dst: rows [sum(split[src][:dst]), +split[src][dst])
            def chunk(src, dst):
                start = sum(split[src][:dst])
                return inputs[src][start:start + split[src][dst]]
            exp = torch.cat([chunk(src, rank) for src in range(ws)])
            out = torch.zeros_like(exp)
            if kind == "uneven":
                dist.all_to_all_single(out, inputs[rank].clone(),
                                       output_split_sizes=[split[s][rank] for s in range(ws)],
                                       input_split_sizes=split[rank], group=ctx.group)
            else:
                dist.all_to_all_single(out, inputs[rank].clone(), group=ctx.group)
            return check_equal(out, exp)
        ctx.case(label, body)


def fam_all_to_all(ctx):
    ws, rank = ctx.ws, ctx.rank
    cases = [(dtype, n, "equal") for dtype in ctx.dtypes for n in (0, 1, 7, 1001)]
    if not is_gloo():  # gloo's list all_to_all requires equal sizes; torch does not
        cases += [(dtype, 5, "uneven") for dtype in ctx.dtypes]
    for dtype, n, kind in cases:
        label = "%s n=%d %s" % (dname(dtype), n, kind)

        def body():
            split = _uneven_splits(ws, n) if kind == "uneven" else [[n] * ws] * ws
            seed = seed_of(label)
            # message src -> dst is payload(seed, src, ..., tag=dst)
            send = [payload(seed, rank, split[rank][dst], dtype, tag=dst) for dst in range(ws)]
            exp = [payload(seed, src, split[src][rank], dtype, tag=rank) for src in range(ws)]
            out = [torch.zeros_like(t) for t in exp]
            dist.all_to_all(out, send, group=ctx.group)
            problems = []
            for src in range(ws):
                problems += ["from rank %d: %s" % (src, p) for p in check_equal(out[src], exp[src])]
            return problems
        ctx.case(label, body)


def fam_gather(ctx):
    ws, rank = ctx.ws, ctx.rank
    for root in range(ws):
        for dtype in ctx.dtypes:
            for n in (0, 1, 7, 1001):
                label = "root=%d %s n=%d" % (root, dname(dtype), n)

                def body():
                    inputs = ctx.inputs(payload, seed_of(label), _shape(n), dtype)
                    outs = [torch.zeros_like(t) for t in inputs] if rank == root else None
                    dist.gather(inputs[rank].clone(), gather_list=outs, dst=root,
                                group=ctx.group)
                    if rank != root:
                        return []
                    problems = []
                    for r in range(ws):
                        problems += ["from rank %d: %s" % (r, p)
                                     for p in check_equal(outs[r], inputs[r])]
                    return problems
                ctx.case(label, body)


def fam_scatter(ctx):
    ws, rank = ctx.ws, ctx.rank
    for root in range(ws):
        for dtype in ctx.dtypes:
            for n in (0, 1, 7, 1001):
                label = "root=%d %s n=%d" % (root, dname(dtype), n)

                def body():
                    # chunk for rank r: payload(seed, root, tag=r)
                    chunks = [payload(seed_of(label), root, _shape(n), dtype, tag=r)
                              for r in range(ws)]
                    out = torch.zeros_like(chunks[rank])
                    dist.scatter(out, scatter_list=[c.clone() for c in chunks]
                                 if rank == root else None, src=root, group=ctx.group)
                    return check_equal(out, chunks[rank])
                ctx.case(label, body)


# --------------------------------------------------------------------------------------
# point to point and barrier
# --------------------------------------------------------------------------------------

def _group_peer(ctx, r):
    """Global rank of group rank r (the groups here span all ranks, but be explicit)."""
    return dist.get_global_rank(ctx.group, r) if ctx.group is not dist.group.WORLD else r


def fam_send_recv(ctx):
    ws, rank = ctx.ws, ctx.rank
    if ws == 1:
        raise SkipFamily("no peers at world size 1")
    pairs = [(s, d) for s in range(ws) for d in range(ws) if s != d]
    cases = [(dtype, n) for dtype in ctx.dtypes for n in (0, 1, 1001)]
    cases.append((torch.float32, BIG_PER_RANK))
    for src, dst in pairs:
        for dtype, n in cases:
            label = "%d->%d %s n=%d" % (src, dst, dname(dtype), n)

            def body():
                exp = payload(seed_of(label), src, _shape(n), dtype)
                if rank == src:
                    dist.send(exp.clone(), dst=_group_peer(ctx, dst), group=ctx.group)
                elif rank == dst:
                    t = torch.zeros_like(exp)
                    dist.recv(t, src=_group_peer(ctx, src), group=ctx.group)
                    return check_equal(t, exp)
                return []
            ctx.case(label, body)


def fam_isend_irecv(ctx):
    """All ranks exchange with all others at once, several messages per pair (FIFO order
    per pair is part of the contract), with receives posted before or after the sends."""
    ws, rank = ctx.ws, ctx.rank
    if ws == 1:
        raise SkipFamily("no peers at world size 1")
    msgs = 3
    for dtype in ctx.dtypes:
        for n in (1, 1001):
            for order in ("recv-first", "send-first"):
                label = "%s n=%d %s" % (dname(dtype), n, order)

                def body():
                    seed = seed_of(label)
                    peers = [p for p in range(ws) if p != rank]
                    # message m from src to dst: payload(seed, src, tag=dst*msgs+m)
                    sends = [(p, m, payload(seed, rank, n, dtype, tag=p * msgs + m))
                             for p in peers for m in range(msgs)]
                    recvs = [(p, m, torch.zeros(n, dtype=dtype)) for p in peers
                             for m in range(msgs)]

                    def post_sends():
                        return [dist.isend(t, dst=_group_peer(ctx, p), group=ctx.group)
                                for p, m, t in sends]

                    def post_recvs():
                        return [dist.irecv(t, src=_group_peer(ctx, p), group=ctx.group)
                                for p, m, t in recvs]
                    if order == "recv-first":
                        works = post_recvs() + post_sends()
                    else:
                        works = post_sends() + post_recvs()
                    for w in works:
                        w.wait()
                    problems = []
                    for p, m, t in recvs:
                        exp = payload(seed, p, n, dtype, tag=rank * msgs + m)
                        problems += ["from %d msg %d: %s" % (p, m, e)
                                     for e in check_equal(t, exp)]
                    return problems
                ctx.case(label, body)
    for dtype in ctx.dtypes:
        label = "batch_isend_irecv %s n=7" % dname(dtype)

        def body():
            seed = seed_of(label)
            ops, recvs = [], []
            for p in range(ws):
                if p == rank:
                    continue
                t = torch.zeros(7, dtype=dtype)
                recvs.append((p, t))
                ops.append(dist.P2POp(dist.isend, payload(seed, rank, 7, dtype, tag=p),
                                      _group_peer(ctx, p), ctx.group))
                ops.append(dist.P2POp(dist.irecv, t, _group_peer(ctx, p), ctx.group))
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            problems = []
            for p, t in recvs:
                problems += ["from %d: %s" % (p, e)
                             for e in check_equal(t, payload(seed, p, 7, dtype, tag=rank))]
            return problems
        ctx.case(label, body)


def fam_barrier(ctx):
    """A barrier releases nobody before everybody arrived: ranks arrive staggered, and
    every exit time (wall clock, same host) must be >= the last arrival time."""
    ws, rank = ctx.ws, ctx.rank
    for it in range(3):
        label = "staggered iteration %d" % it

        def body():
            time.sleep(0.05 * ((rank + it) % ws))
            t_in = time.time()
            dist.barrier(group=ctx.group)
            t_out = time.time()
            times = [None] * ws
            dist.all_gather_object(times, (t_in, t_out), group=ctx.gloo)
            last_in = max(t for t, _ in times)
            early = [r for r, (_, o) in enumerate(times) if o < last_in]
            if early:
                return ["ranks %s left the barrier before the last one arrived" % early]
            return []
        ctx.case(label, body)

    def back_to_back():
        for _ in range(20):
            dist.barrier(group=ctx.group)
    ctx.case("20 back-to-back barriers", back_to_back)


FAMILIES = {
    "all_reduce": fam_all_reduce,
    "all_reduce_coalesced": fam_all_reduce_coalesced,
    "reduce": fam_reduce,
    "broadcast": fam_broadcast,
    "all_gather": fam_all_gather,
    "all_gather_into_tensor": fam_all_gather_into_tensor,
    "coalesced_all_gather_into_tensor": fam_coalesced_all_gather_into_tensor,
    "reduce_scatter": fam_reduce_scatter,
    "reduce_scatter_tensor": fam_reduce_scatter_tensor,
    "coalesced_reduce_scatter_tensor": fam_coalesced_reduce_scatter_tensor,
    "all_to_all_single": fam_all_to_all_single,
    "all_to_all": fam_all_to_all,
    "gather": fam_gather,
    "scatter": fam_scatter,
    "send_recv": fam_send_recv,
    "isend_irecv": fam_isend_irecv,
    "barrier": fam_barrier,
}


def run_families(rank, ws, names, side_timeout_s, compact=False):
    """Entry point inside a rank: run the named families, return the per-family report."""
    ctx = Ctx(rank, ws, side_timeout_s, compact)
    for name in names:
        # A fresh group per family isolates failures; all_reduce uses the default group.
        group = (dist.group.WORLD if name == "all_reduce"
                 else dist.new_group(timeout=group_timeout()))
        # Guard against testing the wrong thing: the group must run the backend under test.
        assert dist.get_backend(group) == WORLD["backend"], dist.get_backend(group)
        ctx.begin(name, group)
        t0 = time.monotonic()
        try:
            FAMILIES[name](ctx)
        except SkipFamily as s:
            ctx.skip(str(s))
        if group is not dist.group.WORLD:
            try:
                dist.destroy_process_group(group)
            except Exception as e:  # noqa: BLE001
                ctx.fail("destroy_process_group(subgroup) raised " + _short(e))
        dist.barrier(group=ctx.gloo)
        ctx.report[name]["seconds"] = round(time.monotonic() - t0, 2)
    return ctx.report


def report_failures(reports, families):
    """Failure lines of the named families over all ranks' reports (for assertions)."""
    lines = []
    for family in families:
        for rank, rep in enumerate(reports):
            fam = rep[family]
            lines += ["[%s] rank %d: %s" % (family, rank, f) for f in fam["failures"]]
            if fam["more"]:
                lines.append("[%s] rank %d: ... and %d more failures"
                             % (family, rank, fam["more"]))
    return lines
