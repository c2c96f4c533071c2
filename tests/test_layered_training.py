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

# fp8_e4m3 with error feedback against uncompressed training, after 50 steps: the loss
# may differ by at most this fraction of the uncompressed run's (measured: 1.1e-4 for FSDP2
# and 2e-5 for DDP, 2 ranks).
FP8_LOSS_BOUND = 0.01


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


def ddp_world(rank, ws, kind, setting, seed, steps, on_pycomm):
    """DDP over a gloo group (or over the pycomm world) with pycomm's ``kind`` hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm.hooks import register_compression_hook, register_deterministic_hook

    group = None if on_pycomm else dist.new_group(backend="gloo", timeout=group_timeout())
    model = _model()
    _perturb(model, seed, rank)
    ddp = DDP(model, process_group=group)
    if kind == "deterministic":
        register_deterministic_hook(ddp, setting)
    elif kind == "compression":
        register_compression_hook(ddp, setting)
    return _train(ddp, list(ddp.parameters()), rank, steps)


def _runs_agree(runs):
    first = runs[0]
    for other in runs[1:]:
        for rank, ((d0, _), (d1, _)) in enumerate(zip(first, other)):
            assert d0 == d1, f"rank {rank}: parameters differ first after step {next(i for i, (a, b) in enumerate(zip(d0, d1)) if a != b)}"


@pytest.mark.parametrize("mode", [True, "exact"])
def test_ddp_deterministic_hook_on_gloo(mode):
    runs = [run_world(ddp_world, 3, args=("deterministic", mode, seed, 10, False), timeout=120) for seed in (1, 2)]
    runs.append(run_world(ddp_world, 3, args=("deterministic", mode, None, 10, True), timeout=120))
    _runs_agree(runs)  # two perturbations over gloo, and the pycomm group: one result


def test_ddp_compression_hook_on_gloo():
    env = {"PYCOMM_DETERMINISTIC": "1"}  # the native group then computes as the layered path
    runs = [run_world(ddp_world, 3, args=("compression", "fp8_e4m3", seed, 10, False), env=env, timeout=120)
            for seed in (1, 2)]
    runs.append(run_world(ddp_world, 3, args=("compression", "fp8_e4m3", None, 10, True), env=env, timeout=120))
    _runs_agree(runs)
    fp8 = run_world(ddp_world, 2, args=("compression", "fp8_e4m3", None, 50, False), timeout=120)
    plain = run_world(ddp_world, 2, args=("none", None, None, 50, False), timeout=120)
    print("DDP loss after 50 steps: fp8_e4m3 %.6f, uncompressed %.6f" % (fp8[0][1], plain[0][1]))
    assert abs(fp8[0][1] - plain[0][1]) <= FP8_LOSS_BOUND * plain[0][1], (fp8[0][1], plain[0][1])


def fsdp_world(rank, ws, compression, deterministic, seed, steps):
    """FSDP2 on a CPU mesh over the gloo world, with pycomm's reduce-scatter (or FSDP's
    own, where both are None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import pycomm.fsdp

    mesh = init_device_mesh("cpu", (ws,))
    model = _model()
    _perturb(model, seed, rank)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if compression or deterministic:
        pycomm.fsdp.use_reduce_scatter(model, compression=compression, deterministic=deterministic)
    result = _train(model, list(model.parameters()), rank, steps)
    calls = pycomm.stats(mesh.get_group())["collectives"].get("reduce_scatter", {})
    assert bool(calls) == bool(compression or deterministic), calls  # pycomm reduced, over gloo
    return result


def test_fsdp2_exact_reduce_scatter_is_reproducible():
    runs = [run_world(fsdp_world, 3, args=(None, "exact", seed, 20), backend="gloo", timeout=180)
            for seed in (None, 1, 2)]
    _runs_agree(runs)


def test_fsdp2_fp8_reduce_scatter_trains_like_uncompressed():
    fp8 = run_world(fsdp_world, 2, args=("fp8_e4m3", True, None, 50), backend="gloo", timeout=180)
    plain = run_world(fsdp_world, 2, args=(None, None, None, 50), backend="gloo", timeout=180)
    print("FSDP2 loss after 50 steps: fp8_e4m3 %.6f, uncompressed %.6f" % (fp8[0][1], plain[0][1]))
    assert abs(fp8[0][1] - plain[0][1]) <= FP8_LOSS_BOUND * plain[0][1], (fp8[0][1], plain[0][1])
