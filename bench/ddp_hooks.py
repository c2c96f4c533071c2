"""DDP step time over a gloo group: Gloo's own all-reduce against pycomm's hooks (the
layered path, gloo moving the bytes), in the same run.

    .venv/bin/python bench/ddp_hooks.py [--np 2] [--batch 64] [--steps 8] [--rounds 3] [--json out.json]

An MLP of about 10.5 M float32 parameters (1024 -> 2048 -> 2048 -> 2048 -> 16, GELU) is
trained with AdamW by DistributedDataParallel over a gloo group (default buckets of 25
MiB, one intra-op thread per rank), each rank one batch of --batch samples per step:

* gloo: DDP as it comes, gloo all-reducing each bucket;
* exact: pycomm.hooks.register_deterministic_hook(ddp, "exact");
* fp8: pycomm.hooks.register_compression_hook(ddp, "fp8_e4m3") (error feedback on).

A hook's all-reduce is asynchronous, so DDP overlaps a bucket's reduction with the rest of
backward as it does gloo's own. The variants alternate, each in a world of its own,
--rounds times; a world times --steps steps after two warm-up steps; printed: the median
over rounds of each variant's median step time (rank 0) and its ratio to gloo's.
"""

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time

WIDTHS = (1024, 2048, 2048, 2048, 16)
VARIANTS = ("gloo", "exact", "fp8")
WARM_UP = 2


def _model(torch):
    torch.manual_seed(0)
    layers = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1])


def _rank(rank, world, variant, batch, steps, init_file, queue):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pycomm.hooks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    model = _model(torch)
    ddp = DDP(model)
    if variant == "exact":
        pycomm.hooks.register_deterministic_hook(ddp, "exact")
    elif variant == "fp8":
        pycomm.hooks.register_compression_hook(ddp, "fp8_e4m3")
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, WIDTHS[0], generator=g), torch.randn(batch, WIDTHS[-1], generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(steps + WARM_UP):
        dist.barrier()
        start = time.perf_counter()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step >= WARM_UP:
            times.append(time.perf_counter() - start)
    if rank == 0:
        queue.put({"variant": variant, "step_s": statistics.median(times),
                   "params": sum(p.numel() for p in model.parameters())})
    dist.destroy_process_group()


def run_world(world, variant, batch, steps, timeout):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_rank, args=(r, world, variant, batch, steps, os.path.join(d, "init"), queue),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            result = queue.get(timeout=timeout)
            for p in procs:
                p.join(max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"ddp_hooks: a rank of the {variant} world failed: {[p.exitcode for p in procs]}")
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64, help="samples per rank and step (default 64)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0, help="deadline of one world, s")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    rows = [run_world(args.np, v, args.batch, args.steps, args.timeout) for _ in range(args.rounds) for v in VARIANTS]
    by = {v: [r for r in rows if r["variant"] == v] for v in VARIANTS}
    step = {v: statistics.median(r["step_s"] for r in by[v]) for v in VARIANTS}
    print(f"DDP over gloo, {args.np} ranks, MLP {rows[0]['params'] / 1e6:.1f} M params, batch {args.batch} per rank, "
          f"AdamW; median of {args.rounds} rounds x {args.steps} steps "
          f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    print(f"{'variant':8} {'step_ms':>9} {'x_gloo':>7}  step_ms per round")
    for v in VARIANTS:
        print(f"{v:8} {step[v] * 1e3:9.1f} {step[v] / step['gloo']:7.2f}  "
              + " ".join(f"{r['step_s'] * 1e3:.0f}" for r in by[v]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "step_s": step}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
