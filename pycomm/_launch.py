"""Start a world of local processes, wait for them under one deadline, kill what is left,
and say how each one ended.

Shared by the test harness (tests/_harness.py), the fault matrix (tests/test_fault_matrix.py)
and the benchmark's launchers (pycomm.bench.launch). RankOutcomes keeps what a world's ranks
report over their channels, the stack files and the failure story's sections in one form
for the harness and the bench; what else the ranks say, and what counts as success, stays
with each caller.

Each process starts in a session of its own: SIGKILL to its process group then also ends
what it started and left in that group (a pool of compile workers, say), and a Ctrl-C at
the terminal reaches the parent alone, which then kills the world on its way out.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from multiprocessing import connection
from typing import Iterable, List, Optional, Sequence

# How long kill() waits for each killed process to be reaped: SIGKILL cannot be caught,
# so only a process stuck in the kernel (uninterruptible I/O) takes longer.
REAP_S = 10.0
# Seconds to keep collecting the other ranks' reports after the first failure: the peers of
# a failed rank usually fail too, and their tracebacks tell where.
FAILURE_GRACE_S = 3.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago: another process may take it
    before the caller binds it, a race that local worlds accept."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def signal_pid(pid: Optional[int], sig: int) -> None:
    """Sends ``sig`` to ``pid`` (nothing when None or 0); a process already gone is not an
    error, since it may exit at any moment before the signal."""
    if pid:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def dump_stacks(pids: Sequence[Optional[int]], grace_s: float) -> None:
    """SIGUSR1 to each of ``pids`` (None: skipped), then, if there were any, ``grace_s``
    seconds for them to write their stacks. The processes must have registered a
    faulthandler for SIGUSR1 (its default action ends a process)."""
    for pid in pids:
        signal_pid(pid, signal.SIGUSR1)
    if pids:
        time.sleep(grace_s)


def stack_path(directory: str, rank: int) -> str:
    """Where rank ``rank`` of the world whose temp folder is ``directory`` has its
    faulthandler write its Python stacks; read_stacks() reads them back."""
    return os.path.join(directory, "stacks-rank%d.txt" % rank)


def read_stacks(directory: str, world: int) -> List[str]:
    """Each rank's stack file (stack_path), stripped; "" where it is empty or missing.
    Read before the folder is removed."""
    stacks = []
    for rank in range(world):
        try:
            with open(stack_path(directory, rank), errors="replace") as f:
                stacks.append(f.read().strip())
        except OSError:
            stacks.append("")
    return stacks


class RankOutcomes:
    """What each rank of a world has reported, under one deadline for the world.

    A rank sends (kind, payload) messages on a channel of its own; on_message() takes
    these kinds (the caller handles any other, and reads ok's payload itself):
      ("ok", payload)        its work is done; it tears its group down next
      ("err", text)          it failed (text: its traceback); it exits without tearing down
      ("destroyed", None)    after ok: its group is torn down
      ("destroy_err", text)  after ok: the tear-down raised
    on_eof() takes the end of its channel (it closed it, or died): a rank that had sent ok
    is then "dead_after_ok", one that had sent nothing final "dead".
    States: running -> ok -> destroyed | destroy_err | dead_after_ok; or err | dead. A
    caller with a state before "running" (the bench's "starting", until a rank's hello)
    passes it as ``initial`` and moves the rank on itself.

    The first rank to enter a state in ``failing`` sets failed_at; from then on the
    world waits at most FAILURE_GRACE_S more (limit()), for its peers' reports.
    """

    def __init__(self, world: int, timeout_s: float, failing: Sequence[str],
                 initial: str = "running"):
        self.deadline = time.monotonic() + timeout_s
        self.state = [initial] * world
        self.notes = [""] * world      # what each rank sent with err or destroy_err
        self.failed_at: Optional[float] = None
        self._failing = frozenset(failing)

    def _enter(self, rank: int, state: str) -> None:
        self.state[rank] = state
        if state in self._failing and self.failed_at is None:
            self.failed_at = time.monotonic()

    def on_message(self, rank: int, kind: str, payload) -> bool:
        """Takes a message of one of the kinds above; False (nothing done) for any other."""
        if kind not in ("ok", "err", "destroyed", "destroy_err"):
            return False
        if kind in ("err", "destroy_err"):
            self.notes[rank] = payload
        self._enter(rank, kind)
        return True

    def on_eof(self, rank: int) -> None:
        """Rank ``rank``'s channel ended, or the rank exited before it had one."""
        if self.state[rank] == "ok":
            self._enter(rank, "dead_after_ok")
        elif self.state[rank] not in ("err", "destroyed", "destroy_err"):
            self._enter(rank, "dead")

    def limit(self) -> float:
        """Until when (time.monotonic()) to wait for reports: the deadline, or the end of
        the grace period after the first failure if sooner."""
        if self.failed_at is None:
            return self.deadline
        return min(self.deadline, self.failed_at + FAILURE_GRACE_S)

    def wait(self, channels, until: float = float("inf"),
             poll_s: float = float("inf")) -> Optional[list]:
        """The channels (multiprocessing.connection.wait's objects) ready to read, waiting
        at most ``poll_s`` and never past limit() or ``until`` (time.monotonic()); None,
        without waiting, once that time has come."""
        left = min(self.limit(), until) - time.monotonic()
        if left <= 0:
            return None
        return connection.wait(channels, timeout=min(left, poll_s))

    def section(self, rank: int, what: str, stacks: str = "", note: Optional[str] = None,
                max_chars: Optional[int] = None) -> str:
        """Rank ``rank``'s section of a failure story: "--- rank r: what", then ``note``
        (default: what it reported, a traceback) and its Python ``stacks`` (read_stacks),
        each when not empty; of these two, the last ``max_chars`` characters when given
        (the stacks, which say where it hung, outlive the traceback's start)."""
        note = self.notes[rank] if note is None else note
        body = "\n".join(part for part in (
            note.rstrip(), stacks and "Python stacks (faulthandler):\n" + stacks) if part)
        if max_chars is not None:
            body = body[-max_chars:]
        return "--- rank %d: %s" % (rank, what) + ("\n" + body if body else "")


class Processes:
    """Processes started together and stopped together, indexed in the order started.

    Used as a context manager, whatever still runs when the block is left, by any path
    (an exception or KeyboardInterrupt included), is killed: a caller never leaves a
    world behind.
    """

    def __init__(self):
        self._popens: List[subprocess.Popen] = []
        self._killed = set()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc_info) -> None:
        self.kill()

    def __len__(self) -> int:
        return len(self._popens)

    def start(self, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """Starts ``argv`` in a new session, its stdin from /dev/null (no rank reads the
        parent's); ``popen_kwargs`` go to subprocess.Popen (env, stdout, pass_fds...)."""
        popen = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, start_new_session=True,
                                 **popen_kwargs)
        self._popens.append(popen)
        return popen

    def add(self, process) -> None:
        """Takes a process started elsewhere (the test harness's forked ranks) as if
        start() had started it: it has Popen's pid, poll() and wait(timeout), and a session
        of its own."""
        self._popens.append(process)

    def pid(self, index: int) -> int:
        return self._popens[index].pid

    def exit_code(self, index: int) -> Optional[int]:
        """Its exit status as subprocess reports it (negative: the signal that ended it),
        or None while it runs."""
        return self._popens[index].poll()

    def running(self) -> List[int]:
        return [i for i in range(len(self._popens)) if self.exit_code(i) is None]

    def wait(self, timeout_s: float, which: Optional[Iterable[int]] = None) -> bool:
        """Waits until every process in ``which`` (default: all) has exited, or until
        ``timeout_s`` seconds have passed, one deadline for them all. True when all have
        exited."""
        end = time.monotonic() + timeout_s
        for i in range(len(self._popens)) if which is None else which:
            try:
                self._popens[i].wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def dump_stacks(self, which: Iterable[int], grace_s: float) -> None:
        """dump_stacks() of each process in ``which`` still running."""
        dump_stacks([self.pid(i) for i in which if self.exit_code(i) is None], grace_s)

    def kill(self) -> None:
        """SIGKILL to the process group of each process still running, then reaps every
        process, waiting at most REAP_S for each. Only processes not yet reaped are
        signalled: a reaped one's id may belong to another process by now."""
        for i in self.running():
            self._killed.add(i)
            try:
                os.killpg(self.pid(i), signal.SIGKILL)
            except ProcessLookupError:
                pass
        for popen in self._popens:
            try:
                popen.wait(REAP_S)
            except subprocess.TimeoutExpired:
                pass

    def ending(self, index: int) -> str:
        """How the process ended, for a failure report: "exit code 3", "killed by SIGSEGV",
        "still running, killed" (by kill()), or "still running"."""
        code = self.exit_code(index)
        if code is None:
            return "still running"
        if code == -signal.SIGKILL and index in self._killed:
            return "still running, killed"
        if code < 0:
            try:
                return "killed by %s" % signal.Signals(-code).name
            except ValueError:
                return "killed by signal %d" % -code
        return "exit code %d" % code
