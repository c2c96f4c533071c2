"""What a drop-in replacement for Gloo must do that PyTorch's own distributed suite found
missing: recv from any source, all_gather_coalesced in torch's layout, the backend's name
where torch and DDP read it, and sparse all-reduce (values against Gloo's, in the same
processes). `make conformance` runs the whole suite; these are its findings, kept."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from _harness import is_gloo, run_world

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
