"""DistributedDataParallel trains the same model to the same parameters with the backend
under test as with gloo.

One world: model A is wrapped with the default group (backend under test), model B, an
exact copy, with a gloo group; both train 20 steps on the same per-rank shards. DDP
exercises the backend the way training does: initial parameter broadcast from rank 0,
shape verification (all_gather), bucketed gradient all-reduce (AVG via SUM + division).
"""

import copy

import pytest

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _harness import BACKEND, group_timeout, run_world

STEPS = 20
# Float32 gradients averaged in different orders differ by a few ulps per step; over 20
# SGD steps on this small, well-conditioned problem that stays far below these bounds.
RTOL, ATOL = 1e-5, 1e-6


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


def _shard(rank, step):
    """This rank's batch at this step (different shards per rank, fixed seed)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 8, generator=g)
    return x, torch.sin(x[:, :4]) + 0.1 * torch.randn(16, 4, generator=g)


def _train(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = _shard(dist.get_rank(), step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.module.parameters()]


def ddp_world(rank, ws):
    # Different initial weights on every rank: DDP must broadcast rank 0's.
    torch.manual_seed(rank)
    model = _mlp()
    twin = copy.deepcopy(model)
    gloo = dist.new_group(backend="gloo", timeout=group_timeout())
    # Small buckets so that several bucketed all-reduces happen per step.
    params_test = _train(DDP(model, process_group=None, bucket_cap_mb=0.001))
    params_gloo = _train(DDP(twin, process_group=gloo, bucket_cap_mb=0.001))
    return [p.tolist() for p in params_test], [p.tolist() for p in params_gloo]


@pytest.mark.large
def test_ddp_matches_gloo():
    results = run_world(ddp_world, 3, timeout=120)
    as_tensors = [([torch.tensor(p) for p in a], [torch.tensor(p) for p in b])
                  for a, b in results]
    problems = []
    test0, gloo0 = as_tensors[0]
    for rank, (test_r, gloo_r) in enumerate(as_tensors):
        for i, (a, b) in enumerate(zip(test_r, gloo_r)):
            if not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
                problems.append("rank %d param %d: %s vs gloo differ by %.3g"
                                % (rank, i, BACKEND, (a - b).abs().max().item()))
        # Every rank must hold bit-identical parameters (D0: same bits on every rank).
        for i, (a, a0) in enumerate(zip(test_r, test0)):
            if not torch.equal(a, a0):
                problems.append("rank %d param %d differs from rank 0 (max %.3g)"
                                % (rank, i, (a - a0).abs().max().item()))
    assert not problems, "\n".join(problems)
