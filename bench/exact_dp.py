"""Step time and memory of pycomm.exact_data_parallel against plain DDP and FSDP2, same backend.

    .venv/bin/python bench/exact_dp.py [--np 2] [--micro-batch 64] [--steps 6] [--rounds 3]
                                       [--variants ddp,exact,fsdp,fsdp-exact] [--json out.json]

An MLP of about 10.5 M float32 parameters (1024 -> 2048 -> 2048 -> 2048 -> 16, GELU) is
trained with AdamW on a global batch of 8 micro-batches of --micro-batch samples, each
rank computing 8 / np of them, on a pycomm group (one intra-op thread per rank):

* ddp: DistributedDataParallel, no_sync for all but the last local micro-batch (the
  gradients added in float in .grad, one all-reduce per step);
* exact: pycomm.exact_data_parallel (each micro-batch's gradients kept and added into the
  binned state four at a time; per step a MAX all-reduce of the bin index, a reduce-scatter
  of the bins and an all-gather of the mean, rounded once);
* fsdp: FSDP2 (every Linear and the root fully_shard-ed), its own accumulation: without
  gradient sync for all but the last local micro-batch (the unsharded gradients kept in
  float), one reduce-scatter per module and step;
* fsdp-exact: FSDP2 with pycomm.exact_data_parallel (every micro-batch's gradients merged
  into this rank's shard of the binned state: per module a MAX all-reduce of the bin
  index and a reduce-scatter of the bins).

The variants alternate, each in a world of its own, --rounds times; a world times --steps
steps after one warm-up step and reports the median step time of rank 0 and every rank's
peak RSS. Printed: median over rounds of each variant's median step time, against its
baseline (exact: ddp, fsdp-exact: fsdp), and the peak RSS of each with the difference per
parameter.
"""

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import sys
import time

import _training

MICRO_BATCHES = 8
BASELINE = {"ddp": "ddp", "exact": "ddp", "fsdp": "fsdp", "fsdp-exact": "fsdp"}


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
    if variant.startswith("fsdp"):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    edp = pycomm.exact_data_parallel(model) if variant.endswith("exact") else None
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        trained = DDP(model)
    else:
        trained = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        for i, (x, y) in enumerate(data):
            last = i == len(data) - 1
            if edp is not None:
                context = edp.last_micro_batch() if last else contextlib.nullcontext()
            elif variant == "ddp":
                context = contextlib.nullcontext() if last else trained.no_sync()
            else:
                model.set_requires_gradient_sync(last)
                context = contextlib.nullcontext()
            with context:
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
    ap.add_argument("--variants", default="ddp,exact", help="of ddp, exact, fsdp, fsdp-exact (default ddp,exact)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if MICRO_BATCHES % args.np:
        ap.error(f"--np must divide the {MICRO_BATCHES} micro-batches")
    variants = args.variants.split(",")
    if any(v not in BASELINE or BASELINE[v] not in variants for v in variants):
        ap.error(f"--variants: of {', '.join(BASELINE)}, each with its baseline ({BASELINE})")
    rows = []
    for _ in range(args.rounds):
        for variant in variants:
            rows.append(_training.run_world(_rank, args.np, (variant, args.micro_batch, args.steps), args.timeout,
                                            variant))
    by = {v: [r for r in rows if r["variant"] == v] for v in variants}
    step = {v: statistics.median(r["step_s"] for r in by[v]) for v in by}
    rss = {v: statistics.median(r["peak_rss_mib"] for r in by[v]) for v in by}
    params = rows[0]["params"]
    print(f"exact_data_parallel vs DDP and FSDP2: {args.np} ranks, pycomm group, MLP {params / 1e6:.1f} M params, "
          f"{MICRO_BATCHES} micro-batches of {args.micro_batch}, AdamW; median of {args.rounds} rounds x {args.steps} "
          f"steps ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    print(f"{'variant':10} {'step_ms':>9} {'x_base':>6} {'peak_rss_MiB':>13} {'B/param_vs_base':>16}  step_ms per round")
    for v in variants:
        base = BASELINE[v]
        print(f"{v:10} {step[v] * 1e3:9.1f} {step[v] / step[base]:6.2f} {rss[v]:13.0f} "
              f"{(rss[v] - rss[base]) * 2**20 / params:+16.1f}  " + " ".join(f"{r['step_s'] * 1e3:.0f}" for r in by[v]))
    for v in variants:
        if BASELINE[v] != v:
            print(f"{v}/{BASELINE[v]} step time: {step[v] / step[BASELINE[v]]:.2f}x; peak RSS "
                  f"{rss[v] - rss[BASELINE[v]]:+.0f} MiB, {(rss[v] - rss[BASELINE[v]]) * 2**20 / params:+.1f} B per "
                  "parameter")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "step_s": step, "peak_rss_mib": rss, "params": params}, f,
                      indent=1)


if __name__ == "__main__":
    sys.exit(main())
