"""The layered path (pycomm/layered/): pycomm's reductions over a group of another
backend, here gloo as the mover. What it must show: bits equal to the native path's for
the same inputs, world size and options; exact mode independent of the world size; the
same options and errors as the native path; observability; a failing mover failing the
call with its error wrapped."""

import hashlib
import json
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from _harness import capture_stderr, group_timeout, run_world, world_marks

CODECS = [None, "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
# The layered all-reduce on one host over gloo: a call whose data fits the opening all-gather of
# every call (pycomm/layered/stamps.py) in one shot, a larger one pairwise (gloo's sends copy less
# than its all-to-all and all-gather).
ONE_SHOT, OVER_GLOO = "layered-oneshot", "layered-pairwise"
MODES = [True, "exact"]
SMALL = [0, 1, 7, 1001]


def _op(name):
    return dist._make_nccl_premul_sum(0.375) if name == "PREMUL_SUM" else getattr(dist.ReduceOp, name)


def _values(rank, count, dtype, salt):
    """Gaussian data over several decades (so that fold order and the exact sum matter),
    different on every rank and case. Drawn in float32 unless the data are float64: torch
    draws float64 normals several times slower, and the large cases draw millions."""
    g = torch.Generator().manual_seed(1000003 * rank + salt)
    drawn = torch.float64 if dtype == torch.float64 else torch.float32
    x = torch.randn(count, generator=g, dtype=drawn)
    x *= torch.tensor([1e-3, 1.0, 3e2, 7e4], dtype=drawn).repeat(count // 4 + 1)[:count]
    if not dtype.is_floating_point:
        return (x.clamp(-1e4, 1e4)).to(dtype)
    return x.to(dtype)


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _outcome(fn):
    """The result's bits, or the error (type and message) the call raised."""
    try:
        return ("ok", _bits(fn()).clone())
    except (ValueError, RuntimeError, TypeError) as e:
        return ("error", type(e).__name__, str(e))


def _run(collective, group, x, op, codec, mode, ws):
    import pycomm

    kw = dict(group=group, compression=codec, deterministic=mode)
    if collective == "allreduce":
        t = x.clone()
        pycomm.all_reduce(t, op, **kw)
        return t
    if collective == "reduce_scatter":
        out = torch.empty(x.numel() // ws, dtype=x.dtype)
        pycomm.reduce_scatter_tensor(out, x, op, **kw)
        return out
    out = torch.empty(x.numel() * ws, dtype=x.dtype)
    pycomm.all_gather_into_tensor(out, x, **kw)
    return out


def cases_for(ws, sizes):
    """(collective, dtype, op, count, codec, mode): the matrix of the issue, the large
    sizes on float32 and bfloat16."""
    out = []
    for count in sizes:
        large = count > 1001
        dtypes = [torch.float32, torch.bfloat16] if large else [torch.float32, torch.float16, torch.bfloat16,
                                                                  torch.float64]
        ops = ["SUM", "AVG"] if large else ["SUM", "AVG", "PREMUL_SUM"]
        codecs = [None, "bf16", "fp8_e4m3"] if large else CODECS
        for dtype in dtypes:
            for codec in codecs:
                for mode in MODES:
                    for op in ops:
                        out.append(("allreduce", dtype, op, count, codec, mode))
                        out.append(("reduce_scatter", dtype, op, count, codec, mode))
                out.append(("allgather", dtype, "SUM", count, codec, True))
        if not large:  # the other reductions, where the mode allows them; integers
            for dtype in (torch.float32, torch.bfloat16, torch.int32):
                for op in ("MIN", "MAX", "PRODUCT"):
                    for mode in MODES:
                        out.append(("allreduce", dtype, op, count, None, mode))
                        out.append(("reduce_scatter", dtype, op, count, None, mode))
            out.append(("allreduce", torch.int32, "SUM", count, "fp8_e4m3", "exact"))  # runs uncompressed
    return out


def _cut_in_parts(parts):
    """Makes the layered plans cut all-reduces in ``parts`` parts (where they have as many
    units): the plan's parts written over, as a test may."""
    from pycomm import _C

    planned = _C.layered_plan

    def plan(*args):
        p = planned(*args)
        p.parts = parts
        return p

    _C.layered_plan = plan


def _slow_link_between_hosts():
    """Makes the layered plans price the link between hosts at 1 byte per microsecond
    (what the first call measured, written over), so that they send the fewest bytes
    across it."""
    from pycomm import _C

    planned = _C.layered_plan

    def plan(collective, dtype, count, options, host_of, within, across, *rest):
        return planned(collective, dtype, count, options, host_of, within, (0.0, 1.0), *rest)

    _C.layered_plan = plan


def layered_equals_native_world(rank, ws, sizes, parts=None, slow_hosts=False):
    """Every case on the native path (the pycomm world) and the layered path (a gloo group
    of the same ranks); returns the cases whose outcomes differ, a digest of the layered
    all-reduce and all-gather results, which must be the same on every rank, the number
    of cases and the algorithms the layered all-reduces ran. ``parts``: all-reduces cut in
    that many parts; ``slow_hosts``: see _slow_link_between_hosts."""
    import pycomm

    if parts:
        _cut_in_parts(parts)
    if slow_hosts:
        _slow_link_between_hosts()
    gloo = dist.new_group(backend="gloo", timeout=group_timeout())
    differ, digest = [], hashlib.sha256()
    for i, (collective, dtype, op, count, codec, mode) in enumerate(cases_for(ws, sizes)):
        x = _values(rank, count * (ws if collective == "reduce_scatter" else 1), dtype, i)
        native = _outcome(lambda: _run(collective, None, x, _op(op), codec, mode, ws))
        layered = _outcome(lambda: _run(collective, gloo, x, _op(op), codec, mode, ws))
        same = native[0] == layered[0] and (torch.equal(native[1], layered[1]) if native[0] == "ok"
                                            else native[1:] == layered[1:])
        if not same:
            differ.append((collective, str(dtype), op, count, codec, mode, str(native)[:200], str(layered)[:200]))
        if collective != "reduce_scatter":  # the results every rank holds alike
            digest.update(layered[1].numpy().tobytes() if layered[0] == "ok" else repr(layered).encode())
    return differ, digest.hexdigest(), len(cases_for(ws, sizes)), set(pycomm.stats(gloo)["collectives"]["allreduce"])


def _check_world(results):
    differ, digest, n_cases, _ = results[0]
    assert n_cases > 0
    for rank, (d, h, _, _) in enumerate(results):
        assert not d, f"rank {rank}: layered and native differ in {len(d)} cases, e.g. {d[:3]}"
        assert h == digest, f"rank {rank}'s layered results differ from rank 0's"


# One rank, even and odd worlds; 4 ranks run in the hierarchical and gathering tests below.
@pytest.mark.parametrize("ws", [pytest.param(ws, marks=world_marks(ws)) for ws in (1, 2, 3, 5)])
def test_layered_equals_native_bit_for_bit(ws):
    _check_world(run_world(layered_equals_native_world, ws, args=(SMALL,), timeout=240))


def test_layered_equals_native_large():
    # 65537 and 786433 elements (3 MiB of float32) on 3 ranks: segments that do not divide evenly,
    # several codec blocks and native chunks per segment, all-reduces pipelined in 5 parts.
    _check_world(run_world(layered_equals_native_world, 3, args=([65537, 786433], 5), timeout=240))


def test_results_gathered_across_hosts_then_within_keep_the_bits():
    # 2 hosts of 2 ranks and a slow link between them: the direct algorithm gathers its
    # results among the ranks of each local index, then within the hosts; deterministic
    # modes, every dtype and codec, against the native path.
    results = run_world(layered_equals_native_world, 4, args=([1001, 65537], 3, True),
                        env={"PYCOMM_RANKS_PER_NODE": "2"}, timeout=300)
    _check_world(results)
    assert "layered-direct+host-gather" in results[0][3], results[0][3]


def hierarchical_world(rank, ws, parts):
    """The native hierarchical all-reduce (the pycomm world, its nodes PYCOMM_RANKS_PER_NODE
    ranks) against the layered one over gloo, in ``parts`` parts where given; returns the
    cases whose bits differ and the algorithms the layered calls ran."""
    import pycomm

    if parts:
        _cut_in_parts(parts)
    gloo = dist.new_group(backend="gloo", timeout=group_timeout())
    differ, ran = [], set()
    cases = [(dtype, op, count, codec) for dtype in (torch.float32, torch.bfloat16)
             for op in ("SUM", "AVG", "PREMUL_SUM") for count in (1, 7, 1001, 65537)
             for codec in (None, "fp16", "fp8_e4m3", "fp8_e5m2")]
    for i, (dtype, op, count, codec) in enumerate(cases):
        x = _values(rank, count, dtype, i)
        native, layered = x.clone(), x.clone()
        pycomm.all_reduce(native, _op(op), algorithm="hierarchical", compression=codec)
        work = pycomm.all_reduce(layered, _op(op), group=gloo, algorithm="hierarchical", compression=codec,
                                 async_op=True)
        work.wait()
        ran.add(work.algorithm)
        if not torch.equal(_bits(native), _bits(layered)):
            differ.append((str(dtype), op, count, codec))
    return differ, ran


@pytest.mark.parametrize("ws,per_host,parts",
                         [pytest.param(*p, marks=world_marks(p[0])) for p in [(4, 2, None), (4, 2, 3), (6, 3, 2)]])
def test_layered_hierarchical_equals_native_hierarchical(ws, per_host, parts):
    # PYCOMM_RANKS_PER_NODE stands for hosts on one machine, for pycomm groups and layered
    # calls alike; 2 hosts of 2 or 3 ranks, where the native hierarchical folds the host
    # partials in host order coded and uncoded.
    results = run_world(hierarchical_world, ws, args=(parts,), env={"PYCOMM_RANKS_PER_NODE": str(per_host)},
                        timeout=300)
    for rank, (differ, ran) in enumerate(results):
        assert not differ, f"rank {rank}: layered and native hierarchical differ in {len(differ)} cases: {differ[:4]}"
        assert ran == {"layered-hierarchical over gloo"}, ran


def test_layered_plan():
    from pycomm import _C

    def plan(count, host_of, codec="fp8_e4m3", across=(0.0, 0.0), algorithm="auto", determinism="0", cuda=False,
             core_share=1.0, collective="allreduce", pairwise_mover=False, oneshot_capacity=0):
        options = _C.LayeredConfig().options(collective, torch.float32, dist.ReduceOp.SUM, algorithm, codec,
                                             determinism)
        return _C.layered_plan(collective, torch.float32, count, options, host_of, (0.0, 0.0), across, core_share,
                               cuda, pairwise_mover, oneshot_capacity)

    one_host, two_hosts, three_hosts = [0] * 4, [0, 0, 1, 1], [0, 0, 1, 1, 2, 2]
    gbit = (100.0, 125.0)  # a 1 Gbit/s link between hosts, 100 us
    assert plan(1000, one_host).variant == "layered-direct"
    large = plan(16 << 20, two_hosts, across=gbit, algorithm="hierarchical")
    assert (large.variant, large.fallback) == ("layered-hierarchical", ""), large.variant
    assert large.parts > 1 and large.predicted_us < plan(16 << 20, two_hosts, across=gbit,
                                                         algorithm="twoshot").predicted_us
    # The default mode's choice between hierarchical and direct, which add in other orders,
    # is priced at the reference links (10 GbE), whatever was measured (D1: the same bits
    # in every run); the measured link chooses among the direct variants and the parts.
    two_by_four = [0] * 4 + [1] * 4
    for host_of, codec, expected in [(two_hosts, "fp8_e4m3", "layered-direct"),
                                     (two_by_four, "none", "layered-hierarchical")]:
        for across in [(0.0, 0.0), gbit, (1.0, 1e5)]:
            variant = plan(64 << 20, host_of, codec=codec, across=across).variant
            assert variant.startswith(expected), (host_of, codec, across, variant)
    assert plan(16 << 20, two_hosts, across=gbit).variant == "layered-direct+host-gather"
    assert plan(16 << 20, two_hosts, across=gbit, cuda=True).parts == 1  # one stream: nothing overlaps
    # On one host the mover's traffic is the host's work too: nothing to overlap it with.
    assert plan(16 << 20, one_host, codec="none").parts == 1
    assert plan(16 << 20, two_hosts, codec="none", across=gbit).parts > 1
    assert plan(1000, two_hosts, codec="none", across=gbit).parts == 1
    # Where the native hierarchical's bits differ or it does not run, the direct algorithm.
    for host_of, codec, determinism, why in [
            (three_hosts, "none", "0", "ring order"), (two_hosts, "fp8_e4m3", "1", "deterministic modes"),
            ([0, 1, 0, 1], "fp8_e4m3", "0", "host by host"), ([0, 0, 1], "fp8_e4m3", "0", "same number")]:
        p = plan(16 << 20, host_of, codec=codec, determinism=determinism, across=gbit, algorithm="hierarchical")
        assert p.variant.startswith("layered-direct") and why in p.fallback, (host_of, p.fallback)
    assert plan(16 << 20, three_hosts, across=gbit, algorithm="hierarchical").variant == "layered-hierarchical"
    # Gathering the direct results across hosts, then within them: fewer bytes on the link,
    # one collective more; its bits are the direct algorithm's in every mode.
    assert plan(16 << 20, two_hosts, across=gbit, determinism="exact").variant == "layered-direct+host-gather"
    assert plan(1000, two_hosts, across=gbit, determinism="exact").variant == "layered-direct"
    # Ranks that share cores pay for the hierarchical's uncompressed traffic within the host.
    assert plan(64 << 20, two_by_four, codec="none", core_share=0.5).variant.startswith("layered-direct")
    assert "not an algorithm of the layered path" in plan(1000, one_host, algorithm="ring").fallback
    # Over a mover whose sends cost fewer copies than its collectives (gloo), every
    # collective's transfers are pairwise, on host memory only (gloo's sends take no other).
    for collective in ("allreduce", "reduce_scatter", "allgather"):
        assert plan(1 << 20, one_host, collective=collective, pairwise_mover=True).variant == "layered-pairwise"
        assert plan(1 << 20, one_host, collective=collective, pairwise_mover=True, cuda=True).variant == \
            "layered-direct"
    assert plan(1 << 20, [0], pairwise_mover=True).variant == "layered-direct"  # no peer to send to
    # A call whose data fits the opening all-gather runs in it, in one shot, on any memory,
    # unless the direct algorithm is asked for; its data: an all-reduce's or all-gather's
    # input, a reduce-scatter's every segment (encoded, each in a slot of 16-byte multiples).
    fits = 1000 * 4
    for cuda in (False, True):
        assert plan(1000, one_host, codec="none", oneshot_capacity=fits, cuda=cuda).variant == "layered-oneshot"
        assert plan(1001, one_host, codec="none", oneshot_capacity=fits, cuda=cuda).variant != "layered-oneshot"
    assert plan(1000, one_host, codec="none", oneshot_capacity=fits, algorithm="twoshot").variant == "layered-direct"
    assert plan(1000, [0], codec="none", oneshot_capacity=fits).variant == "layered-direct"  # no opening at 1 rank
    coded = _C.encoded_size("fp8_e4m3", _C.default_compression_block(), 1000)
    assert plan(1000, one_host, oneshot_capacity=coded).variant == "layered-oneshot"
    assert plan(1000, one_host, oneshot_capacity=coded - 1).variant == "layered-direct"
    segments = 4 * -(-_C.encoded_size("fp8_e4m3", _C.default_compression_block(), 250) // 16) * 16
    assert plan(1000, one_host, collective="reduce_scatter", oneshot_capacity=segments).variant == "layered-oneshot"
    assert plan(1000, one_host, collective="reduce_scatter", oneshot_capacity=segments - 1).variant != \
        "layered-oneshot"
    refused = plan(2000, one_host, oneshot_capacity=coded, algorithm="oneshot")
    assert "oneshot cannot serve this call" in refused.fallback


# The exact sums of the sliced test on Triton's interpreter (about 2 s a case at 9 ranks):
# float32 terms as they are and encoded, float64's own words (test_triton_kernels.py has
# the kernel's full matrix).
TRITON_EXACT_CASES = {(torch.float32, None), (torch.float32, "fp8_e4m3"), (torch.float64, None)}


def sliced_folds_world(rank, ws, width, sizes, exact_on_triton):
    """Every case with folds of at most ``width`` terms, as device kernels fold past their
    limit of terms (in slices, each handing its accumulation on as a partial term): the
    bits of one fold. Exact mode's sums, which cannot be sliced, run on the Triton kernel
    instead: where ``exact_on_triton`` (interpreted here, so a few cases: SUM and AVG of
    TRITON_EXACT_CASES) the same bits too. That world runs the uncoded and fp8 cases only:
    a codec changes the terms, not their slicing. The sliced calls run on a group of their
    own: a group's kind of call reads terms_per_fold once, at its first call."""
    from pycomm.layered import layout  # whose _Layout reads terms_per_fold

    gloo = dist.new_group(backend="gloo", timeout=group_timeout())
    sliced_gloo = dist.new_group(backend="gloo", timeout=group_timeout())
    whole_fold = layout.terms_per_fold
    differ = []
    for i, (collective, dtype, op, count, codec, mode) in enumerate(cases_for(ws, sizes)):
        if exact_on_triton and codec not in (None, "fp8_e4m3"):
            continue
        exact_sum = mode == "exact" and dtype.is_floating_point and op in ("SUM", "AVG", "PREMUL_SUM") \
            and collective != "allgather"
        if exact_sum and not (exact_on_triton and (dtype, codec) in TRITON_EXACT_CASES and op != "PREMUL_SUM"):
            continue
        x = _values(rank, count * (ws if collective == "reduce_scatter" else 1), dtype, i)
        whole = _outcome(lambda: _run(collective, gloo, x, _op(op), codec, mode, ws))
        layout.terms_per_fold = lambda kernels, device: width
        try:
            sliced = _outcome(lambda: _run(collective, sliced_gloo, x, _op(op), codec, mode, ws))
        finally:
            layout.terms_per_fold = whole_fold
        if not (whole[0] == sliced[0] == "ok" and torch.equal(whole[1], sliced[1])):
            differ.append((collective, str(dtype), op, count, codec, mode, str(whole)[:200], str(sliced)[:200]))
    return differ


@pytest.mark.parametrize("ws,width,sizes,exact_on_triton",
                         [pytest.param(*p, marks=world_marks(p[0]))
                          for p in [(4, 2, SMALL[2:], False), (9, 4, [7], True)]])
def test_folds_in_slices_give_the_bits_of_one_fold(ws, width, sizes, exact_on_triton):
    worlds = run_world(sliced_folds_world, ws, args=(width, sizes, exact_on_triton), env={"TRITON_INTERPRET": "1"},
                       timeout=300)
    for rank, differ in enumerate(worlds):
        assert not differ, f"rank {rank}: {len(differ)} cases differ, e.g. {differ[:3]}"


def exact_world_size_world(rank, ws):
    """The same multiset of contributions {c0, c1} (zeros elsewhere, placed differently)
    reduced in exact mode over gloo groups of 2, 3 and 4 ranks: one result, bit for bit."""
    import pycomm

    c = [_values(p, 4099, torch.float32, 77) for p in (0, 1)]
    zero = torch.zeros(4099)
    placements = {2: [c[0], c[1]], 3: [c[1], zero, c[0]], 4: [zero, c[0], zero, c[1]]}
    digests = {}
    for size, contributions in placements.items():
        group = dist.new_group(ranks=list(range(size)), backend="gloo", timeout=group_timeout())
        if rank >= size:
            continue
        for codec in (None, "fp8_e4m3"):
            t = contributions[rank].clone()
            pycomm.all_reduce(t, group=group, deterministic="exact", compression=codec)
            digests[(size, codec)] = hashlib.sha256(_bits(t).numpy().tobytes()).hexdigest()
    return digests


def test_exact_mode_is_world_size_invariant():
    results = run_world(exact_world_size_world, 4, timeout=120)
    for codec in (None, "fp8_e4m3"):
        seen = {d[(size, codec)] for d in results for size in (2, 3, 4) if (size, codec) in d}
        assert len(seen) == 1, (codec, seen)


def observability_world(rank, ws):
    import pycomm

    gloo = dist.new_group(backend="gloo", timeout=group_timeout())
    t = torch.ones(1000)

    def call():  # the line is written when the call completes: on CPU tensors, on the group's lane
        work = pycomm.all_reduce(t, group=gloo, compression="bf16", deterministic="exact", async_op=True)
        assert work.wait()
        return work

    work, log = capture_stderr(call)
    assert work.is_completed()
    assert work.algorithm == f"{ONE_SHOT} over gloo", work.algorithm
    assert (work.compression, work.determinism) == ("bf16", "exact")
    assert torch.equal(work.get_future().wait()[0], torch.full((1000,), float(ws)))
    # A family the layered path has not: the plan's choice runs, and the line says why.
    _, fallback = capture_stderr(lambda: pycomm.all_reduce(t, group=gloo, algorithm="ring"))
    stats = pycomm.stats(gloo)  # kept as a pycomm group keeps its own
    counters = stats["collectives"]["allreduce"][ONE_SHOT]
    assert (counters["calls"], counters["failures"], counters["bytes"]) == (2, 0, 8000), counters
    assert stats["mover"] == "gloo" and stats["last"]["state"] == "completed", stats
    entries = pycomm.flight_recorder(gloo)["entries"]
    assert [(e["collective"], e["algorithm"], e["compression"], e["determinism"], e["state"]) for e in entries] == [
        ("allreduce", ONE_SHOT, "bf16", "exact", "completed"),
        ("allreduce", ONE_SHOT, "none", "0", "completed")], entries
    return log, fallback


def test_work_stats_and_log_line():
    logs = run_world(observability_world, 2, env={"PYCOMM_DEBUG": "INFO"}, timeout=90)
    assert f"allreduce #1 (float32, sum, 1000 elements, {ONE_SHOT}, bf16/" in logs[0][0]
    assert f"4000 B, algorithm {ONE_SHOT} over gloo, compression bf16, determinism exact" in logs[0][0]
    assert "ring is not an algorithm of the layered path (oneshot, twoshot, hierarchical, auto), 4000 B, " \
           f"algorithm {ONE_SHOT} over gloo" in logs[0][1], logs[0][1]
    assert ONE_SHOT not in logs[1][0] + logs[1][1]  # INFO: rank 0 logs each operation


def mover_fails_world(rank, ws, how):
    """The last rank is killed, or sleeps past the mover's timeout, before all-reduce #2."""
    import datetime

    import pycomm

    gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    t = torch.ones(1 << 16)
    pycomm.all_reduce(t, group=gloo)  # #1 succeeds everywhere
    if rank == ws - 1:
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(8)
        return None
    try:
        pycomm.all_reduce(t, group=gloo, deterministic="exact")
    except dist.DistBackendError as e:
        with open(str(e).rsplit("(flight recorder: ", 1)[-1].rstrip(")")) as f:
            written = json.load(f)["entries"]
        return (str(e), pycomm.stats(gloo)["collectives"]["allreduce"][OVER_GLOO]["failures"],
                [(e["seq"], e["state"]) for e in written])
    raise AssertionError("the all-reduce succeeded without its peer")


@pytest.mark.parametrize("how", ["killed", "late"])
def test_a_failing_mover_fails_the_call_with_its_error_wrapped(how):
    from pycomm.layered.mover import _ALL_GATHER

    results = run_world(mover_fails_world, 3, args=(how,), timeout=120,
                        expect_killed=(2,) if how == "killed" else ())
    for rank in (0, 1):
        message, failures, flight_recorder = results[rank]
        assert message.startswith(f"pycomm: allreduce #2 ({OVER_GLOO} over gloo) on group "), message
        assert flight_recorder == [(1, "completed"), (2, "failed")], flight_recorder  # written as it failed
        assert f"failed on rank {rank}: {_ALL_GATHER}: " in message, message  # the stamps' gather
        assert how == "killed" or "timed out" in message.lower() or "timeout" in message.lower(), message
        assert failures == 1


# What each rank passes where the ranks disagree, and the field its error names: (rank 0's,
# the others'), a count added to the call's size. Every kind of call starts with the same
# opening all-gather, whatever it is (pycomm/layered/stamps.py), so any two can meet there.
DISAGREEMENTS = {
    "compression": ({"compression": "fp8_e4m3"}, {"compression": "fp8_e5m2"}),
    "determinism": ({"deterministic": "exact"}, {"deterministic": 1}),
    "count": ({"count": 1}, {"count": 0}),
    "dtype": ({"dtype": torch.float64}, {"dtype": torch.float32}),
}
# Sizes of calls: one that runs in one shot (its data in the opening, at 2 and 4 ranks but
# for a reduce-scatter at 4), one that runs pairwise.
SIZES = (1000, 1 << 15)


def fields_for(collective):
    # An all-gather has no fold: its determinism mode does not change a bit.
    return [f for f in sorted(DISAGREEMENTS) if not (collective == "allgather" and f == "determinism")]


def disagreeing_world(rank, ws, collective):
    """For each size and field: rank 0 calls the collective with another value of the field
    than the others, kinds of call no rank made before ("new"); then every rank makes both
    kinds, each rank's layout of both made and their stamps agreed, and rank 0 and the
    others disagree again on them ("agreed"); after each disagreement every rank makes the
    same call, which must work. Last, rank 0's call runs in one shot and the others' pairwise
    ("one shot against pairwise"). Returns, by case: the disagreeing call's sequence number,
    its error, how long it took, and the sum of the call after it."""

    gloo = dist.new_group(backend="gloo", timeout=group_timeout())
    made = [0]  # calls made on the group: a call's sequence number is one more

    def call(count, dtype=torch.float32, compression=None, deterministic=True):
        made[0] += 1
        x = torch.ones(count * (ws if collective == "reduce_scatter" else 1), dtype=dtype)
        return _run(collective, gloo, x, dist.ReduceOp.SUM, compression, deterministic, ws)

    def disagreement(mine):
        seq, started = made[0] + 1, time.monotonic()
        try:
            call(**mine)
            error = None
        except dist.DistBackendError as e:
            error = str(e)
        return seq, error, time.monotonic() - started, call(1000).sum().item()

    def kind(size, field, side):
        passed = dict(DISAGREEMENTS[field][side])
        return dict(passed, count=size + passed.get("count", 0))

    out = {}
    for size in SIZES:
        for field in fields_for(collective):
            both = [kind(size, field, 0), kind(size, field, 1)]
            out[(size, field, "new")] = disagreement(both[rank != 0])
            call(**both[0])
            call(**both[1])
            out[(size, field, "agreed")] = disagreement(both[rank != 0])
    out["one shot against pairwise"] = disagreement({"count": SIZES[rank != 0]})
    return out


def _shown(field, passed, size, scale):
    """A field's value as a disagreement's message shows it, where a rank passed ``passed``."""
    if field == "count":
        return str((size + passed.get("count", 0)) * scale)
    return str(passed["deterministic" if field == "determinism" else field]).replace("torch.", "")


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_ranks_that_disagree_fail_on_every_rank(collective, ws):
    # Each rank sees every other's stamp: each fails at once, naming what differs, with
    # nothing pending on the mover (the next call works), whether the kinds of call are
    # new or every rank has agreed on both before.
    results = run_world(disagreeing_world, ws, args=(collective,), timeout=180)
    scale = ws if collective == "reduce_scatter" else 1  # a reduce-scatter's count is its input's
    for rank, outcomes in enumerate(results):
        for case, (seq, error, took, after) in outcomes.items():
            assert error is not None, f"rank {rank}: the call that disagreed on {case} succeeded"
            assert re.search(rf"{collective} #{seq} \(layered-(oneshot|pairwise) over gloo\) on group '\d+' "
                             rf"failed on rank {rank}: ", error), error
            if case == "one shot against pairwise":
                field, values = "count", [str(size * scale) for size in SIZES]
            else:
                size, field, _ = case
                values = [_shown(field, passed, size, scale) for passed in DISAGREEMENTS[field]]
            mine, peer, theirs = (values[0], 1, values[1]) if rank == 0 else (values[1], 0, values[0])
            assert f"rank {peer} called it with {field} {theirs} where this rank has {mine}: ranks called " \
                "different collectives or arguments" in error, (case, error)
            assert took < 10, f"rank {rank} took {took:.1f} s to fail on {case}"
            assert after == 1000 * ws, (case, after)


def device_path_world(rank, ws):
    """The device path on CPU tensors, gloo moving them (layout.on_device made true, the
    CPU ops standing in for a device's kernels): every buffer kept, stamps written and
    judged by the kernels, the direct algorithm's collectives, a disagreement raised by the
    next wait or call. Returns the cases whose bits differ from the native path's, the
    algorithms that ran, and, for a disagreement the transfers cannot feel (two fp8 codecs,
    one width) in one shot and in the direct algorithm (a group each: a disagreement found
    on the device stays), what each wait and the call after it raised."""
    import pycomm
    from pycomm.layered import layout

    layout.on_device = lambda device: True
    gloo = dist.new_group(backend="gloo", timeout=group_timeout())
    differ, ran = [], set()
    cases = [(collective, dtype, op, count, codec, mode) for collective in ("allreduce", "reduce_scatter", "allgather")
             for count in (7, 1001, 65537) for codec in (None, "bf16", "fp8_e4m3") for mode in (True, "exact")
             for dtype, op in [(torch.float32, "AVG"), (torch.bfloat16, "SUM")]]
    for i, (collective, dtype, op, count, codec, mode) in enumerate(cases):
        x = _values(rank, count * (ws if collective == "reduce_scatter" else 1), dtype, i)
        native = _outcome(lambda: _run(collective, None, x, _op(op), codec, mode, ws))
        layered = _outcome(lambda: _run(collective, gloo, x, _op(op), codec, mode, ws))
        if not (native[0] == layered[0] == "ok" and torch.equal(native[1], layered[1])):
            differ.append((collective, str(dtype), op, count, codec, mode, str(layered)[:200]))
    for collective in ("allreduce", "reduce_scatter", "allgather"):
        ran |= set(pycomm.stats(gloo)["collectives"][collective])
    raised = {}
    for count in (1001, 65537):
        group = dist.new_group(backend="gloo", timeout=group_timeout())
        t = torch.ones(count)
        work = pycomm.all_reduce(t, group=group, compression="fp8_e4m3" if rank == 0 else "fp8_e5m2", async_op=True)
        raised[count] = [_outcome(work.wait)[1:], _outcome(lambda: pycomm.all_reduce(t, group=group))[1:]]
    return differ, ran, raised


def test_device_path_on_host_memory():
    results = run_world(device_path_world, 3, timeout=300)
    for rank, (differ, ran, raised) in enumerate(results):
        assert not differ, f"rank {rank}: {len(differ)} cases differ from the native path, e.g. {differ[:3]}"
        assert ran == {"layered-oneshot", "layered-direct"}, ran
        mine, peer, theirs = ("fp8_e4m3", 1, "fp8_e5m2") if rank == 0 else ("fp8_e5m2", 0, "fp8_e4m3")
        for count, outcomes in raised.items():
            for kind, message in outcomes:  # the wait, then the next call
                assert kind == "DistBackendError", (count, kind, message)
                assert "allreduce #1 over gloo on group" in message and f"failed on rank {rank}: rank {peer} called " \
                    f"it with compression {theirs} where this rank has {mine}: ranks called different collectives " \
                    "or arguments (compared on the device" in message, message


def overlap_world(rank, ws):
    """Asynchronous calls on CPU tensors return before the mover has carried them (the last
    rank joins late); several in flight, then a blocking one, keep their order; an error
    reaches wait()."""
    import pycomm

    gloo = dist.new_group(backend="gloo", timeout=group_timeout())
    if rank == ws - 1:
        time.sleep(2)
    started = time.monotonic()
    tensors = [torch.full((1 << 16,), float(rank + i)) for i in range(3)]
    works = [pycomm.all_reduce(t, group=gloo, deterministic="exact", async_op=True) for t in tensors]
    returned = time.monotonic() - started
    pending = [w.is_completed() for w in works]
    last = torch.ones(10)
    pycomm.all_reduce(last, group=gloo)  # blocking: after the three
    finished = [w.is_completed() for w in works]
    for w in works:
        w.wait()
    bad = pycomm.all_reduce(torch.ones(10 + (rank == 0)), group=gloo, async_op=True)
    try:
        bad.wait()
        error = None
    except dist.DistBackendError as e:
        error = str(e)
    return (returned, pending, finished, [t[0].item() for t in tensors], last.sum().item(), error,
            isinstance(bad.exception(), dist.DistBackendError), works[0].algorithm)


def test_asynchronous_calls_overlap_the_caller():
    ws = 3
    results = run_world(overlap_world, ws, timeout=120)
    for rank, (returned, pending, finished, firsts, last, error, failed, algorithm) in enumerate(results):
        if rank < ws - 1:  # the last rank is late: the others' calls cannot have completed
            assert returned < 1.0, f"rank {rank}: async calls took {returned:.2f} s to return"
            assert pending == [False] * 3, f"rank {rank}: completed before the mover carried them: {pending}"
        assert finished == [True] * 3
        assert firsts == [sum(r + i for r in range(ws)) for i in range(3)]
        assert last == 10 * ws
        assert error and "called it with count" in error and failed, error
        assert algorithm == f"{OVER_GLOO} over gloo"
