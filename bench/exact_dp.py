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

Step times: --rounds worlds, each training every variant (a model, wrapper and optimizer
of its own) a step of each in turn, the order reversed every other step, --steps steps
after one warm-up step; rank 0 times them. Each variant's step is timed beside its
baseline's (exact: ddp, fsdp-exact: fsdp), so that the machine's drift, larger here than
the differences measured, falls on both alike. Memory: each variant alone in a world of
its own (a warm-up step and one more), every rank's peak RSS. Printed: each variant's
median step time over all steps, the median of its steps' ratios to the baseline's step
beside each with a 95% confidence interval of that median (distribution-free: two order
statistics of the ratios), its median per round, and its peak RSS with the difference per
parameter.
"""

import argparse
import contextlib
import json
import math
import os
import platform
import resource
import statistics
import sys
import time

import _training

MICRO_BATCHES = 8
BASELINE = {"ddp": "ddp", "exact": "ddp", "fsdp": "fsdp", "fsdp-exact": "fsdp"}


def median_interval(values, confidence=0.95):
    """A confidence interval of the median of ``values`` that assumes nothing of their
    distribution: the order statistics k and n + 1 - k, k the largest for which
    P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2 (the whole range where n is too small)."""
    v, n = sorted(values), len(values)
    below, k = 0.0, 0
    while k < n // 2 and below + math.comb(n, k) / 2**n <= (1 - confidence) / 2:
        below, k = below + math.comb(n, k) / 2**n, k + 1
    return (v[k - 1], v[n - k]) if k else (v[0], v[-1])


def _variant(torch, dist, pycomm, variant, data):
    """One variant's model, wrapper and optimizer: returns the model and its training step."""
    model = _training.model(torch)
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

    def step():
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

    return model, step


def _rank(rank, world, variants, micro_batch, steps, init_file, queue):
    """Trains every variant of ``variants`` in these ranks, a step of each in turn (the
    order reversed every other step), after one warm-up step each; puts rank 0's step times
    and the peak RSS over the ranks on ``queue``."""
    import torch
    import torch.distributed as dist

    import pycomm

    torch.set_num_threads(1)
    dist.init_process_group("pycomm", init_method="file://" + init_file, rank=rank, world_size=world)
    mine = range(rank * MICRO_BATCHES // world, (rank + 1) * MICRO_BATCHES // world)
    g = torch.Generator().manual_seed(rank)
    first, last = _training.WIDTHS[0], _training.WIDTHS[-1]
    data = [(torch.randn(micro_batch, first, generator=g), torch.randn(micro_batch, last, generator=g))
            for _ in mine]
    built = {v: _variant(torch, dist, pycomm, v, data) for v in variants}  # v: (model, step)
    times = {v: [] for v in variants}
    for step in range(steps + 1):
        for v in variants if step % 2 == 0 else variants[::-1]:
            dist.barrier()
            start = time.perf_counter()
            built[v][1]()
            if step:
                times[v].append(time.perf_counter() - start)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])  # MiB
    dist.all_reduce(rss, dist.ReduceOp.MAX)
    if rank == 0:
        queue.put({"variants": variants, "step_s": times, "peak_rss_mib": rss.item(),
                   "params": sum(p.numel() for p in built[variants[0]][0].parameters())})  # a DTensor's: whole
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
    # Step times: every variant in one world, step by step in turn, so that each exact
    # step is timed beside its baseline's (this machine's speed drifts by more than the
    # differences measured here between worlds run one after the other). Peak RSS: each
    # variant in a world of its own.
    rounds = [_training.run_world(_rank, args.np, (variants, args.micro_batch, args.steps), args.timeout, "paired")
              for _ in range(args.rounds)]
    memory = {v: _training.run_world(_rank, args.np, ([v], args.micro_batch, 1), args.timeout, v) for v in variants}
    times = {v: [t for r in rounds for t in r["step_s"][v]] for v in variants}
    step = {v: statistics.median(times[v]) for v in variants}
    ratios = {v: [a / b for a, b in zip(times[v], times[BASELINE[v]])] for v in variants}
    ratio = {v: statistics.median(ratios[v]) for v in variants}
    interval = {v: median_interval(ratios[v]) for v in variants}
    per_round = {v: [statistics.median(r["step_s"][v]) for r in rounds] for v in variants}
    rss = {v: memory[v]["peak_rss_mib"] for v in variants}
    params = memory[variants[0]]["params"]
    print(f"exact_data_parallel vs DDP and FSDP2: {args.np} ranks, pycomm group, MLP {params / 1e6:.1f} M params, "
          f"{MICRO_BATCHES} micro-batches of {args.micro_batch}, AdamW; {args.rounds} rounds x {args.steps} steps of "
          f"each variant, in turn ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    print(f"{'variant':10} {'step_ms':>9} {'x_base':>6} {'peak_rss_MiB':>13} {'B/param_vs_base':>16}  "
          "median step_ms per round")
    for v in variants:
        base = BASELINE[v]
        print(f"{v:10} {step[v] * 1e3:9.1f} {ratio[v]:6.2f} {rss[v]:13.0f} "
              f"{(rss[v] - rss[base]) * 2**20 / params:+16.1f}  " + " ".join(f"{t * 1e3:.0f}" for t in per_round[v]))
    for v in variants:
        if BASELINE[v] != v:
            low, high = interval[v]
            extra = rss[v] - rss[BASELINE[v]]
            print(f"{v}/{BASELINE[v]} step time: {ratio[v]:.2f}x (median of the {len(times[v])} steps' ratios to the "
                  f"baseline's step beside each; 95% interval {low:.2f}-{high:.2f}); peak RSS {extra:+.0f} MiB, "
                  f"{extra * 2**20 / params:+.1f} B per parameter")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds, "memory": memory, "step_s": step, "ratio": ratio,
                       "ratio_interval": interval, "peak_rss_mib": rss, "params": params}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
