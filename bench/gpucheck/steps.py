"""The measuring steps (child processes). Each returns a dict: "rows" (numbers), "verdict"
("pass" or "FAIL: why") and anything else worth keeping, and saves what it has measured so
far with save(dict) as it goes, so that a step stopped at its limit still reports it. The
CUDA graph steps are in graphs.py."""
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

from gpucheck import mps
from gpucheck.common import (BENCH, COPY_TARGET, HOST_FREE_SHARE, MiB, SYSTEM_COMPILERS, init_world,
                             median_time, sleep_cycles_per_second, torch_device)


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

    device = torch_device(dry)
    n = 2048 if dry else (64 << 20)  # 256 MiB of float32; the interpreter is slow
    iters, warmup = (1, 1) if dry else (20, 3)
    block = _C.default_compression_block()
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(n, device=device, generator=gen)
    y = torch.randn(n, device=device, generator=gen)
    out = torch.empty_like(x)
    copy_s = median_time(lambda: out.copy_(x), device, iters, warmup)
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
                s = median_time(call, device, iters, warmup)
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


def step_allreduce(dry, save):
    """Layered (pycomm's reductions, NCCL moving) against NCCL at 1 rank; the native CUDA
    path at 2 ranks (bench/gpu.py's measurement) under MPS if its daemon starts."""
    import torch
    import torch.distributed as dist

    import pycomm

    device = torch_device(dry)
    sizes = [4 << 10, 1 * MiB] if dry else [4 << 10, 1 * MiB, 64 * MiB]
    iters = 2 if dry else 30
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        init_world("gloo" if dry else "nccl", 0, 1, os.path.join(tmp, "one"))
        mover = dist.get_backend()

        def timed(fn):
            def call():
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
            return median_time(call, torch.device("cpu"), iters)

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
        with tempfile.TemporaryDirectory() as tmp, mps.daemon() as mps_note:
            native = gpu.run_spawned(gpu.allreduce_rank, 2, (2, [4 << 10, 64 << 10, 1 * MiB, 64 * MiB], iters,
                                                              os.path.join(tmp, "two")))
    for r in native:
        r["us"] = r["seconds"] * 1e6
        print("%-36s %2d ranks %9d B %10.1f us" % (r["backend"], r["ranks"], r["bytes"], r["us"]))
    bad = [r for r in rows if r["backend"] == "CHECK"] + [r for r in native if not r.get("ok", True)]
    return {"rows": rows, "native": native, "mps": mps_note,
            "verdict": "FAIL: wrong values at %s" % bad if bad else "pass"}


def _wait_behind_kernel(call, device, expected, queued_s):
    """Queues a kernel of about queued_s seconds on the current stream, starts the
    collective (async_op=True) and times the host in Work.wait(); then checks the result."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(int(queued_s * sleep_cycles_per_second()))
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

    device = torch_device(dry)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    init_world("pycomm", rank, ws, init_file)
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

    device = torch_device(dry)
    queued = 0.0 if dry else 0.3
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        init_world("gloo" if dry else "nccl", 0, 1, os.path.join(tmp, "one"))

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
        with mps.daemon():
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

    device = torch_device(dry)
    calls = 5 if dry else 50  # the device's queue of launches stays far from full
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        init_world("gloo" if dry else "nccl", 0, 1, os.path.join(tmp, "one"))
        mover = dist.get_backend()
        held_s = 0.0 if dry else 0.5
        cycles = 0 if dry else int(held_s * sleep_cycles_per_second())
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
    problems = (["wrong values: %s" % wrong] if wrong else []) + \
        (["calls outlasted the held stream: %s" % late] if late else [])
    verdict = "FAIL: %s" % "; ".join(problems) if problems else "pass"
    return {"rows": rows, "verdict": verdict}


# The layered collectives the graphs step captures: (collective, the direct API's keyword arguments).
