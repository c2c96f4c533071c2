"""PYCOMM_VERIFY: every N-th all-reduce, all-gather and broadcast of a group compares the
ranks' result hashes. A bit flipped in one rank's result (PYCOMM_FAULT's flip, after the
collective and before the hash) fails that call on every rank, naming the rank and the
call, and the group stays failed; calls between the verified ones pass whatever they
hold; results that agree pass in every mode and over both transports."""

import re

import pytest
import torch
import torch.distributed as dist

from _harness import capture_stderr, group_timeout, is_gloo, run_world

pytestmark = pytest.mark.skipif(is_gloo(), reason="pycomm's verify mode")

WORLD_S = 120


def _outcome(call):
    """None when ``call()`` returns, else the type and message of what it raised."""
    try:
        call()
    except Exception as e:  # noqa: BLE001
        return {"type": type(e).__name__, "msg": str(e)}
    return None


def corruption_world(rank, ws):
    """Groups made with pycomm.Options(verify=1, fault=...): a flip on rank 2 of the second
    all-reduce, of an all-gather and of a broadcast; a flip on one rank of two (no
    majority); then groups that cannot be made."""
    import pycomm

    def group(fault, ranks=None, **settings):
        return dist.new_group(ranks, backend="pycomm", timeout=group_timeout(),
                              pg_options=pycomm.Options(verify=1, fault=fault, **settings))

    out = {}
    g = group("2:allreduce:2:after:flip")
    dist.all_reduce(torch.ones(100), group=g)
    out["allreduce"] = _outcome(lambda: dist.all_reduce(torch.ones(100), group=g))
    out["later"] = _outcome(lambda: dist.all_reduce(torch.ones(100), group=g))
    out["stats"] = pycomm.stats(g)["verify"]
    out["recorder"] = [(e["seq"], e["state"]) for e in pycomm.flight_recorder(g)["entries"]]
    g = group("2:allgather:1:after:flip")
    out["allgather"] = _outcome(lambda: dist.all_gather_into_tensor(torch.empty(4 * ws), torch.ones(4), group=g))
    g = group("2:broadcast:1:after:flip")
    out["broadcast"] = _outcome(lambda: dist.broadcast(torch.ones(8), src=0, group=g))
    g = group("1:allreduce:1:after:flip", ranks=[0, 1])
    if rank < 2:
        out["tie"] = _outcome(lambda: dist.all_reduce(torch.ones(100), group=g))
    out["disagree"] = _outcome(lambda: dist.new_group(backend="pycomm", timeout=group_timeout(),
                                                      pg_options=pycomm.Options(verify=2 if rank == 1 else 1)))
    out["not_options"] = _outcome(lambda: dist.new_group(backend="pycomm", pg_options={"PYCOMM_VERIFY": "1"}))
    return out


def test_a_flipped_bit_fails_the_call_on_every_rank_naming_the_rank_and_the_call():
    results = run_world(corruption_world, 4, timeout=WORLD_S)
    for rank, r in enumerate(results):
        for op, seq in (("allreduce", 2), ("allgather", 1), ("broadcast", 1)):
            e = r[op]
            assert e and e["type"] == "DistBackendError", (rank, op, e)
            assert re.search(r"pycomm: %s #%d \(.*\) on group '[^']+' failed on rank %d: results differ between "
                             r"ranks \(PYCOMM_VERIFY\): the result of rank 2 differs from the majority's "
                             r"\(ranks 0,1,3\)" % (op, seq, rank), e["msg"]), (rank, op, e["msg"])
        assert "(flight recorder: " in r["allreduce"]["msg"], r["allreduce"]
        assert re.search(r"allreduce #3 .*not started: the group failed earlier: .*rank 2 differs",
                         r["later"]["msg"]), r["later"]
        assert r["stats"] == {"every": 1, "verified": 2, "mismatches": 1}, r["stats"]
        assert r["recorder"] == [(1, "completed"), (2, "failed")], r["recorder"]
        if rank < 2:
            assert "with no majority: rank 0 holds one result, rank 1 another" in r["tie"]["msg"], r["tie"]
        assert r["disagree"]["type"] == "ValueError", r["disagree"]
        mine, theirs = ("2", "1") if rank == 1 else ("1", "2")
        assert "PYCOMM_VERIFY=%s where rank %d (this rank) has %s" % (theirs, rank, mine) in r["disagree"]["msg"], \
            r["disagree"]
        assert r["not_options"]["type"] == "TypeError" and "pycomm.Options" in r["not_options"]["msg"], \
            r["not_options"]


def every_third_world(rank, ws):
    """Six all-reduces of the default group, verified every third; rank 2 flips its results
    of #2 (not verified) and #6 (verified)."""
    import pycomm

    _, created = capture_stderr(lambda: dist.new_group(backend="pycomm", timeout=group_timeout()))
    firsts = []

    def five():
        for i in range(1, 6):
            t = torch.full((64,), float(i))
            dist.all_reduce(t)
            firsts.append(t[0].item())

    _, logged = capture_stderr(five)
    out = {"firsts": firsts, "stats": pycomm.stats()["verify"],
           "created": [line for line in created.splitlines() if "verifying" in line],
           "logged": [line for line in logged.splitlines() if " #" in line]}
    out["sixth"] = _outcome(lambda: dist.all_reduce(torch.ones(64)))
    out["seqs"] = [e["seq"] for e in pycomm.flight_recorder()["entries"]]
    return out


def test_every_nth_call_is_verified_and_the_others_pass_silently():
    env = {"PYCOMM_VERIFY": "3", "PYCOMM_FAULT": "2:allreduce:2:after:flip,2:allreduce:6:after:flip",
           "PYCOMM_DEBUG": "INFO"}
    results = run_world(every_third_world, 4, env=env, timeout=WORLD_S)
    for rank, r in enumerate(results):
        sums = [4.0 * i for i in range(1, 6)]
        if rank == 2:  # its flipped #2 went through unverified: the last bit of 8.0 differs
            assert r["firsts"][1] != sums[1] and abs(r["firsts"][1] - sums[1]) < 1e-5, r["firsts"]
            sums[1] = r["firsts"][1]
        assert r["firsts"] == sums, (rank, r["firsts"])
        assert r["stats"] == {"every": 3, "verified": 1, "mismatches": 0}, r["stats"]
        assert len(r["created"]) == 1 and r["created"][0].endswith(
            "; verifying 1 in 3 all-reduces, all-gathers and broadcasts (PYCOMM_VERIFY)"), r["created"]
        e = r["sixth"]
        assert e and e["type"] == "DistBackendError" and "allreduce #6 (" in e["msg"] and \
            "the result of rank 2 differs from the majority's (ranks 0,1,3)" in e["msg"], (rank, e)
        assert r["seqs"] == [1, 2, 3, 4, 5, 6], r["seqs"]  # the exchanges of hashes are not operations
    verified = [line for line in results[0]["logged"] if ", verified, " in line]
    assert len(results[0]["logged"]) == 5 and len(verified) == 1 and "allreduce #3 (" in verified[0], \
        results[0]["logged"]


def agreement_world(rank, ws):
    """Every verified collective with results that agree: all-reduce in each determinism
    mode and compressed, all-gather (into a tensor, into a list, compressed), broadcast;
    over 70000 elements, more than one frame. Returns the wrong results and the counters."""
    import pycomm

    n = 70000
    x = torch.arange(n, dtype=torch.float32) % 7 + rank
    total = ws * (torch.arange(n, dtype=torch.float32) % 7) + sum(range(ws))
    gathered = torch.cat([torch.arange(n, dtype=torch.float32) % 7 + r for r in range(ws)])
    wrong, calls = [], 0

    def check(name, got, want):
        nonlocal calls
        calls += 1
        if want is not None and not torch.equal(got, want):
            wrong.append(name)

    for det in (None, True, "exact"):
        t = x.clone()
        pycomm.all_reduce(t, deterministic=det)
        check("all_reduce deterministic=%s" % det, t, total)
    t = x.clone()
    pycomm.all_reduce(t, compression="fp8_e4m3")
    check("all_reduce fp8", t, None)
    t = x.to(torch.int64)
    dist.all_reduce(t, async_op=True).wait()
    check("all_reduce int64", t, total.to(torch.int64))
    out = torch.empty(ws * n)
    dist.all_gather_into_tensor(out, x)
    check("all_gather_into_tensor", out, gathered)
    pieces = [torch.empty(n) for _ in range(ws)]
    dist.all_gather(pieces, x)
    check("all_gather", torch.cat(pieces), gathered)
    pycomm.all_gather_into_tensor(out, x, compression="fp8_e4m3")
    check("all_gather fp8", out, None)
    b = x.clone()
    dist.broadcast(b, src=1)
    check("broadcast", b, torch.arange(n, dtype=torch.float32) % 7 + 1)
    return wrong, calls, pycomm.stats()["verify"]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_results_that_agree_pass_in_every_mode(transport):
    env = {"PYCOMM_VERIFY": "1", "PYCOMM_TRANSPORT": transport}
    for wrong, calls, counters in run_world(agreement_world, 4, env=env, timeout=WORLD_S):
        assert wrong == [], wrong
        assert counters == {"every": 1, "verified": calls, "mismatches": 0}, (counters, calls)


@pytest.mark.parametrize("value", ["-1", "x", "1.5"])
def test_a_bad_value_fails_group_creation(monkeypatch, value):
    import pycomm

    monkeypatch.setenv("PYCOMM_VERIFY", value)
    expected = r"pycomm: PYCOMM_VERIFY='%s' \(expected an integer in \[0, " % re.escape(value)
    with pytest.raises(ValueError, match=expected):
        pycomm.ProcessGroupPycomm(dist.HashStore(), 0, 1, 5.0, "verify")


def test_options_name_knobs_and_are_checked():
    import pycomm

    assert pycomm.Options(verify=3, deterministic=True) == {"PYCOMM_VERIFY": "3", "PYCOMM_DETERMINISTIC": "1"}
    with pytest.raises(ValueError, match=r"unknown option PYCOMM_VERFY \(the knobs are PYCOMM_ALGO, "):
        pycomm.ProcessGroupPycomm(dist.HashStore(), 0, 1, 5.0, "verify", pycomm.Options(verfy=3))
    with pytest.raises(ValueError, match=r"PYCOMM_VERIFY='x'"):
        pycomm.ProcessGroupPycomm(dist.HashStore(), 0, 1, 5.0, "verify", pycomm.Options(verify="x"))
