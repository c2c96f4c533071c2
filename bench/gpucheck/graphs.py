"""The measuring steps of CUDA graphs: the layered collectives over NCCL at 1 rank (graphs)
and pycomm's own at 2 ranks on the GPU (capture); each returns and saves as steps.py says."""
import os
import sys
import tempfile

from gpucheck import mps
from gpucheck.common import BENCH, init_world, torch_device


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

    device = torch_device(dry)
    replays = 3 if dry else 100
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        init_world("gloo" if dry else "nccl", 0, 1, os.path.join(tmp, "one"))
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

    device = torch_device(dry)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    init_world("pycomm", rank, ws, init_file)
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

    with tempfile.TemporaryDirectory() as tmp, mps.daemon() as mps_note:
        os.environ["PYCOMM_CUDA_FLAGS"] = "always"  # the team, time-sliced too
        rows = gpu.run_spawned(_capture_rank, 2, (2, os.path.join(tmp, "two"), dry))
    for r in rows:
        print("%-15s %-30s captured: %s; %d replays, %d with other bits than the eager call" % (
            r["collective"], r["options"], r["captured"], r["replays"], r["wrong"]), flush=True)
    bad = ["%s %s" % (r["collective"], r["options"]) for r in rows
           if r["wrong"] or r["captured"] not in ("yes", "dry run") or not r["replays"]]
    return {"rows": rows, "mps": mps_note, "verdict": "FAIL: %s" % bad if bad else "pass"}
