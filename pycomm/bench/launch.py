"""Start the local ranks, watch them against one deadline, collect results or failures.

* Two launchers. "spawn" (the default): ``python -m pycomm.bench.worker DIR RANK WORLD``
  per rank, each a fresh interpreter (fork is unsafe once torch threads exist). "mpirun":
  ``mpirun -np N python -m pycomm.bench.worker DIR``, which MPI peers need (their ranks
  must share MPI_COMM_WORLD). Both start their processes with pycomm._launch. Under
  torchrun there is nothing to start: :func:`run_here` makes this process the rank
  torchrun says it is, and torchrun watches the ranks.
* The run's directory (a fresh temp dir, mode 0700) holds the pickled config, the
  file:// rendezvous when used, the ranks' stack files and the control socket. Each rank
  connects to that socket and reports over its own connection, so a rank that dies
  mid-write cannot corrupt another's channel, and its death reads as EOF. The directory
  is removed afterwards.
* One deadline for the whole run. On the deadline, or shortly after the first failure
  (a grace period lets the peers' tracebacks arrive), every straggler gets SIGUSR1 (its
  faulthandler writes its Python stacks to a per-rank file), then SIGKILL to the process
  group of each process started (under mpirun also to each rank by pid: Open MPI puts each
  rank in a process group of its own);
  :class:`WorldFailed` carries each rank's state, last phase, traceback and stacks. The
  parent never waits unbounded. The messages, the grace period, the stack files and the
  story's sections are those of pycomm._launch.RankOutcomes, which the tests' harness
  shares.
"""
from __future__ import annotations

import math
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

from .._launch import Processes, RankOutcomes, dump_stacks, free_port, read_stacks, signal_pid
from .worker import CONTROL_SOCKET, RUN_FILE

STACK_DUMP_GRACE_S = 2.0   # between SIGUSR1 (stack dump) and SIGKILL
DESTROY_GRACE_S = 30.0     # for destroy_process_group and exit after all results are in
POLL_S = 0.5               # how often ranks that have not connected yet are looked for


class WorldFailed(Exception):
    """The run failed; str() is the whole story, one section per rank in trouble."""


def _pid_alive(pid: Optional[int]) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def mpirun_command(world: int) -> List[str]:
    """The mpirun prefix for ``world`` local ranks (Open MPI's flags)."""
    cmd = [shutil.which("mpirun") or "mpirun"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    # --oversubscribe: ranks may outnumber cores (CI has 2); Open MPI then makes idle ranks
    # yield. --bind-to none: the same CPU placement as the spawn launcher, so the torch
    # backends measured in these processes are not pinned differently.
    return cmd + ["--oversubscribe", "--bind-to", "none", "-np", str(world)]


def mpirun_version() -> Optional[str]:
    """``mpirun --version`` without its program name ("(Open MPI) 4.1.4"), or None."""
    try:
        out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    first = (out.stdout.strip().splitlines() or [""])[0]
    return first.split(" ", 1)[-1] or None


def _worker_command(rundir: str) -> List[str]:
    return [sys.executable, "-m", "pycomm.bench.worker", rundir]


def _worker_env() -> Dict[str, str]:
    """This process's environment, where the ranks import this checkout's package, whatever
    their working directory."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


# A launcher starts ``world`` ranks with start(); ``pids`` fills in as ranks say hello.
# kill() ends whatever start() began, also when start() failed halfway.
class _Spawned:
    """One process per rank, children of this process."""

    def __init__(self, pids: List[Optional[int]]):
        self.processes = Processes()

    def start(self, rundir: str, world: int) -> None:
        for rank in range(world):
            self.processes.start(_worker_command(rundir) + [str(rank), str(world)],
                                 env=_worker_env())

    def exited(self, rank: int) -> bool:
        return self.processes.exit_code(rank) is not None

    def alive(self, rank: int) -> bool:
        return not self.exited(rank)

    def join(self, timeout: float) -> None:
        self.processes.wait(timeout)

    def kill(self) -> None:
        self.processes.kill()

    def story(self, rank: int) -> str:
        return self.processes.ending(rank)

    def clean_exit(self, rank: int) -> bool:
        return self.processes.exit_code(rank) == 0


class _Mpirun:
    """Ranks started by one mpirun child; their pids come from their hello messages."""

    def __init__(self, pids: List[Optional[int]]):
        self.pids = pids
        self.processes = Processes()

    def start(self, rundir: str, world: int) -> None:
        # mpirun's own output (and anything the ranks print) goes to stderr, keeping stdout
        # for the report.
        self.processes.start(mpirun_command(world) + _worker_command(rundir),
                             stdout=sys.stderr.fileno(), env=_worker_env())

    def exited(self, rank: int) -> bool:
        return self.processes.exit_code(0) is not None

    def alive(self, rank: int) -> bool:
        return _pid_alive(self.pids[rank])

    def join(self, timeout: float) -> None:
        self.processes.wait(timeout)

    def kill(self) -> None:
        for pid in self.pids:
            signal_pid(pid, signal.SIGKILL)
        if self.processes.running():
            # SIGTERM first: mpirun then kills any rank whose pid never reached us.
            signal_pid(self.processes.pid(0), signal.SIGTERM)
            self.processes.wait(5.0)
        self.processes.kill()

    def story(self, rank: int) -> str:
        if self.alive(rank):
            return "still running, killed"
        return "mpirun " + self.processes.ending(0)

    def clean_exit(self, rank: int) -> bool:
        return self.processes.exit_code(0) == 0


LAUNCHERS = {"spawn": _Spawned, "mpirun": _Mpirun}


def run_here(cfg, on_row: Optional[Callable[[list], None]] = None) -> dict:
    """Run this process as one of torchrun's ranks (RANK, WORLD_SIZE, LOCAL_RANK; the
    groups meet through env://, i.e. MASTER_ADDR/MASTER_PORT). Returns what
    :func:`run_world` returns; every rank gets the records (their times and counts are
    gathered on all ranks). A failure raises here, for torchrun to report."""
    from .worker import close, run_rank

    def say(kind, payload):
        if kind == "row" and on_row is not None:
            on_row(payload)

    comms, records = run_rank(cfg, int(os.environ["RANK"]), cfg.nranks,
                              int(os.environ["LOCAL_RANK"]), "env://", lambda text: None, say)
    close(comms)
    return {"records": records, "warnings": []}


def run_world(cfg, on_row: Optional[Callable[[list], None]] = None) -> dict:
    """Run the benchmark on ``cfg.nranks`` local ranks started by ``cfg.launcher``.

    Returns {"records": rank 0's records, "warnings": [...]} or raises WorldFailed.
    """
    from multiprocessing.connection import Connection

    rundir = tempfile.mkdtemp(prefix="pycomm-bench-")
    if cfg.init == "file":
        init_method = "file://" + os.path.join(rundir, "rendezvous")
    else:
        init_method = "tcp://127.0.0.1:%d" % free_port()
    with open(os.path.join(rundir, RUN_FILE), "wb") as f:
        pickle.dump((cfg, init_method), f)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(os.path.join(rundir, CONTROL_SOCKET))
    server.listen(cfg.nranks)

    world = cfg.nranks
    # "starting" until its hello. A rank's error or death cuts the run short; a failed
    # tear-down after its results only warns.
    outcomes = RankOutcomes(world, cfg.timeout_s, failing=("err", "dead"), initial="starting")
    state = outcomes.state
    phase = ["start"] * world
    pids: List[Optional[int]] = [None] * world
    conns = {}                      # Connection -> rank, None until its hello
    records: List[dict] = []
    timed_out = False

    ranks = LAUNCHERS[cfg.launcher](pids)
    try:
        ranks.start(rundir, world)
        all_ok_at = None
        while conns or "starting" in state:
            starting = "starting" in state
            torn_down_by = math.inf if all_ok_at is None else all_ok_at + DESTROY_GRACE_S
            ready = outcomes.wait(list(conns) + ([server] if starting else []), torn_down_by,
                                  POLL_S if starting else math.inf)
            if ready is None:
                timed_out = outcomes.failed_at is None and all_ok_at is None
                break
            if not ready:
                # Nothing left to read or accept, so a rank that exited without a hello
                # will never send one.
                for r in range(world):
                    if state[r] == "starting" and ranks.exited(r):
                        outcomes.on_eof(r)
            for c in ready:
                if c is server:
                    sock, _ = server.accept()
                    conns[Connection(sock.detach())] = None
                    continue
                r = conns[c]
                try:
                    kind, payload = c.recv()
                except (EOFError, OSError):
                    del conns[c]
                    if r is None:
                        continue        # died before its hello: found by ranks.exited()
                    outcomes.on_eof(r)
                    continue
                if r is None:
                    if kind != "hello":
                        raise WorldFailed("a rank spoke before its hello: %r" % (kind,))
                    r = payload[0]
                    pids[r] = payload[1]
                    conns[c] = r
                    state[r] = "running"
                elif kind == "phase":
                    phase[r] = payload
                elif kind == "row":
                    if on_row is not None:
                        on_row(payload)
                elif outcomes.on_message(r, kind, payload) and kind == "ok":
                    if r == 0:
                        records = payload
                    if all_ok_at is None and all(s in ("ok", "destroyed", "destroy_err")
                                                 for s in state):
                        all_ok_at = time.monotonic()
        ranks.join(max(0.1, min(5.0, outcomes.deadline - time.monotonic())))
        dump_stacks([pids[r] for r in range(world) if ranks.alive(r)], STACK_DUMP_GRACE_S)
    finally:
        ranks.kill()
        for c in conns:
            c.close()
        server.close()
        stacks = read_stacks(rundir, world)
        shutil.rmtree(rundir, ignore_errors=True)

    failed = outcomes.failed_at is not None or timed_out or any(
        s not in ("ok", "destroyed", "destroy_err", "dead_after_ok") for s in state)
    if failed:
        lines = ["%d-rank run failed%s:" % (
            world, " (deadline of %gs passed)" % cfg.timeout_s if timed_out else "")]
        seen = {}   # traceback text without its "[rank r, ...]" line -> first rank
        for r in range(world):
            if state[r] in ("ok", "destroyed"):
                continue
            note = outcomes.notes[r]
            body = note.split("\n", 1)[-1].rstrip()
            if body and body in seen:
                note = "(same traceback as rank %d)" % seen[body]
            elif note:
                seen[body] = r
            lines.append(outcomes.section(r, "%s (%s); last phase: %s"
                                          % (state[r], ranks.story(r), phase[r]), stacks[r], note))
        raise WorldFailed("\n".join(lines))

    warnings = []
    for r in range(world):
        if state[r] != "destroyed" or not ranks.clean_exit(r):
            warnings.append("rank %d: results complete, but tear-down %s (%s; last phase: %s)%s"
                            % (r, state[r], ranks.story(r), phase[r],
                               ("\n" + outcomes.notes[r].rstrip()) if outcomes.notes[r] else ""))
    return {"records": records, "warnings": warnings}
