"""What a drop-in replacement for Gloo must do that PyTorch's own distributed suite found
missing: recv from any source, all_gather_coalesced in torch's layout, the backend's name
where torch and DDP read it, and sparse all-reduce (values against Gloo's, in the same
processes). `make conformance` runs the whole suite; these are its findings, kept."""

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _harness import group_timeout, is_gloo, run_world

TRANSPORTS = ["shm", "tcp"]


# --------------------------------------------------------------------------------------
# recv from any source
# --------------------------------------------------------------------------------------

def _payload(sender, numel, round_):
    return torch.arange(numel, dtype=torch.float32) + 1000.0 * sender + 0.5 * round_


def any_source_world(rank, ws, numel, rounds):
    """Rank 0 receives every other rank's sends without naming the source, blocking and
    asynchronously; each payload says who sent it, which must be the rank torch reports."""
    if rank != 0:
        for r in range(rounds):
            dist.send(_payload(rank, numel, r), dst=0, tag=7)
        return None
    seen = []
    for r in range(rounds):
        for _ in range(ws - 1):
            t = torch.empty(numel)
            src = dist.recv(t, tag=7)
            round_of_src = sum(1 for s in seen if s == src)
            assert torch.equal(t, _payload(src, numel, round_of_src)), (src, t[:4])
            seen.append(src)
    assert sorted(seen) == sorted(list(range(1, ws)) * rounds), seen
    return seen


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("numel", [1, 3 << 18])  # one frame; several (3 MiB)
def test_recv_from_any_source_several_senders(transport, numel):
    results = run_world(any_source_world, 4, args=(numel, 3), env={"PYCOMM_TRANSPORT": transport},
                        timeout=120)
    assert len(results[0]) == 9


def irecv_any_world(rank, ws):
    """A posted irecv from any source reports its sender through Work.source_rank(), and
    a recv named for a peer still takes that peer's message while it is posted."""
    if rank == 0:
        t_any = torch.empty(5)
        work = dist.irecv(t_any, tag=3)  # only rank 2 sends with tag 3
        t_named = torch.empty(5)
        dist.recv(t_named, src=1, tag=4)
        work.wait()
        assert torch.equal(t_named, torch.full((5,), 1.0))
        assert torch.equal(t_any, torch.full((5,), 2.0))
        return work._source_rank()
    if rank == 1:
        dist.send(torch.full((5,), 1.0), dst=0, tag=4)
    if rank == 2:
        dist.send(torch.full((5,), 2.0), dst=0, tag=3)
    return None


def test_irecv_from_any_source_reports_sender():
    assert run_world(irecv_any_world, 3, timeout=90)[0] == 2


def any_source_nobody_sends_world(rank, ws):
    if rank == 0:
        started = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            dist.recv(torch.empty(4))
        return time.monotonic() - started, str(info.value)
    time.sleep(8)  # outlives rank 0's deadline, never sends
    return None


@pytest.mark.skipif(is_gloo(), reason="pycomm's deadline and message")
def test_recv_from_any_source_times_out_at_the_deadline():
    seconds, message = run_world(any_source_nobody_sends_world, 2, pg_timeout=3, timeout=90)[0]
    assert 2.5 < seconds < 7, seconds
    assert "from any rank" in message and "recv" in message, message


def any_source_sender_dies_world(rank, ws):
    if rank == 1:
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        dist.recv(torch.empty(4))
    return time.monotonic() - started, str(info.value)


@pytest.mark.skipif(is_gloo(), reason="pycomm's failure detection")
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_recv_from_any_source_fails_when_a_sender_dies(transport):
    results = run_world(any_source_sender_dies_world, 2, env={"PYCOMM_TRANSPORT": transport},
                        pg_timeout=60, timeout=90, expect_killed=(1,))
    seconds, message = results[0]
    assert seconds < 10, (seconds, message)
    assert "rank 1" in message, message


# --------------------------------------------------------------------------------------
# point-to-point matched by (source, tag)
# --------------------------------------------------------------------------------------

HELD_ASIDE = 1 << 18  # float32 elements a pair surely holds aside without a posted recv


def _tagged(sender, tag, numel):
    return torch.arange(numel, dtype=torch.float32) + 1000.0 * sender + 100.0 * tag


def out_of_order_tags_world(rank, ws, numel):
    """Rank 0 sends tag 1 then tag 2; rank 1 posts the receive of tag 2 first. Through
    pycomm's group and a Gloo group in the same processes: both deliver both, each to the
    receive of its tag (messages larger than a pair holds aside too: the receive of tag 1
    is posted). Then blocking receives in the other order than the blocking sends, which
    pycomm serves for messages it can hold aside (the first waits for its recv) and Gloo
    does not (its send waits for the matching recv: both ranks block until the timeout)."""
    gloo = dist.new_group(backend="gloo")
    got = {}
    for name, group in (("pycomm", None), ("gloo", gloo)):
        if rank == 0:
            works = [dist.isend(_tagged(0, tag, numel), 1, group=group, tag=tag) for tag in (1, 2)]
            for w in works:
                w.wait()
        elif rank == 1:
            x, y = torch.empty(numel), torch.empty(numel)
            works = [dist.irecv(x, 0, group=group, tag=2), dist.irecv(y, 0, group=group, tag=1)]
            for work in works:
                work.wait()
            got[name] = (x, y)
        dist.barrier(group=gloo)
    if numel > HELD_ASIDE:
        for ours, theirs, tag in zip(got.get("pycomm", ()), got.get("gloo", ()), (2, 1)):
            assert torch.equal(theirs, _tagged(0, tag, numel)) and torch.equal(ours, theirs), tag
        return True
    if rank == 0:
        dist.send(_tagged(0, 3, numel), 1, tag=3)
        dist.send(_tagged(0, 4, numel), 1, tag=4)
        return True
    z, w = torch.empty(numel), torch.empty(numel)
    dist.recv(w, 0, tag=4)
    dist.recv(z, 0, tag=3)
    assert torch.equal(z, _tagged(0, 3, numel)) and torch.equal(w, _tagged(0, 4, numel))
    for ours, theirs, tag in zip(got["pycomm"], got["gloo"], (2, 1)):
        assert torch.equal(theirs, _tagged(0, tag, numel)), tag
        assert torch.equal(ours, theirs), tag
    return True


@pytest.mark.skipif(is_gloo(), reason="compares pycomm with gloo")
@pytest.mark.parametrize("transport", TRANSPORTS)
# One frame; several shm frames (600 KB); more than a pair holds aside without a posted
# recv (chunk x pipeline depth: 4 MiB over TCP by default), 8 MB.
@pytest.mark.parametrize("numel", [1000, 150_000, 2_000_000])
def test_receives_match_sends_by_tag_as_on_gloo(transport, numel):
    assert run_world(out_of_order_tags_world, 2, args=(numel,), env={"PYCOMM_TRANSPORT": transport},
                     timeout=120) == [True, True]


def any_source_behind_other_tag_world(rank, ws):
    """Rank 1 sends tag 5, then tag 6; rank 0 receives tag 6 from any source first, then tag
    5 from rank 1, on pycomm's group and on a Gloo group: the same values and source."""
    gloo = dist.new_group(backend="gloo")
    got = {}
    for name, group in (("pycomm", None), ("gloo", gloo)):
        if rank == 1:  # asynchronous: Gloo's send would wait for the recv of its tag
            works = [dist.isend(_tagged(1, tag, 10), 0, group=group, tag=tag) for tag in (5, 6)]
            for w in works:
                w.wait()
        elif rank == 0:
            six, five = torch.empty(10), torch.empty(10)
            source = dist.recv(six, group=group, tag=6)
            dist.recv(five, 1, group=group, tag=5)
            got[name] = (source, six, five)
        dist.barrier(group=gloo)
    if rank == 0:
        (s_ours, six_ours, five_ours), (s_gloo, six_gloo, five_gloo) = got["pycomm"], got["gloo"]
        assert s_ours == s_gloo == 1
        assert torch.equal(six_gloo, _tagged(1, 6, 10)) and torch.equal(five_gloo, _tagged(1, 5, 10))
        assert torch.equal(six_ours, six_gloo) and torch.equal(five_ours, five_gloo)
    return True


@pytest.mark.skipif(is_gloo(), reason="compares pycomm with gloo")
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_any_source_receive_behind_a_message_of_another_tag(transport):
    assert run_world(any_source_behind_other_tag_world, 2, env={"PYCOMM_TRANSPORT": transport},
                     timeout=120) == [True, True]


def tag_mismatch_world(rank, ws):
    """The same tag, a different dtype: an error naming the send and the recv."""
    if rank == 0:
        dist.send(torch.ones(10), 1, tag=3)
        return None
    with pytest.raises(RuntimeError) as info:
        dist.recv(torch.empty(10, dtype=torch.float64), 0, tag=3)
    return str(info.value)


@pytest.mark.skipif(is_gloo(), reason="pycomm's message")
def test_same_tag_different_dtype_is_an_error_naming_send_and_recv():
    message = run_world(tag_mismatch_world, 2, pg_timeout=20, timeout=90)[1]
    assert "send #0 (float32, 10 elements, tag 3)" in message, message
    assert "recv #0 (float64, 10 elements, tag 3)" in message, message


def _gone(pid):
    """Whether process `pid` has exited (a zombie has)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except (OSError, IndexError):
        return True


def send_then_exit_world(rank, ws):
    """Rank 0 sends to rank 3 (not a neighbour: over TCP, not connected at creation), its
    send completes, it destroys its group and exits; rank 3 receives once rank 0's process
    is gone and its liveness checks (every 100 ms) have had time to notice."""
    pids = [None] * ws  # over gloo: the pycomm group's pairs stay as creation left them
    dist.all_gather_object(pids, os.getpid(), group=dist.new_group(backend="gloo", timeout=group_timeout()))
    if rank == 0:
        dist.send(_tagged(0, 0, 1024), 3)
        dist.destroy_process_group()
        return True
    if rank == 3:
        while not _gone(pids[0]):  # the world's deadline bounds the wait
            time.sleep(0.05)
        time.sleep(1)
        t = torch.empty(1024)
        dist.recv(t, 0)
        return torch.equal(t, _tagged(0, 0, 1024))
    return True


@pytest.mark.large  # 6 ranks
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_completed_send_is_delivered_after_its_sender_exits(transport):
    assert run_world(send_then_exit_world, 6, env={"PYCOMM_TRANSPORT": transport},
                     timeout=120) == [True] * 6


# --------------------------------------------------------------------------------------
# sparse all-reduce
# --------------------------------------------------------------------------------------

def _sparse_input(rank, ws, dtype, case):
    """Rank-dependent COO tensors: overlapping and disjoint indices, duplicates within a
    rank (uncoalesced), an empty rank, dense dimensions, values that round differently
    by summation order."""
    g = torch.Generator().manual_seed(100 * case + rank)
    if case == 0:  # 1-D, overlapping, uncoalesced
        idx = torch.randint(0, 50, (1, 30), generator=g)
        shape = (50,)
    elif case == 1:  # 2-D sparse dims, 3 dense
        idx = torch.stack([torch.randint(0, 7, (20,), generator=g), torch.randint(0, 5, (20,), generator=g)])
        shape = (7, 5, 3)
    elif case in (2, 4):  # rank 1 contributes nothing; nobody does
        n = 0 if rank == 1 or case == 4 else 12
        idx = torch.randint(0, 1000, (1, n), generator=g)
        shape = (1000, 2)
    else:  # disjoint per rank
        idx = (torch.arange(8) * ws + rank).unsqueeze(0)
        shape = (8 * ws,)
    vshape = (idx.shape[1],) + tuple(shape[idx.shape[0]:])
    if dtype.is_floating_point:
        values = (torch.randn(vshape, generator=g, dtype=torch.float64) * 10 ** rank).to(dtype)
    else:
        values = torch.randint(-100, 100, vshape, generator=g).to(dtype)
    return torch.sparse_coo_tensor(idx, values, shape)


def _fsum_per_entry(contributions):
    """Values of the coalesced sum of sparse `contributions`, each entry math.fsum's
    correctly rounded sum of its terms, as float64."""
    import math

    terms = {}
    for t in contributions:
        t = t.coalesce()
        for i, key in enumerate(map(tuple, t.indices().t().tolist())):
            terms.setdefault(key, []).append(t.values()[i].double())
    dense_shape = contributions[0].shape[contributions[0].sparse_dim():]
    rows = []
    for key in sorted(terms):
        stacked = torch.stack(terms[key]).reshape(len(terms[key]), -1)
        rows.append(torch.tensor([math.fsum(col) for col in stacked.t().tolist()],
                                 dtype=torch.float64).reshape(dense_shape))
    return torch.stack(rows) if rows else torch.empty((0,) + tuple(dense_shape), dtype=torch.float64)


def sparse_world(rank, ws, determinism):
    """Each case through pycomm's group and through a Gloo group in the same processes."""
    gloo = dist.new_group(backend="gloo")
    checked = 0
    for dtype in (torch.float32, torch.float64, torch.int64):
        for case in range(5):
            mine = _sparse_input(rank, ws, dtype, case)
            ours, theirs = mine.clone(), mine.clone()
            dist.all_reduce(ours)
            dist.all_reduce(theirs, group=gloo)
            assert ours.is_coalesced() and ours.dtype == dtype and ours.shape == mine.shape
            theirs = theirs.coalesce()
            assert torch.equal(ours.indices(), theirs.indices()), (dtype, case)
            if determinism == "exact" and dtype.is_floating_point:
                # Exact mode rounds the exact sum once: math.fsum's correctly rounded sum.
                expected = _fsum_per_entry([_sparse_input(r, ws, dtype, case) for r in range(ws)])
                assert torch.equal(ours.values(), expected.to(dtype)), (dtype, case)
            else:
                assert torch.equal(ours.values(), theirs.values()), (dtype, case)
            checked += 1
    # The same bits on every rank.
    flat = torch.cat([ours.indices().flatten().double(), ours.values().flatten().double()])
    gathered = [torch.empty_like(flat) for _ in range(ws)]
    dist.all_gather(gathered, flat, group=gloo)
    assert all(torch.equal(x, flat) for x in gathered)
    return checked


@pytest.mark.skipif(is_gloo(), reason="compares pycomm with gloo")
@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("determinism", ["0", "exact"])
def test_sparse_all_reduce_equals_gloo(ws, determinism):
    results = run_world(sparse_world, ws, args=(determinism,), env={"PYCOMM_DETERMINISTIC": determinism},
                        timeout=120)
    assert results == [15] * ws


def sparse_ddp_world(rank, ws, steps):
    """An nn.Embedding(sparse=True) trained by DDP on pycomm and, in the same processes from
    the same start, on a Gloo group: the same parameters after every step. (Its only
    gradient is sparse: dense all-reduces of 3 ranks add in another order than Gloo's ring.)"""
    from torch.nn.parallel import DistributedDataParallel as DDP

    gloo = dist.new_group(backend="gloo")

    def model():
        torch.manual_seed(0)
        return torch.nn.Embedding(100, 8, sparse=True)

    ours, theirs = DDP(model()), DDP(model(), process_group=gloo)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        ids = torch.randint(0, 100, (16,), generator=g)
        target = torch.randn(16, 1, generator=g)
        for m, opt in zip((ours, theirs), optims):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(ids).sum(1, keepdim=True), target).backward()
            opt.step()
        for a, b in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(a, b), (step, (a - b).abs().max())
    assert ours.module.weight.grad.is_sparse
    return steps


@pytest.mark.large
@pytest.mark.skipif(is_gloo(), reason="compares pycomm with gloo")
def test_ddp_sparse_embedding_trains_as_on_gloo():
    assert run_world(sparse_ddp_world, 3, args=(10,), timeout=120) == [10] * 3


# --------------------------------------------------------------------------------------
# all_gather_coalesced, the backend's name
# --------------------------------------------------------------------------------------

def all_gather_coalesced_world(rank, ws):
    """torch's layout: outputs[r][i] is rank r's inputs[i]; mixed shapes, an empty input."""
    shapes = [(3,), (2, 4), (0,), (1, 1, 5)]
    inputs = [torch.full(s, float(10 * rank + i)) for i, s in enumerate(shapes)]
    outputs = [[torch.empty(s) for s in shapes] for _ in range(ws)]
    dist.all_gather_coalesced(outputs, inputs)
    for r in range(ws):
        for i, s in enumerate(shapes):
            assert outputs[r][i].shape == s
            assert torch.equal(outputs[r][i], torch.full(s, float(10 * r + i))), (r, i)
    if not is_gloo():  # Gloo raises a RuntimeError
        bad = [[torch.empty(s) for s in shapes]]  # one list, not one per rank
        with pytest.raises(ValueError, match="output lists"):
            dist.all_gather_coalesced(bad, inputs)
    return True


@pytest.mark.parametrize("ws", [2, 3])
def test_all_gather_coalesced_layout(ws):
    assert run_world(all_gather_coalesced_world, ws, timeout=90) == [True] * ws


def backend_name_world(rank, ws):
    """The name torch and DDP report for the group and a subgroup."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    sub = dist.new_group([0, 1])
    ddp = DDP(torch.nn.Linear(2, 2))
    return (dist.group.WORLD.name(), sub.name(), dist.get_backend(sub),
            ddp._get_ddp_logging_data().get("backend_name"))


@pytest.mark.skipif(is_gloo(), reason="pycomm's name")
def test_backend_name_where_torch_and_ddp_read_it():
    assert run_world(backend_name_world, 2, timeout=90) == [("pycomm",) * 4] * 2


@pytest.mark.skipif(is_gloo(), reason="pycomm's creator")
def test_a_creator_called_outside_torchs_helper_says_the_group_is_torchs():
    """Where the group's device map cannot be read (a torch whose helper changed), the
    backend comes back as torch's plain Backend, with a warning rather than silently."""
    import pycomm

    options = dist.distributed_c10d._DistributedBackendOptions()
    options.store, options.group_rank, options.group_size = dist.HashStore(), 0, 1
    options.timeout, options.group_id, options.global_ranks_in_group = timedelta(seconds=30), "solo", [0]
    with pytest.warns(RuntimeWarning, match="named 'custom'"):
        backend = pycomm._create_backend(options, None)
    assert isinstance(backend, pycomm.ProcessGroupPycomm)
