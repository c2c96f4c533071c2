"""Start a world of local processes, wait for them under one deadline, kill what is left,
and say how each one ended.

Shared by the test harness (tests/_harness.py), the fault matrix (tests/test_fault_matrix.py)
and the benchmark's launchers (pycomm.bench.launch). What the processes report, and what
counts as success, stays with each caller.

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
from typing import Iterable, List, Optional, Sequence

# How long kill() waits for each killed process to be reaped: SIGKILL cannot be caught,
# so only a process stuck in the kernel (uninterruptible I/O) takes longer.
REAP_S = 10.0


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
        """SIGUSR1 to each process in ``which`` still running, then ``grace_s`` seconds for
        them to write their stacks. The processes must have registered a faulthandler for
        SIGUSR1 (its default action ends a process)."""
        asked = [i for i in which if self.exit_code(i) is None]
        for i in asked:
            signal_pid(self.pid(i), signal.SIGUSR1)
        if asked:
            time.sleep(grace_s)

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
