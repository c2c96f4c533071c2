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
  throughput    the folds and codecs of both kernel sets on 256 MiB of float32 against a
                device-to-device copy of the same bytes (target: 80% of its bandwidth),
                and the two sets' outputs compared bit for bit
  stream-wait   whether Work.wait() of a CUDA collective queued behind a long kernel holds
                the host or only the current stream (native path and layered over NCCL)
  allreduce     the layered default-mode, exact and fp8 all-reduce over NCCL against NCCL's
                own all-reduce at 1 rank; the native CUDA all-reduce at 2 ranks on the GPU
                (under MPS where its daemon starts, else time-sliced) against gloo
  host-cost     the host's time per call with the stream held behind a long kernel (so that
                only the host's work counts), NCCL's own all-reduce and the layered one in
                the default mode, exact and fp8_e4m3, at 1 rank (which gathers no stamps)
  capture       pycomm's own all-reduce, reduce-scatter and all-gather (every mode, fp8_e4m3)
                at 2 ranks on the GPU captured in a CUDA graph after a warm-up call and
                replayed 100 times on new data: every replay's bits those of the eager call
  graphs        each layered collective (all-reduce, reduce-scatter, all-gather; default,
                exact, fp8_e4m3) over NCCL captured in a CUDA graph after a warm-up call and
                replayed 100 times on new data: every replay's bits those of the same call
                made outside the graph
  cuda-faults   tests/test_cuda.py's fault tests: a peer of the flag one-shot asleep or
                killed is reported in time
  patterns      every float32 bit pattern (all 2^32), and every bfloat16 and float16 one,
                through each codec with both kernel sets (encode, decode, quantize)
                against the CPU ops, bit for bit
  triton-tests  tests/test_triton_kernels.py and tests/test_triton_binned.py (the exact
                gradient accumulator's kernels) with the kernels compiled for the GPU
  layered       tests/test_cuda.py's layered tests: NCCL moving at 1 rank, gloo moving CUDA
                tensors at 2 and 4 ranks on the GPU, every codec, both deterministic modes,
                with the CUDA kernels and with the Triton kernels: the native CPU bits
  cuda-tests    tests/test_cuda.py but its layered and fault tests: kernels and collectives
                on CUDA tensors bit for bit against the CPU path, AVG included, at 2, 4
                and 8 ranks on the GPU (under MPS), every pair staged through host memory
                (PYCOMM_CUDA_IPC=off) and over TCP
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
import json
import os
import sys

from gpucheck.common import COPY_TARGET, ROOT, SYSTEM_COMPILERS
from gpucheck.graphs import step_capture, step_graphs
from gpucheck.orchestrate import orchestrate
from gpucheck.patterns import step_patterns
from gpucheck.steps import step_allreduce, step_host_cost, step_stream_wait, step_throughput, step_versions


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
        # The short measuring steps first, then the patterns and the test suites, each cut at
        # what is left of the budget: on one H200 the build and the test suites took 374 s of
        # the 480 before the first measurement, so the measurements added since would have
        # found the budget spent.
        Step("throughput", 60, "folds and codecs on 256 MiB against a device copy (target %d%%)" % (100 * COPY_TARGET),
             own("throughput"), measures=True),
        Step("stream-wait", 60, "Work.wait() behind a long kernel: host or stream", own("stream-wait"),
             measures=True),
        Step("allreduce", 120, "layered over NCCL against NCCL at 1 rank; native at 2 ranks on one GPU",
             own("allreduce"), measures=True),
        Step("host-cost", 60, "host time per call, the stream held: NCCL against layered (default, exact, fp8)",
             own("host-cost"), measures=True),
        Step("capture", 60, "pycomm's collectives at 2 ranks captured in CUDA graphs, 100 replays: the bits of "
             "eager calls", own("capture"), measures=True),
        Step("graphs", 90, "layered collectives over NCCL captured in CUDA graphs, 100 replays: the bits of eager "
             "calls", own("graphs"), measures=True),
        # Alone and time-sliced: a killed peer's memory, mapped into a kernel of a rank
        # that survives, must not fault beside other processes sharing an MPS server.
        Step("cuda-faults", 60, "tests/test_cuda.py's flag one-shot with a peer asleep or killed: reported in time",
             tests("tests/test_cuda.py", "-k", "missing_peer"), env=worlds(60)),
        Step("patterns", 150, "every float32, bfloat16 and float16 bit pattern through each codec, CUDA and Triton "
             "kernels: the CPU ops' bits", own("patterns"), measures=True),
        # Several test worlds at a time (pytest-xdist): most of a world's time is its
        # processes' start, CUDA set-up and host-driven steps, not the GPU's work. They share
        # the GPU through MPS: time-sliced, a flag-synchronized kernel waiting for a peer's
        # holds the GPU for its whole slice, and on one H100 every world crawled beside them.
        # The steps themselves run one at a time: side by side, Triton's compiles and the
        # ranks' host work outnumbered 16 cores and every step ran several times slower.
        Step("triton-tests", 90, "tests/test_triton_kernels.py and tests/test_triton_binned.py compiled for the GPU: "
             "bits equal to the CPU ops",
             tests("tests/test_triton_kernels.py", "tests/test_triton_binned.py", parallel=["-n", "8"]),
             env=dict(worlds(90, 8), PYCOMM_TRITON_ON_GPU="0" if dry else "1"), mps=True),
        Step("layered", 120, "layered path on CUDA tensors (NCCL at 1 rank, gloo at 2 and 4), CUDA and Triton "
             "kernels: the native CPU bits", tests("tests/test_cuda.py", "-k", "layered", parallel=["-n", "6"]),
             env=worlds(120, 6), mps=True),
        Step("cuda-tests", 130, "tests/test_cuda.py (kernels, collectives, flag one-shot): bits equal to the CPU's",
             tests("tests/test_cuda.py", "-k", "not layered and not missing_peer", parallel=["-n", "8"]),
             env=worlds(130, 8), mps=True),
        Step("sanitizer", 100, "compute-sanitizer memcheck: reduce and codec kernel tests",
             tests("tests/test_cuda.py", "-k",
                   "reduce_kernel_matches_cpu and float32 or codec_kernels_match_cpu and fp8_e4m3", wrapper=sanitizer),
             optional=True),
    ]


MEASURING = {"versions": step_versions, "throughput": step_throughput, "patterns": step_patterns,
             "allreduce": step_allreduce,
             "host-cost": step_host_cost, "graphs": step_graphs, "capture": step_capture,
             "stream-wait": step_stream_wait}


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
    dry = os.environ.get("GPU_CHECK_DRY") == "1"
    return orchestrate(args, dry, plan(dry))


if __name__ == "__main__":
    sys.exit(main())
