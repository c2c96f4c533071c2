"""Multi-host runs (docs/design.md, 'Testing on one machine'): every "host" is a network namespace on one bridge
(pycomm/bench/netns.py), and each runs its ranks under torchrun's multi-node c10d rendezvous, so
ranks on different hosts can only talk over TCP through the veth links, and ranks of one
host over shared memory. _multihost_worker.py checks every algorithm against exact
expectations; this file checks the jobs end well and that pycomm saw the intended
topology (its PYCOMM_DEBUG=INFO line per rank: node, shm peers, TCP peers). The link-fault
tests break the link between two hosts mid-job (_link_fault_worker.py) and check that
both ranks fail in time with errors naming the op, its sequence number and the peer.

Root only (namespaces): skips with the reason otherwise.

Rendezvous: c10d (torchrun --rdzv-backend=c10d) hosted by host 0's agent, with is_host and
--local-addr given explicitly (see netns.torchrun_commands); static rendezvous is not
needed.
"""

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from pycomm.bench import netns

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_multihost_worker.py")

# Whole-job deadline per test; a job takes about 10 s on the 2-core CI machine.
JOB_TIMEOUT_S = 120
# Worker-side limits, inside the job deadline: process-group timeout and self-exit.
WORKER_ARGS = ["--pg-timeout", "45", "--deadline", "100"]

_ok, _why = netns.available()
pytestmark = pytest.mark.skipif(not _ok, reason="multi-host tests: %s" % _why)

_INFO_RE = re.compile(r"pycomm: group '[^']*' rank (\d+)/(\d+) node (\d+): (.*), chunk ")
_OK_RE = re.compile(r"^OK rank=(\d+) world=(\d+) host=(\S+)$", re.M)


def _peers(transports, kind):
    """Ranks listed for transport `kind` in an INFO line's "shm: ranks 1; tcp: ranks 2,3"."""
    for part in transports.split("; "):
        name, _, ranks = part.partition(": ranks ")
        if name == kind:
            return {int(r) for r in ranks.split(",")}
    return set()


def run_job(n_hosts, nproc, rate=None, env=None, worker_args=()):
    """Builds the hosts, runs the worker on all of them, checks how it ended. Returns the
    hosts' combined output, the story for assertion messages and, when `rate` is set, each
    host's tbf statistics."""
    env = dict(env or {})
    env.setdefault("PYCOMM_DEBUG", "INFO")
    with netns.Hosts(n_hosts, rate=rate) as hosts:
        cmds = netns.torchrun_commands(hosts, sys.executable, WORKER,
                                        list(WORKER_ARGS) + list(worker_args),
                                        nproc=nproc, extra_env=env)
        start = time.monotonic()
        results, timed_out = netns.run_jobs(cmds, JOB_TIMEOUT_S)
        elapsed = time.monotonic() - start
        story = "%s\n%s" % (hosts.describe(), "\n".join(r.describe() for r in results))
        assert not timed_out, "job passed its %d s deadline\n%s" % (JOB_TIMEOUT_S, story)
        assert all(r.rc == 0 for r in results), "a host failed after %.1f s\n%s" % (elapsed, story)
        stats = [_qdisc_stats(h) for h in hosts.hosts] if rate else None
    print("job took %.1f s\n%s" % (elapsed, story))
    output = "\n".join(r.output for r in results)
    return output, story, stats


def _qdisc_stats(host):
    """(bytes sent, overlimits) of the tbf on a host's link."""
    p = subprocess.run(host.command([netns.TC, "-s", "qdisc", "show", "dev", host.ifname]),
                       capture_output=True, text=True, timeout=20)
    m = re.search(r"qdisc tbf .*?Sent (\d+) bytes .*?overlimits (\d+)", p.stdout, re.S)
    assert m, "no tbf statistics on %s: %s" % (host, p.stdout)
    return int(m.group(1)), int(m.group(2))


def check_topology(output, story, n_hosts, nproc, ranks_per_node=0):
    """Every rank finished, ranks sit on hosts in blocks of `nproc` (torchrun's numbering),
    and each rank used shm exactly for the peers of its own node and TCP for the rest."""
    world = n_hosts * nproc
    oks = {int(m.group(1)): m for m in _OK_RE.finditer(output)}
    assert sorted(oks) == list(range(world)), "ranks that finished: %s\n%s" % (sorted(oks), story)
    for r, m in oks.items():
        assert int(m.group(2)) == world, story
        assert m.group(3) == oks[(r // nproc) * nproc].group(3), (
            "rank %d is not on the host of ranks %d..%d\n%s" % (
                r, (r // nproc) * nproc, (r // nproc) * nproc + nproc - 1, story))
    hosts_used = {m.group(3) for m in oks.values()}
    assert len(hosts_used) == n_hosts, "ranks ran on %s\n%s" % (sorted(hosts_used), story)

    infos = {int(m.group(1)): m for m in _INFO_RE.finditer(output)}
    assert sorted(infos) == list(range(world)), "PYCOMM_DEBUG=INFO lines for ranks %s\n%s" % (
        sorted(infos), story)
    group = ranks_per_node or nproc
    for r, m in infos.items():
        node = int(m.group(3))
        assert node == r // group, "rank %d is in node %d, want %d\n%s" % (r, node, r // group, story)
        same_node = {p for p in range(world) if p != r and p // group == r // group
                     and p // nproc == r // nproc}
        others = set(range(world)) - same_node - {r}
        shm, tcp = _peers(m.group(4), "shm"), _peers(m.group(4), "tcp")
        assert (shm, tcp) == (same_node, others), (
            "rank %d: shm peers %s, tcp peers %s; want %s and %s\n%s" % (
                r, sorted(shm), sorted(tcp), sorted(same_node), sorted(others), story))


# (hosts, ranks per host, PYCOMM_RANKS_PER_NODE). Two hosts of two ranks, one node each,
# run on a shaped link below; three hosts of one rank also cover two.
TOPOLOGIES = [
    pytest.param(3, 1, 0, id="3hosts-x1"),
    pytest.param(2, 2, 1, id="2hosts-x2-rank-per-node"),
]


@pytest.mark.parametrize("n_hosts,nproc,rpn", TOPOLOGIES)
def test_every_algorithm_across_hosts(n_hosts, nproc, rpn):
    env = {"PYCOMM_RANKS_PER_NODE": str(rpn)} if rpn else {}
    output, story, _ = run_job(n_hosts, nproc, env=env)
    check_topology(output, story, n_hosts, nproc, rpn)


def test_every_algorithm_across_shaped_link():
    """2 hosts x 2 ranks, a node per host, over a 200 Mbit/s tbf-limited link: the
    topology, and correctness under a shaper that queues (and may drop) packets; the
    statistics prove the traffic went through it. float32 alone: what a shaper can break is
    the byte stream, whatever its type (the unshaped jobs check every dtype)."""
    output, story, stats = run_job(2, 2, rate="200mbit", worker_args=["--dtypes", "float32"])
    check_topology(output, story, 2, 2)
    for host, (sent, overlimits) in enumerate(stats):
        # Each host sends at least one 1 MiB all-reduce's cross-host share many times over.
        assert sent > 8 << 20, "host %d's shaped link carried only %d bytes\n%s" % (host, sent, story)
        assert overlimits > 0, "host %d's shaper never throttled (%d bytes)\n%s" % (host, sent, story)


# --------------------------------------------------------------------------------------
# link faults: a connection reset, and total packet loss, on the link between two hosts
# --------------------------------------------------------------------------------------

LINK_WORKER = os.path.join(HERE, "_link_fault_worker.py")
LINK_PG_TIMEOUT_S = 5
# When the survivors must have failed, counted from the fault: a reset is seen at once;
# lost packets are noticed at the group timeout.
LINK_FAULT_BOUND_S = {"reset": 3.0, "loss": LINK_PG_TIMEOUT_S + 5.0}
_RESULT_RE = re.compile(r"^RESULT (\{.*\})$", re.M)
_CONTRACT_RE = re.compile(r"pycomm: allreduce #\d+ .* on group '[^']*' failed on rank \d: .*rank \d")


def _wait_for_files(paths, limit_s):
    end = time.monotonic() + limit_s
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def _break_link(hosts, fault):
    """reset: host 1 aborts its pycomm connections to host 0 (ss -K sends an RST; the
    rendezvous store's connections, on its port, are spared); loss: host 1's switch port
    goes down, so every packet from either side is dropped."""
    if fault == "reset":
        netns._run(hosts.hosts[1].command([
            netns._tool("ss"), "-K", "dst", hosts.hosts[0].addr, "and", "dport", "!=", ":29400",
            "and", "sport", "!=", ":29400"]))
    else:
        netns._run([netns.IP, "-n", hosts.switch, "link", "set", "port1", "down"])


def _restore_link(hosts, fault):
    if fault == "loss":
        netns._run([netns.IP, "-n", hosts.switch, "link", "set", "port1", "up"])


@pytest.mark.parametrize("fault", ["reset", "loss"])
def test_link_fault_fails_every_rank_in_time(fault, tmp_path):
    marker = lambda name: str(tmp_path / name)  # noqa: E731
    with netns.Hosts(2) as hosts:
        cmds = netns.torchrun_commands(
            hosts, sys.executable, LINK_WORKER,
            ["--marker-dir", str(tmp_path), "--pg-timeout", LINK_PG_TIMEOUT_S, "--deadline", 100],
            nproc=1)
        outcome = {}

        def inject():
            # Between calls of the workers' loops, once both are looping; then the link
            # comes back, so that the jobs (and torchrun's rendezvous) end normally.
            outcome["ready"] = _wait_for_files([marker("ready-0"), marker("ready-1")], 90)
            if not outcome["ready"]:
                return
            time.sleep(0.5)
            with open(marker("fault.tmp"), "w") as f:
                f.write(repr(time.monotonic()))
            os.replace(marker("fault.tmp"), marker("fault"))
            _break_link(hosts, fault)
            outcome["failed"] = _wait_for_files([marker("failed-0"), marker("failed-1")], 60)
            _restore_link(hosts, fault)
            open(marker("restored"), "w").close()

        injector = threading.Thread(target=inject, daemon=True)
        injector.start()
        results, timed_out = netns.run_jobs(cmds, JOB_TIMEOUT_S)
        injector.join(timeout=10)
        story = "%s\n%s" % (hosts.describe(), "\n".join(r.describe() for r in results))
    assert outcome.get("ready"), "the ranks never started looping\n" + story
    assert not timed_out and all(r.rc == 0 for r in results), story
    reports = [json.loads(m.group(1)) for r in results for m in _RESULT_RE.finditer(r.output)]
    assert sorted(r["rank"] for r in reports) == [0, 1], story
    for r in reports:
        print("%s: rank %d failed %.2f s after the fault: %s" % (
            fault, r["rank"], r.get("after_fault_s", -1), r.get("message", "")[:300]))
        assert r["raised"], "rank %d never saw the %s\n%s" % (r["rank"], fault, story)
        assert 0 <= r["after_fault_s"] <= LINK_FAULT_BOUND_S[fault], story
        assert _CONTRACT_RE.search(r["message"]), "the error names no op, seq or peer:\n" + story
        if fault == "loss":
            assert "timed out" in r["message"], story
