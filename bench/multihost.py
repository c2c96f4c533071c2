"""All-reduce (or reduce-scatter, all-gather) across a slow link between simulated hosts:
hierarchical against flat ring, compressed against uncompressed, pycomm against gloo,
pycomm's layered path over gloo.

    .venv/bin/python bench/multihost.py [--rate 1gbit] [--size 64M] [--repeats 5] [--groups 10] [--json out.json]
        [--algorithms ring,hierarchical,auto,auto+fp16,auto+fp8_e4m3,gloo,layered,layered+fp8_e4m3,
                      layered-direct+fp8_e4m3,layered-hierarchical+fp8_e4m3]

Builds 2 network namespaces ("hosts") x 2 ranks on one bridge (pycomm/bench/netns.py; root
only), every host's link limited to --rate by tc tbf on the host side of its veth (its
egress, so both directions of the link between the two hosts), and runs one torchrun job
across them. Each rank times float32 SUM all-reduce of --size bytes through
pycomm.all_reduce(t, algorithm=A, compression=C) for every variant A[+C] of --algorithms
(or dist.all_reduce on a gloo group for "gloo", and pycomm.all_reduce(t, group=<that gloo
group>, compression=C) for "layered[+C]": pycomm's layered path with gloo moving the
bytes, pycomm/layered/, its algorithm the plan's choice, or named: "layered-direct",
"layered-hierarchical"): one warm-up call each,
then --repeats rounds, the algorithms interleaved within each round, a barrier on a gloo
group before every timed call. A call's time is the slowest rank's; the median over the
rounds is reported with nccl-tests' algbw = S/t and busbw = S/t * 2(n-1)/n, and the ratio
of hierarchical's busbw to ring's, and every variant's busbw over auto's and gloo's. Every
result is checked (#wrong: the inputs are small integers, exact under every codec up to 8
ranks), and each variant's relative RMS error against fp64 is measured on Gaussian data in
the same job.

Wire model, S bytes, n ranks on N hosts of L = n/N: the flat ring in rank order crosses
each host boundary once per direction and sends 2(n-1)/n S over each link, so each host's
egress carries 2(n-1)/n S; hierarchical reduces within the host first and then each of the
host's L ranks all-reduces an S/L shard with its peers on the other hosts, sending
2(N-1)/N S/L, i.e. 2(N-1)/N S per host egress. When the link is the bottleneck,
hierarchical/ring <= (n-1)/n / ((N-1)/N): 1.5 for 2 x 2, 1.67 for 2 x 3, 1.75 for 2 x 4,
tending to 2 as L grows; reaching it needs the intra-host phases hidden behind the transfer.

The layered path's direct algorithm over the mover: an all_to_all_single in which every
rank sends S/n to every other rank, so each host's egress carries L (n-L) S/n =
L (N-1)/N S, then gloo's all-gather of the n results of S/n, a ring that carries (n-1)/n S
over each host's link. On 2 x 2 that is S + 3/4 S = 1.75 S per host egress, against 1.5 S
for gloo's ring all-reduce; under a codec about 3.9x less (fp8_e4m3: one byte per element
and a 4-byte scale per block), 0.45 S. Its hierarchical algorithm moves the shards within
the host uncompressed and only 2 (N-1)/N S per host egress (a quarter of that under fp8)
across the link. A large call runs in pipelined parts (encode, all-to-all, fold,
all-gather, decode of one part while the mover carries another), as many as the plan's
cost model says. For every layered variant the report splits each
rank's time per call into those steps (``phases_ms``: the mover's collectives, waiting
for the slowest peer included, and pycomm's encode, fold and decode), timed by wrapping
the layered path's step functions (``Call.move``, ``pairwise``, ``wait``, ``fold``) in the
ranks.

``--collective reduce_scatter`` or ``all_gather`` times that collective instead (--size
its whole buffer: the reduce-scatter's input, the all-gather's output; busbw S/t (n-1)/n):
a flat ring sends (n-1)/n S over each host's link, hierarchical (N-1)/N S, so the same
bound holds for hierarchical/ring. Gloo runs torch's reduce_scatter_tensor and
all_gather_into_tensor on its group.

``--collective fsdp2`` times FSDP2 training steps instead: every variant (a pycomm
algorithm forced for the whole group through PYCOMM_ALGO at the group's creation, or
"gloo") trains its own copy of bench/_training.py's MLP (10.5 M float32 parameters, one
fully_shard per Linear and one for the model, SGD) on the same batches of --batch samples,
the variants' steps interleaved; each step all-gathers the parameters (forward and
backward) and reduce-scatters the gradients. Reported: the median step time, every
variant's over auto's (and gloo's, when it ran), and the ring's over each (the step-time
ratio); a step is wrong when its loss is not finite or differs from the first variant's by
more than 1e-4 relative (the variants add the same gradients in other orders).

``--collective ddp`` times DistributedDataParallel training steps over the gloo group
instead, in the same job on the same link: every variant trains its own copy of the same
MLP with AdamW (lr 1e-4, as bench/ddp_hooks.py) under DDP(model, process_group=<the gloo
group>) with its default buckets, on the same batches, the steps interleaved as for fsdp2.
The variants (default gloo,exact,fp8_e4m3): "gloo", DDP as it comes (gloo all-reduces each
bucket); "exact", pycomm.hooks.register_deterministic_hook(ddp, "exact"); a codec,
pycomm.hooks.register_compression_hook(ddp, codec), error feedback on. The hooks average
each bucket through pycomm's layered path, gloo moving the bytes. Reported: the median
step time and every variant's over gloo's (x_gloo; below 1 is faster than gloo), and as a
sanity column the relative RMS difference of its losses from gloo's: the exact sum and the
codec change the gradients, so the difference is only reported, and a step is wrong only
when its loss is not finite.

An algorithm pycomm does not have yet is reported as such (no traceback). Exit status:
0 when the job ran and every result was right, 1 otherwise, 2 when namespaces cannot be
built here (with the reason).
"""

import argparse
import json
import math
import os
import re
import signal
import statistics
import sys
import time

from pycomm.bench import netns

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT_TAG = "MULTIHOST-RESULT "
ERROR_ELEMENTS = 1 << 20  # Gaussian elements per rank for the error column
TRAINING = ("fsdp2", "ddp")  # the collectives that time training steps


def parse_size(text):
    m = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError("size %r: a number of bytes, optionally K, M or G" % text)
    size = int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]
    if size <= 0 or size % 4:
        raise argparse.ArgumentTypeError("size %r: a positive multiple of 4 bytes (float32)" % text)
    return size


def human(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return "%d %s" % (n >> shift, unit)
    return "%d B" % n


# ---------------------------------------------------------------------------------------
# rank side (run by torchrun inside a host namespace)
# ---------------------------------------------------------------------------------------

# The layered variants: the plan's choice, or the algorithm named.
LAYERED = {"layered": None, "layered-direct": "twoshot", "layered-hierarchical": "hierarchical"}
# The layered path's steps, in the order they run.
PHASES = ("encode", "all_to_all_single", "pairwise", "fold", "fold+encode", "all_gather", "decode")


class LayeredPhases:
    """Seconds this rank spends in each step of the layered calls since ``reset()``: the
    mover's transfers, started and waited for (``Call.move``, ``pairwise`` and ``wait``:
    all_to_all_single, pairwise, the all-gather, the stamps' included) and pycomm's CPU
    work (``Call.fold``: encode, fold, fold+encode, decode), timed by wrapping those
    methods of pycomm.layered.call.Call in this process."""

    def __init__(self):
        from pycomm import layered
        from pycomm.layered.call import Call

        self.spent = {}
        move, pairwise, wait, fold = Call.move, Call.pairwise, Call.wait, Call.fold
        Form, Stage = layered.Form, layered.Stage

        def phase_of(what):
            return {"all_to_all_single": "all_to_all_single", "pairwise sends": "pairwise"}.get(what, "all_gather")

        def timed_move(call, what, *args, **kw):
            start = time.perf_counter()
            try:
                return move(call, what, *args, **kw)
            finally:
                self.add(phase_of(what), start)

        def timed_pairwise(call, *args, **kw):
            start = time.perf_counter()
            try:
                return pairwise(call, *args, **kw)
            finally:
                self.add("pairwise", start)

        def timed_wait(call, moving):
            start = time.perf_counter()
            try:
                return wait(call, moving)
            finally:
                self.add(phase_of(moving[0]), start)

        def timed_fold(call, out, terms, forms, count, stage, **kw):
            start = time.perf_counter()
            try:
                return fold(call, out, terms, forms, count, stage, **kw)
            finally:
                if stage == Stage.Encoded:
                    phase = "encode"
                elif stage == Stage.FinalEncoded:
                    phase = "fold+encode"
                elif len(terms) == 1 and forms[0] == Form.Encoded:
                    phase = "decode"
                else:
                    phase = "fold"
                self.add(phase, start)

        Call.move, Call.pairwise, Call.wait, Call.fold = timed_move, timed_pairwise, timed_wait, timed_fold

    def add(self, phase, start):
        self.spent[phase] = self.spent.get(phase, 0.0) + time.perf_counter() - start

    def reset(self):
        self.spent = {}


def worker(args):
    import datetime
    import faulthandler

    import torch
    import torch.distributed as dist

    import pycomm

    faulthandler.dump_traceback_later(args.deadline, exit=True)
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    dist.init_process_group("pycomm", timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    rank, n = dist.get_rank(), dist.get_world_size()
    algorithms = [a for a in args.algorithms.split(",") if a]
    if args.collective in TRAINING:
        return train_steps(args, gloo, rank, n, algorithms)

    count = args.size // 4
    # The collective's input and output (one tensor for the in-place all-reduce), filled
    # with small integers exact under every codec: each rank's index + 1 to be gathered, or
    # 1 to be reduced (a sum n of up to 8 ranks; fp8_e5m2 rounds 21, the sum of 1..6).
    shard = count // n
    inputs = {"all_reduce": count, "reduce_scatter": shard * n, "all_gather": shard}
    outputs = {"all_reduce": 0, "reduce_scatter": shard, "all_gather": shard * n}
    t = torch.empty(inputs[args.collective], dtype=torch.float32)
    out = torch.empty(outputs[args.collective], dtype=torch.float32) if outputs[args.collective] else t
    if args.collective == "all_gather":
        want = torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(shard)
    else:
        want = torch.full_like(out, float(n))

    def all_reduce(variant, x, y):
        """The collective of ``variant`` from x into y (x itself for the all-reduce)."""
        algorithm, _, codec = variant.partition("+")
        if variant == "gloo":  # torch's API on the gloo group
            kw, api = dict(group=gloo), dist
        elif algorithm.startswith("layered"):  # pycomm's layered path, gloo moving the bytes
            kw, api = dict(group=gloo, algorithm=LAYERED[algorithm], compression=codec or None), pycomm
        else:
            kw, api = dict(algorithm=algorithm, compression=codec or None), pycomm
        if args.collective == "all_reduce":
            api.all_reduce(x, **kw)
        elif args.collective == "reduce_scatter":
            api.reduce_scatter_tensor(y, x, **kw)
        else:
            api.all_gather_into_tensor(y, x, **kw)

    phases = LayeredPhases()
    spent = {a: {} for a in algorithms}  # variant -> phase -> seconds over the timed calls

    def timed(a, record=True):
        t.fill_(rank + 1 if args.collective == "all_gather" else 1)
        dist.barrier(group=gloo)
        phases.reset()
        start = time.perf_counter()
        all_reduce(a, t, out)
        elapsed = time.perf_counter() - start
        if record:
            for phase, seconds in phases.spent.items():
                spent[a][phase] = spent[a].get(phase, 0.0) + seconds
        # The check allocates and compares a whole tensor: only once every rank has
        # finished, so that it never competes for the cores with a rank still timed.
        dist.barrier(group=gloo)
        return elapsed, int((out != want).sum())

    def error(a):
        """Relative RMS error against fp64 on Gaussian data (every rank regenerates all)."""
        length = ERROR_ELEMENTS // n if args.collective == "all_gather" else ERROR_ELEMENTS // n * n
        xs = [torch.randn(length, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
              for r in range(n)]
        x = xs[rank].float()
        if args.collective == "all_reduce":
            y, ref = x, torch.stack(xs).sum(0)
        elif args.collective == "reduce_scatter":
            y, ref = torch.empty(length // n), torch.stack(xs).sum(0).chunk(n)[rank]
        else:
            y, ref = torch.empty(length * n), torch.cat(xs)
        all_reduce(a, x, y)
        return ((y.double() - ref).norm() / ref.norm()).item()

    for a in algorithms:
        timed(a, record=False)
    times = torch.zeros(len(algorithms), args.repeats, dtype=torch.float64)
    wrong = torch.zeros(len(algorithms), dtype=torch.int64)
    # Each round starts with the next algorithm, so that none always follows the same one
    # (a connection idle through another algorithm's call restarts TCP slow start).
    for r in range(args.repeats):
        for k in range(len(algorithms)):
            i = (r + k) % len(algorithms)
            times[i, r], w = timed(algorithms[i])
            wrong[i] += w
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=gloo)   # a call ends with its slowest rank
    dist.all_reduce(wrong, op=dist.ReduceOp.SUM, group=gloo)
    errors = [error(a) for a in algorithms]
    # The automatic choice in groups created anew, each measuring its links again: the
    # labels their plans give (Work.algorithm).
    choices = {}
    for _ in range(args.groups if args.collective == "all_reduce" else 0):
        group = dist.new_group(backend="pycomm")
        for a in algorithms:
            algorithm, _, codec = a.partition("+")
            if algorithm == "auto":
                work = pycomm.all_reduce(t, group=group, compression=codec or None, async_op=True)
                choices.setdefault(a, []).append(work.algorithm)
                work.wait()
        dist.destroy_process_group(group)
    every = [None] * n
    dist.all_gather_object(every, spent, group=gloo)
    if rank == 0:
        out = {"world": n,
               "results": {a: {"times_s": times[i].tolist(), "wrong": int(wrong[i]), "rel_rms_error": errors[i]}
                           for i, a in enumerate(algorithms)},
               "choices_in_new_groups": choices or None}
        for a in algorithms:  # ms per call on each rank, by step (layered variants)
            if any(every[r][a] for r in range(n)):
                out["results"][a]["phases_ms"] = {
                    phase: [every[r][a].get(phase, 0.0) * 1e3 / args.repeats for r in range(n)]
                    for phase in sorted({p for r in range(n) for p in every[r][a]}, key=PHASES.index)}
        if any(a.startswith("layered") for a in algorithms):  # what the layered plans chose, and from what
            layered = pycomm.stats(gloo)
            out["layered_plans"] = {algo: c["calls"] for algo, c in layered["collectives"].get(
                args.collective.replace("_", ""), {}).items()}
            out["mover_links"] = layered.get("mover_links")
        print(RESULT_TAG + json.dumps(out), flush=True)
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    return 0


def fsdp2_variant(gloo, a, model):
    """``model`` fully sharded (each Linear, then the whole) over a pycomm group whose
    algorithm is forced to ``a``, or over ``gloo`` for "gloo"; and its SGD."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if a == "gloo":
        group = gloo
    else:  # read when the group is created; the same on every rank
        os.environ["PYCOMM_ALGO"] = a
        group = dist.new_group(backend="pycomm")
        del os.environ["PYCOMM_ALGO"]
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def ddp_variant(gloo, a, model):
    """``model`` under DDP over ``gloo``: gloo's own all-reduce for "gloo", else pycomm's
    deterministic ("exact") or compressed (a codec) hook, which averages each bucket
    through pycomm's layered path with gloo moving the bytes; and its AdamW (as
    bench/ddp_hooks.py)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import pycomm.hooks

    ddp = DistributedDataParallel(model, process_group=gloo)
    if a == "exact":
        pycomm.hooks.register_deterministic_hook(ddp, "exact")
    elif a != "gloo":
        pycomm.hooks.register_compression_hook(ddp, a)
    return ddp, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_steps(args, gloo, rank, n, algorithms):
    """Times training steps of one copy of bench/_training.py's MLP per variant (built by
    fsdp2_variant or ddp_variant); rank 0 prints each variant's step times (the slowest
    rank's) and its own losses, which the driver compares."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    import _training

    torch.set_num_threads(1)
    build = fsdp2_variant if args.collective == "fsdp2" else ddp_variant
    trained = {a: build(gloo, a, _training.model(torch)) for a in algorithms}
    data = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(args.batch, _training.WIDTHS[0], generator=data),
                torch.randn(args.batch, _training.WIDTHS[-1], generator=data)) for _ in range(args.repeats + 1)]
    losses = {a: [] for a in algorithms}

    def step(a, i):
        model, optimizer = trained[a]
        x, y = batches[i]
        dist.barrier(group=gloo)
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        elapsed = time.perf_counter() - start
        losses[a].append(loss.item())
        return elapsed

    for a in algorithms:
        step(a, 0)
    times = torch.zeros(len(algorithms), args.repeats, dtype=torch.float64)
    for r in range(args.repeats):
        for k in range(len(algorithms)):
            i = (r + k) % len(algorithms)
            times[i, r] = step(algorithms[i], r + 1)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=gloo)
    if rank == 0:
        out = {"world": n, "results": {a: {"times_s": times[i].tolist(), "losses": losses[a]}
                                       for i, a in enumerate(algorithms)}}
        print(RESULT_TAG + json.dumps(out), flush=True)
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------
# driver side
# ---------------------------------------------------------------------------------------

def link_bound(hosts, world):
    """Ring's bytes over a host's link divided by hierarchical's (see the module comment):
    2(n-1)/n S against 2(N-1)/N S for n ranks on N hosts; None with one host."""
    if hosts < 2:
        return None
    return (2 * (world - 1) / world) / (2 * (hosts - 1) / hosts)


def summarize_steps(args, raw, describe):
    results = raw["results"]
    # FSDP2's variants add the same gradients in other orders, so their losses must match
    # the first variant's; DDP's hooks change the gradients themselves (the exact sum, a
    # codec), so their losses' difference from gloo's is only reported.
    reference = "gloo" if args.collective == "ddp" and "gloo" in results else next(iter(results))
    close = 1e-4 if args.collective == "fsdp2" else None
    ref = results[reference]["losses"]
    rows = {}
    for a, r in results.items():
        wrong = sum(not math.isfinite(x) or (close is not None and abs(x - y) > close * abs(y))
                    for x, y in zip(r["losses"], ref))
        rows[a] = {"median_s": statistics.median(r["times_s"]), "times_s": r["times_s"], "wrong": wrong,
                   "loss_rel_diff": math.hypot(*(x - y for x, y in zip(r["losses"], ref))) / math.hypot(*ref),
                   "losses": r["losses"]}
    for r in rows.values():
        for peer in ("auto", "gloo"):
            if peer in rows:
                r["x_" + peer] = r["median_s"] / rows[peer]["median_s"]
        if "ring" in rows:
            r["ring_over_this"] = rows["ring"]["median_s"] / r["median_s"]
    return {"collective": args.collective, "hosts": args.hosts, "ranks_per_host": args.nproc, "world": raw["world"],
            "rate": args.rate, "batch": args.batch, "repeats": args.repeats, "topology": describe,
            "loss_reference": reference, "results": rows}


def report_steps(s):
    what = {"fsdp2": "FSDP2 training steps", "ddp": "DDP training steps over the gloo group"}[s["collective"]]
    # A ratio's column only where its peer ran.
    ratios = [(k, head, fmt) for k, head, fmt in (("x_auto", "x_auto", "%.2f"), ("x_gloo", "x_gloo", "%.2f"),
                                                  ("ring_over_this", "ring/this time", "%.2fx"))
              if any(k in r for r in s["results"].values())]
    width = {k: max(8, len(head) + 1) for k, head, _ in ratios}
    lines = ["multi-host %s: %d hosts x %d ranks, link %s (tbf, each host's egress), "
             "batch %d per rank, median of %d" % (what, s["hosts"], s["ranks_per_host"], s["rate"], s["batch"],
                                                  s["repeats"]),
             "%-14s %10s%s %7s %14s  %s" % ("variant", "step_ms", "".join(" %*s" % (width[k], head)
                                                                       for k, head, _ in ratios),
                                           "#wrong", "loss_rel_diff", "all steps_ms")]
    for a, r in s["results"].items():
        lines.append("%-14s %10.1f%s %7d %14.2e  %s" % (
            a, r["median_s"] * 1e3, "".join(" %*s" % (width[k], fmt % r[k] if k in r else "-") for k, _, fmt in ratios),
            r["wrong"], r["loss_rel_diff"], " ".join("%.0f" % (x * 1e3) for x in r["times_s"])))
    lines.append("loss_rel_diff: rank 0's losses against %s's, relative RMS over every step (warm-up "
                 "included)" % s["loss_reference"])
    return "\n".join(lines)


def summarize(args, raw, describe):
    n = raw["world"]
    factor = (2 if args.collective == "all_reduce" else 1) * (n - 1) / n
    rows = {}
    for a, r in raw["results"].items():
        t = statistics.median(r["times_s"])
        rows[a] = {"median_s": t, "times_s": r["times_s"], "algbw_GBps": args.size / t / 1e9,
                   "busbw_GBps": args.size / t / 1e9 * factor, "wrong": r["wrong"],
                   "rel_rms_error": r["rel_rms_error"]}
        if "phases_ms" in r:  # per rank, ms per call
            rows[a]["phases_ms"] = r["phases_ms"]
    for peer in ("auto", "gloo"):  # busbw of every variant over the peer's, same run
        if peer in rows:
            for r in rows.values():
                r["x_" + peer] = r["busbw_GBps"] / rows[peer]["busbw_GBps"]
    ratio = None
    if "ring" in rows and "hierarchical" in rows:
        ratio = rows["hierarchical"]["busbw_GBps"] / rows["ring"]["busbw_GBps"]
    layered = {a: r["x_gloo"] for a, r in rows.items() if a.startswith("layered") and "x_gloo" in r}
    return {"collective": args.collective, "hosts": args.hosts, "ranks_per_host": args.nproc, "world": n,
            "rate": args.rate,
            "link_bound": link_bound(args.hosts, n),
            "size_bytes": args.size, "dtype": "float32", "op": "sum", "repeats": args.repeats,
            "topology": describe, "results": rows,
            "hierarchical_over_ring_busbw": ratio, "layered_over_gloo_busbw": layered or None,
            "layered_plans": raw.get("layered_plans"), "mover_links": raw.get("mover_links"),
            "choices_in_new_groups": raw.get("choices_in_new_groups")}


def report(s):
    lines = ["multi-host %s: %d hosts x %d ranks, link %s (tbf, each host's egress), "
             "float32 sum, %s, median of %d" % (s["collective"].replace("_", "-"), s["hosts"], s["ranks_per_host"],
                                                s["rate"],
                                                human(s["size_bytes"]), s["repeats"]),
             "%-18s %10s %12s %12s %7s %10s %8s %8s  %s" % (
                 "variant", "time_ms", "algbw_GB/s", "busbw_GB/s", "#wrong", "rel_error", "x_auto",
                 "x_gloo", "all times_ms")]
    ratio = lambda r, k: "%8.2f" % r[k] if k in r else "%8s" % "-"  # noqa: E731
    for a, r in s["results"].items():
        lines.append("%-18s %10.1f %12.4f %12.4f %7d %10.2e %s %s  %s" % (
            a, r["median_s"] * 1e3, r["algbw_GBps"], r["busbw_GBps"], r["wrong"], r["rel_rms_error"],
            ratio(r, "x_auto"), ratio(r, "x_gloo"), " ".join("%.0f" % (x * 1e3) for x in r["times_s"])))
    if s["hierarchical_over_ring_busbw"] is not None:
        lines.append("hierarchical/ring busbw: %.2fx (bound from bytes per "
                     "host link: %s)" % (s["hierarchical_over_ring_busbw"],
                                         "%.2fx" % s["link_bound"] if s["link_bound"] else "n/a"))
    else:
        lines.append("hierarchical/ring busbw: n/a (needs both ring and hierarchical in --algorithms)")
    for a, x in (s.get("layered_over_gloo_busbw") or {}).items():
        target = " (target >= 3x for fp8_e4m3)" if a.endswith("fp8_e4m3") else ""
        lines.append("%s/gloo busbw: %.2fx%s" % (a, x, target))
    if s.get("choices_in_new_groups"):
        groups = len(next(iter(s["choices_in_new_groups"].values())))
        lines.append("the automatic choice in %d groups created anew: " % groups
                     + "; ".join("%s: %s" % (a, ", ".join("%s %d" % (c, labels.count(c)) for c in sorted(set(labels))))
                                 for a, labels in s["choices_in_new_groups"].items()))
    if s.get("layered_plans"):
        lines.append("layered calls by the algorithm their plan chose (warm-up and error runs included): " + ", ".join(
            "%s %d" % kv for kv in s["layered_plans"].items()))
    if s.get("mover_links"):
        lines.append("the mover's links as measured at the first layered call: " + ", ".join(
            "%s %.0f us + %.3f GB/s" % (k, lat, bw / 1e3) for k, (lat, bw) in s["mover_links"].items()))
    phased = [(a, r["phases_ms"]) for a, r in s["results"].items() if "phases_ms" in r]
    if phased:
        lines.append("layered steps, ms per call (mean over the rounds), mean over ranks (max over ranks); "
                     "the mover's steps include waiting for peers:")
        lines.append("%-18s %10s  %s" % ("variant", "time_ms", "  ".join("%-17s" % p for p in PHASES)))
        for a, phases in phased:
            cells = ["%7.1f (%7.1f)" % (statistics.mean(phases[p]), max(phases[p])) if p in phases
                     else "%17s" % "-" for p in PHASES]
            lines.append("%-18s %10.1f  %s" % (a, s["results"][a]["median_s"] * 1e3, "  ".join(cells)))
    return "\n".join(lines)


def drive(args):
    ok, why = netns.available()
    if not ok:
        print("multihost bench: cannot run: %s" % why, file=sys.stderr)
        return 2
    worker_args = ["--worker", "--collective", args.collective, "--size", str(args.size), "--batch", str(args.batch),
                   "--repeats", str(args.repeats), "--groups", str(args.groups),
                   "--algorithms", args.algorithms, "--pg-timeout", str(args.pg_timeout),
                   "--deadline", str(max(10, args.timeout - 15))]
    sysctls = {"net.ipv4.tcp_slow_start_after_idle": args.slow_start_after_idle}
    rate = None if args.rate == "none" else args.rate
    with netns.Hosts(args.hosts, rate=rate, sysctls=sysctls) as hosts:
        describe = hosts.describe()
        print(describe, flush=True)
        cmds = netns.torchrun_commands(hosts, sys.executable, os.path.abspath(__file__),
                                       worker_args, nproc=args.nproc)
        start = time.monotonic()
        results, timed_out = netns.run_jobs(cmds, args.timeout)
        elapsed = time.monotonic() - start
    outputs = "\n".join(r.output for r in results)
    found = [line[len(RESULT_TAG):] for line in outputs.splitlines() if line.startswith(RESULT_TAG)]
    if timed_out or any(r.rc != 0 for r in results) or len(found) != 1:
        print("multihost bench: the job failed after %.0f s%s; every host's output:" % (
            elapsed, " (deadline %d s)" % args.timeout if timed_out else ""), file=sys.stderr)
        for r in results:
            print(r.describe(), file=sys.stderr)
        return 1
    steps = args.collective in TRAINING
    summary = (summarize_steps if steps else summarize)(args, json.loads(found[0]), describe)
    summary["job_s"] = elapsed
    summary["run"] = run_of()
    print("run: %s" % json.dumps(summary["run"]))
    print((report_steps if steps else report)(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
    return 0 if all(r["wrong"] == 0 for r in summary["results"].values()) else 1


def run_of():
    """When, from which commit and on which machine the results were made."""
    import platform

    from pycomm.bench.run_metadata import git_state, usable_cpus

    return {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git": git_state(),
            "machine": "%s, %d usable CPUs, %s" % (platform.processor() or platform.machine(), usable_cpus(),
                                                   platform.platform())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit", help="tc rate of each host's link (default 1gbit; none: unshaped)")
    ap.add_argument("--collective", choices=("all_reduce", "reduce_scatter", "all_gather") + TRAINING,
                    default="all_reduce",
                    help="what every variant runs (default all_reduce); --size is its whole buffer: the "
                         "reduce-scatter's input, the all-gather's output; fsdp2, ddp: training steps")
    ap.add_argument("--batch", type=int, default=64, help="fsdp2, ddp: samples per rank and step (default 64)")
    ap.add_argument("--size", type=parse_size, default=parse_size("64M"), help="bytes (default 64M)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--algorithms",
                    help="variants: a pycomm algorithm, algorithm+codec (auto+fp8_e4m3), gloo, or "
                         "layered[+codec] (pycomm's layered path over the gloo group); default "
                         "ring,hierarchical,auto. ddp: gloo, exact or a codec (pycomm's hooks), default "
                         "gloo,exact,fp8_e4m3")
    ap.add_argument("--groups", type=int, default=0,
                    help="all_reduce: create this many pycomm groups afterwards and report what the auto variants "
                         "choose in each (each group measures its links anew)")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2, help="ranks per host")
    ap.add_argument("--slow-start-after-idle", type=int, choices=(0, 1), default=1,
                    help="net.ipv4.tcp_slow_start_after_idle in the hosts (default 1, Linux's)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--timeout", type=int, default=540, help="deadline of the whole job, s")
    ap.add_argument("--pg-timeout", type=float, default=120.0, help="process-group timeout, s")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=525.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.algorithms is None:
        args.algorithms = "gloo,exact,fp8_e4m3" if args.collective == "ddp" else "ring,hierarchical,auto"
    if args.worker:
        return worker(args)
    # SIGTERM and SIGHUP unwind like Ctrl-C, so the namespaces are torn down.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
