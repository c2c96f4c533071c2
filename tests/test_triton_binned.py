"""The binned sums of pycomm.exact_data_parallel as Triton kernels (pycomm/kernels/binned.py)
against the C++ ones, bit for bit, run by Triton's interpreter on this CPU
(TRITON_INTERPRET=1, set before the kernels are defined): adding terms of every input type
into empty and filled states (indices raised by 0, 1 and 2+ bins, zeros, subnormals,
NaN and infinities), aligning, merging, the value in every output type and through
divisors; their PTX for sm_90 (compiled without a GPU); and exact_data_parallel running on
them at 2 ranks, the CPU ops' bits."""

from _triton_env import DEVICE, NUMPY_WARNINGS, ON_GPU  # first: before Triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton is pinned in requirements.txt: wherever these tests run it must import, and
# its absence is a broken environment, a failure, never a skip.
try:
    import triton  # noqa: E402, F401
except ImportError as e:
    raise ImportError("triton is pinned in requirements.txt but does not import (%s): "
                      "pip install -r requirements.txt" % e) from e
pytestmark = NUMPY_WARNINGS

from pycomm import _C  # noqa: E402
from pycomm.kernels import binned as triton_binned  # noqa: E402

from _harness import run_world  # noqa: E402
from _triton_compile import INEXACT_PTX, Launches, compile_sm90, skip_without_compiler  # noqa: E402


def _terms(n, k, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    terms = [(torch.randn(n, generator=g) * torch.exp2(torch.randint(-70, 70, (n,), generator=g).float())).to(dtype)
             for _ in range(k)]
    specials = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-45, -1e-40, 3.4e38, -3.4e38]
    for j, v in enumerate(specials):
        terms[j % k][j] = v
    terms[len(specials) % k][1] = float("inf")  # +Inf and -Inf in one element
    for t in terms:
        t[20:30] = 0.0  # elements without a nonzero term
    return terms


def _state(n, device="cpu"):
    return (torch.full((n,), -128, dtype=torch.int8, device=device),
            torch.zeros(n, dtype=torch.float64, device=device), torch.zeros(n, dtype=torch.float64, device=device))


def _same(a, b):
    """Bit-equal states (a NaN's payload aside: its value is the one quiet NaN)."""
    a, b = [t.cpu() for t in a], [t.cpu() for t in b]
    if not torch.equal(a[0], b[0]):
        return False
    for x, y in zip(a[1:], b[1:]):
        nan = torch.isnan(x)
        if not torch.equal(nan, torch.isnan(y)):
            return False
        if not torch.equal(x[~nan].view(torch.int64), y[~nan].view(torch.int64)):
            return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_add_align_merge_and_value_match_cpu(dtype):
    n, k = 2600, 5  # tiles of 1024 and a short one
    terms = _terms(n, k, 11, dtype)
    halves = []
    for part in (terms[:2], terms[2:]):
        cpu, tri = _state(n), _state(n, DEVICE)
        for j, t in enumerate(part):
            _C.add_to_bins(*cpu, [t], empty=j == 0)
            triton_binned.add_to_bins(*tri, [t.to(DEVICE)], empty=j == 0)
            assert _same(cpu, tri), (dtype, j)
        at_once = _state(n, DEVICE)
        triton_binned.add_to_bins(*at_once, [t.to(DEVICE) for t in part], empty=True)
        assert _same(cpu, at_once), dtype
        halves.append((cpu, tri))
    (a_cpu, a_tri), (b_cpu, b_tri) = halves
    top = torch.maximum(a_cpu[0], b_cpu[0])
    aligned_cpu, aligned_tri = [t.clone() for t in b_cpu], [t.clone() for t in b_tri]
    _C.align_bins(*aligned_cpu, top)
    triton_binned.align_bins(*aligned_tri, top.to(DEVICE))
    assert _same(aligned_cpu, aligned_tri)
    _C.merge_bins(*a_cpu, *b_cpu)
    triton_binned.merge_bins(*a_tri, *b_tri)
    assert _same(a_cpu, a_tri)
    for out_dtype in (torch.float32, torch.float16, torch.bfloat16):
        for divisor in (1.0, 3.0, 8.0):
            want = torch.empty(n, dtype=out_dtype)
            got = torch.empty(n, dtype=out_dtype, device=DEVICE)
            _C.value_of_bins(want, a_cpu[1], a_cpu[2], divisor)
            triton_binned.value_of_bins(got, a_tri[1], a_tri[2], divisor)
            bits = torch.int16 if out_dtype != torch.float32 else torch.int32
            assert torch.equal(want.view(bits), got.cpu().view(bits)), (dtype, out_dtype, divisor)


def test_refuses_what_the_cpu_refuses():
    state = _state(4, DEVICE)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        triton_binned.add_to_bins(*state, [torch.zeros(4, dtype=torch.float64, device=DEVICE)])
    with pytest.raises(ValueError, match="has 3 elements"):
        triton_binned.add_to_bins(*state, [torch.zeros(4, device=DEVICE), torch.zeros(3, device=DEVICE)])
    with pytest.raises(ValueError, match="of one dtype"):
        triton_binned.add_to_bins(*state, [torch.zeros(4, device=DEVICE),
                                           torch.zeros(4, dtype=torch.bfloat16, device=DEVICE)])
    with pytest.raises(ValueError, match="not positive"):
        triton_binned.value_of_bins(torch.empty(4, device=DEVICE), state[1], state[2], 0.0)


def test_compiled_kernels_divide_and_add_as_the_cpu(monkeypatch):
    """The kernels compiled for sm_90 without a GPU, as the functions launch them: no
    approximate division and no fused multiply-add; the value divides correctly rounded."""
    skip_without_compiler()
    launches = {}
    calls = [("_add_kernel", lambda: triton_binned.add_to_bins(*_state(64), [torch.ones(64, dtype=torch.bfloat16)])),
             ("_merge_kernel", lambda: triton_binned.merge_bins(*_state(64), *_state(64))),
             ("_value_kernel", lambda: triton_binned.value_of_bins(torch.empty(64, dtype=torch.float16),
                                                                   *_state(64)[1:], 3.0))]
    for name, call in calls:
        launches[f"pycomm.kernels.binned:{name}"] = recorder = Launches()
        monkeypatch.setattr(triton_binned, name, recorder)
        call()
    ptxs = compile_sm90(launches)
    for name, ptx in ptxs:
        assert not INEXACT_PTX.search(ptx), (name, sorted(set(INEXACT_PTX.findall(ptx))))
    assert any(name == "pycomm.kernels.binned:_value_kernel" and "div.rn.f64" in ptx for name, ptx in ptxs)


def on_triton_world(rank, ws):
    """A small MLP, 2 steps of 4 micro-batches per rank (the second on the accumulator the
    first emptied), by exact_data_parallel on the CPU ops and then on the Triton kernels
    (here on CPU tensors, interpreted): the same parameters after every step."""
    import contextlib
    import hashlib

    import torch.distributed as dist

    import pycomm
    from pycomm import data_parallel

    def train(ops):
        data_parallel.binned_ops = lambda device: ops
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        edp = pycomm.exact_data_parallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        digests = []
        for step in range(2):
            for m in range(4):
                g = torch.Generator().manual_seed(100 * step + 10 * rank + m)
                x = torch.randn(4, 8, generator=g)
                with edp.last_micro_batch() if m == 3 else contextlib.nullcontext():
                    torch.nn.functional.mse_loss(model(x), x[:, :4].sin()).backward()
            edp.reduce_gradients()
            opt.step()
            opt.zero_grad()
            digests.append(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
                           .hexdigest())
        dist.barrier()
        return digests

    cpu = train(_C)
    tri = train(triton_binned)
    return [] if cpu == tri else [f"rank {rank}: {cpu} on the CPU ops, {tri} on the Triton kernels"]


@pytest.mark.skipif(ON_GPU, reason="the world runs on CPU tensors through the interpreter")
def test_exact_data_parallel_on_triton_kernels():
    for problems in run_world(on_triton_world, 2, env={"TRITON_INTERPRET": "1"}, timeout=180):
        assert not problems, problems
