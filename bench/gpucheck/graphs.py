"""The measuring steps of CUDA graphs: the layered collectives over NCCL at 1 rank (graphs)
and pycomm's own at 2 ranks on the GPU (capture); each returns and saves as steps.py says."""
import os
import sys
import tempfile

from gpucheck import mps
from gpucheck.common import BENCH, init_world, torch_device


GRAPH_CASES = [(collective, kw) for collective in ("allreduce", "reduce_scatter", "allgather")
               for kw in ({"deterministic": True}, {"deterministic": "exact"}, {"compression": "fp8_e4m3"})]


def _against_eager(collective, kw, sizes, device, replays, rank, reduce_kw):
    """One case of a graph step: the collective warmed up, captured in a CUDA graph and
    replayed on new data, each replay's output compared bit for bit with the same call made
    outside the graph (in a dry run, the calls stand in for the replays); a case that
    cannot be captured says why. ``sizes``: the input's and output's elements;
    ``reduce_kw``: the reducing collectives' own arguments (their op)."""
    import torch

    import pycomm

    data, out = (torch.empty(n, device=device) for n in sizes)

    def call(x, y):
        if collective == "allreduce":
            y.copy_(x)
            pycomm.all_reduce(y, **reduce_kw, **kw)
        elif collective == "reduce_scatter":
            pycomm.reduce_scatter_tensor(y, x, **reduce_kw, **kw)
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
        data.copy_(torch.randn(sizes[0], generator=torch.Generator().manual_seed(1000 * i + rank)).to(device))
        replay()
        expected = torch.empty_like(out)
        call(data, expected)
        row["replays"] += 1
        row["wrong"] += not torch.equal(out.view(torch.int32), expected.view(torch.int32))
    return row


def _failed(rows):
    """The cases whose replays gave other bits, or that were not captured or replayed."""
    return ["%s %s" % (r["collective"], r["options"]) for r in rows
            if r["wrong"] or r["captured"] not in ("yes", "dry run") or not r["replays"]]


def _show(r):
    print("%-15s %-30s captured: %s; %d replays, %d with other bits than the eager call" % (
        r["collective"], r["options"], r["captured"], r["replays"], r["wrong"]), flush=True)


def step_graphs(dry, save):
    """Each layered collective captured in a CUDA graph after a warm-up call (which makes
    its layout, its buffers and the mover's communicator), then replayed 100 times on new
    data (_against_eager)."""
    import torch.distributed as dist

    device = torch_device(dry)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        init_world("gloo" if dry else "nccl", 0, 1, os.path.join(tmp, "one"))
        for collective, kw in GRAPH_CASES:
            rows.append(_against_eager(collective, kw, (1 << 16, 1 << 16), device, 3 if dry else 100, 0,
                                       {"op": dist.ReduceOp.AVG}))
            _show(rows[-1])
            save({"rows": rows, "verdict": "FAIL: cut short"})
        dist.destroy_process_group()
    bad = _failed(rows)
    return {"rows": rows, "verdict": "FAIL: other bits or no capture in %s" % bad if bad else "pass"}


# pycomm's own collectives the capture step captures, at 2 ranks on the GPU: (collective,
# the direct API's keyword arguments).
CAPTURE_CASES = [(collective, kw) for collective in ("allreduce", "reduce_scatter", "allgather")
                 for kw in ({}, {"deterministic": True}, {"deterministic": "exact"}, {"compression": "fp8_e4m3"})]


def _capture_rank(rank, ws, init_file, dry, queue):
    """One rank of the capture step: every case of CAPTURE_CASES (_against_eager)."""
    import torch
    import torch.distributed as dist

    import pycomm  # noqa: F401 (registers the backend)

    device = torch_device(dry)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    init_world("pycomm", rank, ws, init_file)
    n = 1 << 14
    rows = [_against_eager(collective, kw, {"allreduce": (n, n), "reduce_scatter": (n * ws, n),
                                            "allgather": (n, n * ws)}[collective], device, 3 if dry else 100, rank, {})
            for collective, kw in CAPTURE_CASES]
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def step_capture(dry, save):
    """pycomm's own collectives (all-reduce, reduce-scatter, all-gather; every mode, a
    codec) at 2 ranks on the GPU, captured in CUDA graphs after a warm-up call and replayed
    100 times on new data, each replay's bits those of the same call made outside the
    graph; a collective that cannot be captured fails the step, saying why."""
    sys.path.insert(0, BENCH)
    import gpu

    with tempfile.TemporaryDirectory() as tmp, mps.daemon() as mps_note:
        os.environ["PYCOMM_CUDA_FLAGS"] = "always"  # the team, time-sliced too
        rows = gpu.run_spawned(_capture_rank, 2, (2, os.path.join(tmp, "two"), dry))
    for r in rows:
        _show(r)
    bad = _failed(rows)
    return {"rows": rows, "mps": mps_note, "verdict": "FAIL: %s" % bad if bad else "pass"}
