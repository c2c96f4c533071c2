"""A fork server for the harness's ranks: fresh processes without a fresh interpreter's cost.

Importing torch takes 2-4 s of CPU per process on a small machine: most of a short
multi-process test, and most of the suite. The zygote is one process per test session
that imports torch and pycomm once, and what DDP and FSDP import on first use
(torch._dynamo, torch.distributed.fsdp: 1-3 s of CPU in every rank of a training world),
while it has a single thread (OPENBLAS_NUM_THREADS=1 keeps numpy's BLAS from starting its
pool at import; torch starts none until it computes), and forks a rank on request. A rank it forks:

* starts a session of its own, as Processes.start does, so that SIGKILL to its process
  group ends it and whatever it started;
* takes the requester's stdout, stderr and report pipe (passed over the control socket),
  environment and working directory, so that it runs as a Popen'ed interpreter would;
  pycomm and torch.distributed read their knobs when a group is created, not at import;
* dies with the zygote (PR_SET_PDEATHSIG), and the zygote kills its ranks and exits when
  the test session goes (end of file on its control socket);
* leaves the zygote's loop and runs the rank at the top level of this script, so that it
  ends like any interpreter (the harness's ranks end with os._exit once their group is
  torn down and their atexit handlers have run: see _harness._child).

The zygote reaps its ranks and reports each exit status, so that the harness sees for a
forked rank the pid, poll() and wait() it sees for a Popen (ForkedRank). Messages are
pickled; the control socket is a SOCK_SEQPACKET pair, one message per packet.
"""

import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

_MAX_MESSAGE = 1 << 20
_PR_SET_PDEATHSIG = 1


# --------------------------------------------------------------------------------------
# the test session's side
# --------------------------------------------------------------------------------------

class ZygoteGone(RuntimeError):
    pass


class Zygote:
    """The session's fork server; start() returns a ForkedRank. Thread-safe."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        self._process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._exited = {}      # pid -> exit code as Popen reports it
        self._gone = False

    def alive(self):
        return not self._gone and self._process.poll() is None

    def start(self, rank_main, args, env, pass_fds, output=None):
        """Forks a rank that calls rank_main (a "module:function" of this folder) with
        ``args`` and the numbers that ``pass_fds`` (descriptors of this process) have in
        the rank, after the rank's stdout and stderr became this process's, or the
        descriptor ``output``."""
        request = dict(rank_main=rank_main, args=list(args), env=dict(env), cwd=os.getcwd(),
                       sys_path=list(sys.path))
        with self._lock:
            if self._gone:
                raise ZygoteGone("the zygote exited")
            try:
                streams = [1, 2] if output is None else [output, output]
                socket.send_fds(self._sock, [pickle.dumps(request)], [*streams, *pass_fds])
            except OSError as e:
                self._gone = True
                raise ZygoteGone("the zygote exited (%s)" % e) from e
            while True:
                message = self._receive(None)
                if message[0] == "started":
                    return ForkedRank(self, message[1])
                if message[0] == "refused":
                    raise ZygoteGone(message[1])

    def poll(self, pid, timeout):
        """The exit code of ``pid`` once it is known within ``timeout`` seconds, else None.
        After the zygote's end, a rank whose exit was not reported died of SIGKILL."""
        end = time.monotonic() + timeout
        with self._lock:
            while pid not in self._exited and not self._gone:
                left = end - time.monotonic()
                if left < 0:
                    break
                try:
                    self._receive(left)
                except ZygoteGone:
                    break
            if self._gone:
                return self._exited.get(pid, -signal.SIGKILL)
            return self._exited.get(pid)

    def close(self):
        self._sock.close()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _receive(self, timeout):
        """The next message that is not an exit report (those are recorded), or None when
        none came within ``timeout`` seconds (None: wait for one)."""
        while True:
            self._sock.settimeout(timeout)
            try:
                packet = self._sock.recv(_MAX_MESSAGE)
            except socket.timeout:
                return None
            if not packet:
                # The zygote is gone and its ranks with it (PR_SET_PDEATHSIG).
                self._gone = True
                raise ZygoteGone("the zygote exited (%s)" % self._process.wait())
            message = pickle.loads(packet)
            if message[0] != "exited":
                return message
            self._exited[message[1]] = message[2]
            if timeout is not None:
                return message


class ForkedRank:
    """A forked rank as Processes sees a Popen: pid, poll() and wait(timeout)."""

    def __init__(self, zygote, pid):
        self._zygote = zygote
        self.pid = pid

    def poll(self):
        return self._zygote.poll(self.pid, 0)

    def wait(self, timeout=None):
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 3600.0 if end is None else end - time.monotonic()
            code = self._zygote.poll(self.pid, max(0.0, left))
            if code is not None:
                return code
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired("forked rank %d" % self.pid, timeout)


# --------------------------------------------------------------------------------------
# the zygote's side
# --------------------------------------------------------------------------------------

def _serve(sock):
    """Forks a rank per request until the session closes the socket. Returns, in a forked
    rank only, (request, descriptors) for the rank to run."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    children = set()
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_read:
                while os.read(wake_read, 4096) == 4096:
                    pass
                _reap(sock, children)
                continue
            packet, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 16)
            if not packet:
                for pid in children:
                    _kill_group(pid)
                return None
            request = pickle.loads(packet)
            threads = threading.active_count(), len(os.listdir("/proc/self/task"))
            if threads != (1, 1):
                # Forking a process with other threads may copy a lock one of them held.
                _close(fds)
                sock.send(pickle.dumps(("refused", "the zygote has %d threads" % threads[1])))
                continue
            pid = os.fork()
            if pid == 0:
                selector.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_read)
                os.close(wake_write)
                sock.close()
                return request, fds
            children.add(pid)
            _close(fds)
            sock.send(pickle.dumps(("started", pid)))


def _reap(sock, children):
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        sock.send(pickle.dumps(("exited", pid, os.waitstatus_to_exitcode(status))))


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _close(fds):
    for fd in fds:
        os.close(fd)


def _become_rank(request, fds, zygote_pid):
    import ctypes

    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != zygote_pid:  # the zygote died before the line above
        os._exit(1)
    stdout, stderr, *passed = fds
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = request["sys_path"]
    module, function = request["rank_main"].split(":")
    main = getattr(__import__(module), function)
    main(*request["args"], *passed)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    import _harness  # noqa: F401
    import pycomm  # noqa: F401

    zygote_pid = os.getpid()
    control = socket.socket(fileno=int(sys.argv[1]))
    job = _serve(control)
    if job is not None:
        _become_rank(*job, zygote_pid)
