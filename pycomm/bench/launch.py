"""Spawn the local ranks, watch them against one deadline, collect results or failures.

* "spawn" start method (fork is unsafe once torch threads exist); one pipe per rank, so a
  rank that dies mid-write cannot corrupt another's channel, and its death reads as EOF.
* The rendezvous (file:// in a fresh temp dir, or tcp:// on a free loopback port) is
  created here and removed afterwards.
* One deadline for the whole run. On the deadline, or shortly after the first failure
  (a grace period lets the peers' tracebacks arrive), every straggler gets SIGUSR1 (its
  faulthandler writes its Python stacks to a per-rank file), then SIGKILL;
  :class:`WorldFailed` carries each rank's state, last phase, traceback and stacks. The
  parent never waits unbounded.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time
from typing import Callable, List, Optional

FAILURE_GRACE_S = 3.0      # keep collecting peers' reports after the first failure
STACK_DUMP_GRACE_S = 2.0   # between SIGUSR1 (stack dump) and SIGKILL
DESTROY_GRACE_S = 30.0     # for destroy_process_group and exit after all results are in


class WorldFailed(Exception):
    """The run failed; str() is the whole story, one section per rank in trouble."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _signal(procs, sig) -> None:
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass


def _stack_path(tmpdir: str, rank: int) -> str:
    return os.path.join(tmpdir, "stacks-rank%d.txt" % rank)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _exit_story(p) -> str:
    code = p.exitcode
    if code is None:
        return "still running, killed"
    if code < 0:
        try:
            return "killed by %s" % signal.Signals(-code).name
        except ValueError:
            return "killed by signal %d" % -code
    return "exit code %d" % code


def run_world(cfg, on_row: Optional[Callable[[list], None]] = None) -> dict:
    """Run the benchmark on ``cfg.nranks`` spawned ranks.

    Returns {"records": rank 0's records, "warnings": [...]} or raises WorldFailed.
    """
    import multiprocessing as mp
    from multiprocessing.connection import wait

    from .worker import rank_main

    tmpdir = tempfile.mkdtemp(prefix="pycomm-bench-")
    if cfg.init == "file":
        init_method = "file://" + os.path.join(tmpdir, "rendezvous")
    else:
        init_method = "tcp://127.0.0.1:%d" % _free_port()

    world = cfg.nranks
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    state = ["running"] * world     # -> ok -> destroyed | err | dead | dead_after_ok
    phase = ["spawn"] * world
    notes = [""] * world
    records: List[dict] = []
    deadline = time.monotonic() + cfg.timeout_s
    fail_at = None
    timed_out = False
    try:
        for rank in range(world):
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=rank_main, name="pycomm-bench-rank%d" % rank, daemon=True,
                            args=(rank, world, cfg, init_method, _stack_path(tmpdir, rank),
                                  send_end))
            p.start()
            send_end.close()   # EOF on recv_end now means the rank is gone
            procs.append(p)
            conns.append(recv_end)

        open_conns = {c: r for r, c in enumerate(conns)}
        all_ok_at = None
        while open_conns:
            now = time.monotonic()
            limit = deadline
            if fail_at is not None:
                limit = min(limit, fail_at + FAILURE_GRACE_S)
            if all_ok_at is not None:
                limit = min(limit, all_ok_at + DESTROY_GRACE_S)
            if now >= limit:
                timed_out = fail_at is None and all_ok_at is None
                break
            for c in wait(list(open_conns), timeout=limit - now):
                r = open_conns[c]
                try:
                    kind, payload = c.recv()
                except (EOFError, OSError):
                    del open_conns[c]
                    state[r] = "dead_after_ok" if state[r] == "ok" else (
                        state[r] if state[r] in ("err", "destroyed", "destroy_err") else "dead")
                    if state[r] == "dead" and fail_at is None:
                        fail_at = time.monotonic()
                    continue
                if kind == "phase":
                    phase[r] = payload
                elif kind == "row":
                    if on_row is not None:
                        on_row(payload)
                elif kind == "ok":
                    state[r] = "ok"
                    if r == 0:
                        records = payload
                    if all_ok_at is None and all(s in ("ok", "destroyed", "destroy_err")
                                                 for s in state):
                        all_ok_at = time.monotonic()
                elif kind == "err":
                    state[r] = "err"
                    notes[r] = payload
                    if fail_at is None:
                        fail_at = time.monotonic()
                elif kind in ("destroyed", "destroy_err"):
                    state[r] = kind
                    notes[r] = payload or ""
        for p in procs:
            p.join(max(0.1, min(5.0, deadline - time.monotonic())))
        stragglers = [p for p in procs if p.is_alive()]
        if stragglers:
            _signal(stragglers, signal.SIGUSR1)
            time.sleep(STACK_DUMP_GRACE_S)
    finally:
        _signal(procs, signal.SIGKILL)
        for p in procs:
            p.join(10)
        for c in conns:
            c.close()
        stacks = [_read(_stack_path(tmpdir, r)) for r in range(len(procs))]
        shutil.rmtree(tmpdir, ignore_errors=True)

    failed = fail_at is not None or timed_out or any(
        s not in ("ok", "destroyed", "destroy_err", "dead_after_ok") for s in state)
    if failed:
        lines = ["%d-rank run failed%s:" % (
            world, " (deadline of %gs passed)" % cfg.timeout_s if timed_out else "")]
        seen = {}   # traceback text without its "[rank r, ...]" line -> first rank
        for r, p in enumerate(procs):
            if state[r] in ("ok", "destroyed"):
                continue
            lines.append("--- rank %d: %s (%s); last phase: %s"
                         % (r, state[r], _exit_story(p), phase[r]))
            body = notes[r].split("\n", 1)[-1].rstrip()
            if body and body in seen:
                lines.append("(same traceback as rank %d)" % seen[body])
            elif notes[r]:
                seen[body] = r
                lines.append(notes[r].rstrip())
            if stacks[r].strip():
                lines.append("Python stacks of rank %d (faulthandler: fatal signal, or SIGUSR1 "
                             "at the deadline):\n%s" % (r, stacks[r].rstrip()))
        raise WorldFailed("\n".join(lines))

    warnings = []
    for r, p in enumerate(procs):
        if state[r] != "destroyed" or p.exitcode != 0:
            warnings.append("rank %d: results complete, but tear-down %s (%s; last phase: %s)%s"
                            % (r, state[r], _exit_story(p), phase[r],
                               ("\n" + notes[r].rstrip()) if notes[r] else ""))
    return {"records": records, "warnings": warnings}
