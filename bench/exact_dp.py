"""Step time and memory of pycomm.exact_data_parallel against plain DDP, same backend.

    .venv/bin/python bench/exact_dp.py [--np 2] [--micro-batch 64] [--steps 6] [--rounds 3] [--json out.json]

An MLP of about 10.5 M float32 parameters (1024 -> 2048 -> 2048 -> 2048 -> 16, GELU) is
trained with AdamW on a global batch of 8 micro-batches of --micro-batch samples, each
rank computing 8 / np of them, on a pycomm group (one intra-op thread per rank):

* ddp: DistributedDataParallel, no_sync for all but the last local micro-batch (the
  gradients added in float in .grad, one all-reduce per step);
* exact: pycomm.exact_data_parallel (each micro-batch's gradients moved into the binned
  exact state, a MAX and a SUM all-reduce of the states per step, the mean rounded once).

The two alternate, each in a world of its own, --rounds times; a world times --steps steps
after one warm-up step and reports the median step time of rank 0 and every rank's peak
RSS. Printed: median over rounds of each variant's median step time, exact / ddp, and the
peak RSS of each with the difference per parameter.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time

import _training

MICRO_BATCHES = 8


def _rank(rank, world, variant, micro_batch, steps, init_file, queue):
    import torch
    import torch.distributed as dist

    import pycomm

    torch.set_num_threads(1)
    dist.init_process_group("pycomm", init_method="file://" + init_file, rank=rank, world_size=world)
    model = _training.model(torch)
    params = sum(p.numel() for p in model.parameters())
    mine = range(rank * MICRO_BATCHES // world, (rank + 1) * MICRO_BATCHES // world)
    g = torch.Generator().manual_seed(rank)
    first, last = _training.WIDTHS[0], _training.WIDTHS[-1]
    data = [(torch.randn(micro_batch, first, generator=g), torch.randn(micro_batch, last, generator=g))
            for _ in mine]
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        trained, edp = DDP(model), None
    else:
        trained, edp = model, pycomm.exact_data_parallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        for i, (x, y) in enumerate(data):
            if edp is None and i < len(data) - 1:
                with trained.no_sync():
                    (torch.nn.functional.mse_loss(trained(x), y) / len(data)).backward()
            else:
                loss = torch.nn.functional.mse_loss(trained(x), y)
                (loss / len(data) if edp is None else loss).backward()
        if edp is not None:
            edp.reduce_gradients()
        opt.step()
        opt.zero_grad()
        if step:
            times.append(time.perf_counter() - start)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])  # MiB
    dist.all_reduce(rss, dist.ReduceOp.MAX)
    if rank == 0:
        queue.put({"variant": variant, "step_s": statistics.median(times), "peak_rss_mib": rss.item(),
                   "params": params})
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=64, help="samples per micro-batch (default 64)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0, help="deadline of one world, s")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if MICRO_BATCHES % args.np:
        ap.error(f"--np must divide the {MICRO_BATCHES} micro-batches")
    rows = []
    for _ in range(args.rounds):
        for variant in ("ddp", "exact"):
            rows.append(_training.run_world(_rank, args.np, (variant, args.micro_batch, args.steps), args.timeout,
                                            variant))
    by = {v: [r for r in rows if r["variant"] == v] for v in ("ddp", "exact")}
    step = {v: statistics.median(r["step_s"] for r in by[v]) for v in by}
    rss = {v: statistics.median(r["peak_rss_mib"] for r in by[v]) for v in by}
    params = rows[0]["params"]
    print(f"exact_data_parallel vs DDP: {args.np} ranks, pycomm group, MLP {params / 1e6:.1f} M params, "
          f"{MICRO_BATCHES} micro-batches of {args.micro_batch}, AdamW; median of {args.rounds} rounds x {args.steps} "
          f"steps ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    print(f"{'variant':8} {'step_ms':>9} {'x_ddp':>6} {'peak_rss_MiB':>13}  step_ms per round")
    for v in ("ddp", "exact"):
        print(f"{v:8} {step[v] * 1e3:9.1f} {step[v] / step['ddp']:6.2f} {rss[v]:13.0f}  "
              + " ".join(f"{r['step_s'] * 1e3:.0f}" for r in by[v]))
    extra = (rss["exact"] - rss["ddp"]) * 2**20 / params
    print(f"exact/ddp step time: {step['exact'] / step['ddp']:.2f}x (target <= 1.3x at 2 ranks); peak RSS "
          f"{rss['exact'] - rss['ddp']:+.0f} MiB, {extra:+.1f} B per parameter")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "step_s": step, "peak_rss_mib": rss, "params": params}, f,
                      indent=1)


if __name__ == "__main__":
    sys.exit(main())
