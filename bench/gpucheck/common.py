"""What the GPU check's plan, measuring steps and report share: paths, targets, the
compilers of the build, and the measuring steps' helpers (device, timing, a world)."""
import os
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
MiB = 1 << 20
COPY_TARGET = 0.8  # a kernel's share of device-to-device copy bandwidth
# A Work.wait() that returns within this share of the kernel queued before the collective
# left the host free; one that returns after the kernel held it.
HOST_FREE_SHARE = 0.25


# The extension must link the C++ runtime dynamically, as torch does: built by a toolchain
# that links libstdc++ statically, it crashes at its first stream insertion (seen on an
# H100 machine whose default c++ did), so the build takes the system's compilers.
SYSTEM_COMPILERS = {var: path for var, path in (("CC", "/usr/bin/gcc"), ("CXX", "/usr/bin/g++"))
                    if os.path.exists(path)}


def torch_device(dry):
    import torch

    return torch.device("cpu" if dry else "cuda")


def median_time(fn, device, iters, warmup=3):
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


def init_world(backend, rank, ws, init_file):
    import torch.distributed as dist

    dist.init_process_group(backend, init_method="file://" + init_file, rank=rank, world_size=ws)


def sleep_cycles_per_second():
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    torch.cuda._sleep(cycles)  # warm
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)

