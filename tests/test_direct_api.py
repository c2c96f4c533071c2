"""pycomm's per-call API (docs/design.md, 'Public surface') gives the same results as torch.distributed.

    pycomm.all_reduce(tensor, op=SUM, group=None, *, algorithm=None, compression=None,
                      deterministic=None, async_op=False)
    pycomm.reduce_scatter_tensor(out, inp, ...), pycomm.all_gather_into_tensor(out, inp, ...)
"""

import pytest
import torch
import torch.distributed as dist

from _harness import BACKEND, group_timeout, run_world
from _values import check_equal


def direct_api_world(rank, ws):
    import pycomm

    problems = []

    def compare(what, got, exp):
        nonlocal problems
        problems += ["%s: %s" % (what, p) for p in check_equal(got, exp)]

    g = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        # Random floats: with the same (default) algorithm both paths must give the same
        # bits (D0/D1 hold in every mode).
        x = (torch.randn(10007, generator=g) * 3).to(dtype)
        a, b = x.clone(), x.clone()
        pycomm.all_reduce(a)
        dist.all_reduce(b)
        compare("all_reduce %s" % dtype, a, b)
        for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            a, b = x.clone(), x.clone()
            pycomm.all_reduce(a, op=op)
            dist.all_reduce(b, op=op)
            compare("all_reduce %s %s" % (dtype, op), a, b)
        out_a, out_b = torch.empty(1001, dtype=dtype), torch.empty(1001, dtype=dtype)
        inp = x[:1001 * ws].clone()
        pycomm.reduce_scatter_tensor(out_a, inp)
        dist.reduce_scatter_tensor(out_b, inp.clone())
        compare("reduce_scatter_tensor %s" % dtype, out_a, out_b)
        out_a, out_b = torch.empty(1001 * ws, dtype=dtype), torch.empty(1001 * ws, dtype=dtype)
        pycomm.all_gather_into_tensor(out_a, x[:1001].clone())
        dist.all_gather_into_tensor(out_b, x[:1001].clone())
        compare("all_gather_into_tensor %s" % dtype, out_a, out_b)
    # async_op and group
    sub = dist.new_group(list(range(ws)), timeout=group_timeout())
    a = torch.full((777,), float(rank + 1))
    w = pycomm.all_reduce(a, group=sub, async_op=True)
    w.wait()
    compare("async all_reduce on a new group", a, torch.full((777,), float(sum(range(1, ws + 1)))))
    return problems


@pytest.fixture(scope="module")
def direct_api_results():
    if BACKEND != "pycomm":
        pytest.skip("the direct API is pycomm's (backend under test: %s)" % BACKEND)
    return run_world(direct_api_world, 3, timeout=120)


def test_direct_api_matches_dist(direct_api_results):
    problems = ["rank %d: %s" % (r, p) for r, ps in enumerate(direct_api_results) for p in ps]
    assert not problems, "\n".join(problems)


def shut_down_world(rank, ws):
    """A backend kept past its group's destruction: every kind of call is refused."""
    sub = dist.new_group(list(range(ws)), timeout=group_timeout())
    backend = sub._get_backend(torch.device("cpu"))
    dist.destroy_process_group(sub)
    refusals = []
    for call in (lambda: backend.allreduce([torch.ones(3)]), lambda: backend.barrier(),
                 lambda: backend.allgather([[torch.ones(3)] * ws], [torch.ones(3)])):
        try:
            call().wait()
            refusals.append(None)
        except ValueError as e:
            refusals.append(str(e))
    return refusals


@pytest.mark.skipif(BACKEND != "pycomm", reason="pycomm's backend object")
def test_a_shut_down_group_refuses_calls():
    for refusals in run_world(shut_down_world, 2, timeout=60):
        assert all(r and "on a group that was shut down" in r for r in refusals), refusals
