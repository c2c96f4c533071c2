"""Multi-process harness: run one function on every rank of a real torch.distributed world.

Why this shape:
* Real processes, started, waited for and killed by pycomm._launch. Each is forked from
  the session's zygote (tests/_zygote.py), a single-threaded process that imported torch
  and pycomm once: an interpreter that imports torch itself costs 2-4 s of CPU, most of a
  short test. PYCOMM_TEST_FRESH_INTERPRETERS=1 starts a fresh interpreter per rank instead.
* ``env`` is the rank's whole environment from its start, as a fresh interpreter's would
  be; what the zygote imported read its own environment, so knobs must be read when a
  group is created or later (pycomm's and torch.distributed's are). The child receives
  the function by name (module + qualname) and its arguments as a pickle blob, and
  resolves/unpickles both in its own phase, so that an error there is reported like any
  other.
* One pipe per rank (not a shared Queue): a rank that is SIGKILLed while writing cannot
  corrupt the other ranks' channel, and its death shows up as EOF.
* The parent enforces one deadline for the whole world; on the deadline, or as soon as a
  rank reports a failure (after a short grace so the peers' tracebacks are collected too),
  every straggler is asked for its Python stacks, SIGKILLed and reaped, and an
  AssertionError carrying every rank's story is raised. The messages, the grace period,
  the stack files and the story's sections are those of pycomm._launch.RankOutcomes,
  which the benchmark's launcher shares. PYCOMM_TEST_WORLD_DEADLINE_S caps every world's
  deadline, so that a run with a limit of its own (the GPU check's steps) gets the ranks'
  stacks of a hung world before that limit kills the whole test session.
* A rank that has reported and torn down its group runs its atexit handlers and ends with
  os._exit: the interpreter's finalization frees torch's modules one by one, about a
  second of CPU per process, which made up most of a short world's time.
"""

import atexit
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback

# The backend under test. "gloo" validates the harness and test logic without pycomm.
BACKEND = os.environ.get("PYCOMM_TEST_BACKEND", "pycomm")

# Seconds for stragglers to write their Python stacks (SIGUSR1) before they are killed.
_STACK_DUMP_S = 1.0
# Per-rank report lines kept in the assertion message (tracebacks can be long).
_MAX_REPORT_CHARS = 6000

# The largest world of make test-quick, whose run sets QUICK (tests/conftest.py): there
# run_world refuses a larger world, saying that its test should be marked `large`.
QUICK_RANKS = 4
QUICK = False

# Filled in the child process: how this world was initialised, so that test functions
# can re-initialise (hung-peer test) or name the backend without extra arguments.
WORLD = {}


def world_marks(world_size):
    """The marks of a test parameter that starts a world of `world_size` ranks: `large`
    over QUICK_RANKS (make test-quick leaves it out)."""
    import pytest

    return [pytest.mark.large] if world_size > QUICK_RANKS else []


def is_gloo(backend=None):
    return (backend or WORLD.get("backend") or BACKEND) == "gloo"


def new_file_init_method(directory=None):
    """A fresh file:// rendezvous URL (the file must not exist yet)."""
    d = directory or tempfile.mkdtemp(prefix="pycomm-test-")
    path = os.path.join(d, "rdzv-%d-%d" % (os.getpid(), time.monotonic_ns()))
    return "file://" + path


# --------------------------------------------------------------------------------------
# child side
# --------------------------------------------------------------------------------------

def _resolve(module_name, qualname):
    import importlib

    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def group_timeout():
    """The world's group timeout as a timedelta, for new_group(timeout=...) in a rank:
    torch's default for new groups is 30 minutes, far beyond any test deadline."""
    import datetime

    return datetime.timedelta(seconds=WORLD["pg_timeout_s"])


def capture_stderr(fn):
    """Runs ``fn()`` with file descriptor 2 redirected to a file (pycomm's C++ core logs
    there, below Python's sys.stderr); returns (fn's result, what was written)."""
    with tempfile.TemporaryFile() as capture:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
        try:
            result = fn()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        capture.seek(0)
        return result, capture.read().decode()


# What a rank's fresh interpreter runs. It imports this module under its own name, from
# this folder (test functions read WORLD from that module), then takes the parent's
# sys.path so that it finds the function's module where the parent found it.
_CHILD_COMMAND = ("import sys; sys.path.insert(0, sys.argv[1]); import _harness; "
                  "_harness._child_main(*sys.argv[2:])")


def _child_main(world_path, rank, report_fd):
    from multiprocessing.connection import Connection

    with open(world_path, "rb") as f:
        world = pickle.load(f)  # plain data: unpickling imports nothing
    sys.path[:] = world.pop("sys_path")
    rank = int(rank)
    _child(rank, stack_path=world.pop("stack_paths")[rank],
           conn=Connection(int(report_fd), readable=False), **world)


def _child(rank, world_size, fn_ref, args_blob, init_method, backend, pg_timeout_s,
           stack_path, conn):
    # Python stacks of every thread on SIGUSR1: the parent asks for them before killing a
    # straggler, so a hang is reported with the line it hangs on.
    import faulthandler

    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    phase = "setup"
    try:
        import datetime

        import torch
        import torch.distributed as dist

        # One intra-op thread per rank, as torchrun gives its ranks (OMP_NUM_THREADS=1): a
        # world's ranks share the host's cores, where each rank's idle intra-op workers spin.
        # With torch's default, a thread per core in every rank, the tests' own tensor
        # arithmetic ran several times slower on 2 cores, and 20-50 times slower on an
        # H200's host (the GPU check's bit comparisons passed their deadline).
        torch.set_num_threads(1)

        if backend == "pycomm":
            import pycomm  # noqa: F401  (registers the backend)
        fn = _resolve(*fn_ref)
        args = pickle.loads(args_blob)
        WORLD.update(backend=backend, init_method=init_method, rank=rank,
                     world_size=world_size, pg_timeout_s=pg_timeout_s)
        phase = "init_process_group"
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        phase = "fn"
        result = fn(rank, world_size, *args)
        blob = pickle.dumps(result)
    except BaseException:
        conn.send(("err", "[phase %s]\n%s" % (phase, traceback.format_exc())))
        conn.close()
        # Do not try to destroy a group that may be stuck: the parent kills us if needed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    conn.send(("ok", blob))
    # Tear down after reporting, and report the tear-down separately: a destroy that
    # raises or hangs is a bug too, but must not hide fn's result.
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.send(("destroyed", None))
    except BaseException:
        conn.send(("destroy_err", traceback.format_exc()))
        conn.close()
        return
    conn.close()
    # Done and torn down: the atexit handlers run, the interpreter's finalization does not
    # (see the top).
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------------------

def _fn_ref(fn):
    mod = getattr(fn, "__module__", None)
    qual = getattr(fn, "__qualname__", "")
    if not mod or "<locals>" in qual or "<lambda>" in qual:
        raise TypeError("run_world needs a module-level function, got %r" % (fn,))
    return (mod, qual)


_zygote = None


def start_process(procs, main, args, fresh_argv, env, pass_fds=(), output=None):
    """Starts in ``procs`` a process that calls ``main`` ("module:function" of this folder)
    with ``args`` and the numbers ``pass_fds`` have in it, its stdout and stderr this
    process's or the descriptor ``output``: forked from the session's zygote
    (tests/_zygote.py: torch already imported), or, with PYCOMM_TEST_FRESH_INTERPRETERS=1
    or where the zygote is gone, as the fresh interpreter ``fresh_argv``."""
    global _zygote
    if os.environ.get("PYCOMM_TEST_FRESH_INTERPRETERS") != "1":
        import _zygote as zygote_module

        if _zygote is None or not _zygote.alive():
            _zygote = zygote_module.Zygote()
            atexit.register(_zygote.close)
        try:
            procs.add(_zygote.start(main, args, env, pass_fds, output))
            return
        except zygote_module.ZygoteGone as e:
            sys.stderr.write("pycomm tests: %s; %s starts in a fresh interpreter\n" % (e, main))
    procs.start(fresh_argv, env=env, pass_fds=pass_fds, stdout=output, stderr=output)


def _start_rank(procs, world_path, rank, report_fd, env):
    start_process(procs, "_harness:_child_main", (world_path, str(rank)),
                  [sys.executable, "-c", _CHILD_COMMAND, os.path.dirname(os.path.abspath(__file__)), world_path,
                   str(rank), str(report_fd)], env, (report_fd,))


def _child_env(env, init, port, rank, world_size):
    """The parent's environment with ``env`` applied (None removes a variable), and for
    init "env" what env:// reads."""
    child = dict(os.environ)
    for k, v in (env or {}).items():
        if v is None:
            child.pop(k, None)
        else:
            child[k] = str(v)
    if init == "env":
        child.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                     WORLD_SIZE=str(world_size))
    return child


def run_world(fn, world_size, *, args=(), env=None, timeout=90, init="file",
              backend=None, pg_timeout=60, expect_killed=()):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results.

    timeout: harness deadline in seconds for the whole world (start + init + fn + destroy).
    pg_timeout: the process-group timeout passed to init_process_group, in seconds.
    expect_killed: ranks that are meant to die by SIGKILL (fault tests); their result is
    None, and the world fails if they do anything else.
    """
    import shutil
    from multiprocessing.connection import Connection

    from pycomm import _launch

    if QUICK and world_size > QUICK_RANKS:
        raise AssertionError("a world of %d ranks in the quick run, which starts none over %d: mark the test "
                             "@pytest.mark.large" % (world_size, QUICK_RANKS))
    backend = backend or BACKEND
    expect_killed = set(expect_killed)
    fn_ref = _fn_ref(fn)
    tmpdir = tempfile.mkdtemp(prefix="pycomm-test-")
    port = None
    if init == "file":
        init_method = new_file_init_method(tmpdir)
    elif init == "tcp":
        port = _launch.free_port()
        init_method = "tcp://127.0.0.1:%d" % port
    elif init == "env":
        port = _launch.free_port()
        init_method = "env://"
    else:
        raise ValueError("init must be 'file', 'tcp' or 'env', not %r" % (init,))
    world_path = os.path.join(tmpdir, "world.pickle")
    # The stack paths travel as data: the child must not import pycomm (torch) before its
    # try block, and a gloo world in fresh interpreters never imports it.
    with open(world_path, "wb") as f:
        pickle.dump(dict(world_size=world_size, fn_ref=fn_ref, args_blob=pickle.dumps(tuple(args)),
                         init_method=init_method, backend=backend, pg_timeout_s=pg_timeout,
                         sys_path=list(sys.path),
                         stack_paths=[_launch.stack_path(tmpdir, r) for r in range(world_size)]), f)

    timeout = min(timeout, float(os.environ.get("PYCOMM_TEST_WORLD_DEADLINE_S", timeout)))
    # A rank's reported failure (err, destroy_err) cuts the world short; a death alone
    # does not: the world then waits for the peers' reports or the deadline.
    outcomes = _launch.RankOutcomes(world_size, timeout, failing=("err", "destroy_err"))
    state = outcomes.state
    conns = []
    results = [None] * world_size
    procs = _launch.Processes()
    try:
        for rank in range(world_size):
            read_fd, write_fd = os.pipe()
            conns.append(Connection(read_fd, writable=False))
            try:
                _start_rank(procs, world_path, rank, write_fd,
                            _child_env(env, init, port, rank, world_size))
            finally:
                os.close(write_fd)  # so that EOF on read_fd means the child is gone

        open_conns = {c: r for r, c in enumerate(conns)}
        while open_conns:
            ready = outcomes.wait(list(open_conns))
            if ready is None:
                break
            for c in ready:
                r = open_conns[c]
                try:
                    kind, payload = c.recv()
                except (EOFError, OSError):
                    del open_conns[c]
                    outcomes.on_eof(r)
                    continue
                outcomes.on_message(r, kind, payload)
                if kind == "ok":
                    results[r] = pickle.loads(payload)
        # Everyone reported; give the processes the rest of the deadline to exit cleanly.
        procs.wait(max(0.0, outcomes.deadline - time.monotonic())
                   if outcomes.failed_at is None else 0.5)
        procs.dump_stacks(procs.running(), _STACK_DUMP_S)
    finally:
        procs.kill()
        for c in conns:
            c.close()
        stacks = _launch.read_stacks(tmpdir, world_size)
        shutil.rmtree(tmpdir, ignore_errors=True)

    problems = []
    for r in range(world_size):
        story = procs.ending(r)
        if r in expect_killed:
            if state[r] == "dead" and procs.exit_code(r) == -signal.SIGKILL:
                continue
            problems.append(outcomes.section(r, "expected to be killed by SIGKILL, but state=%s, %s"
                                             % (state[r], story), max_chars=_MAX_REPORT_CHARS))
            continue
        if state[r] == "destroyed" and procs.exit_code(r) == 0:
            continue
        if state[r] == "running":
            what = ("no result before the %ss deadline" % timeout if outcomes.failed_at is None
                    else "no result (stopped after another rank failed)")
        elif state[r] == "ok":
            what = "returned a result but destroy_process_group did not finish"
        elif state[r] == "dead":
            what = "died without reporting"
        elif state[r] == "dead_after_ok":
            what = "died during destroy_process_group"
        elif state[r] == "destroyed":
            what = "did not exit cleanly after destroy_process_group"
        else:
            what = state[r]
        problems.append(outcomes.section(r, "%s (%s)" % (what, story), stacks[r],
                                         max_chars=_MAX_REPORT_CHARS))
    if problems:
        raise AssertionError("\n".join(["world of %d ranks (backend=%s, init=%s, fn=%s.%s) failed:"
                                        % (world_size, backend, init, fn_ref[0], fn_ref[1])]
                                       + problems))
    return results
