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
import os
import platform
import statistics
import sys
import time

import _training

VARIANTS = ("gloo", "exact", "fp8")
WARM_UP = 2


def _rank(rank, world, variant, batch, steps, init_file, queue):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pycomm.hooks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    model = _training.model(torch)
    ddp = DDP(model)
    if variant == "exact":
        pycomm.hooks.register_deterministic_hook(ddp, "exact")
    elif variant == "fp8":
        pycomm.hooks.register_compression_hook(ddp, "fp8_e4m3")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, _training.WIDTHS[0], generator=g)
    y = torch.randn(batch, _training.WIDTHS[-1], generator=g)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64, help="samples per rank and step (default 64)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0, help="deadline of one world, s")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    rows = [_training.run_world(_rank, args.np, (v, args.batch, args.steps), args.timeout, v)
            for _ in range(args.rounds) for v in VARIANTS]
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
