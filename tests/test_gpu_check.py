"""bench/gpu_check.py (make gpu-check) rehearsed without a GPU, as GPU_CHECK_DRY=1 does it:
every step planned in order, the test steps' tests collected, the measuring steps' own code
run on CPU tensors (the CPU ops and Triton's interpreter standing in for the GPU kernels,
gloo for NCCL), and the report written under names that carry the device."""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from gpucheck.orchestrate import device_slug  # noqa: E402

STEPS = ["build", "versions", "throughput", "stream-wait", "allreduce", "host-cost", "capture", "graphs",
         "cuda-faults", "patterns", "triton-tests", "layered", "cuda-tests", "sanitizer"]


def test_dry_run_plans_and_rehearses_every_step(tmp_path):
    env = dict(os.environ, GPU_CHECK_DRY="1")
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--out", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["gpu-cpu-dry-check.%s" % ext for ext in ("json", "log", "md")]
    report = json.loads((tmp_path / "gpu-cpu-dry-check.json").read_text())
    verdicts = {s["name"]: s["verdict"] for s in report["steps"]}
    assert list(verdicts) == STEPS
    assert verdicts["build"].startswith("planned: ") and "--no-build-isolation --no-deps -e ." in verdicts["build"]
    for name in ("cuda-tests", "cuda-faults", "layered", "triton-tests", "sanitizer"):
        assert re.match(r"collected: [1-9]\d*(/\d+)? tests? collected", verdicts[name]), (name, verdicts[name])
    for name in ("versions", "throughput", "patterns", "allreduce", "host-cost", "graphs", "capture", "stream-wait"):
        assert verdicts[name] == "pass", (name, verdicts[name])
    results = {s["name"]: s["result"] for s in report["steps"] if s.get("result")}
    measured = {(r["kernels"], r["op"]) for r in results["throughput"]["rows"]}
    ops = {op for _, op in measured} - {"copy, device to device"}
    assert {k for k, _ in measured} == {"torch", "cuda", "triton"}
    assert measured >= {(k, op) for k in ("cuda", "triton") for op in ops} and len(ops) == 15
    patterns = results["patterns"]["rows"]
    assert {(r["codec"], r["input"], r["kernels"]) for r in patterns} == {
        (c, i, k) for c in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2") for i in ("float32", "bfloat16", "float16")
        for k in ("cuda", "triton")}
    assert all(r["patterns"] > 0 and not r["differences"] for r in patterns), patterns
    assert {r["backend"] for r in results["allreduce"]["rows"]} == {
        "gloo all_reduce", "layered over gloo, default mode", "layered over gloo, exact", "layered over gloo, fp8_e4m3"}
    assert {(r["backend"], r["bytes"]) for r in results["host-cost"]["rows"]} == {
        (name, size) for size in (4 << 10, 1 << 20) for name in ("gloo all_reduce", "layered over gloo, default mode",
                                                                  "layered over gloo, exact",
                                                                  "layered over gloo, fp8_e4m3")}
    graphs = results["graphs"]["rows"]
    assert {r["collective"] for r in graphs} == {"allreduce", "reduce_scatter", "allgather"} and len(graphs) == 9
    assert all(r["replays"] > 0 and r["wrong"] == 0 for r in graphs), graphs
    capture = results["capture"]["rows"]
    assert {r["collective"] for r in capture} == {"allreduce", "reduce_scatter", "allgather"} and len(capture) == 12
    assert all(r["replays"] > 0 and r["wrong"] == 0 for r in capture), capture
    assert set(results["stream-wait"]["rows"]) == {"layered over gloo, 1 rank", "native pycomm, 2 ranks"}
    summary = (tmp_path / "gpu-cpu-dry-check.md").read_text()
    assert all("| %s |" % name in summary for name in STEPS)


def test_device_names():
    assert device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert device_slug("NVIDIA H200") == "h200"
    assert device_slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
    assert device_slug("") == "cpu"
