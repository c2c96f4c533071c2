"""pycomm.hooks: DDP gradient compression with error feedback.

* Training: DDP with the hook, for every codec with error feedback on and off (and 16-bit
  and float64 models), leaves bit-identical parameters on every rank, close to those of
  an uncompressed twin, and different from them where the wire compresses; error
  feedback brings them closer.
* Bookkeeping, checked bit for bit on every bucket of every step of a real DDP run: the
  residual is g - quantize(g), with g = gradient + the previous residual of the same
  parameters (also across DDP's bucket rebuild after the first step, and after a
  checkpoint is restored into a fresh DDP); reset(), state_dict()/load_state_dict();
  buckets that the wire does not compress; codec validation.
* Over a gloo group (the layered path) the hooks return at once, their futures complete
  only once the mover has carried the bucket (DDP overlaps them with backward).
* Quality (slow): fp8_e4m3 with error feedback trains a small regression model to within
  2% of the uncompressed loss on a fixed evaluation set.
"""

import copy
import io

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _harness import group_timeout, is_gloo, run_world
from conftest import soak

pytestmark = pytest.mark.skipif(is_gloo(), reason="compression hooks are pycomm's")

CODECS = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]


def _mlp(dtype=torch.float32):
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4)).to(dtype)


def _shard(rank, step, dtype=torch.float32):
    """This rank's batch at this step (different shards per rank, fixed seed)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 8, generator=g)
    y = torch.sin(x[:, :4]) + 0.1 * torch.randn(16, 4, generator=g)
    return x.to(dtype), y.to(dtype)


def _flat(params):
    return torch.cat([p.detach().double().flatten() for p in params])


# --------------------------------------------------------------------------------------
# 1. training with the hook, every codec, error feedback on and off
# --------------------------------------------------------------------------------------

TRAIN_STEPS = 15
# (codec, error feedback, parameter dtype); the twin is the same model without a hook.
TRAIN_CONFIGS = ([(c, ef, torch.float32) for c in CODECS for ef in (True, False)]
                 + [("fp8_e4m3", True, torch.bfloat16), ("bf16", True, torch.bfloat16),
                    ("fp8_e4m3", True, torch.float64)])
# max |params - twin's| / max |twin's - initial|: how far compression moved the result,
# relative to how far training moved the parameters. Measured on float32 without / with
# error feedback: fp16 7e-5 / 4e-6, bf16 3e-4 / 4e-5, fp8_e4m3 8e-3 / 6e-4, fp8_e5m2
# 2e-2 / 2e-3 (bf16 model, fp8_e4m3: 7e-3). The bounds leave >= 5x headroom.
CLOSE = {"fp16": 5e-4, "bf16": 5e-3, "fp8_e4m3": 5e-2, "fp8_e5m2": 1e-1}


# Which trained configurations travel compressed, as docs/compression.md states it: float32 with
# every codec, bfloat16 with fp8 only (a 16-bit codec would save nothing), float64 never.
ON_WIRE = {**{(codec, torch.float32): True for codec in CODECS},
           ("fp8_e4m3", torch.bfloat16): True, ("bf16", torch.bfloat16): False,
           ("fp8_e4m3", torch.float64): False}


def _train(ddp, steps, dtype):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = _shard(dist.get_rank(), step, dtype)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in ddp.module.parameters()]


def train_world(rank, ws):
    from pycomm.hooks import register_compression_hook

    torch.manual_seed(rank)  # different on every rank: DDP broadcasts rank 0's
    base = _mlp()
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        model = copy.deepcopy(base).to(dtype)
        out["init", dtype] = [p.tolist() for p in model.parameters()]
        twin = _train(DDP(copy.deepcopy(model), bucket_cap_mb=0.001), TRAIN_STEPS, dtype)
        out["twin", dtype] = [p.tolist() for p in twin]
    for codec, ef, dtype in TRAIN_CONFIGS:
        ddp = DDP(copy.deepcopy(base).to(dtype), bucket_cap_mb=0.001)
        state = register_compression_hook(ddp, codec, error_feedback=ef)
        params = _train(ddp, TRAIN_STEPS, dtype)
        out[codec, ef, dtype] = ([p.tolist() for p in params],
                                 {i: r.numel() for i, r in state.residuals.items()})
    return out


@pytest.fixture(scope="module")
def trained():
    return run_world(train_world, 3, timeout=120)


@pytest.mark.large
@pytest.mark.parametrize("codec,ef,dtype", TRAIN_CONFIGS,
                         ids=["%s-%s-%s" % (c, "ef" if ef else "noef", str(d)[6:])
                              for c, ef, d in TRAIN_CONFIGS])
def test_hook_training_identical_on_ranks_and_close_to_uncompressed(trained, codec, ef, dtype):
    ranks = [[torch.tensor(p, dtype=dtype) for p in r[codec, ef, dtype][0]] for r in trained]
    for rank, params in enumerate(ranks):
        for i, (a, a0) in enumerate(zip(params, ranks[0])):
            assert torch.equal(a, a0), "rank %d param %d differs from rank 0's" % (rank, i)
    got = _flat(ranks[0])
    twin = _flat(torch.tensor(p, dtype=dtype) for p in trained[0]["twin", dtype])
    init = _flat(torch.tensor(p, dtype=dtype) for p in trained[0]["init", dtype])
    moved = (twin - init).abs().max().item()
    dev = (got - twin).abs().max().item() / moved
    compressed = ON_WIRE[codec, dtype]
    print("%s ef=%s %s: deviation from the uncompressed twin %.2e of the training move %.3g"
          % (codec, ef, dtype, dev, moved))
    assert moved > 0.1, "the twin barely trained"
    if compressed:
        assert dev <= CLOSE[codec]
        # Compression really happened: the result differs from the twin's, and from the
        # same hook's where the wire does not compress (bf16 codec on a bf16 model).
        plain = trained[0].get(("bf16", True, dtype), [None])[0] if dtype != torch.float32 else None
        assert dev > 0, "compressed training gave the uncompressed parameters bit for bit"
        assert plain is None or not torch.equal(got, _flat(torch.tensor(p, dtype=dtype)
                                                           for p in plain))
    else:
        # Nothing compressed: only AVG in one step versus DDP's divide-then-SUM differs.
        assert dev <= (1e-12 if dtype == torch.float64 else 2e-2)
    # Residuals exist exactly when the wire compresses and error feedback is on, one per
    # bucket; every rank has the same buckets.
    residual_sizes = [r[codec, ef, dtype][1] for r in trained]
    assert all(s == residual_sizes[0] for s in residual_sizes)
    if compressed and ef:
        n_params = sum(p.numel() for p in ranks[0])
        assert len(residual_sizes[0]) >= 2, "expected several buckets"
        assert sum(residual_sizes[0].values()) == n_params
    else:
        assert residual_sizes[0] == {}


@pytest.mark.large
@pytest.mark.parametrize("codec", CODECS)
def test_error_feedback_brings_training_closer_to_uncompressed(trained, codec):
    """Measured: error feedback cuts the deviation from the twin 6x (bf16) to 16x (fp16)."""
    twin = _flat(torch.tensor(p) for p in trained[0]["twin", torch.float32])
    dev = {ef: (_flat(torch.tensor(p) for p in trained[0][codec, ef, torch.float32][0])
                - twin).abs().max().item() for ef in (True, False)}
    assert dev[True] <= 0.5 * dev[False], dev


# --------------------------------------------------------------------------------------
# 2. error-feedback bookkeeping
# --------------------------------------------------------------------------------------

class _Recorder:
    """Wraps compressed_allreduce_hook and checks its residuals bit for bit against an
    independent per-parameter model: the residual of a bucket is g - quantize(g), where
    g = the bucket's gradient + the previous residual of the same parameters, wherever
    those were in the previous step's buckets."""

    def __init__(self, state, model, expect=None):
        self.state = state
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.expect = dict(expect or {})   # parameter name -> residual piece
        self.step = 0
        self.problems = []
        self.layouts = {}                  # step -> [(bucket index, parameter names)]
        self.sent = {}                     # (step, bucket index) -> g
        self.got = {}                      # (step, bucket index) -> averaged bucket

    def pieces(self, residual, layout):
        return {n: piece for n, piece in zip([n for n, _ in layout],
                                             residual.split([s for _, s in layout]))}


def _recording_hook(rec, bucket):
    import pycomm
    from pycomm.hooks import compressed_allreduce_hook

    index, step, buf = bucket.index(), rec.step, bucket.buffer()
    layout = [(rec.names[id(p)], p.numel()) for p in bucket.parameters()]
    rec.layouts.setdefault(step, []).append((index, [n for n, _ in layout]))
    prev = torch.cat([rec.expect.get(n, torch.zeros(s)) for n, s in layout])
    g = buf + prev
    rec.sent[step, index] = g.clone()
    fut = compressed_allreduce_hook(rec.state, bucket)
    want = g - pycomm.quantize(g, rec.state.codec)
    got = rec.state.residuals.get(index)
    if got is None or not torch.equal(got, want):
        rec.problems.append("step %d bucket %d: residual %s, want g - quantize(g)"
                            % (step, index, "missing" if got is None else "differs"))
    rec.expect.update(rec.pieces(want, layout))

    def done(f):
        rec.got[step, index] = f.value().clone()
        return f.value()
    return fut.then(done)


def _steps(ddp, rec, first, count):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(first, first + count):
        rec.step = step
        x, y = _shard(dist.get_rank(), step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def _same_everywhere(t, group):
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t, group=group)
    return all(torch.equal(everyone[0], e) for e in everyone), everyone


def bookkeeping_world(rank, ws):
    from pycomm.hooks import CompressionState

    side = dist.new_group(backend="gloo", timeout=group_timeout())
    out = {"problems": []}
    torch.manual_seed(0)
    model = _mlp()
    ddp = DDP(model, bucket_cap_mb=0.001)
    state = CompressionState("fp8_e4m3", model=model)
    rec = _Recorder(state, model)
    ddp.register_comm_hook(rec, _recording_hook)
    _steps(ddp, rec, 0, 3)
    out["problems"] += rec.problems
    out["layouts"] = rec.layouts
    out["residual_keys"] = sorted(state.residuals)
    out["bucket_sizes"] = {i: rec.got[2, i].numel() for i, _ in rec.layouts[2]}
    out["residual_sizes"] = {i: r.numel() for i, r in state.residuals.items()}
    # What came back is the average of every rank's g, within fp8 error, the same bits on
    # every rank.
    errors = []
    for key in sorted(rec.got):
        everyone = _same_everywhere(rec.sent[key], side)[1]
        mean = torch.stack(everyone).mean(0)
        errors.append(((rec.got[key] - mean).norm() / mean.norm()).item())
        if not _same_everywhere(rec.got[key], side)[0]:
            out["problems"].append("step %d bucket %d: ranks got different bits" % key)
    out["avg_errors"] = errors

    # Checkpoint: a clone, restored exactly into a fresh state, through torch.save.
    sd = state.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    fresh = CompressionState("fp16", error_feedback=True)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    out["loaded"] = (fresh.codec, fresh.error_feedback,
                     sorted(fresh.residuals) == sorted(state.residuals)
                     and all(torch.equal(fresh.residuals[i], r)
                             for i, r in state.residuals.items()))
    # Neither state_dict() nor load_state_dict() shares tensors with its source.
    kept = {i: r.clone() for i, r in sd["residuals"].items()}
    for r in state.residuals.values():
        r.add_(1.0)
    out["sd_is_a_clone"] = all(torch.equal(kept[i], r) for i, r in sd["residuals"].items())
    fresh2 = CompressionState()
    fresh2.load_state_dict(sd)
    for r in sd["residuals"].values():
        r.add_(1.0)
    out["load_clones"] = all(torch.equal(kept[i], r) for i, r in fresh2.residuals.items())

    # Resume: the checkpointed residuals, loaded into a fresh state on a fresh DDP (whose
    # first step uses DDP's initial bucket layout, not the rebuilt one), are fed back to
    # the same parameters.
    model2 = copy.deepcopy(model)
    ddp2 = DDP(model2, bucket_cap_mb=0.001)
    state2 = CompressionState(model=model2)
    state2.load_state_dict(fresh2.state_dict())
    rec2 = _Recorder(state2, model2, expect=rec.expect)
    ddp2.register_comm_hook(rec2, _recording_hook)
    _steps(ddp2, rec2, 3, 2)
    out["problems"] += ["resumed: " + p for p in rec2.problems]
    out["resume_layouts"] = rec2.layouts

    state.reset()
    out["after_reset"] = (len(state.residuals), len(state.state_dict()["residuals"]))
    return out


def test_error_feedback_bookkeeping():
    results = run_world(bookkeeping_world, 2, timeout=90)
    for rank, out in enumerate(results):
        assert not out["problems"], "rank %d:\n%s" % (rank, "\n".join(out["problems"]))
        # Several buckets, one residual each, of the bucket's length.
        assert len(out["layouts"][2]) >= 2
        assert out["residual_keys"] == sorted(i for i, _ in out["layouts"][2])
        assert out["residual_sizes"] == out["bucket_sizes"]
        # The run did cross a layout change (DDP rebuilds its buckets after step 0, and
        # the resumed DDP starts from its initial layout), so remapping was exercised.
        assert [n for _, n in out["layouts"][0]] != [n for _, n in out["layouts"][1]]
        assert [n for _, n in out["resume_layouts"][3]] != [n for _, n in out["layouts"][2]]
        assert max(out["avg_errors"]) <= 6e-2, out["avg_errors"]
        assert out["loaded"] == ("fp8_e4m3", True, True)
        assert out["sd_is_a_clone"] and out["load_clones"]
        assert out["after_reset"] == (0, 0)


class _Bucket:
    """What the hooks read of a DDP bucket, for a hook called by hand: its index, the
    parameters it holds (in bucket order), its flat gradient values, whether it is last."""

    def __init__(self, index, params, values, last=True):
        self.idx, self.params, self.buf, self.last = index, params, values, last

    def index(self):
        return self.idx

    def buffer(self):
        return self.buf

    def parameters(self):
        return self.params

    def is_last(self):
        return self.last


def edge_world(rank, ws):
    """The hook on hand-made buckets: non-compressed dtypes, non-finite gradients, layouts
    that change."""
    import pycomm
    from pycomm.hooks import CompressionState, compressed_allreduce_hook

    def run(state, bucket):
        return compressed_allreduce_hook(state, bucket).wait()

    out = {}
    p = [torch.nn.Parameter(torch.zeros(s)) for s in ((300,), (40, 10), (300,))]
    # Integers, float64, 16-bit floats with a 16-bit codec: exact, no residual.
    for dtype, codec in ((torch.int64, "fp8_e4m3"), (torch.float64, "fp8_e4m3"),
                         (torch.bfloat16, "fp16"), (torch.float16, "bf16")):
        state = CompressionState(codec)
        base = torch.arange(700) % 16          # exact in every dtype, and so is the mean
        got = run(state, _Bucket(0, p[:2], values=(base * (rank + 1)).to(dtype)))
        want = base.double() * (1 + ws) / 2    # the mean over ranks of base * (rank + 1)
        if not dtype.is_floating_point:
            want = want.floor()
        out[str(dtype), codec] = (torch.equal(got.double(), want), len(state.residuals))
    # 16-bit floats with an fp8 codec: compressed, residual in float32.
    state = CompressionState("fp8_e4m3")
    run(state, _Bucket(0, p[:2], values=torch.linspace(-1, 1, 700).to(torch.bfloat16)))
    out["bf16-fp8"] = (state.residuals[0].dtype, bool(state.residuals[0].abs().max() > 0))
    # Non-finite gradients: zero residual there, finite elsewhere.
    state = CompressionState("fp8_e4m3")
    vals = torch.linspace(-1, 1, 700)
    vals[5], vals[400] = float("inf"), float("nan")
    run(state, _Bucket(0, p[:2], values=vals))
    r = state.residuals[0]
    out["nonfinite"] = (bool(torch.isfinite(r).all()), r[5].item(), r[400].item(),
                        bool(r[:256].abs().max() > 0))
    # A change of layout (DDP rebuilding buckets, a checkpoint restored into a fresh DDP):
    # the residual follows its parameters, identified by name when the state knows the
    # model. Identified by shape only, the two (300,) parameters are ambiguous: their
    # pieces are dropped, and the uniquely shaped one still follows. What is sent after
    # the change (zero gradients) is exactly the carried residual.
    named = torch.nn.ParameterList(p)
    state = CompressionState("fp8_e4m3", model=named)
    run(state, _Bucket(0, p, values=torch.linspace(-1, 1, 1000)))
    before = state.residuals[0].clone()
    sent = []
    orig = pycomm.all_reduce

    def spy(tensor, *a, **k):
        sent.append(tensor.clone())
        return orig(tensor, *a, **k)
    pycomm.all_reduce = spy
    try:
        run(state, _Bucket(0, [p[2]], last=False, values=torch.zeros(300)))
        run(state, _Bucket(1, [p[1], p[0]], values=torch.zeros(700)))
        state_sh = CompressionState("fp8_e4m3")
        run(state_sh, _Bucket(0, p, values=torch.linspace(-1, 1, 1000)))
        before_sh = state_sh.residuals[0].clone()
        run(state_sh, _Bucket(0, [p[2]], last=False, values=torch.zeros(300)))
        run(state_sh, _Bucket(1, [p[1], p[0]], values=torch.zeros(700)))
    finally:
        pycomm.all_reduce = orig
    out["named"] = (torch.equal(sent[0], before[700:]),
                    torch.equal(sent[1], torch.cat([before[300:700], before[:300]])))
    out["shape_only"] = (torch.equal(sent[3], torch.zeros(300)),
                         torch.equal(sent[4], torch.cat([before_sh[300:700], torch.zeros(300)])))
    return out


def test_hook_edge_cases():
    for rank, out in enumerate(run_world(edge_world, 2, timeout=60)):
        for dtype, codec in (("torch.int64", "fp8_e4m3"), ("torch.float64", "fp8_e4m3"),
                             ("torch.bfloat16", "fp16"), ("torch.float16", "bf16")):
            assert out[dtype, codec] == (True, 0), (rank, dtype, codec, out[dtype, codec])
        assert out["bf16-fp8"] == (torch.float32, True)
        assert out["nonfinite"] == (True, 0.0, 0.0, True)
        assert out["named"] == (True, True)
        assert out["shape_only"] == (True, True)


def hook_future_world(rank, ws):
    """Both hooks over a gloo group (the layered path), rank 1 calling them only once
    rank 0 has looked at its futures (a barrier on another group): rank 0's cannot be
    complete then, since the mover has not carried the buckets."""
    import pycomm.hooks

    gloo, other = (dist.new_group(backend="gloo", timeout=group_timeout()) for _ in range(2))
    buckets = [torch.full((1000,), float(rank + 1)), torch.full((1000,), float(rank + 1))]

    def call_hooks():
        return [pycomm.hooks.deterministic_allreduce_hook(pycomm.hooks.DeterministicState("exact", gloo),
                                                          _Bucket(0, [], buckets[0])),
                pycomm.hooks.compressed_allreduce_hook(pycomm.hooks.CompressionState("fp8_e4m3", False, gloo),
                                                       _Bucket(0, [], buckets[1]))]

    if rank == 0:
        futures = call_hooks()
        done_before = [f.done() for f in futures]
        dist.barrier(group=other)
    else:
        dist.barrier(group=other)
        futures, done_before = call_hooks(), None
    return done_before, [f.wait()[0].item() for f in futures]


def test_hook_futures_complete_after_the_mover_carried_the_bucket():
    for rank, (done_before, values) in enumerate(run_world(hook_future_world, 2, timeout=60)):
        if rank == 0:
            assert done_before == [False, False], done_before
        assert values == [1.5, 1.5], (rank, values)


def test_codec_validation():
    from pycomm.hooks import CompressionState

    with pytest.raises(ValueError, match="fp16, bf16, fp8_e4m3, fp8_e5m2"):
        CompressionState("fp9")
    with pytest.raises(ValueError, match="valid codecs"):
        CompressionState().load_state_dict({"codec": "none", "error_feedback": True})
    with pytest.raises(ValueError, match="error_feedback off"):
        CompressionState().load_state_dict(
            {"codec": "fp16", "error_feedback": False, "residuals": {0: torch.zeros(3)}})
    state = CompressionState("bf16", error_feedback=False)
    assert state.state_dict() == {"codec": "bf16", "error_feedback": False,
                                  "residuals": {}, "layouts": {}}


# --------------------------------------------------------------------------------------
# 3. training quality (soak)
# --------------------------------------------------------------------------------------

# Short by default, long with PYCOMM_SOAK=1 (see conftest.soak()). The same 2% bound for
# both: the eval loss (fixed 2048-sample set, mean of the last 10 steps, not a noisy
# minibatch loss) has fallen ~15x by step 60 and ~50x by step 400, and fp8_e4m3 with
# error feedback measured +0.02% (60 steps) and -0.01% (400 steps) from uncompressed.
QUALITY_STEPS = 400 if soak() else 60
QUALITY_WINDOW = 10        # eval losses averaged over the last steps
QUALITY_TOLERANCE = 0.02


def _regression_data():
    """A fixed teacher network, inputs and targets: (teacher, eval x, eval y)."""
    g = torch.Generator().manual_seed(7)
    w1, w2 = torch.randn(16, 32, generator=g) / 4, torch.randn(32, 1, generator=g) / 4
    teacher = lambda x: torch.tanh(x @ w1) @ w2 + 0.3 * torch.sin(2 * x[:, :1])  # noqa: E731
    x = torch.randn(2048, 16, generator=g)
    return teacher, x, teacher(x)


def _regression_batch(teacher, rank, step):
    g = torch.Generator().manual_seed(100_000 * (rank + 1) + step)
    x = torch.randn(32, 16, generator=g)
    return x, teacher(x) + 0.05 * torch.randn(32, 1, generator=g)


def quality_world(rank, ws, steps, configs):
    from pycomm.hooks import register_compression_hook

    teacher, eval_x, eval_y = _regression_data()
    out = {}
    for codec, ef in configs:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 1))
        ddp = DDP(model, bucket_cap_mb=0.01)
        if codec is not None:
            register_compression_hook(ddp, codec, error_feedback=ef)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        evals = []
        with torch.no_grad():
            evals.append(torch.nn.functional.mse_loss(model(eval_x), eval_y).item())
        for step in range(steps):
            x, y = _regression_batch(teacher, rank, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            with torch.no_grad():
                evals.append(torch.nn.functional.mse_loss(model(eval_x), eval_y).item())
        out[codec, ef] = evals
    return out


@pytest.mark.slow
@pytest.mark.large
def test_fp8_error_feedback_training_quality():
    configs = [(None, False), ("fp8_e4m3", True), ("fp8_e4m3", False)]
    # About 20 s alone on 2 cores, 50 s beside a compile; beside the suite's other worker
    # it once ran past 90 s (a deadline against hangs, not a time limit).
    results = run_world(quality_world, 2, args=(QUALITY_STEPS, configs),
                        timeout=300 if soak() else 240)
    evals = results[0]
    assert all(r == evals for r in results), "ranks evaluated different models"
    final = {k: sum(v[-QUALITY_WINDOW:]) / QUALITY_WINDOW for k, v in evals.items()}
    base, fp8 = final[None, False], final["fp8_e4m3", True]
    print("%d steps: eval loss %.4f at start; over the last %d steps uncompressed %.5f, "
          "fp8_e4m3 + error feedback %.5f (%+.2f%%), fp8_e4m3 alone %.5f (%+.2f%%)"
          % (QUALITY_STEPS, evals[None, False][0], QUALITY_WINDOW, base, fp8,
             100 * (fp8 / base - 1), final["fp8_e4m3", False],
             100 * (final["fp8_e4m3", False] / base - 1)))
    assert base < 0.3 * evals[None, False][0], "the model did not learn"
    assert abs(fp8 - base) <= QUALITY_TOLERANCE * base
