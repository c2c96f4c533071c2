"""Fault matrix (issue "[7/7] hardening", docs/design.md, 'Fault model'), driven by PYCOMM_FAULT.

Each scenario is a group of 3 or 4 ranks in real processes (_fault_worker.py), one of
which misbehaves: killed, stopped or exiting before, during or after an all_reduce over
TCP, shared memory and the hierarchical layout (2 "nodes" of 2 ranks: shm within, TCP
across), or killed during a log-step reduce-scatter or all-gather over TCP; raising,
dropping its connections, corrupting a frame header or sleeping; or starting up wrong
(never joining, a duplicate rank, another world size). Expected of every other process:
a pycomm error naming the operation, its sequence number and the peer, within a bound
(near the group timeout where a timeout is the outcome); the group then refuses the next
call at once; a new group works in the same processes; the process exits normally. The
time to error is the failing call's (or group creation's) duration.

The scenarios of one layout run in turn in one world of processes (a fresh group each,
and a fresh process for a victim that cannot go on): a process start costs seconds on
this 2-core machine. `pytest -s` prints a table of every scenario at the end.
"""

import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field

import pytest

from _fault_checks import contract_problems, sticky_problems
from _harness import is_gloo, start_process
from pycomm._launch import Processes

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fault_worker.py")

# Survivors of a dead, exiting, raising or corrupting peer fail within this many seconds
# of entering the failing call...
DETECT_S = 5.0
# ...under a group timeout far longer, so that a pass proves detection, not the timeout.
LONG_TIMEOUT_S = 60
# Where a timeout is the expected outcome: the group timeout, and how late the error may
# come (a 2-core machine shared with other jobs).
HUNG_TIMEOUT_S = 3
LATE_S = 3.0
TIMED_OUT = (HUNG_TIMEOUT_S - 0.3, HUNG_TIMEOUT_S + LATE_S)
# Group creation waits this long where its failure is not the point: a fresh victim
# process waits there while the others still run the scenarios before.
INIT_TIMEOUT_S = 120
CALLS = 5
COUNT = 4096          # floats per all_reduce: small, a few frames per call
DELAY_MS = 1000       # the delay scenario that must not fail
LONG_DELAY_MS = 6000  # the one that must, at HUNG_TIMEOUT_S
WORLD_DEADLINE_S = 240

# name -> (ranks, environment of the faulty group). One world of processes per layout.
LAYOUTS = {
    "tcp": (3, {"PYCOMM_TRANSPORT": "tcp"}),
    "shm": (3, {"PYCOMM_TRANSPORT": "shm"}),
    "hier": (4, {"PYCOMM_ALGO": "hierarchical", "PYCOMM_RANKS_PER_NODE": "2"}),
    # Recursive halving with a pair (ranks 0 and 1) and Bruck, over TCP.
    "tree": (3, {"PYCOMM_TRANSPORT": "tcp", "PYCOMM_ALGO": "tree"}),
}
# The collectives whose calls a layout's scenarios fault (as PYCOMM_FAULT names them).
LAYOUT_COLLECTIVES = {"tree": ("reduce_scatter", "allgather")}
# Exit statuses by the victim's fate (see Scenario.fate); "ok" for everyone else.
STATUS = {"ok": 0, "killed": -signal.SIGKILL, "stopped": "stopped", "exit": 0}


@dataclass(frozen=True)
class Scenario:
    name: str
    layout: str               # its world (see LAYOUTS)
    fault: str = ""           # PYCOMM_FAULT of the faulty group
    collective: str = "allreduce"  # what every rank calls, as PYCOMM_FAULT names it
    victim: int = 2           # the rank the fault or the start-up error is about
    # How the victim ends: "killed" (SIGKILL), "stopped" (found stopped; the test kills it),
    # "exit" (status 0, no record), "absent" (never joins the faulty group, joins the
    # recovery), or "reports" (raises like the others, then recovers).
    fate: str = "reports"
    # What fails: "call" (an all_reduce on every survivor, see calls()), "creation" (group
    # creation) or "nothing".
    fails: str = "call"
    expect: str = ""          # regex every survivor's error matches
    victim_expect: str = ""   # regex the victim's own error matches, when it reports one
    within: tuple = (0.0, DETECT_S)  # survivors' time to error, seconds
    pg_timeout: float = LONG_TIMEOUT_S
    start: dict = field(default_factory=dict)  # rank -> (rank, world) it starts as; None: absent

    def ranks(self):
        return LAYOUTS[self.layout][0]

    def gone(self):
        """The victim process cannot go on: the world replaces it for later scenarios."""
        return self.fate in ("killed", "stopped", "exit")

    def peer(self):
        """The rank survivors' errors must name: the victim's, as it starts."""
        start = self.start.get(self.victim)
        return start[0] if start else self.victim

    def expected(self):
        if self.fails == "nothing":
            return "no error; a call takes >= %.1f s" % (DELAY_MS / 1e3)
        what = "group creation fails" if self.creation() else "%s %s fails" % (self.collective, "|".join(
            "#%d" % n for n in self.calls()))
        what += " /%s/" % self.expect if self.expect else " naming rank %d" % self.peer()
        return "%s in %.1f-%.0f s; %snew group ok" % (what, self.within[0], self.within[1],
                                                     "" if self.creation() else "poisoned; ")

    def creation(self):
        return self.fails == "creation"

    def calls(self):
        """The calls at which a survivor may fail: the one the fault hits; the one before,
        for a survivor still waiting there for frames that the victim had handed to its
        transport but not yet written when it died or aborted (TCP's abort drops them); the one
        after, for a survivor whose part of the hit call had completed (the frames it
        needed had arrived) when the fault struck after or during it."""
        _, _, seq, point = self.fault.split(":")[:4]
        hit = int(seq)
        return {"before": (hit - 1, hit), "after": (hit, hit + 1)}.get(point, (hit - 1, hit, hit + 1))


def _kills():
    out = []
    for layout, (n, _) in LAYOUTS.items():
        victim = n - 1  # in hier: on the second node, across TCP from rank 0
        if layout in LAYOUT_COLLECTIVES:  # a kill in the middle of each
            for c in LAYOUT_COLLECTIVES[layout]:
                out.append(Scenario("kill during %s (%s)" % (c, layout), layout, victim=victim, collective=c,
                                    fault="%d:%s:3:during:kill" % (victim, c), fate="killed"))
            continue
        for point, spec in (("before", "before"), ("during", "during@1"), ("after", "after")):
            out.append(Scenario("kill %s (%s)" % (point, layout), layout, victim=victim,
                                fault="%d:allreduce:3:%s:kill" % (victim, spec), fate="killed"))
    return out


_CLAIMED = "rank 1 was claimed by 2 processes|already joined as rank 1"
_SIZES = "started with world size [34]"

# In each world, scenarios run in this order. Those that make group creation fail come
# after one that lines the processes up (their group timeout is short), and before any
# whose victim is gone (its replacement waits at group creation from the start).
SCENARIOS = [
    Scenario("raise during (tcp)", "tcp", fault="2:allreduce:3:during:raise",
             expect="fault injected", victim_expect="fault injected"),
    Scenario("raise after (shm)", "shm", fault="2:allreduce:3:after:raise",
             expect="fault injected", victim_expect="fault injected"),
    Scenario("drop before (tcp)", "tcp", fault="2:allreduce:3:before:drop",
             expect="fault injected", victim_expect="fault injected"),
    Scenario("drop during (shm)", "shm", fault="2:allreduce:3:during:drop",
             expect="fault injected", victim_expect="fault injected"),
    Scenario("corrupt seq (shm)", "shm", victim=1, fault="1:allreduce:3:during:corrupt",
             expect=r"rank 1\b.* is in allreduce #%d\b" % (3 ^ 2 ** 20)),
    Scenario("corrupt count (tcp)", "tcp", victim=1, fault="1:allreduce:3:during:corrupt:count",
             expect=r"rank 1\b.* %d elements" % (COUNT ^ 2 ** 20)),
    Scenario("corrupt bytes (tcp)", "tcp", victim=1, fault="1:allreduce:3:during:corrupt:bytes",
             expect=r"rank 1\b.* sent \d+ bytes where \d+ were expected"),
    Scenario("delay under timeout (shm)", "shm", fault="2:allreduce:3:before:delay:%d" % DELAY_MS,
             fails="nothing", pg_timeout=10),
    Scenario("delay over timeout (tcp)", "tcp", fault="2:allreduce:3:during:delay:%d" % LONG_DELAY_MS,
             expect=r"timed out.*rank 2\b", within=TIMED_OUT, pg_timeout=HUNG_TIMEOUT_S),
    Scenario("rank never joins", "shm", fate="absent", fails="creation", start={2: None},
             expect="rank 2 did not join", within=TIMED_OUT, pg_timeout=HUNG_TIMEOUT_S),
    Scenario("duplicate rank", "shm", fails="creation", start={2: (1, 3)}, expect=_CLAIMED,
             victim_expect=_CLAIMED, within=(0.0, TIMED_OUT[1]), pg_timeout=HUNG_TIMEOUT_S),
    Scenario("world size disagreement", "shm", fails="creation", start={2: (2, 4)}, expect=_SIZES,
             victim_expect=_SIZES, within=(0.0, TIMED_OUT[1]), pg_timeout=HUNG_TIMEOUT_S),
] + _kills() + [
    Scenario("stop before (tcp)", "tcp", fault="2:allreduce:3:before:stop", fate="stopped",
             expect=r"timed out.*rank 2\b", within=TIMED_OUT, pg_timeout=HUNG_TIMEOUT_S),
    Scenario("stop during (shm)", "shm", fault="2:allreduce:3:during:stop", fate="stopped",
             expect=r"timed out.*rank 2\b", within=TIMED_OUT, pg_timeout=HUNG_TIMEOUT_S),
    Scenario("exit 0 during (hier)", "hier", victim=3, fault="3:allreduce:3:during@1:exit",
             fate="exit"),
]


# --------------------------------------------------------------------------------------
# running worlds
# --------------------------------------------------------------------------------------

def world_plan(scenarios, directory):
    """The plan of a world running `scenarios` in turn (see _fault_worker.py), the fate of
    each process, and the process of each rank per scenario. Processes 0..n-2 are ranks
    0..n-2 throughout; rank n-1 is one process until a scenario's victim cannot go on,
    then a fresh one (which waits at its scenario's group creation from the start)."""
    n = scenarios[0].ranks()
    procs, fates, last = {}, {}, n - 1
    for i, sc in enumerate(scenarios):
        assert not sc.creation() or (i > 0 and not scenarios[i - 1].gone()), sc.name
        assert not sc.gone() or sc.victim == n - 1, sc.name
        procs[sc.name] = list(range(n - 1)) + [last]
        if sc.gone():
            fates[last] = sc.fate
            last += 1
    count = max(p for ps in procs.values() for p in ps) + 1
    plan = []
    for sc in scenarios:
        start = [None] * count  # None: not in this scenario
        for r, p in enumerate(procs[sc.name]):
            s = sc.start.get(r, (r, n))
            start[p] = "absent" if s is None else s
        base = os.path.join(directory, re.sub(r"\W", "_", sc.name))
        env = dict(LAYOUTS[sc.layout][1], **({"PYCOMM_FAULT": sc.fault} if sc.fault else {}))
        plan.append({"name": sc.name, "env": env, "start": start, "count": COUNT, "calls": CALLS,
                     "collective": sc.collective,
                     "init_timeout": sc.pg_timeout if sc.creation() else INIT_TIMEOUT_S,
                     "timeout": sc.pg_timeout, "url": "file://" + base + "-rdzv",
                     "recovery_url": "file://" + base + "-recovery",
                     "recover": [p for r, p in enumerate(procs[sc.name])
                                 if not (r == sc.victim and sc.gone())]})
    return plan, [fates.get(p, "ok") for p in range(count)], procs


def _state(pid):
    """The process state letter from /proc (T: stopped), or '' when it is gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _tail(path, n=3000):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def run_scenarios(scenarios, directory):
    """Runs `scenarios` in turn in one world of worker processes. Returns the world:
    "procs" (scenario name -> process of each rank), "fates", and per process its "status"
    (exit status, "stopped" or "late"), "records" (scenario name -> record) and "log"."""
    plan, fates, procs = world_plan(scenarios, directory)
    plan_path = os.path.join(directory, "plan.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYCOMM_FAULT", None)  # only the plan's faulty groups get one
    logs = [os.path.join(directory, "process-%d.log" % i) for i in range(len(fates))]
    with Processes() as world:
        for i, log_path in enumerate(logs):
            with open(log_path, "w") as log:
                start_process(world, "_fault_worker:main", (plan_path, i), [sys.executable, WORKER, plan_path, str(i)],
                              env, output=log.fileno())
        # Every process ends by itself, but the stopped ones.
        world.wait(WORLD_DEADLINE_S, [i for i in range(len(world)) if fates[i] != "stopped"])
        stopped = {i for i in world.running() if _state(world.pid(i)) == "T"}
        late = [i for i in world.running() if i not in stopped]
        world.dump_stacks(late, 1.0)  # into their logs (see the worker)
    processes = []
    for i in range(len(world)):
        path, records = os.path.join(directory, "records-%d.jsonl" % i), {}
        if os.path.exists(path):
            with open(path) as f:
                records = {r["scenario"]: r for r in map(json.loads, f)}
        status = "stopped" if i in stopped else "late" if i in late else world.exit_code(i)
        processes.append({"status": status, "records": records, "log": logs[i]})
    return {"procs": procs, "fates": fates, "processes": processes}


# --------------------------------------------------------------------------------------
# judging
# --------------------------------------------------------------------------------------

def _error_problems(sc, rec, victim):
    """What is wrong with a record's error in scenario `sc`; `victim`: the record is the
    victim's, whose own error is checked for its pattern only (not its timing)."""
    init = rec["init"]
    if not init["joined"]:
        return []  # the absent rank: nothing to fail
    if sc.fails == "nothing":
        if not init["ok"] or rec["error"]:
            return ["unexpected error: %s" % (rec["error"] or init)["msg"]]
        slow = max((c["elapsed"] for c in rec["calls"]), default=0)
        return [] if victim or slow >= DELAY_MS / 1e3 * 0.9 else [
            "no call waited for the delayed rank (slowest %.2f s)" % slow]
    err = (None if init["ok"] else init) if sc.creation() else rec.get("error")
    if err is None:
        return ["no error (%s)" % ("group created" if sc.creation() else rec.get("calls"))]
    problems, msg = [], err["msg"]
    pattern = sc.victim_expect if victim else sc.expect
    if pattern and not re.search(pattern, msg):
        problems.append("message lacks /%s/: %r" % (pattern, msg))
    if sc.creation():
        if "pycomm" not in msg:
            problems.append("message does not name pycomm: %r" % msg)
    else:
        if not victim and err["seq"] not in sc.calls():
            problems.append("failed at call #%d, expected one of %s: %r" % (err["seq"], sc.calls(), msg))
        peer = r"rank %d\b" % sc.peer()
        problems += ["message %s: %r" % (p, msg) for p in
                     contract_problems(msg, "" if victim else peer, op=sc.collective, seq=err["seq"])]
        problems += sticky_problems(rec["index"], err["second"], pattern or peer)
        wrong = [c["seq"] for c in rec["calls"] if not c["correct"]]
        if wrong:
            problems.append("wrong results of calls %s" % wrong)
    if not victim and not sc.within[0] <= err["elapsed"] <= sc.within[1]:
        problems.append("error after %.2f s, expected %.1f-%.1f s" % (err["elapsed"], *sc.within))
    return problems


def judge(sc, world):
    """Problems of scenario `sc` in `world` (see run_scenarios), and its table row."""
    problems, times, causes, slowest = [], [], set(), 0.0
    for rank, p in enumerate(world["procs"][sc.name]):
        proc, who = world["processes"][p], "rank %d (process %d): " % (rank, p)
        if proc["status"] != STATUS[world["fates"][p]]:
            problems.append(who + "ended with status %s, expected %s"
                            % (proc["status"], STATUS[world["fates"][p]]))
        rec = proc["records"].get(sc.name)
        victim = rank == sc.victim
        if victim and sc.gone():
            if rec:
                problems.append(who + "the victim went on: %s" % rec)
            continue
        if rec is None:
            problems.append(who + "left no record; its log ends:\n" + _tail(proc["log"]))
            continue
        problems += [who + what for what in _error_problems(sc, rec, victim)]
        if rec.get("recovered") != "ok":
            problems.append(who + "new group: %s" % rec.get("recovered"))
        slowest = max([slowest] + [c["elapsed"] for c in rec.get("calls", [])])
        err = rec["init"] if sc.creation() else rec.get("error")
        if err and "msg" in err and not victim:
            times.append(err["elapsed"])
            causes.add(_cause(err["msg"]))
    if sc.fails == "nothing":
        observed = "no error; slowest call %.2f s" % slowest
    else:
        observed = " | ".join(sorted(causes)) or "-"
    spent = "%.2f-%.2f s" % (min(times), max(times)) if times else "-"
    return problems, (sc.name, sc.fault or "-", sc.expected(), observed, spent,
                      "FAILED" if problems else "ok")


# Shortened for the table: what varies from run to run, or is in the row already.
_NOISE = (r" \(pid \d+ on [^)]*\)", r" \(flight recorder: [^)]*\)", r" \(rank \d+ waited for it\)",
          r" \(rank \d+\)", r"pycomm: ", r" by PYCOMM_FAULT='[^']*'", r"creating group '\w+': ")


def _cause(msg):
    """The innermost cause of an error message, for the table."""
    cause = re.split(r"failed on rank \d+: ", msg)[-1]
    for noise in _NOISE:
        cause = re.sub(noise, "", cause)
    return cause[:110]


# --------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------

ROWS = {}


@pytest.fixture(scope="module", autouse=True)
def table():
    """Prints every scenario's row when the module is done (pytest -s shows it)."""
    yield
    if not ROWS:
        return
    rows = [("scenario", "PYCOMM_FAULT", "expected", "observed (survivors' causes)", "time to error", "")]
    rows += [ROWS[sc.name] for sc in SCENARIOS if sc.name in ROWS]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    print("\n\nfault matrix (time to error: the survivors' failing call or group creation, min-max)")
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """layout -> its world, run once when a test first needs it."""
    cache = {}

    def get(layout):
        if layout not in cache:
            cache[layout] = run_scenarios([sc for sc in SCENARIOS if sc.layout == layout],
                                      str(tmp_path_factory.mktemp(layout)))
        return cache[layout]
    return get


@pytest.mark.parametrize("sc", SCENARIOS, ids=[re.sub(r"\W+", "-", sc.name).strip("-")
                                                for sc in SCENARIOS])
def test_fault(sc, worlds, shm_guard):
    if is_gloo():
        pytest.skip("PYCOMM_FAULT is pycomm's test hook")
    problems, ROWS[sc.name] = judge(sc, worlds(sc.layout))
    assert not problems, "%s:\n%s" % (sc.name, "\n".join(problems))


# Malformed specs are rejected at group creation, before the store is touched: a group of
# one rank over a local store shows it without starting processes.
BAD_SPECS = {
    "1:allreduce:3:before": "has 4 fields",
    "x:allreduce:3:before:kill": "rank 'x'",
    "1:allreduse:3:before:kill": "op 'allreduse'",
    "1:allreduce:-3:before:kill": "seq '-3'",
    "1:allreduce:3:inside:kill": "point 'inside'",
    "1:allreduce:3:during@x:kill": "point 'during@x'",
    "1:allreduce:3:before:explode": "action 'explode'",
    "1:allreduce:3:before:kill:9": "takes no argument",
    "1:allreduce:3:before:delay": "delay needs milliseconds",
    "1:allreduce:3:before:exit:256": "exit status '256'",
    "1:allreduce:3:before:corrupt": "point must be during",
    "1:allreduce:3:during:corrupt:magic": "corrupt field 'magic'",
    "1:allreduce:3:during:flip": "point must be after",
    "1:allreduce:3:after:flip:1": "takes no argument",
    "1:*:*:after:raise,": "has 1 fields",
}


def _one_rank_group(monkeypatch, spec):
    import torch.distributed as dist

    import pycomm

    monkeypatch.setenv("PYCOMM_FAULT", spec)
    return pycomm.ProcessGroupPycomm(dist.HashStore(), 0, 1, 5.0, "fault-spec")


@pytest.mark.parametrize("spec", list(BAD_SPECS))
def test_malformed_spec_is_rejected(monkeypatch, spec):
    if is_gloo():
        pytest.skip("PYCOMM_FAULT is pycomm's test hook")
    with pytest.raises(ValueError) as info:
        _one_rank_group(monkeypatch, spec)
    msg = str(info.value)
    assert "PYCOMM_FAULT" in msg and BAD_SPECS[spec] in msg, msg


def test_spec_fires_on_its_rank_op_and_seq(monkeypatch):
    """On a group of one rank: the spec for rank 1 is inert, the delay delays allreduce #1
    only, the raise fails allreduce #2 after it ran, and the group is then poisoned."""
    if is_gloo():
        pytest.skip("PYCOMM_FAULT is pycomm's test hook")
    import torch

    pg = _one_rank_group(monkeypatch, "1:*:*:before:kill,0:allreduce:1:before:delay:200,"
                                      "0:allreduce:2:after:raise")
    t = torch.ones(4)
    t0 = time.monotonic()
    pg.allreduce([t]).wait()
    assert time.monotonic() - t0 >= 0.2
    with pytest.raises(RuntimeError, match=r"allreduce #2 .*fault injected .* after allreduce #2"):
        pg.allreduce([t]).wait()
    with pytest.raises(RuntimeError, match=r"allreduce #3 .*not started: the group failed earlier"):
        pg.allreduce([t]).wait()

