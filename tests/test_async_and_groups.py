"""Async work handles, several groups (also from two threads), transports, init methods and
a torchrun smoke test."""

import datetime
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.distributed as dist

from _collective_checks import report_failures, run_families
from _harness import BACKEND, group_timeout, is_gloo, run_world

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAIT = datetime.timedelta(seconds=30)


def _flatten(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _flatten(x)]
    return []


# --------------------------------------------------------------------------------------
# async work
# --------------------------------------------------------------------------------------

def _async_cases(rank, ws):
    """name -> fn(async_op) issuing the collective on fresh tensors; returns (work, get)
    where get() reads the result once the work is done (None for barrier).

    Inputs are deterministic, so the sync and async calls must give identical bits."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(ws, 1001, generator=g)  # row r: rank r's contribution

    def all_reduce(async_op):
        t = base[rank].clone()
        return dist.all_reduce(t, async_op=async_op), lambda: t

    def broadcast(async_op):
        t = base[1 % ws].clone() if rank == 1 % ws else torch.zeros(1001)
        return dist.broadcast(t, src=1 % ws, async_op=async_op), lambda: t

    def all_gather_into_tensor(async_op):
        out = torch.zeros(ws * 1001)
        return (dist.all_gather_into_tensor(out, base[rank].clone(), async_op=async_op),
                lambda: out)

    def all_gather(async_op):
        outs = [torch.zeros(1001) for _ in range(ws)]
        return (dist.all_gather(outs, base[rank].clone(), async_op=async_op),
                lambda: torch.stack(outs))

    def reduce_scatter_tensor(async_op):
        out = torch.zeros(7)
        inp = base[rank, :7 * ws].clone()
        return dist.reduce_scatter_tensor(out, inp, async_op=async_op), lambda: out

    def all_to_all_single(async_op):
        out = torch.zeros(7 * ws)
        return (dist.all_to_all_single(out, base[rank, :7 * ws].clone(), async_op=async_op),
                lambda: out)

    def barrier(async_op):
        return dist.barrier(async_op=async_op), lambda: None

    return {f.__name__: f for f in (all_reduce, broadcast, all_gather_into_tensor, all_gather,
                                    reduce_scatter_tensor, all_to_all_single, barrier)}


# Only when validating against gloo: its reduce_scatter_tensor Work has no future and
# reports is_completed() False after wait(); its works complete out of issue order
# (several worker threads).
GLOO_NO_FUTURE = {"reduce_scatter_tensor"}


def _check_work(name, w, get, sync_result, how):
    problems = []
    if w is None:
        return ["%s: async_op=True returned None" % name]
    if how == "future":  # wait through the future only, read the result, then wait()
        w.get_future().wait()
        result = get()
        w.wait()
    elif how == "wait()":
        w.wait()
        result = get()
    else:
        ok = w.wait(timeout=WAIT)
        result = get()
        if ok is False:
            problems.append("%s: wait(timeout) returned False" % name)
    if not w.is_completed() and not (is_gloo() and name in GLOO_NO_FUTURE):
        problems.append("%s: is_completed() is False after %s" % (name, how))
    if result is None:
        return problems
    if not torch.equal(result, sync_result):
        problems.append("%s: async result differs from the synchronous one" % name)
    if is_gloo() and name in GLOO_NO_FUTURE:
        return problems
    value = w.get_future().value()
    if not any(t.shape == result.shape and torch.equal(t, result) for t in _flatten(value)):
        # all_gather (list) hands back a list of tensors: compare their stack.
        flat = _flatten(value)
        if not (flat and sum(t.numel() for t in flat) == result.numel()
                and torch.equal(torch.cat([t.reshape(-1) for t in flat]), result.reshape(-1))):
            problems.append("%s: get_future().value() does not hold the result (%s)"
                            % (name, [tuple(t.shape) for t in flat]))
    return problems


def async_world(rank, ws):
    problems = []
    cases = _async_cases(rank, ws)
    for i, (name, fn) in enumerate(cases.items()):
        _, get_sync = fn(False)
        w, get = fn(True)
        if not isinstance(w.is_completed(), bool):
            problems.append("%s: is_completed() is not a bool" % name)
        problems += _check_work(name, w, get, get_sync(),
                                ["wait()", "wait(timeout)", "future"][i % 3])
    # Several works in flight at once: they complete in issue order, and each is right.
    sizes = [1, 3 * 2 ** 18, 7, 1001, 2 ** 16 + 1, 0, 5, 3 * 2 ** 18 + 1]
    done_order = []
    inflight = []
    for i, n in enumerate(sizes):
        t = torch.full((n,), float(rank + i))
        w = dist.all_reduce(t, async_op=True)
        w.get_future().add_done_callback(lambda _f, i=i: done_order.append(i))
        inflight.append((w, t, float(sum(r + i for r in range(ws)))))
    inflight[-1][0].wait(timeout=WAIT)
    not_done = [i for i, (w, _, _) in enumerate(inflight) if not w.is_completed()]
    in_order = not is_gloo()  # see GLOO_NO_FUTURE
    if not_done and in_order:
        problems.append("works %s not completed after the last issued one" % not_done)
    for i, (w, t, exp) in enumerate(inflight):
        w.wait(timeout=WAIT)
        if not torch.equal(t, torch.full_like(t, exp)):
            problems.append("in-flight work %d (n=%d) wrong result" % (i, t.numel()))
    if done_order != sorted(done_order) and in_order:
        problems.append("completion order %s is not the issue order" % done_order)
    return problems


def test_async_work():
    results = run_world(async_world, 3, timeout=120)
    problems = ["rank %d: %s" % (r, p) for r, ps in enumerate(results) for p in ps]
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------
# several groups, interleaved and from two threads
# --------------------------------------------------------------------------------------

def _member_sum(members, it):
    """all_reduce input of global rank r at iteration it is r + 1 + 100 * it."""
    return float(sum(r + 1 + 100 * it for r in members))


def groups_world(rank, ws):
    assert ws == 4
    problems = []
    # Every rank creates every group, in the same order (torch requires it).
    g_all = dist.new_group(list(range(ws)), timeout=group_timeout())
    g_even = dist.new_group([0, 2], timeout=group_timeout())
    g_odd = dist.new_group([1, 3], timeout=group_timeout())
    g_013 = dist.new_group([0, 1, 3], timeout=group_timeout())  # non-contiguous subset of size 3
    sub, _ = dist.new_subgroups(group_size=2, timeout=group_timeout())  # {0,1}, {2,3}
    parity, parity_members = (g_even, [0, 2]) if rank % 2 == 0 else (g_odd, [1, 3])
    groups = {"default": (None, list(range(ws))), "all": (g_all, list(range(ws))),
              "parity": (parity, parity_members),
              "sub": (sub, [0, 1] if rank < 2 else [2, 3])}
    if rank in (0, 1, 3):
        groups["013"] = (g_013, [0, 1, 3])

    def check(name, t, members, it):
        if not torch.equal(t, torch.full_like(t, _member_sum(members, it))):
            problems.append("group %s iteration %d: got %s expected %s"
                            % (name, it, t[:3].tolist(), _member_sum(members, it)))

    # Interleaved, synchronous. The order of groups is the same on every rank.
    for it in range(10):
        for name, (g, members) in groups.items():
            t = torch.full((1001,), float(rank + 1 + 100 * it))
            dist.all_reduce(t, group=g)
            check(name, t, members, it)
    # Interleaved, all in flight at once, waited in reverse.
    works = []
    for name, (g, members) in groups.items():
        t = torch.full((65537,), float(rank + 1 + 100 * 50))
        works.append((name, dist.all_reduce(t, group=g, async_op=True), t, members))
    for name, w, t, members in reversed(works):
        w.wait(timeout=WAIT)
        check(name, t, members, 50)
    # Rank translation inside a subset group: gather global ranks, broadcast from rank 3.
    if rank in (0, 1, 3):
        out = torch.zeros(3, dtype=torch.int64)
        dist.all_gather_into_tensor(out, torch.tensor([rank]), group=g_013)
        if out.tolist() != [0, 1, 3]:
            problems.append("all_gather on [0,1,3] gave %s" % out.tolist())
        t = torch.tensor([float(rank)])
        dist.broadcast(t, src=3, group=g_013)
        if t.item() != 3.0:
            problems.append("broadcast from global rank 3 in [0,1,3] gave %s" % t.item())
    # Two Python threads at once, each on its own group (every rank is in both groups).
    errors = []

    def loop(name):
        g, members = groups[name]
        try:
            for it in range(30):
                t = torch.full((4099,), float(rank + 1 + 100 * it))
                dist.all_reduce(t, group=g)
                check(name + " (thread)", t, members, it)
        except Exception as e:  # noqa: BLE001
            errors.append("thread on %s raised %s: %s" % (name, type(e).__name__, e))
    threads = [threading.Thread(target=loop, args=(n,), daemon=True) for n in ("parity", "sub")]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
        if th.is_alive():
            errors.append("a thread did not finish in 60 s (hang?)")
    return problems + errors


def test_concurrent_groups_no_cross_talk():
    results = run_world(groups_world, 4, timeout=150)
    problems = ["rank %d: %s" % (r, p) for r, ps in enumerate(results) for p in ps]
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------
# transports, init methods
# --------------------------------------------------------------------------------------

TRANSPORT_FAMILIES = ["all_reduce", "broadcast", "all_gather_into_tensor",
                      "reduce_scatter_tensor", "all_to_all_single", "send_recv",
                      "isend_irecv"]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_transport(transport):
    # gloo ignores the variable: the run then only validates the harness.
    reports = run_world(run_families, 3, args=(TRANSPORT_FAMILIES, 90, True),
                        env={"PYCOMM_TRANSPORT": transport}, pg_timeout=30, timeout=300)
    failures = report_failures(reports, TRANSPORT_FAMILIES)
    assert not failures, "PYCOMM_TRANSPORT=%s (backend %s):\n%s" % (
        transport, BACKEND, "\n".join(failures))


def small_all_reduce(rank, ws):
    t = torch.arange(10, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    return t.tolist()


@pytest.mark.parametrize("init", ["file", "tcp", "env"])
def test_init_method(init):
    results = run_world(small_all_reduce, 2, init=init, timeout=60)
    exp = [float(i * 3) for i in range(10)]
    assert results == [exp, exp]


def public_constructor_world(rank, ws):
    """A pycomm group and a gloo group built from a store, as libraries that make their own
    groups do (torchft), without init_process_group: the same results through torch's
    Backend API."""
    import pycomm

    store = dist.distributed_c10d._get_default_store()
    built = {"pycomm": pycomm.ProcessGroupPycomm(dist.PrefixStore("own-pycomm", store), rank, ws, WAIT),
             "gloo": dist.ProcessGroupGloo(dist.PrefixStore("own-gloo", store), rank, ws, WAIT)}
    got = {}
    for name, pg in built.items():
        assert pg.rank() == rank and pg.size() == ws, name
        t = torch.arange(6, dtype=torch.float32) * (rank + 1)
        pg.allreduce([t]).wait()
        b = torch.full((3,), float(rank))
        pg.broadcast([b], dist.BroadcastOptions()).wait()  # from rank 0
        gathered = [[torch.zeros(2) for _ in range(ws)]]
        pg.allgather(gathered, [torch.full((2,), float(rank))]).wait()
        got[name] = [t.tolist(), b.tolist(), [g.tolist() for g in gathered[0]]]
    return got


def test_public_constructor_builds_a_group_without_init_process_group():
    for rank, got in enumerate(run_world(public_constructor_world, 3, timeout=60)):
        assert got["pycomm"] == got["gloo"], (rank, got)
        assert got["pycomm"][0] == [float(6 * i) for i in range(6)]


# --------------------------------------------------------------------------------------
# torchrun
# --------------------------------------------------------------------------------------

TORCHRUN_SCRIPT = """
    import os
    import torch
    import torch.distributed as dist

    backend = os.environ["PYCOMM_TEST_BACKEND"]
    if backend == "pycomm":
        import pycomm  # noqa: F401
    dist.init_process_group(backend)
    rank, ws = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print("RESULT rank=%d world=%d sum=%.1f" % (rank, ws, t.item()), flush=True)
    dist.destroy_process_group()
"""


def _run_with_deadline(cmd, timeout, env):
    """Run cmd in its own session; on timeout kill that whole session (torchrun's workers
    included) and fail with what it printed."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail("%s timed out after %ss:\n%s" % (cmd, timeout, out[-4000:]))
    return p.returncode, out


def test_torchrun_smoke(tmp_path):
    script = tmp_path / "smoke.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT))
    env = dict(os.environ, PYCOMM_TEST_BACKEND=BACKEND,
               PYTHONPATH=os.pathsep.join(
                   [REPO_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", str(script)]
    rc, out = _run_with_deadline(cmd, 120, env)
    assert rc == 0, "torchrun exited with %d:\n%s" % (rc, out[-4000:])
    for rank in range(2):
        assert "RESULT rank=%d world=2 sum=3.0" % rank in out, out[-4000:]


def _running_all_reduce_after(seen_id):
    """Whether this rank's flight recorder shows an all-reduce begun after operation
    ``seen_id`` and still running."""
    import pycomm

    return any(e["id"] > seen_id and e["collective"] == "allreduce" and e["state"] == "running"
               for e in pycomm.flight_recorder()["entries"])


def eager_world(rank, ws, nbytes, expect_done):
    """Rank 0's async all-reduce while rank 1 holds back: was its Work already completed
    when the call returned, and had rank 1 joined it by then?

    Rank 1 joins only once rank 0 could not have seen the all-reduce finished on a worker
    thread before its check (it never waits a fixed time). Where the call should return at
    once (expect_done False): once rank 0 has looked at is_completed(). Where it should run
    on the calling thread (expect_done True), rank 0 cannot look before rank 1 joins: then
    once rank 0's flight recorder shows the all-reduce running, the call not yet returned.
    Either way rank 0 says "go" through the store after its look, and rank 1 marks its
    arrival in the store before it joins: rank 0 reads that mark right after the call
    returned, so a call that returned completed must also have waited for rank 1."""
    import threading

    import pycomm

    store = dist.distributed_c10d._get_default_store()
    t = torch.ones(nbytes // 4)
    if rank == 1:
        store.wait(["go"], datetime.timedelta(seconds=60))
        store.set("rank 1 joins", "1")
        dist.all_reduce(t, async_op=True).wait()
        return None
    watcher, returned = None, threading.Event()
    if expect_done:
        seen = max((e["id"] for e in pycomm.flight_recorder()["entries"]), default=0)

        def go_once_running():
            while not returned.is_set():
                if _running_all_reduce_after(seen):
                    store.set("go", "1")
                    return
                returned.wait(0.001)  # the look's period, not a delay

        watcher = threading.Thread(target=go_once_running)
        watcher.start()
    w = dist.all_reduce(t, async_op=True)
    done_on_return = w.is_completed()
    returned.set()
    if watcher is not None:
        watcher.join()  # before this thread uses the store
    joined_before_return = store.check(["rank 1 joins"])
    store.set("go", "1")
    w.wait()
    return done_on_return, joined_before_return, bool((t == ws).all())


@pytest.mark.parametrize("eager_bytes,nbytes,done", [
    ("65536", 4096, True),          # small: runs on the calling thread
    ("65536", 1 << 20, False),      # large: handed to the worker, the call returns at once
    ("0", 4096, False),             # eager execution switched off
])
def test_small_async_collectives_run_eagerly(eager_bytes, nbytes, done):
    if is_gloo():
        pytest.skip("PYCOMM_EAGER_BYTES is a pycomm knob")
    results = run_world(eager_world, 2, args=(nbytes, done), env={"PYCOMM_EAGER_BYTES": eager_bytes}, timeout=120)
    assert results[0] == (done, done, True), results
