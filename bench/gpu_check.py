"""The GPU check: pycomm's whole CUDA path, prepared to run as one command on a GPU machine
(`make gpu-check`) in at most 8 minutes on one H100.

    python bench/gpu_check.py [--out DIR] [--budget SECONDS]
    GPU_CHECK_DRY=1 python bench/gpu_check.py [--out DIR]    # any machine: plan and rehearse

Steps, in order. Each runs as a child process (its own process group) with its own time
limit, so a hang costs only that step; the steps after a failed build are skipped; an
optional step runs only if its whole limit fits in what is left of the budget. A step at
its limit is interrupted (SIGINT) before it is killed, so that pytest reports what failed.

  build         pip install --no-build-isolation --no-deps -e . with the CUDA build
  versions      torch, CUDA, NCCL, triton, driver, GPU
  cuda-tests    tests/test_cuda.py but its layered and fault tests: kernels and collectives
                on CUDA tensors bit for bit against the CPU path, AVG included, at 2, 4
                and 8 ranks on the GPU (under MPS), every pair staged through host memory
                (PYCOMM_CUDA_IPC=off) and over TCP
  cuda-faults   tests/test_cuda.py's fault tests: a peer of the flag one-shot asleep or
                killed is reported in time
  triton-tests  tests/test_triton_kernels.py and tests/test_triton_binned.py (the exact
                gradient accumulator's kernels) with the kernels compiled for the GPU
  layered       tests/test_cuda.py's layered tests: NCCL moving at 1 rank, gloo moving CUDA
                tensors at 2 and 4 ranks on the GPU, every codec, both deterministic modes,
                with the CUDA kernels and with the Triton kernels: the native CPU bits
  throughput    the folds and codecs of both kernel sets on 256 MiB of float32 against a
                device-to-device copy of the same bytes (target: 80% of its bandwidth),
                and the two sets' outputs compared bit for bit
  allreduce     the layered default-mode, exact and fp8 all-reduce over NCCL against NCCL's
                own all-reduce at 1 rank; the native CUDA all-reduce at 2 ranks on the GPU
                (under MPS where its daemon starts, else time-sliced) against gloo
  host-cost     the host's time per call with the stream held behind a long kernel (so that
                only the host's work counts), NCCL's own all-reduce and the layered one in
                the default mode, exact and fp8_e4m3, at 1 rank (which gathers no stamps)
  graphs        each layered collective (all-reduce, reduce-scatter, all-gather; default,
                exact, fp8_e4m3) over NCCL captured in a CUDA graph after a warm-up call and
                replayed 100 times on new data: every replay's bits those of the same call
                made outside the graph
  capture       pycomm's own all-reduce, reduce-scatter and all-gather (every mode, fp8_e4m3)
                at 2 ranks on the GPU captured in a CUDA graph after a warm-up call and
                replayed 100 times on new data: every replay's bits those of the eager call
  stream-wait   whether Work.wait() of a CUDA collective queued behind a long kernel holds
                the host or only the current stream (native path and layered over NCCL)
  sanitizer     compute-sanitizer memcheck on the kernel tests (optional)

Dry run (GPU_CHECK_DRY=1): the build prints its command only; the test steps collect their
tests; the measuring steps run their own code on CPU tensors at small sizes (the CPU ops
and Triton's interpreter standing in for the GPU kernels, gloo for NCCL).

Writes under --out, named for the device: gpu-<device>-check.md (device, versions, each
step's verdict, the numbers beside their targets), .json (every number) and .log (every
step's output). The Markdown is rewritten after each step, so a run cut short still
leaves what it measured. GPU_CHECK_COMMIT names the commit in the report (a tree copied to
a GPU machine may carry no git history, or a stale one).
"""
import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
MiB = 1 << 20
COPY_TARGET = 0.8  # a kernel's share of device-to-device copy bandwidth
INTERRUPT_GRACE_S = 15  # a step at its limit is interrupted this long before it is killed
# A Work.wait() that returns within this share of the kernel queued before the collective
# left the host free; one that returns after the kernel held it.
HOST_FREE_SHARE = 0.25


# The extension must link the C++ runtime dynamically, as torch does: built by a toolchain
# that links libstdc++ statically, it crashes at its first stream insertion (seen on an
# H100 machine whose default c++ did), so the build takes the system's compilers.
SYSTEM_COMPILERS = {var: path for var, path in (("CC", "/usr/bin/gcc"), ("CXX", "/usr/bin/g++"))
                    if os.path.exists(path)}


class Step:
    """One step: argv of a child process run in ROOT, with a time limit in seconds."""

    def __init__(self, name, limit_s, what, argv, env=None, needs_build=True, optional=False, measures=False,
                 mps=False):
        self.name, self.limit_s, self.what, self.argv = name, limit_s, what, argv
        self.env, self.needs_build, self.optional, self.measures = env or {}, needs_build, optional, measures
        self.mps = mps  # its processes share the GPU through the MPS daemon, where it starts


def plan(dry):
    """The steps. In a dry run the test steps only collect their tests (so the compiled-only
    arguments, xdist's -n and the sanitizer, stay out) and the measuring steps get --dry."""
    def tests(*args, parallel=(), wrapper=()):
        if dry:
            return [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *args]
        return [*wrapper, sys.executable, "-m", "pytest", "-q", "-rfEs", "--durations=12", "-p", "no:cacheprovider",
                *parallel, *args]

    def own(name):
        return [sys.executable, os.path.abspath(__file__), "--step", name] + (["--dry"] if dry else [])

    jobs = str(min(os.cpu_count() or 1, 16))

    def worlds(limit_s, workers=1):
        """A test step's worlds: a deadline short of the step's limit, so that a hung world
        reports its ranks' stacks; fresh interpreters for ranks (the suite's zygote forks
        them from a process that imported pycomm, not tried beside CUDA); each of the step's
        pytest workers a share of the cores for torch's host ops (a thread per core in every
        worker overran the cores, and the ranks' own worlds beside them)."""
        return {"PYCOMM_TEST_WORLD_DEADLINE_S": str(limit_s - 40), "PYCOMM_TEST_FRESH_INTERPRETERS": "1",
                "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // workers))}

    sanitizer = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "1", "--target-processes", "all"]
    return [
        Step("build", 300, "pip install --no-build-isolation --no-deps -e . (PYCOMM_WITH_CUDA=1)",
             [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", "."],
             env=dict(SYSTEM_COMPILERS, PYCOMM_WITH_CUDA="1", MAX_JOBS=jobs), needs_build=False),
        Step("versions", 60, "torch, CUDA, NCCL, triton, driver, GPU", own("versions"), measures=True),
        # Several test worlds at a time (pytest-xdist): most of a world's time is its
        # processes' start, CUDA set-up and host-driven steps, not the GPU's work. They share
        # the GPU through MPS: time-sliced, a flag-synchronized kernel waiting for a peer's
        # holds the GPU for its whole slice, and on one H100 every world crawled beside them.
        # The steps themselves run one at a time: side by side, Triton's compiles and the
        # ranks' host work outnumbered 16 cores and every step ran several times slower.
        Step("cuda-tests", 130, "tests/test_cuda.py (kernels, collectives, flag one-shot): bits equal to the CPU's",
             tests("tests/test_cuda.py", "-k", "not layered and not missing_peer", parallel=["-n", "8"]),
             env=worlds(130, 8), mps=True),
        # Alone and time-sliced: a killed peer's memory, mapped into a kernel of a rank
        # that survives, must not fault beside other processes sharing an MPS server.
        Step("cuda-faults", 60, "tests/test_cuda.py's flag one-shot with a peer asleep or killed: reported in time",
             tests("tests/test_cuda.py", "-k", "missing_peer"), env=worlds(60)),
        Step("triton-tests", 90, "tests/test_triton_kernels.py and tests/test_triton_binned.py compiled for the GPU: "
             "bits equal to the CPU ops",
             tests("tests/test_triton_kernels.py", "tests/test_triton_binned.py", parallel=["-n", "8"]),
             env=dict(worlds(90, 8), PYCOMM_TRITON_ON_GPU="0" if dry else "1"), mps=True),
        Step("layered", 120, "layered path on CUDA tensors (NCCL at 1 rank, gloo at 2 and 4), CUDA and Triton "
             "kernels: the native CPU bits", tests("tests/test_cuda.py", "-k", "layered", parallel=["-n", "6"]),
             env=worlds(120, 6), mps=True),
        Step("throughput", 60, "folds and codecs on 256 MiB against a device copy (target %d%%)" % (100 * COPY_TARGET),
             own("throughput"), measures=True),
        Step("allreduce", 120, "layered over NCCL against NCCL at 1 rank; native at 2 ranks on one GPU",
             own("allreduce"), measures=True),
        Step("host-cost", 60, "host time per call, the stream held: NCCL against layered (default, exact, fp8)",
             own("host-cost"), measures=True),
        Step("graphs", 90, "layered collectives over NCCL captured in CUDA graphs, 100 replays: the bits of eager "
             "calls", own("graphs"), measures=True),
        Step("capture", 60, "pycomm's collectives at 2 ranks captured in CUDA graphs, 100 replays: the bits of "
             "eager calls", own("capture"), measures=True),
        Step("stream-wait", 60, "Work.wait() behind a long kernel: host or stream", own("stream-wait"),
             measures=True),
        Step("sanitizer", 100, "compute-sanitizer memcheck: reduce and codec kernel tests",
             tests("tests/test_cuda.py", "-k",
                   "reduce_kernel_matches_cpu and float32 or codec_kernels_match_cpu and fp8_e4m3", wrapper=sanitizer),
             optional=True),
    ]


# ---------------------------------------------------------------------------------------
# The measuring steps (child processes). Each returns a dict: "rows" (numbers), "verdict"
# ("pass" or "FAIL: why") and anything else worth keeping, and saves what it has measured
# so far with save(dict) as it goes, so that a step stopped at its limit still reports it.
# ---------------------------------------------------------------------------------------

def _device(dry):
    import torch

    return torch.device("cpu" if dry else "cuda")


def _median_time(fn, device, iters, warmup=3):
    """Median seconds per call: CUDA events around each call on a GPU, the host clock on
    the CPU (where the ops finish before returning)."""
    import torch

    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    torch.cuda.synchronize()
    pairs = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs) / 1e3


def step_versions(dry, save):
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cpus": os.cpu_count(), "commit": os.environ.get("GPU_CHECK_COMMIT", "unknown")}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError as e:
        info["triton"] = "not importable (%s)" % e
    try:
        import pycomm
        info["pycomm CUDA build"] = bool(pycomm._C.has_cuda)
        linked = subprocess.run(["ldd", pycomm._C.__file__], capture_output=True, text=True, timeout=30).stdout
        info["extension's libstdc++"] = "shared" if "libstdc++.so" in linked else "NOT SHARED (static or missing)"
    except ImportError as e:
        info["pycomm"] = "not importable (%s)" % e
    info["1-rank pycomm group"] = _one_rank_group("cpu" if dry else "cuda")
    compiler = SYSTEM_COMPILERS.get("CXX", "c++")
    info["compiler"] = compiler + ": " + subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                                        timeout=30).stdout.partition("\n")[0]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update({"gpu": props.name, "multiprocessors": props.multi_processor_count,
                     "gpu memory GiB": round(props.total_memory / 2**30, 1),
                     "capability": "%d.%d" % (props.major, props.minor),
                     "nccl": ".".join(map(str, torch.cuda.nccl.version()))})
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        info["driver"] = out.stdout.strip() or out.stderr.strip()
    for k, v in info.items():
        print("%-20s %s" % (k, v))
    ok = dry or (torch.cuda.is_available() and info.get("pycomm CUDA build") is True
                 and info.get("extension's libstdc++") == "shared" and info["1-rank pycomm group"] == "ok")
    return {"info": info, "verdict": "pass" if ok else "FAIL: no GPU or pycomm without its CUDA build"}


ONE_RANK_GROUP = """
import sys, tempfile, torch, torch.distributed as dist, pycomm
dist.init_process_group("pycomm", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
t = torch.ones(4, device=sys.argv[1])
dist.all_reduce(t)
print("ok" if t.sum().item() == 4 else "wrong sum")
dist.destroy_process_group()
"""


def _one_rank_group(device):
    """Whether a 1-rank pycomm group makes and runs an all-reduce, in a process of its own
    (a crash there is the answer, not the end of this step)."""
    run = subprocess.run([sys.executable, "-X", "faulthandler", "-c", ONE_RANK_GROUP, device], capture_output=True,
                         text=True, timeout=60)
    if run.returncode == 0:
        return run.stdout.strip()
    print(run.stderr[-3000:])
    return "exit %d: %s" % (run.returncode, (run.stderr.strip().splitlines() or ["no output"])[-1][:200])


def _kernel_sets():
    """The folds to measure, by name: pycomm's CUDA kernels and its Triton kernels (in a
    dry run the CPU ops and Triton's interpreter)."""
    from pycomm import _C

    sets = {"cuda": _C.fold}
    try:
        from pycomm.kernels import triton
        sets["triton"] = triton.fold
    except ImportError as e:
        print("triton: not importable (%s)" % e)
    return sets


def step_throughput(dry, save):
    import torch
    import torch.distributed as dist

    from pycomm import _C

    device = _device(dry)
    n = 2048 if dry else (64 << 20)  # 256 MiB of float32; the interpreter is slow
    iters, warmup = (1, 1) if dry else (20, 3)
    block = _C.default_compression_block()
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(n, device=device, generator=gen)
    y = torch.randn(n, device=device, generator=gen)
    out = torch.empty_like(x)
    copy_s = _median_time(lambda: out.copy_(x), device, iters, warmup)
    copy_bw = 2 * x.nbytes / copy_s
    rows = [{"kernels": "torch", "op": "copy, device to device", "bytes": 2 * x.nbytes, "seconds": copy_s,
             "GBps": copy_bw / 1e9, "share": 1.0}]
    Form, Stage, SUM = _C.Form, _C.Stage, dist.ReduceOp.SUM

    # (name, dtype, terms, forms, stage, codec, exact): each op as the layered path runs it.
    def cases():
        xb, yb = x.bfloat16(), y.bfloat16()
        yield "fold float32 SUM, 2 terms", torch.float32, [x, y], [Form.Input] * 2, Stage.Final, "none", False
        yield "fold float32 SUM, 2 terms, exact", torch.float32, [x, y], [Form.Input] * 2, Stage.Final, "none", True
        yield "fold bfloat16 SUM, 2 terms", torch.bfloat16, [xb, yb], [Form.Input] * 2, Stage.Final, "none", False
        for codec in _C.codecs:
            enc = _C.encode(y, codec, block, None)
            yield "encode -> %s" % codec, torch.float32, [x], [Form.Input], Stage.Encoded, codec, False
            yield "decode %s ->" % codec, torch.float32, [enc], [Form.Encoded], Stage.Final, codec, False
            yield ("fold input + %s -> %s" % (codec, codec), torch.float32, [x, enc], [Form.Input, Form.Encoded],
                   Stage.FinalEncoded, codec, False)

    problems = []
    for name, dtype, terms, forms, stage, codec, exact in cases():
        coded_out = stage in (Stage.Encoded, Stage.FinalEncoded)
        result = (torch.empty(_C.encoded_size(codec, block, n), dtype=torch.uint8, device=device) if coded_out
                  else torch.empty(n, dtype=dtype, device=device))
        nbytes = sum(t.nbytes for t in terms) + result.nbytes
        outputs = {}
        for kernels, fold in _kernel_sets().items():
            def call():
                fold(result, terms, forms, dtype, n, SUM, 2, exact, codec, block, stage)
            try:
                s = _median_time(call, device, iters, warmup)
            except Exception as e:  # a kernel set that cannot run this op is a finding, not the end
                problems.append("%s %s: %s" % (kernels, name, e))
                continue
            outputs[kernels] = result.clone()
            rows.append({"kernels": kernels, "op": name, "bytes": nbytes, "seconds": s, "GBps": nbytes / s / 1e9,
                         "share": nbytes / s / copy_bw})
            print("%-8s %-36s %10.1f us %8.1f GB/s %5.0f%% of copy" % (
                kernels, name, s * 1e6, nbytes / s / 1e9, 100 * nbytes / s / copy_bw), flush=True)
        if len(outputs) == 2 and not torch.equal(*[o.view(torch.uint8) for o in outputs.values()]):
            problems.append("%s: the CUDA and Triton kernels' bits differ" % name)
        save({"rows": rows, "verdict": "FAIL: cut short", "elements": n})
    below = ["%s %s (%.0f%%)" % (r["kernels"], r["op"], 100 * r["share"]) for r in rows if r["share"] < COPY_TARGET]
    verdict = "FAIL: " + "; ".join(problems) if problems else "pass"
    return {"rows": rows, "verdict": verdict, "below target": below, "elements": n}


def _init_world(backend, rank, ws, init_file):
    import torch.distributed as dist

    dist.init_process_group(backend, init_method="file://" + init_file, rank=rank, world_size=ws)


def step_allreduce(dry, save):
    """Layered (pycomm's reductions, NCCL moving) against NCCL at 1 rank; the native CUDA
    path at 2 ranks (bench/gpu.py's measurement) under MPS if its daemon starts."""
    import torch
    import torch.distributed as dist

    import pycomm

    device = _device(dry)
    sizes = [4 << 10, 1 * MiB] if dry else [4 << 10, 1 * MiB, 64 * MiB]
    iters = 2 if dry else 30
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        _init_world("gloo" if dry else "nccl", 0, 1, os.path.join(tmp, "one"))
        mover = dist.get_backend()

        def timed(fn):
            def call():
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
            return _median_time(call, torch.device("cpu"), iters)

        for size in sizes:
            t = torch.ones(size // 4, device=device)
            variants = [(mover + " all_reduce", lambda: dist.all_reduce(t)),
                        ("layered over %s, default mode" % mover, lambda: pycomm.all_reduce(t, deterministic=True)),
                        ("layered over %s, exact" % mover, lambda: pycomm.all_reduce(t, deterministic="exact")),
                        ("layered over %s, fp8_e4m3" % mover, lambda: pycomm.all_reduce(t, compression="fp8_e4m3"))]
            for name, call in variants:
                rows.append({"backend": name, "ranks": 1, "bytes": size, "seconds": timed(call)})
                rows[-1]["us"] = rows[-1]["seconds"] * 1e6
                print("%-36s 1 rank %9d B %10.1f us" % (name, size, rows[-1]["us"]), flush=True)
                save({"rows": rows, "native": [], "mps": "not reached", "verdict": "FAIL: cut short"})
            if not bool(torch.all(t == 1).item()):
                rows.append({"backend": "CHECK", "ranks": 1, "bytes": size, "seconds": float("nan")})
        dist.destroy_process_group()
    native = []
    mps_note = "not run (dry run)"
    if not dry:
        sys.path.insert(0, BENCH)
        import gpu
        with tempfile.TemporaryDirectory() as tmp, _mps_daemon() as mps_note:
            native = gpu.run_spawned(gpu.allreduce_rank, 2, (2, [4 << 10, 64 << 10, 1 * MiB, 64 * MiB], iters,
                                                              os.path.join(tmp, "two")))
    for r in native:
        r["us"] = r["seconds"] * 1e6
        print("%-36s %2d ranks %9d B %10.1f us" % (r["backend"], r["ranks"], r["bytes"], r["us"]))
    bad = [r for r in rows if r["backend"] == "CHECK"] + [r for r in native if not r.get("ok", True)]
    return {"rows": rows, "native": native, "mps": mps_note,
            "verdict": "FAIL: wrong values at %s" % bad if bad else "pass"}


# The MPS daemon's pipes and log: a directory of this check's own, so that the orchestrator
# can stop a daemon that a step killed at its limit left running.
MPS_DIR = os.path.join(tempfile.gettempdir(), "pycomm-gpu-check-mps")
MPS_ENV = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(MPS_DIR, "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": os.path.join(MPS_DIR, "log")}


def stop_mps():
    if os.path.isdir(MPS_DIR) and shutil.which("nvidia-cuda-mps-control"):
        subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", env=dict(os.environ, **MPS_ENV), timeout=30,
                       capture_output=True)
        shutil.rmtree(MPS_DIR, ignore_errors=True)


class _mps_daemon:
    """The CUDA MPS control daemon for the duration (the spawned ranks inherit its
    variables); yields what ran."""

    def __init__(self):
        self.env, self.started = MPS_ENV, False

    def __enter__(self):
        control = shutil.which("nvidia-cuda-mps-control")
        if not control:
            return "time-sliced (no nvidia-cuda-mps-control)"
        for d in self.env.values():
            os.makedirs(d, exist_ok=True)
        rc = subprocess.run([control, "-d"], env=dict(os.environ, **self.env), timeout=30).returncode
        if rc != 0:
            return "time-sliced (the MPS daemon did not start: exit %d)" % rc
        os.environ.update(self.env)
        self.started = True
        return "MPS"

    def __exit__(self, *exc):
        if self.started:
            stop_mps()
            for k in self.env:
                os.environ.pop(k, None)


def _sleep_cycles_per_second():
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    torch.cuda._sleep(cycles)  # warm
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def _wait_behind_kernel(call, device, expected, queued_s):
    """Queues a kernel of about queued_s seconds on the current stream, starts the
    collective (async_op=True) and times the host in Work.wait(); then checks the result."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(int(queued_s * _sleep_cycles_per_second()))
    t0 = time.perf_counter()
    work, tensor = call()
    issued = time.perf_counter() - t0
    work.wait()
    waited = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return {"issue s": issued, "wait returned s": waited, "complete s": total, "queued kernel s": queued_s,
            "right values": bool(torch.equal(tensor.cpu(), expected)),
            "holds": "stream" if waited < HOST_FREE_SHARE * queued_s else "host"}


def _native_wait_rank(rank, ws, init_file, dry, queue):
    import torch

    import pycomm  # noqa: F401 (registers the backend)

    device = _device(dry)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    _init_world("pycomm", rank, ws, init_file)
    import torch.distributed as dist

    def call():
        t = torch.full((1 << 18,), rank + 1.0, device=device)
        return dist.all_reduce(t, async_op=True), t

    call()[0].wait()  # the group's device path is up
    result = _wait_behind_kernel(call, device, torch.full((1 << 18,), ws * (ws + 1) / 2), 0.0 if dry else 0.3)
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def step_stream_wait(dry, save):
    import torch
    import torch.distributed as dist

    import pycomm

    device = _device(dry)
    queued = 0.0 if dry else 0.3
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        _init_world("gloo" if dry else "nccl", 0, 1, os.path.join(tmp, "one"))

        def layered():
            t = torch.full((1 << 18,), 2.0, device=device)
            return pycomm.all_reduce(t, deterministic=True, async_op=True), t

        layered()[0].wait()
        rows["layered over %s, 1 rank" % dist.get_backend()] = _wait_behind_kernel(
            layered, device, torch.full((1 << 18,), 2.0), queued)
        save({"rows": rows, "verdict": "FAIL: cut short"})
        dist.destroy_process_group()
        sys.path.insert(0, BENCH)
        import gpu
        # The native all-reduce runs on the group's device team, whose members' kernels must
        # run at once: under MPS where its daemon starts (time-sliced too, with always).
        with _mps_daemon():
            os.environ["PYCOMM_CUDA_FLAGS"] = "always"
            rows["native pycomm, 2 ranks"] = gpu.run_spawned(_native_wait_rank, 2, (2, os.path.join(tmp, "two"), dry))
    for name, r in rows.items():
        print("%-32s wait returned after %.1f ms (kernel queued: %.0f ms): the %s waits; values %s" % (
            name, 1e3 * r["wait returned s"], 1e3 * r["queued kernel s"], r["holds"],
            "right" if r["right values"] else "WRONG"))
    wrong = [k for k, r in rows.items() if not r["right values"]]
    return {"rows": rows, "verdict": "FAIL: wrong values: %s" % wrong if wrong else "pass"}


def _layered_variants(mover):
    """The layered all-reduce's modes a step measures, by name: (algorithm's name, the
    direct API's keyword arguments)."""
    return [("layered over %s, default mode" % mover, {"deterministic": True}),
            ("layered over %s, exact" % mover, {"deterministic": "exact"}),
            ("layered over %s, fp8_e4m3" % mover, {"compression": "fp8_e4m3"})]


def step_host_cost(dry, save):
    """The host's time per call, at 1 rank: the stream held behind a kernel longer than
    all the calls take to enqueue, so that nothing the host does waits for the device and
    the time is only the host's (what a CUDA graph removes); each call then checked."""
    import torch
    import torch.distributed as dist

    import pycomm

    device = _device(dry)
    calls = 5 if dry else 50  # the device's queue of launches stays far from full
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        _init_world("gloo" if dry else "nccl", 0, 1, os.path.join(tmp, "one"))
        mover = dist.get_backend()
        held_s = 0.0 if dry else 0.5
        cycles = 0 if dry else int(held_s * _sleep_cycles_per_second())
        for size in (4 << 10, 1 * MiB):
            t = torch.ones(size // 4, device=device)
            variants = [(mover + " all_reduce", lambda: dist.all_reduce(t))] + [
                (name, lambda kw=kw: pycomm.all_reduce(t, **kw)) for name, kw in _layered_variants(mover)]
            for name, call in variants:
                call()  # each kind's first call makes what its next calls keep
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda._sleep(cycles)
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                host_s = (time.perf_counter() - t0) / calls
                if device.type == "cuda":
                    torch.cuda.synchronize()
                rows.append({"backend": name, "bytes": size, "host us": host_s * 1e6, "stream held s": held_s,
                             "right values": bool(torch.all(t == 1).item())})
                print("%-36s %9d B %8.1f us of host per call" % (name, size, host_s * 1e6), flush=True)
                save({"rows": rows, "verdict": "FAIL: cut short"})
        dist.destroy_process_group()
    late = [r["backend"] for r in rows if r["host us"] * calls > 1e6 * held_s > 0]
    wrong = [r["backend"] for r in rows if not r["right values"]]
    verdict = "pass" if not wrong and not late else "FAIL: %s" % "; ".join(
        (["wrong values: %s" % wrong] if wrong else []) + (["calls outlasted the held stream: %s" % late] if late else []))
    return {"rows": rows, "verdict": verdict}


# The layered collectives the graphs step captures: (collective, the direct API's keyword arguments).
GRAPH_CASES = [(collective, kw) for collective in ("allreduce", "reduce_scatter", "allgather")
               for kw in ({"deterministic": True}, {"deterministic": "exact"}, {"compression": "fp8_e4m3"})]


def step_graphs(dry, save):
    """Each layered collective captured in a CUDA graph after a warm-up call (which makes
    its layout, its buffers and the mover's communicator), then replayed on new data, each
    replay's output compared bit for bit with the same call made outside the graph. In a
    dry run the calls stand in for the replays."""
    import torch
    import torch.distributed as dist

    import pycomm

    device = _device(dry)
    replays = 3 if dry else 100
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        _init_world("gloo" if dry else "nccl", 0, 1, os.path.join(tmp, "one"))
        for collective, kw in GRAPH_CASES:
            n = 1 << 16
            data = torch.empty(n, device=device)
            out = torch.empty(n, device=device)

            def call(x, y):
                if collective == "allreduce":
                    y.copy_(x)
                    pycomm.all_reduce(y, dist.ReduceOp.AVG, **kw)
                elif collective == "reduce_scatter":
                    pycomm.reduce_scatter_tensor(y, x, dist.ReduceOp.AVG, **kw)
                else:
                    pycomm.all_gather_into_tensor(y, x, **kw)

            call(data.normal_(), out)  # the warm-up
            replay = lambda: call(data, out)  # noqa: E731 - a dry run's stand-in
            if device.type == "cuda":
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    call(data, out)
                replay = graph.replay
            wrong = 0
            for i in range(replays):
                data.copy_(torch.randn(n, generator=torch.Generator().manual_seed(i)).to(device))
                replay()
                expected = torch.empty_like(out)
                call(data, expected)
                wrong += not torch.equal(out.view(torch.int32), expected.view(torch.int32))
            rows.append({"collective": collective, "options": kw, "replays": replays, "wrong": wrong})
            print("%-15s %-30s %d replays, %d with other bits than the eager call" % (collective, kw, replays, wrong),
                  flush=True)
            save({"rows": rows, "verdict": "FAIL: cut short"})
        dist.destroy_process_group()
    bad = ["%s %s" % (r["collective"], r["options"]) for r in rows if r["wrong"]]
    return {"rows": rows, "verdict": "FAIL: other bits in %s" % bad if bad else "pass"}


# pycomm's own collectives the capture step captures, at 2 ranks on the GPU: (collective,
# the direct API's keyword arguments).
CAPTURE_CASES = [(collective, kw) for collective in ("allreduce", "reduce_scatter", "allgather")
                 for kw in ({}, {"deterministic": True}, {"deterministic": "exact"}, {"compression": "fp8_e4m3"})]


def _capture_rank(rank, ws, init_file, dry, queue):
    """One rank of the capture step: each case warmed up, captured, replayed on new data
    and compared with the same call made outside the graph (in a dry run, the calls stand
    in for the replays); a case that cannot be captured says why."""
    import torch

    import pycomm

    device = _device(dry)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    _init_world("pycomm", rank, ws, init_file)
    replays = 3 if dry else 100
    n = 1 << 14
    rows = []
    for collective, kw in CAPTURE_CASES:
        size_in, size_out = {"allreduce": (n, n), "reduce_scatter": (n * ws, n), "allgather": (n, n * ws)}[collective]
        data = torch.empty(size_in, device=device)
        out = torch.empty(size_out, device=device)

        def call(x, y):
            if collective == "allreduce":
                y.copy_(x)
                pycomm.all_reduce(y, **kw)
            elif collective == "reduce_scatter":
                pycomm.reduce_scatter_tensor(y, x, **kw)
            else:
                pycomm.all_gather_into_tensor(y, x, **kw)

        row = {"collective": collective, "options": kw, "replays": 0, "wrong": 0, "captured": "dry run"}
        call(data.normal_(), out)  # the warm-up
        replay = lambda: call(data, out)  # noqa: E731 - a dry run's stand-in
        if device.type == "cuda":
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    call(data, out)
                row["captured"] = "yes"
                replay = graph.replay
            except Exception as e:  # not capturable: say why, and go on with the next case
                row["captured"] = "no: " + str(e).splitlines()[0][:300]
                replay = None
                torch.cuda.synchronize()
        for i in range(replays if replay else 0):
            seed = 1000 * i + rank
            data.copy_(torch.randn(size_in, generator=torch.Generator().manual_seed(seed)).to(device))
            replay()
            expected = torch.empty_like(out)
            call(data, expected)
            row["replays"] += 1
            row["wrong"] += not torch.equal(out.view(torch.int32), expected.view(torch.int32))
        rows.append(row)
    if rank == 0:
        queue.put(rows)
    import torch.distributed as dist
    dist.destroy_process_group()


def step_capture(dry, save):
    """pycomm's own collectives (all-reduce, reduce-scatter, all-gather; every mode, a
    codec) at 2 ranks on the GPU, captured in CUDA graphs after a warm-up call and replayed
    100 times on new data, each replay's bits those of the same call made outside the
    graph; a collective that cannot be captured fails the step, saying why."""
    sys.path.insert(0, BENCH)
    import gpu

    with tempfile.TemporaryDirectory() as tmp, _mps_daemon() as mps_note:
        os.environ["PYCOMM_CUDA_FLAGS"] = "always"  # the team, time-sliced too
        rows = gpu.run_spawned(_capture_rank, 2, (2, os.path.join(tmp, "two"), dry))
    for r in rows:
        print("%-15s %-30s captured: %s; %d replays, %d with other bits than the eager call" % (
            r["collective"], r["options"], r["captured"], r["replays"], r["wrong"]), flush=True)
    bad = ["%s %s" % (r["collective"], r["options"]) for r in rows
           if r["wrong"] or r["captured"] not in ("yes", "dry run") or not r["replays"]]
    return {"rows": rows, "mps": mps_note, "verdict": "FAIL: %s" % bad if bad else "pass"}


MEASURING = {"versions": step_versions, "throughput": step_throughput, "allreduce": step_allreduce,
             "host-cost": step_host_cost, "graphs": step_graphs, "capture": step_capture,
             "stream-wait": step_stream_wait}


# ---------------------------------------------------------------------------------------
# The orchestrator.
# ---------------------------------------------------------------------------------------

def device_slug(name):
    """'h100' for 'NVIDIA H100 80GB HBM3', else the name in lower case and dashes; 'cpu'
    for no name."""
    name = name.replace("NVIDIA", "")
    model = re.search(r"\b([A-Za-z]+\d+[A-Za-z]?)\b", name)
    return model.group(1).lower() if model else (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cpu")


def run_child(step, argv, env, limit_s, log):
    """Runs argv in its own process group; kills the group at the limit or when it ends
    (a rank left behind must not outlive its step). Returns (rc or None, output)."""
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except OSError as e:
            return -1, "cannot start %s: %s\n" % (argv[0], e)
        try:
            rc = proc.wait(timeout=max(1.0, limit_s - INTERRUPT_GRACE_S))
        except subprocess.TimeoutExpired:
            rc = None
            # Interrupted first, pytest reports the failures it has seen and a measuring
            # step stops where it is (it has saved what it measured).
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        out.seek(0)
        text = out.read().decode(errors="replace")
    log.write("\n===== %s: %s (limit %.0f s)\n%s" % (step.name, " ".join(argv), limit_s, text))
    log.flush()
    return rc, text


def pytest_summary(text):
    lines = [l.strip("= ") for l in text.splitlines() if re.search(r"\b(passed|failed|error|skipped|no tests ran)\b", l)
             and re.search(r" in [\d.]+s", l)]
    return lines[-1] if lines else None


def summary_markdown(report):
    info = report["versions"]
    lines = ["# GPU check: %s" % (report.get("device") or ("no GPU (dry run)" if report["dry"] else "no GPU")), "",
             "`%s` at commit %s, %s, %.0f s of a %.0f s budget." % (
                 report["command"], info.get("commit", "unknown"), report["date"], report["elapsed_s"],
                 report["budget_s"]), ""]
    lines += ["| | |", "|---|---|"] + ["| %s | %s |" % kv for kv in info.items()] + [""]
    lines += ["| step | verdict | seconds (limit) | what |", "|---|---|---|---|"]
    for s in report["steps"]:
        lines.append("| %s | %s | %s | %s |" % (s["name"], s["verdict"].replace("|", "/"),
                                                "%.0f (%.0f)" % (s["seconds"], s["limit_s"]) if "seconds" in s else "-",
                                                s["what"]))
    results = {s["name"]: s.get("result") or {} for s in report["steps"]}
    thr = results.get("throughput", {}).get("rows")
    if thr:
        lines += ["", "## Kernel throughput, %d float32 elements in (target: %d%% of copy bandwidth)" % (
            results["throughput"]["elements"], 100 * COPY_TARGET), "",
            "| kernels | op | us | GB/s | share of copy |", "|---|---|---|---|---|"]
        lines += ["| %s | %s | %.1f | %.0f | %.0f%% |" % (r["kernels"], r["op"], r["seconds"] * 1e6, r["GBps"],
                                                       100 * r["share"]) for r in thr]
    ar = results.get("allreduce")
    if ar and ar.get("rows"):
        lines += ["", "## All-reduce, float32 SUM, blocking (median; native rows: slowest rank; %s)" % ar["mps"], "",
                  "| backend | ranks | bytes | us |", "|---|---|---|---|"]
        lines += ["| %s | %d | %d | %.1f |" % (r["backend"], r["ranks"], r["bytes"], r["us"])
                  for r in ar["rows"] + ar.get("native", [])]
    hc = results.get("host-cost")
    if hc and hc.get("rows"):
        lines += ["", "## Host time per call, the stream held (1 rank)", "",
                  "| backend | bytes | host us per call | values |", "|---|---|---|---|"]
        lines += ["| %s | %d | %.1f | %s |" % (r["backend"], r["bytes"], r["host us"],
                                               "right" if r["right values"] else "WRONG") for r in hc["rows"]]
    gr = results.get("graphs")
    if gr and gr.get("rows"):
        lines += ["", "## Layered collectives in CUDA graphs (1 rank)", "",
                  "| collective | options | replays | other bits than the eager call |", "|---|---|---|---|"]
        lines += ["| %s | %s | %d | %d |" % (r["collective"], r["options"], r["replays"], r["wrong"])
                  for r in gr["rows"]]
    ca = results.get("capture")
    if ca and ca.get("rows"):
        lines += ["", "## pycomm's collectives in CUDA graphs (2 ranks, %s)" % ca["mps"], "",
                  "| collective | options | captured | replays | other bits than the eager call |",
                  "|---|---|---|---|---|"]
        lines += ["| %s | %s | %s | %d | %d |" % (r["collective"], r["options"], r["captured"], r["replays"],
                                                 r["wrong"]) for r in ca["rows"]]
    sw = results.get("stream-wait")
    if sw and sw.get("rows"):
        lines += ["", "## Work.wait() behind a queued kernel", "",
                  "| path | kernel queued ms | wait() returned ms | complete ms | waits | values |",
                  "|---|---|---|---|---|---|"]
        lines += ["| %s | %.0f | %.1f | %.1f | %s | %s |" % (
            k, 1e3 * r["queued kernel s"], 1e3 * r["wait returned s"], 1e3 * r["complete s"], r["holds"],
            "right" if r["right values"] else "WRONG") for k, r in sw["rows"].items()]
    return "\n".join(lines) + "\n"


def gpu_name():
    """The first GPU's name as nvidia-smi gives it ('' without one): read without making a
    CUDA context in this process, which outlives every step."""
    if not shutil.which("nvidia-smi"):
        return ""
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""


def orchestrate(args, dry):
    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()
    device = "" if dry else gpu_name()
    stem = os.path.join(args.out, "gpu-%s-check" % ("cpu-dry" if dry else device_slug(device)))
    report = {"dry": dry, "device": device, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "budget_s": args.budget,
              "command": ("GPU_CHECK_DRY=1 " if dry else "") + "python bench/gpu_check.py", "versions": {},
              "steps": [], "elapsed_s": 0.0}
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    if dry:
        env["TRITON_INTERPRET"] = "1"
    built = True
    steps = plan(dry)
    asked = set(args.steps.split(",")) if args.steps else set()
    unknown = asked - {step.name for step in steps}
    if unknown:
        raise SystemExit("--steps: no step named %s" % ", ".join(sorted(unknown)))
    with open(stem + ".log", "w") as log:
        for step in steps:
            entry = {"name": step.name, "what": step.what, "limit_s": step.limit_s}
            report["steps"].append(entry)
            left = args.budget - (time.monotonic() - start)
            if asked and step.name not in asked and step.name != "build":
                entry["verdict"] = "not asked for (--steps)"
            elif step.needs_build and not built:
                entry["verdict"] = "skipped: the build failed"
            elif dry and step.name == "build":
                entry["verdict"] = "planned: " + " ".join(step.argv)
            elif step.optional and left < step.limit_s:
                entry["verdict"] = "skipped: %.0f s left of the budget, the step needs %.0f" % (left, step.limit_s)
            elif left < 5:
                entry["verdict"] = "skipped: the budget is spent"
            else:
                run_step(step, entry, min(step.limit_s, left), dict(env, **step.env), stem, log, dry)
                built = built and (step.name != "build" or entry["verdict"].startswith("pass"))
                if step.name == "versions" and entry.get("result"):
                    report["versions"] = entry["result"]["info"]
                print("[%5.0f s] %s: %s" % (time.monotonic() - start, step.name, entry["verdict"]), flush=True)
            report["elapsed_s"] = time.monotonic() - start
            with open(stem + ".md", "w") as f:
                f.write(summary_markdown(report))
            with open(stem + ".json", "w") as f:
                json.dump(report, f, indent=1, default=str)
    print("\n" + summary_markdown(report))
    return 1 if any(s["verdict"].startswith(("FAIL", "TIMEOUT")) for s in report["steps"]) else 0


def run_step(step, entry, limit, env, stem, log, dry):
    """Runs one step and fills its entry: seconds, the measuring step's result, verdict."""
    record = stem + ".%s.tmp.json" % step.name
    argv = step.argv + (["--record", record] if step.measures else [])
    t0 = time.monotonic()
    segments = shm_segments()
    with _mps_daemon() if step.mps and not dry else contextlib.nullcontext("") as sharing:
        if sharing:
            entry["what"] += " [%s]" % sharing
        rc, text = run_child(step, argv, dict(env, **MPS_ENV) if sharing == "MPS" else env, limit, log)
    stop_mps()  # left running if the step was killed in it
    entry["seconds"] = time.monotonic() - t0
    settle = time.monotonic() + 2  # ranks unlink theirs as they exit
    while shm_segments() - segments and time.monotonic() < settle:
        time.sleep(0.1)
    leaked = sorted(shm_segments() - segments)
    if step.measures and os.path.exists(record):
        with open(record) as f:
            entry["result"] = json.load(f)
        os.remove(record)
    if rc is None:
        summary = pytest_summary(text)
        entry["verdict"] = "TIMEOUT after %.0f s" % limit + (": " + summary if summary else "")
    elif rc != 0:
        entry["verdict"] = "FAIL (exit %d): %s" % (
            rc, pytest_summary(text) or (text.strip().splitlines() or ["no output"])[-1][:300])
    elif step.measures:
        entry["verdict"] = entry.get("result", {}).get("verdict", "FAIL: the step recorded nothing")
    elif dry and step.name != "build":
        entry["verdict"] = "collected: " + (text.strip().splitlines() or ["nothing"])[-1]
    else:
        entry["verdict"] = "pass" + (": " + pytest_summary(text) if pytest_summary(text) else "")
    if leaked:  # the segments of its groups must all be gone when a step ends
        entry["verdict"] = "FAIL: left in /dev/shm: %s; %s" % (" ".join(leaked[:5]), entry["verdict"])


def shm_segments():
    return {n for n in os.listdir("/dev/shm") if n.startswith("pycomm")} if os.path.isdir("/dev/shm") else set()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "gpu-check"))
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all steps together")
    ap.add_argument("--steps", help="comma-separated: run only these steps (and the build), e.g. to rerun what "
                    "failed; the others are reported as not asked for")
    ap.add_argument("--step", choices=sorted(MEASURING), help="run one measuring step (in a child process)")
    ap.add_argument("--record", help="with --step: where to write its JSON")
    ap.add_argument("--dry", action="store_true", help="with --step: on CPU tensors at small sizes")
    args = ap.parse_args()
    if args.step:
        def save(result):
            with open(args.record + ".part", "w") as f:
                json.dump(result, f, indent=1, default=str)
            os.replace(args.record + ".part", args.record)
        save(MEASURING[args.step](args.dry, save))
        return 0
    return orchestrate(args, os.environ.get("GPU_CHECK_DRY") == "1")


if __name__ == "__main__":
    sys.exit(main())
