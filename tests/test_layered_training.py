"""Training on a group of another backend (gloo here) with pycomm's reductions, one line
each: DDP with pycomm's deterministic and compression hooks, FSDP2 with pycomm's
reduce-scatter. Runs are compared bit for bit across timing perturbations (each rank
sleeps a seeded random time before every layer's forward, so collectives arrive in other
orders) and with the same training on a pycomm group."""

import hashlib
import random
import time

import pytest
import torch
import torch.distributed as dist

from _harness import group_timeout, run_world

pytestmark = pytest.mark.large  # training runs

# fp8_e4m3 (with error feedback in DDP's hook) against uncompressed training, after
# QUALITY_STEPS steps: the loss may differ by at most this fraction of the uncompressed run's.
FP8_LOSS_BOUND = 0.01
QUALITY_STEPS = 30


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4))


def _batch(rank, step):
    g = torch.Generator().manual_seed(7919 * rank + step)
    x = torch.randn(32, 16, generator=g)
    return x, torch.sin(x[:, :4] * 3) + 0.1 * x[:, 4:8]


def _perturb(model, seed, rank):
    """Every layer's forward starts after a seeded random sleep of up to 2 ms."""
    if seed is None:
        return
    rng = random.Random(seed * 1000 + rank)
    for layer in model.modules():
        layer.register_forward_pre_hook(lambda *_: time.sleep(rng.uniform(0, 0.002)))


def _train(model, params, rank, steps):
    """AdamW steps; returns the digest of this rank's parameters after every step, and
    the last loss (averaged over the ranks on a gloo group of its own)."""
    opt = torch.optim.AdamW(params, lr=3e-3)
    digests, loss = [], None
    for step in range(steps):
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        h = hashlib.sha256()
        for p in params:
            h.update((p.to_local() if hasattr(p, "to_local") else p).detach().numpy().tobytes())
        digests.append(h.hexdigest())
    return digests, loss.item()


def ddp_world(rank, ws, trainings):
    """DDP trainings, one after another in the same ranks: (hook kind, its setting,
    perturbation seed, steps, on the pycomm world or a gloo group)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm.hooks import register_compression_hook, register_deterministic_hook

    gloo = dist.new_group(backend="gloo", timeout=group_timeout())
    results = []
    for kind, setting, seed, steps, on_pycomm in trainings:
        model = _model()
        _perturb(model, seed, rank)
        ddp = DDP(model, process_group=None if on_pycomm else gloo)
        if kind == "deterministic":
            register_deterministic_hook(ddp, setting)
        elif kind == "compression":
            register_compression_hook(ddp, setting)
        results.append(_train(ddp, list(ddp.parameters()), rank, steps))
    return results


def _agree(results, trainings):
    """The parameters after every step are the same in each of ``trainings`` (indices),
    on every rank."""
    for rank, runs in enumerate(results):
        first = runs[trainings[0]][0]
        for i in trainings[1:]:
            other = runs[i][0]
            assert first == other, (f"rank {rank}: training {i} differs from training {trainings[0]} first after "
                                    f"step {next(k for k, (a, b) in enumerate(zip(first, other)) if a != b)}")


def _loss_close(results, fp8, plain, what):
    a, b = results[0][fp8][1], results[0][plain][1]
    print("%s loss after %d steps: fp8_e4m3 %.6f, uncompressed %.6f" % (what, QUALITY_STEPS, a, b))
    assert abs(a - b) <= FP8_LOSS_BOUND * b, (a, b)


def test_ddp_deterministic_hook_on_gloo():
    # Per mode: two timing perturbations over gloo, and the same training on the pycomm
    # world: one result.
    trainings = [("deterministic", mode, seed, 10, on_pycomm) for mode in (True, "exact")
                 for seed, on_pycomm in ((1, False), (2, False), (None, True))]
    results = run_world(ddp_world, 3, args=(trainings,), timeout=180)
    _agree(results, [0, 1, 2])
    _agree(results, [3, 4, 5])


def test_ddp_compression_hook_on_gloo():
    trainings = [("compression", "fp8_e4m3", 1, 10, False), ("compression", "fp8_e4m3", 2, 10, False),
                 ("compression", "fp8_e4m3", None, 10, True),
                 ("compression", "fp8_e4m3", None, QUALITY_STEPS, False), ("none", None, None, QUALITY_STEPS, False)]
    # PYCOMM_DETERMINISTIC=1: the pycomm world then computes as the layered path does.
    results = run_world(ddp_world, 3, args=(trainings,), env={"PYCOMM_DETERMINISTIC": "1"}, timeout=180)
    _agree(results, [0, 1, 2])
    _loss_close(results, 3, 4, "DDP")


def fsdp_world(rank, ws, trainings):
    """FSDP2 trainings on a CPU mesh over the gloo world: (compression, deterministic,
    perturbation seed, steps), with pycomm's reduce-scatter (FSDP's own where both
    options are None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import pycomm.fsdp

    mesh = init_device_mesh("cpu", (ws,))
    results = []
    for compression, deterministic, seed, steps in trainings:
        model = _model()
        _perturb(model, seed, rank)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if compression or deterministic:
            pycomm.fsdp.use_reduce_scatter(model, compression=compression, deterministic=deterministic)
        results.append(_train(model, list(model.parameters()), rank, steps))
    calls = pycomm.stats(mesh.get_group())["collectives"]["reduce_scatter"]
    assert sum(c["calls"] for name, c in calls.items() if name.startswith("layered-")) > 0, calls  # pycomm reduced
    return results


def test_fsdp2_with_pycomm_reduce_scatter():
    trainings = [(None, "exact", seed, 10) for seed in (None, 1, 2)] + [("fp8_e4m3", True, None, QUALITY_STEPS),
                                                                         (None, None, None, QUALITY_STEPS)]
    results = run_world(fsdp_world, 3, args=(trainings,), backend="gloo", timeout=240)
    _agree(results, [0, 1, 2])  # exact: two runs, two timing perturbations
    _loss_close(results, 3, 4, "FSDP2")
