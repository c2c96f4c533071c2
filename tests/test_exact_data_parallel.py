"""pycomm.exact_data_parallel: the binned exact sums it accumulates with (order and split
invariance, the error bound, rounding once, non-finite values), and training on 1, 2, 4
and 8 ranks (processes) that gives bit-identical parameters after every step for the same
global batch of 8 micro-batches, where plain DDP in pycomm's exact mode does not."""

import contextlib
import hashlib
import math
import random
import time
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

import pycomm
from pycomm import _C
from _harness import group_timeout, run_world

MICRO_BATCHES = 8
STEPS = 5
# fp8_e4m3 on the cross-rank step against the uncompressed run, after STEPS steps: the loss
# may differ by at most this fraction of the uncompressed run's.
FP8_LOSS_BOUND = 0.01


# ---- the binned exact sum ----

def _state(n):
    return (torch.full((n,), -128, dtype=torch.int8), torch.zeros(n, dtype=torch.float64),
            torch.zeros(n, dtype=torch.float64))


def _add_all(terms, n):
    state = _state(n)
    for t in terms:
        _C.add_to_bins(*state, [t])
    return state


def _merged(states):
    top = torch.stack([s[0] for s in states]).max(0).values
    for s in states:
        _C.align_bins(*s, top)
    return top, sum(s[1] for s in states), sum(s[2] for s in states)


def _value(state, dtype=torch.float32, divisor=1.0):
    out = torch.empty(state[0].numel(), dtype=dtype)
    _C.value_of_bins(out, state[1], state[2], divisor)
    return out


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _terms(n, k, seed, spread=40):
    g = torch.Generator().manual_seed(seed)
    terms = [torch.randn(n, generator=g) * torch.exp2(torch.randint(-spread, spread, (n,), generator=g).float())
             for _ in range(k)]
    specials = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-45, -1e-40, 3.4e38, -3.4e38]
    for j, v in enumerate(specials):
        terms[j % k][j] = v
    terms[(len(specials)) % k][1] = float("inf")  # +Inf and -Inf in one element: NaN
    terms[0][20:30] = 0.0  # elements without any term
    for t in terms[1:]:
        t[20:30] = 0.0
    return terms


@pytest.mark.parametrize("seed", [0, 1])
def test_binned_sum_is_the_same_for_any_order_and_split(seed):
    n, k = 3000, 11
    terms = _terms(n, k, seed)
    one = _value(_add_all(terms, n))
    rng = random.Random(seed)
    for parts in (1, 2, 3, 5, 11):
        shuffled = terms[:]
        rng.shuffle(shuffled)
        states = [_add_all(shuffled[p::parts], n) for p in range(parts)]
        rng.shuffle(states)
        assert torch.equal(_bits(_value(_merged(states))), _bits(one)), parts
    assert torch.isinf(one[0]) and one[0] > 0 and torch.isnan(one[1]) and torch.isnan(one[2])
    assert torch.equal(_bits(one[20:30]), torch.zeros(10, dtype=torch.int32))


def _binned_add_reference(state, k, x):
    """numerics.h's binned_add of the float x into element k of the state, one term at a
    time in Python's doubles: the specification the vectorized accumulator must match."""
    index, hi, lo = state
    i, h, l = int(index[k]), float(hi[k]), float(lo[k])
    if math.isinf(x) or math.isnan(x):
        hi[k] = h + x
        return
    if x == 0.0:
        return
    e = max(math.frexp(x)[1] - 1, -126)  # 2^e <= |x| < 2^(e+1); subnormals share 2^-126's bin
    b = e // 32
    if b > i:
        finite = not (math.isinf(h) or math.isnan(h))
        l = 0.0 if not finite or b - i >= 2 else h
        h = 0.0 if finite else h
        i = b
    top = math.ldexp(math.trunc(math.ldexp(x, -32 * i)), 32 * i)
    index[k], hi[k] = i, h + top
    lo[k] = l + math.ldexp(math.trunc(math.ldexp(x - top, 32 - 32 * i)), 32 * i - 32)


def test_binned_add_matches_its_specification():
    """The accumulator's vectorized runs (finite terms) and its term-by-term path (runs
    holding a non-finite term), against the specification, bit for bit: indices raised by
    0, 1 and 2+ bins, zeros, subnormals and non-finite terms."""
    n, k = 1200, 6
    terms = _terms(n, k, 5, spread=70)
    terms[2][700] = float("nan")  # one run of 256 on the term-by-term path
    reference = _state(n)
    for t in terms:
        for j, x in enumerate(t.tolist()):
            _binned_add_reference(reference, j, x)
    # One term per call, several per call (the state read and written once for them),
    # and all at once into a state never initialized: the same bits.
    one_by_one, grouped, at_once = _state(n), _state(n), [torch.empty_like(s) for s in _state(n)]
    for t in terms:
        _C.add_to_bins(*one_by_one, [t])
    _C.add_to_bins(*grouped, terms[:1])
    _C.add_to_bins(*grouped, terms[1:4])
    _C.add_to_bins(*grouped, terms[4:])
    _C.add_to_bins(*at_once, terms, empty=True)
    for state in (one_by_one, grouped, at_once):
        assert torch.equal(state[0], reference[0])
        for got, want in zip(state[1:], reference[1:]):
            assert torch.equal(got.view(torch.int64), want.view(torch.int64))


def test_binned_sum_error_bound():
    """Each term loses less than 2^-32 of the element's largest |term|; the sum is then
    rounded once to float32."""
    n, k = 2000, 8
    terms = _terms(n, k, 7, spread=60)
    got = _value(_add_all(terms, n))
    for i in range(30, n):
        values = [float(t[i]) for t in terms]
        exact = sum(Fraction(v) for v in values)
        largest = max(abs(v) for v in values)
        ulp = (torch.nextafter(got[i:i + 1].abs(), torch.tensor([float("inf")])) - got[i:i + 1].abs()).item()
        bound = k * Fraction(largest) / 2**32 + Fraction(ulp) / 2
        assert abs(Fraction(float(got[i])) - exact) <= bound, (i, values)


def test_binned_sum_rounds_once():
    # 2^24 + 1 + 2^-31: a double rounds it to the tie 2^24 + 1, which float32 would round
    # to even (2^24); rounded once, it is 2^24 + 2.
    terms = [torch.tensor([2.0 ** 24]), torch.tensor([1.0]), torch.tensor([2.0 ** -31])]
    assert _value(_add_all(terms, 1)).item() == 2.0 ** 24 + 2
    # Sums a double holds exactly: the correctly rounded float32, also through a divisor
    # that is a power of two, and for 16-bit outputs.
    terms = _terms(1000, 8, 3, spread=3)
    for t in terms:
        t[:30] = 1.0
    state = _add_all(terms, 1000)
    exact = sum(t.double() for t in terms)
    assert torch.equal(_value(state), exact.float())
    assert torch.equal(_value(state, divisor=8.0), (exact / 8).float())
    assert torch.equal(_bits(_value(state, torch.bfloat16)), _bits(exact.float().bfloat16()))


def test_binned_state_checks_its_operands():
    state = _state(4)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        _C.add_to_bins(*state, [torch.zeros(4, dtype=torch.float64)])
    with pytest.raises(ValueError, match="has 3 elements"):
        _C.add_to_bins(*state, [torch.zeros(4), torch.zeros(3)])
    with pytest.raises(ValueError, match="of one dtype"):
        _C.add_to_bins(*state, [torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="at least one term"):
        _C.add_to_bins(*state, [], empty=True)
    with pytest.raises(ValueError, match="lower bin"):
        _C.add_to_bins(*state, [torch.ones(4)])
        _C.align_bins(*state, torch.full((4,), -1, dtype=torch.int8))


# ---- training on 1, 2, 4 and 8 ranks ----

def _model(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                                   torch.nn.Linear(64, 4))
    layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=32, dropout=0.0, batch_first=True)
    return torch.nn.Sequential(layer, torch.nn.Flatten(), torch.nn.Linear(16 * 6, 4))


def _micro_batch(kind, step, m):
    g = torch.Generator().manual_seed(1000 * step + m)
    x = torch.randn(8, 6, 16, generator=g) if kind == "transformer" else torch.randn(8, 16, generator=g)
    flat = x.reshape(8, -1)
    return x, torch.sin(flat[:, :4] * 3) + 0.1 * flat[:, 4:8]


def _perturb(model, seed, rank):
    if seed is not None:
        rng = random.Random(seed * 1000 + rank)
        for layer in model.modules():
            layer.register_forward_pre_hook(lambda *_: time.sleep(rng.uniform(0, 0.002)))


def _digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2's shards, gathered
        h.update(full.detach().numpy().tobytes())
    return h.hexdigest()


def _train(rank, ws, kind, how, group, seed):
    """STEPS AdamW steps on the global batch of MICRO_BATCHES micro-batches, this rank
    computing its contiguous share; ``how``: "exact" (the accumulator), "fsdp" (the
    accumulator in FSDP2's reduce-scatter, every layer and the root sharded over the
    group), a codec (the accumulator with that compression) or "ddp"
    (DistributedDataParallel, no_sync for all but the last local micro-batch, each loss
    divided by the local count). Returns the parameters' digest after every step and the
    last step's loss over the global batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model(kind)
    _perturb(model, seed, rank)
    mine = range(rank * MICRO_BATCHES // ws, (rank + 1) * MICRO_BATCHES // ws)
    if how == "fsdp":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, "cpu")
        for layer in model:
            if any(p.requires_grad for p in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if how == "ddp":
        trained = DDP(model, process_group=group)
    else:
        trained = model
        edp = pycomm.exact_data_parallel(model, group, compression=None if how in ("exact", "fsdp") else how)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    digests = []
    for step in range(STEPS):
        for i, m in enumerate(mine):
            x, y = _micro_batch(kind, step, m)
            last = i == len(mine) - 1
            if how == "ddp":
                context = contextlib.nullcontext() if last else trained.no_sync()
            else:
                context = edp.last_micro_batch() if last else contextlib.nullcontext()
            with context:
                loss = torch.nn.functional.mse_loss(trained(x), y)
                (loss / len(mine) if how == "ddp" else loss).backward()
        if how != "ddp":
            edp.reduce_gradients()
        opt.step()
        opt.zero_grad()
        digests.append(_digest(model))
    with torch.no_grad():
        loss = sum(torch.nn.functional.mse_loss(model(x), y).item()
                   for x, y in (_micro_batch(kind, STEPS, m) for m in range(MICRO_BATCHES)))
    return digests, loss / MICRO_BATCHES


def trainings_world(rank, ws, trainings):
    """Each training of ``trainings`` (model kind, how, on "pycomm" or "gloo", perturbation
    seed) in turn, in these ranks."""
    torch.set_num_threads(1)  # the same local kernels whatever the number of processes
    gloo = dist.new_group(backend="gloo", timeout=group_timeout())
    return [_train(rank, ws, kind, how, None if on == "pycomm" else gloo, seed) for kind, how, on, seed in trainings]


EXACT_ENV = {"PYCOMM_DETERMINISTIC": "exact"}
PLAIN = [("mlp", "exact", "pycomm", None), ("transformer", "exact", "pycomm", None), ("mlp", "ddp", "pycomm", None)]


@pytest.fixture(scope="module")
def plain_runs():
    """PLAIN's trainings on 1, 2, 4 and 8 ranks: {ws: rank 0's results}, every rank's the same."""
    runs = {}
    for ws in (1, 2, 4, 8):
        results = run_world(trainings_world, ws, args=(PLAIN,), env=EXACT_ENV, timeout=300)
        for other in results[1:]:
            assert [r[0] for r in other] == [r[0] for r in results[0]], "ranks disagree"
        runs[ws] = results[0]
    return runs


@pytest.mark.large
@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_exact_accumulator_is_world_size_invariant(plain_runs, kind):
    k = PLAIN.index((kind, "exact", "pycomm", None))
    one = plain_runs[1][k][0]
    for ws in (2, 4, 8):
        assert plain_runs[ws][k][0] == one, f"{kind}: parameters differ between 1 and {ws} ranks"


@pytest.mark.large
def test_plain_ddp_in_exact_mode_is_not(plain_runs):
    # Each rank adds its micro-batches' gradients in float before the exact all-reduce, so
    # the sum depends on how the batch was split: the check above can fail.
    k = PLAIN.index(("mlp", "ddp", "pycomm", None))
    digests = {ws: plain_runs[ws][k][0][-1] for ws in (1, 2, 4, 8)}
    assert len(set(digests.values())) > 1, digests


@pytest.mark.large
def test_invariant_under_perturbation_on_any_group_with_fsdp2_and_with_fp8(plain_runs):
    """At 2 and 4 ranks, under timing perturbation (pycomm frames and layer forwards
    delayed at random): the accumulator on the pycomm world and over a gloo group, and
    under FSDP2 (every layer and the root sharded; over pycomm at 2 ranks, gloo at 4) for
    both models, equal the unperturbed run on 1 rank; with fp8_e4m3 two differently
    perturbed runs and one over gloo agree bit for bit and stay within FP8_LOSS_BOUND of
    the uncompressed loss."""
    reference = {kind: plain_runs[1][PLAIN.index((kind, "exact", "pycomm", None))] for kind in ("mlp", "transformer")}
    for ws, fsdp_on in ((2, "pycomm"), (4, "gloo")):
        trainings = [("mlp", "exact", "pycomm", 1), ("mlp", "exact", "gloo", 2), ("mlp", "fsdp", fsdp_on, 3),
                     ("transformer", "fsdp", fsdp_on, 4), ("mlp", "fp8_e4m3", "pycomm", 5),
                     ("mlp", "fp8_e4m3", "pycomm", 6), ("mlp", "fp8_e4m3", "gloo", 7)]
        env = dict(EXACT_ENV, PYCOMM_TEST_PERTURB="%d:300" % ws)
        results = run_world(trainings_world, ws, args=(trainings,), env=env, timeout=300)
        for other in results[1:]:
            assert [r[0] for r in other] == [r[0] for r in results[0]], "ranks disagree"
        perturbed, over_gloo, fsdp_mlp, fsdp_transformer, fp8_a, fp8_b, fp8_gloo = results[0]
        assert perturbed[0] == reference["mlp"][0] and over_gloo[0] == reference["mlp"][0]
        assert fsdp_mlp[0] == reference["mlp"][0], f"FSDP2 at {ws} ranks differs from 1 rank (mlp)"
        assert fsdp_transformer[0] == reference["transformer"][0], f"FSDP2 at {ws} ranks differs (transformer)"
        assert fp8_a[0] == fp8_b[0] == fp8_gloo[0]
        assert fp8_a[0] != reference["mlp"][0]
        loss = reference["mlp"][1]
        assert abs(fp8_a[1] - loss) <= FP8_LOSS_BOUND * loss, (fp8_a[1], loss)


def refusals_world(rank, ws):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    solo = [dist.new_group([r]) for r in range(ws)][rank]  # every rank creates every group

    def sharded_on_one_rank():
        model = _model("mlp")
        fully_shard(model, mesh=DeviceMesh.from_group(solo, "cpu"))
        pycomm.exact_data_parallel(model, solo)

    problems = []
    for build, expected in [(lambda: pycomm.exact_data_parallel(DDP(_model("mlp"))), "pass the module itself"),
                            (sharded_on_one_rank, "does not call its reduce-scatter on one rank"),
                            (lambda: pycomm.exact_data_parallel(_model("mlp").double()),
                             "float32, float16 or bfloat16"),
                            (lambda: pycomm.exact_data_parallel(_model("mlp"), compression="fp9"),
                             "compression='fp9'")]:
        try:
            build()
            problems.append(expected + ": accepted")
        except ValueError as e:
            if expected not in str(e):
                problems.append(str(e))
    return problems


def test_exact_data_parallel_refuses_what_it_cannot_do():
    for problems in run_world(refusals_world, 2, timeout=120):
        assert not problems, problems


def merged_bound_world(rank, ws):
    """The states add at most max_terms() terms exactly (lowered to 3 here): 2 micro-batches
    per rank pass each rank's own check, but the merged states hold 2 * ws; every rank
    raises before a gradient is written, and the accumulator is usable again."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from pycomm import data_parallel

    data_parallel.max_terms = lambda: 3
    problems = []
    for sharded in (False, True):
        model = _model("mlp")
        if sharded:
            fully_shard(model, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
        edp = pycomm.exact_data_parallel(model)
        x, y = _micro_batch("mlp", 0, rank)
        try:
            for i in range(2):
                with edp.last_micro_batch() if i == 1 else contextlib.nullcontext():
                    torch.nn.functional.mse_loss(model(x), y).backward()
            edp.reduce_gradients()
            problems.append(f"sharded={sharded}: 4 merged terms accepted")
        except RuntimeError as e:
            if "more than the 3" not in str(e):
                problems.append(f"sharded={sharded}: {e}")
        if not sharded and any(p.grad is not None for p in model.parameters()):
            problems.append("a gradient was written")
        with edp.last_micro_batch():  # one micro-batch per rank: within the bound
            torch.nn.functional.mse_loss(model(x), y).backward()
        edp.reduce_gradients()
        if any(p.grad is None for p in model.parameters()):
            problems.append(f"sharded={sharded}: no gradient after a step within the bound")
    return problems


def unused_parameters_world(rank, ws):
    """A parameter without a gradient in a step gets zeros, not the last step's sum."""
    torch.manual_seed(0)
    used, unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    model = torch.nn.ModuleList([used, unused])
    edp = pycomm.exact_data_parallel(model)
    x = torch.ones(2, 4)
    (used(x).sum() + unused(x).sum()).backward()
    edp.reduce_gradients()
    model.zero_grad()
    used(x).sum().backward()
    edp.reduce_gradients()
    return [] if all(torch.equal(p.grad, torch.zeros_like(p)) for p in unused.parameters()) else \
        ["the unused parameters' gradients are the last step's"]


def kept_gradients_world(rank, ws):
    """The last step's gradients, where a tensor still holds them, are not overwritten by
    the next step's; once none does, their memory takes the next step's."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    edp = pycomm.exact_data_parallel(model)

    def step(seed):
        model.zero_grad()
        model(torch.full((2, 4), float(seed + rank))).sum().backward()
        edp.reduce_gradients()
        return [p.grad for p in model.parameters()]

    problems = []
    kept = step(1)
    copies = [g.clone() for g in kept]
    second = step(2)
    if not all(torch.equal(g, c) for g, c in zip(kept, copies)):
        problems.append("a gradient held from the last step was overwritten")
    if torch.equal(second[0], kept[0]):
        problems.append("the second step's gradient is the first's")
    where = [g.data_ptr() for g in second]
    del kept, second
    if [g.data_ptr() for g in step(3)] != where:
        problems.append("the gradients of a step no tensor holds any more were not reused")
    return problems


def test_gradients_held_past_a_step_keep_their_values():
    for problems in run_world(kept_gradients_world, 2, timeout=120):
        assert not problems, problems


def test_merged_states_are_checked_against_the_bound():
    for problems in run_world(merged_bound_world, 2, timeout=120):
        assert not problems, problems


def test_a_parameter_without_a_gradient_gets_zeros():
    for problems in run_world(unused_parameters_world, 2, timeout=120):
        assert not problems, problems
