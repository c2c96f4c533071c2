"""Bad input is rejected on the calling rank, clearly, and leaves the group usable;
mismatches between ranks become errors, never hangs (docs/design.md, 'Fault model').

Bad-input cases all run in ONE world of 2 ranks (a module fixture): every rank makes the
same bad call on a fresh group, the outcome is recorded, then a correct all_reduce on that
same group must still work. The parametrized tests judge the recorded outcomes.

Some cases go through the process group's backend object directly
(``group._get_backend(cpu)``): for those inputs torch's front end either rejects them
itself (complex MAX, broadcast root outside a subgroup) or never calls the backend at all
(meta tensors have a no-op meta kernel), and the point is the backend's own check.
"""

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from _harness import BACKEND, is_gloo, run_world

PG_TIMEOUT_S = 10
SIDE_TIMEOUT_S = 60
# "Before any communication": a local rejection takes milliseconds; allow scheduling noise.
LOCAL_REJECT_S = 2.0
# The contract: bad input raises ValueError (TypeError where torch's front end rejects a
# type first). Gloo, which the harness can run instead, raises RuntimeError too.
ACCEPTED = ("ValueError", "TypeError") + (("RuntimeError",) if is_gloo() else ())


# --------------------------------------------------------------------------------------
# bad-input cases (run inside ranks). Each returns None (nothing to check) or a list of
# problems with the result when the call did not raise.
# --------------------------------------------------------------------------------------

def _backend(group):
    return group._get_backend(torch.device("cpu"))


def _allreduce_opts(op_name):
    o = dist.AllreduceOptions()
    o.reduceOp = getattr(dist.ReduceOp, op_name)
    return o


def _sum_or_problem(t, ws, dtype_name):
    """Result check for 'error or correct' dtype cases: inputs are all ones."""
    got = t.to(torch.float64)
    if torch.equal(got, torch.full_like(got, float(ws))):
        return []
    return ["%s SUM of ones gave %s, expected %d" % (dtype_name, got.tolist(), ws)]


def case_complex128_max(g, rank, ws):
    t = torch.ones(3, dtype=torch.complex128)
    _backend(g).allreduce([t], _allreduce_opts("MAX")).wait()
    return ["complex128 MAX did not raise"]


def _dtype_sum_case(dtype_name):
    def case(g, rank, ws):
        dtype = getattr(torch, dtype_name)
        t = torch.ones(5, dtype=dtype)
        dist.all_reduce(t, group=g)
        return _sum_or_problem(t, ws, dtype_name)
    case.__name__ = "case_%s_sum" % dtype_name
    return case


case_float8_e4m3fn_sum = _dtype_sum_case("float8_e4m3fn")
case_uint16_sum = _dtype_sum_case("uint16")
case_uint32_sum = _dtype_sum_case("uint32")


def case_bool_avg(g, rank, ws):
    dist.all_reduce(torch.ones(3, dtype=torch.bool), op=dist.ReduceOp.AVG, group=g)
    return ["bool AVG did not raise"]


def case_all_gather_into_tensor_output_size(g, rank, ws):
    dist.all_gather_into_tensor(torch.zeros(ws * 3 + 1), torch.ones(3), group=g)
    return ["output of ws*n+1 elements accepted"]


def case_all_gather_into_tensor_dtype(g, rank, ws):
    dist.all_gather_into_tensor(torch.zeros(ws * 3, dtype=torch.float64), torch.ones(3),
                                group=g)
    return ["float64 output for float32 input accepted"]


def case_reduce_scatter_tensor_input_size(g, rank, ws):
    dist.reduce_scatter_tensor(torch.zeros(3), torch.ones(ws * 3 + 1), group=g)
    return ["input of ws*n+1 elements accepted"]


def case_all_gather_list_length(g, rank, ws):
    dist.all_gather([torch.zeros(3) for _ in range(ws + 1)], torch.ones(3), group=g)
    return ["output list of ws+1 tensors accepted"]


def case_reduce_scatter_list_length(g, rank, ws):
    dist.reduce_scatter(torch.zeros(3), [torch.ones(3) for _ in range(ws - 1)], group=g)
    return ["input list of ws-1 tensors accepted"]


def case_all_to_all_list_length(g, rank, ws):
    dist.all_to_all([torch.zeros(3) for _ in range(ws + 1)],
                    [torch.ones(3) for _ in range(ws + 1)], group=g)
    return ["lists of ws+1 tensors accepted"]


def case_meta_tensor(g, rank, ws):
    _backend(g).allreduce([torch.ones(3, device="meta")]).wait()
    return ["meta tensor accepted"]


def _broadcast_root_case(root_of_ws):
    def case(g, rank, ws):
        o = dist.BroadcastOptions()
        o.rootRank = root_of_ws(ws)
        o.rootTensor = 0
        _backend(g).broadcast([torch.ones(3)], o).wait()
        return ["root %d accepted" % root_of_ws(ws)]
    return case


case_broadcast_root_world_size = _broadcast_root_case(lambda ws: ws)
case_broadcast_root_negative = _broadcast_root_case(lambda ws: -1)


def case_noncontiguous_all_reduce(g, rank, ws):
    """A strided view: either rejected, or reduced correctly without touching the gaps."""
    base = torch.arange(10, dtype=torch.float32)
    dist.all_reduce(base[::2], group=g)
    exp = torch.arange(10, dtype=torch.float32)
    exp[::2] *= ws
    return [] if torch.equal(base, exp) else ["strided all_reduce gave %s, expected %s"
                                               % (base.tolist(), exp.tolist())]


def case_noncontiguous_broadcast(g, rank, ws):
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = (src.clone() if rank == 0 else torch.zeros(3, 4)).t()  # transposed view
    dist.broadcast(t, src=dist.get_global_rank(g, 0), group=g)
    return [] if torch.equal(t, src.t()) else ["transposed broadcast gave %s" % t.tolist()]


def case_noncontiguous_all_gather_input(g, rank, ws):
    inp = (torch.arange(12, dtype=torch.float32) + 100 * rank)[::2]
    out = torch.zeros(ws * 6)
    dist.all_gather_into_tensor(out, inp, group=g)
    exp = torch.cat([(torch.arange(12, dtype=torch.float32) + 100 * r)[::2]
                     for r in range(ws)])
    return [] if torch.equal(out, exp) else ["strided all_gather gave %s" % out.tolist()]


# name -> (function, must the call raise?). "error or correct" cases may instead return a
# correct result: these inputs are supportable, the contract only forbids silent garbage.
BAD_INPUT_CASES = {
    "complex128 MAX (backend)": (case_complex128_max, True),
    "float8_e4m3fn SUM": (case_float8_e4m3fn_sum, False),
    "uint16 SUM": (case_uint16_sum, False),
    "uint32 SUM": (case_uint32_sum, False),
    "bool AVG": (case_bool_avg, True),
    "all_gather_into_tensor output size": (case_all_gather_into_tensor_output_size, True),
    "all_gather_into_tensor dtype": (case_all_gather_into_tensor_dtype, True),
    "reduce_scatter_tensor input size": (case_reduce_scatter_tensor_input_size, True),
    "all_gather list length": (case_all_gather_list_length, True),
    "reduce_scatter list length": (case_reduce_scatter_list_length, True),
    "all_to_all list length": (case_all_to_all_list_length, True),
    "meta tensor (backend)": (case_meta_tensor, True),
    "broadcast root == world size (backend)": (case_broadcast_root_world_size, True),
    "broadcast root -1 (backend)": (case_broadcast_root_negative, True),
    "non-contiguous all_reduce": (case_noncontiguous_all_reduce, False),
    "non-contiguous broadcast": (case_noncontiguous_broadcast, False),
    "non-contiguous all_gather_into_tensor input": (case_noncontiguous_all_gather_input, False),
}

# Only when validating the suite against gloo: cases gloo cannot survive or gets wrong.
GLOO_SKIPS = {
    "reduce_scatter_tensor input size": "gloo aborts the process (CHECK failure)",
    "non-contiguous all_reduce": "gloo silently reduces the wrong elements",
}


def _first_lines(exc, n=3):
    return " | ".join(str(exc).strip().splitlines()[:n])[:800]


def bad_input_world(rank, ws, names):
    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=SIDE_TIMEOUT_S))
    outcomes = {}
    for name in names:
        fn, _ = BAD_INPUT_CASES[name]
        if is_gloo() and name in GLOO_SKIPS:
            outcomes[name] = {"skipped": GLOO_SKIPS[name]}
            continue
        g = dist.new_group(timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        out = {"skipped": None, "raised": False}
        t0 = time.monotonic()
        try:
            out["problems"] = fn(g, rank, ws) or []
        except Exception as e:  # noqa: BLE001 - the outcome is what we record
            out.update(raised=True, type=type(e).__name__,
                       accepted_type=type(e).__name__ in ACCEPTED,
                       msg=_first_lines(e))
        out["elapsed"] = time.monotonic() - t0
        dist.barrier(group=side)  # lock step, even if one rank hung until the timeout
        # The same group must still work after rejecting bad input.
        try:
            t = torch.ones(5)
            dist.all_reduce(t, group=g)
            out["after"] = None if torch.equal(t, torch.full((5,), float(ws))) else \
                "all_reduce afterwards gave %s" % t.tolist()
        except Exception as e:  # noqa: BLE001
            out["after"] = "all_reduce afterwards raised %s: %s" % (type(e).__name__,
                                                                    _first_lines(e))
        dist.barrier(group=side)
        outcomes[name] = out
    return outcomes


@pytest.fixture(scope="module")
def bad_input_outcomes():
    return run_world(bad_input_world, 2, args=(list(BAD_INPUT_CASES),),
                     pg_timeout=PG_TIMEOUT_S, timeout=240)


@pytest.mark.parametrize("name", list(BAD_INPUT_CASES))
def test_bad_input(bad_input_outcomes, name):
    _, must_raise = BAD_INPUT_CASES[name]
    per_rank = [o[name] for o in bad_input_outcomes]
    if per_rank[0]["skipped"]:
        pytest.skip(per_rank[0]["skipped"])
    problems = []
    for rank, o in enumerate(per_rank):
        if o["raised"]:
            # Printed so that the messages can be reviewed (pytest -s / -rA).
            print("rank %d: %s: %s: %s" % (rank, name, o["type"], o["msg"]))
            if not o["accepted_type"]:
                problems.append("rank %d raised %s, expected one of %s"
                                % (rank, o["type"], ACCEPTED))
            if not is_gloo() and "pycomm" not in o["msg"].lower():
                problems.append("rank %d: message does not mention pycomm: %r"
                                % (rank, o["msg"]))
            if o["elapsed"] > LOCAL_REJECT_S:
                problems.append("rank %d: rejection took %.1fs (communicated first?)"
                                % (rank, o["elapsed"]))
        elif must_raise:
            problems.append("rank %d: did not raise (%s)" % (rank, o["problems"]))
        else:
            problems += ["rank %d: no error and wrong result: %s" % (rank, p)
                         for p in o["problems"]]
        if o["after"]:
            problems.append("rank %d: group unusable after the bad call: %s"
                            % (rank, o["after"]))
    raised = {o["raised"] for o in per_rank}
    if len(raised) > 1:
        problems.append("only some ranks raised: %s" % [o["raised"] for o in per_rank])
    assert not problems, "%s (backend %s):\n%s" % (name, BACKEND, "\n".join(problems))


# --------------------------------------------------------------------------------------
# mismatches between ranks
# --------------------------------------------------------------------------------------

MISMATCH_PG_TIMEOUT_S = 10
MISMATCH_DEADLINE_S = 60
# Each rank must be out of its call by the group timeout plus detection/teardown slack.
MISMATCH_BOUND_S = MISMATCH_PG_TIMEOUT_S + 5


def _mismatched_call(kind, rank):
    if kind == "count":          # rank 0: 10 floats, rank 1: 12 floats
        dist.all_reduce(torch.ones(10 + 2 * rank))
    elif kind == "collective":   # rank 0 all_reduce, rank 1 broadcast
        if rank == 0:
            dist.all_reduce(torch.ones(10))
        else:
            dist.broadcast(torch.ones(10), src=1)
    elif kind == "dtype":        # same byte count, different dtype
        dist.all_reduce(torch.ones(10, dtype=torch.float32 if rank == 0 else torch.int32))
    elif kind == "op":
        dist.all_reduce(torch.ones(10),
                        op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
    else:
        raise ValueError(kind)


def mismatch_world(rank, ws, kind):
    t0 = time.monotonic()
    try:
        _mismatched_call(kind, rank)
        return {"raised": False, "elapsed": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001
        return {"raised": True, "type": type(e).__name__, "msg": _first_lines(e),
                "runtime_error": isinstance(e, RuntimeError),
                "elapsed": time.monotonic() - t0}


# gloo aborts the process on a count mismatch and does not detect dtype/op mismatches:
# those cases test pycomm's header fingerprint (docs/design.md, 'Fault model'), not the harness.
MISMATCH_GLOO_SKIPS = {"count": "gloo aborts the process",
                       "dtype": "gloo does not detect it",
                       "op": "gloo does not detect it"}


@pytest.mark.parametrize("kind", ["count", "collective", "dtype", "op"])
def test_rank_mismatch_raises_not_hangs(kind):
    if is_gloo() and kind in MISMATCH_GLOO_SKIPS:
        pytest.skip(MISMATCH_GLOO_SKIPS[kind])
    results = run_world(mismatch_world, 2, args=(kind,), pg_timeout=MISMATCH_PG_TIMEOUT_S,
                        timeout=MISMATCH_DEADLINE_S)
    for rank, r in enumerate(results):
        print("rank %d: %s" % (rank, r))
    assert any(r["raised"] for r in results), "%s mismatch raised on no rank: %s" % (
        kind, results)
    problems = []
    for rank, r in enumerate(results):
        if r["elapsed"] > MISMATCH_BOUND_S:
            problems.append("rank %d left the call after %.1fs (> %ss)"
                            % (rank, r["elapsed"], MISMATCH_BOUND_S))
        if r["raised"] and not r["runtime_error"]:
            problems.append("rank %d raised %s, expected a RuntimeError" % (rank, r["type"]))
        if r["raised"] and not is_gloo() and "pycomm" not in r["msg"].lower():
            problems.append("rank %d: message does not mention pycomm: %r" % (rank, r["msg"]))
    assert not problems, "\n".join(problems)


KNOB_PG_TIMEOUT_S = 60


def knob_mismatch_world(rank, ws):
    """Ranks differ in a knob that decides which path an all-reduce on CUDA tensors takes."""
    import os

    os.environ["PYCOMM_CUDA_FLAG_BYTES"] = "0" if rank == 1 else "65536"
    t0 = time.monotonic()
    try:
        dist.new_group(backend=BACKEND, timeout=datetime.timedelta(seconds=KNOB_PG_TIMEOUT_S))
    except Exception as e:  # noqa: BLE001
        return {"raised": True, "type": type(e).__name__, "msg": str(e), "elapsed": time.monotonic() - t0}
    return {"raised": False, "elapsed": time.monotonic() - t0}


@pytest.mark.skipif(is_gloo(), reason="pycomm's own knobs")
def test_ranks_differing_in_a_shared_knob_fail_at_group_creation_naming_it():
    results = run_world(knob_mismatch_world, 2, timeout=KNOB_PG_TIMEOUT_S)
    for rank, r in enumerate(results):
        mine, theirs = ("0", "65536") if rank == 1 else ("65536", "0")
        assert r["raised"], "rank %d created the group: %s" % (rank, r)
        assert r["type"] == "ValueError", r
        assert "PYCOMM_CUDA_FLAG_BYTES=%s where rank %d (this rank) has %s" % (theirs, rank, mine) in r["msg"], r
        assert r["elapsed"] < KNOB_PG_TIMEOUT_S / 2, "rank %d waited %.1f s instead of failing at once" % (
            rank, r["elapsed"])


RANK0_CHECKED = "rank 0 checked"
PEER_EXIT_WORLD_S = 120


def peer_exits_before_connecting_world(rank, ws, passed_dir):
    """Over TCP a rank connects at creation only to the ranks at power-of-two ring distances:
    at 8 ranks, rank 3 and rank 0 have no connection until an operation between them. Rank
    3 is killed; rank 0 waits for it in a recv meanwhile, which connects to it (refused:
    rank 3 is gone), or finds it exited while connecting, or lost once connected."""
    import os
    import signal

    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    # Rank 3 dies once every rank has left the barrier: a socket closed with unread input
    # resets the connection, and could take the barrier's last frame from a slower rank.
    open(os.path.join(passed_dir, str(rank)), "w").close()
    if rank == 3:
        deadline = time.monotonic() + 60
        while len(os.listdir(passed_dir)) < ws and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    if rank != 0:
        # Stays connected until rank 0 is done with its check, and takes no part in it:
        # rank 0 says so through the store, whatever its outcome (its recv gives up at the
        # group's timeout, within this wait's).
        store.wait([RANK0_CHECKED], datetime.timedelta(seconds=PEER_EXIT_WORLD_S - 10))
        return None
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError) as info:
            dist.recv(torch.empty(4), src=3)
    finally:
        store.set(RANK0_CHECKED, "1")
    return time.monotonic() - started, str(info.value)


@pytest.mark.large
@pytest.mark.skipif(is_gloo(), reason="pycomm's failure detection")
def test_peer_that_exits_before_the_pair_connected_fails_the_wait_at_once(tmp_path):
    results = run_world(peer_exits_before_connecting_world, 8, args=(str(tmp_path),), env={"PYCOMM_TRANSPORT": "tcp"},
                        pg_timeout=60, timeout=PEER_EXIT_WORLD_S, expect_killed=(3,))
    seconds, message = results[0]
    assert seconds < 10, (seconds, message)
    assert "rank 3" in message, message
    assert any(why in message for why in ("exited before it connected", "refused: it has exited", "lost")), message
