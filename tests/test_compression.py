"""Compressed collectives against the numerics contract (docs/design.md, 'Numerics').

* Relative RMS error versus an fp64 reference on Gaussian data, float32 all-reduce, for
  every algorithm and codec at world sizes 2, 3, 4 and 8, within the contract's bounds,
  and error(8 ranks) <= 1.5 x error(2 ranks): each contribution is quantized once and
  the result once more, so the error must not grow with the world size.
* Every rank gets identical bits; NaN and Inf reach the same positions on every rank and
  leave their finite block neighbours intact.
* Reduce-scatter and all-gather, 16-bit inputs, AVG and PREMUL_SUM.
* Integer and float64 tensors are never compressed, even with PYCOMM_COMPRESSION set.
* Ranks that disagree on the compression get an error, not a hang or garbage.
Hierarchical needs several nodes, so every world here is cut into nodes with
PYCOMM_RANKS_PER_NODE (shared memory within, TCP across), which also covers both transports.
"""

import math

import pytest
import torch
import torch.distributed as dist

from _harness import group_timeout, is_gloo, run_world

pytestmark = pytest.mark.skipif(is_gloo(), reason="compression is pycomm's")

CODECS = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
BOUND = {"fp16": 1e-3, "bf16": 5e-3, "fp8_e4m3": 6e-2, "fp8_e5m2": 1.2e-1}
ALGORITHMS = ["ring", "tree", "oneshot", "twoshot", "hierarchical"]
COUNT = 30011  # odd, not a multiple of any block size
RANKS_PER_NODE = {2: "1", 3: "1", 4: "2", 8: "4"}


def _gaussian(seed, rank, n, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def _rel_rms(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


def _same_bits_everywhere(t, group):
    """True when every rank holds exactly these bits (NaN payloads included)."""
    raw = t.contiguous().view(torch.uint8) if t.numel() else t.view(torch.uint8)
    everyone = [torch.empty_like(raw) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, raw, group=group)
    return all(torch.equal(everyone[0], e) for e in everyone)


def error_world(rank, ws):
    import pycomm

    side = dist.new_group(backend="gloo", timeout=group_timeout())
    out = {}
    for i, algo in enumerate(ALGORITHMS):
        for j, codec in enumerate(CODECS):
            seed = 10 * i + j
            xs = [_gaussian(seed, r, COUNT) for r in range(ws)]
            ref = torch.stack([x.double() for x in xs]).sum(0)
            t = xs[rank].clone()
            pycomm.all_reduce(t, compression=codec, algorithm=algo)
            out[algo, codec] = (_rel_rms(t, ref), _same_bits_everywhere(t, side))
    return out


@pytest.fixture(scope="module")
def errors():
    """(world size) -> {(algorithm, codec): (relative RMS error, identical on all ranks)}."""
    return {ws: run_world(error_world, ws, env={"PYCOMM_RANKS_PER_NODE": RANKS_PER_NODE[ws]},
                          timeout=240)[0]
            for ws in (2, 3, 4, 8)}


@pytest.mark.large  # an 8-rank world
def test_error_within_bounds_and_identical_bits(errors):
    problems = []
    for ws, table in errors.items():
        for (algo, codec), (err, same) in table.items():
            print("ws=%d %-12s %-8s rel RMS error %.3e" % (ws, algo, codec, err))
            if not err <= BOUND[codec]:
                problems.append("ws=%d %s %s: error %.3e > %.1e" % (ws, algo, codec, err, BOUND[codec]))
            if not same:
                problems.append("ws=%d %s %s: ranks hold different bits" % (ws, algo, codec))
    assert not problems, "\n".join(problems)


@pytest.mark.large  # an 8-rank world
def test_error_does_not_grow_with_world_size(errors):
    problems = []
    for key, (err8, _) in errors[8].items():
        err2 = errors[2][key][0]
        print("%-12s %-8s error(2) %.3e error(8) %.3e ratio %.2f" % (*key, err2, err8, err8 / err2))
        if not err8 <= 1.5 * err2:
            problems.append("%s %s: error(8) %.3e > 1.5 x error(2) %.3e" % (*key, err8, err2))
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------
# non-finite values, other collectives, dtypes and ops
# --------------------------------------------------------------------------------------

def special_world(rank, ws):
    import pycomm

    side = dist.new_group(backend="gloo", timeout=group_timeout())
    problems = []
    n = 3000
    for algo in ALGORITHMS:
        for codec in CODECS:
            label = "%s %s" % (algo, codec)
            xs = [_gaussian(7, r, n) for r in range(ws)]
            xs[0][5] = math.inf           # +Inf alone
            xs[1][100] = math.nan         # NaN alone
            xs[0][1000] = math.inf        # +Inf + -Inf = NaN
            xs[2][1000] = -math.inf
            xs[2][2999] = -math.inf       # -Inf in the last, short block
            t = xs[rank].clone()
            pycomm.all_reduce(t, compression=codec, algorithm=algo)
            if not _same_bits_everywhere(t, side):
                problems.append(label + ": ranks hold different bits")
            if not (t[5] == math.inf and math.isnan(t[100]) and math.isnan(t[1000]) and t[2999] == -math.inf):
                problems.append(label + ": non-finite results %s" % [t[i].item() for i in (5, 100, 1000, 2999)])
            finite = torch.ones(n, dtype=torch.bool)
            finite[[5, 100, 1000, 2999]] = False
            if not torch.isfinite(t[finite]).all():
                problems.append(label + ": a finite position became non-finite")
            ref = torch.stack([x.double() for x in xs]).sum(0)
            # The neighbours of each non-finite value share its block: still accurate.
            err = _rel_rms(t[finite], ref[finite])
            if not err <= BOUND[codec]:
                problems.append(label + ": error of the finite values %.3e" % err)
    # Huge and tiny magnitudes never wrap or flush whole blocks.
    for codec in CODECS:
        for scale, what in ((1e30, "huge"), (1e-30, "tiny")):
            ys = [_gaussian(8, r, n) * scale for r in range(ws)]
            ref = torch.stack([y.double() for y in ys]).sum(0)
            t = ys[rank].clone()
            pycomm.all_reduce(t, compression=codec)
            err = _rel_rms(t, ref)
            if not (torch.isfinite(t).all() and err <= BOUND[codec]):
                finite = torch.isfinite(t).all().item()
                problems.append("%s %s values: error %.3e, finite %s" % (codec, what, err, finite))
    return problems


def other_world(rank, ws):
    import pycomm

    side = dist.new_group(backend="gloo", timeout=group_timeout())
    problems = []
    n = 2001
    for codec in CODECS:
        # 16-bit inputs: only the fp8 codecs save bytes; fp16/bf16 leave them exact.
        for dtype in (torch.float16, torch.bfloat16):
            xs = [_gaussian(3, r, n, dtype) for r in range(ws)]
            ref = torch.stack([x.double() for x in xs]).sum(0)
            t = xs[rank].clone()
            pycomm.all_reduce(t, compression=codec)
            err = _rel_rms(t, ref)
            bound = BOUND[codec] if codec.startswith("fp8") else 1e-2  # one rounding to the dtype
            if not (err <= bound and _same_bits_everywhere(t, side)):
                problems.append("all_reduce %s %s: error %.3e" % (dtype, codec, err))
        # AVG and PREMUL_SUM scale once, at the end and at the start respectively.
        xs = [_gaussian(4, r, n) for r in range(ws)]
        ref = torch.stack([x.double() for x in xs]).sum(0)
        for op, expect in ((dist.ReduceOp.AVG, ref / ws), (dist._make_nccl_premul_sum(0.25), ref * 0.25)):
            t = xs[rank].clone()
            pycomm.all_reduce(t, op, compression=codec)
            err = _rel_rms(t, expect)
            if not err <= BOUND[codec]:
                problems.append("all_reduce %s %s: error %.3e" % (op, codec, err))
        for algo in ("ring", "oneshot"):
            full = [_gaussian(5, r, n * ws) for r in range(ws)]
            ref = torch.stack([x.double() for x in full]).sum(0)[rank * n:(rank + 1) * n]
            out = torch.empty(n)
            pycomm.reduce_scatter_tensor(out, full[rank], compression=codec, algorithm=algo)
            err = _rel_rms(out, ref)
            if not err <= BOUND[codec]:
                problems.append("reduce_scatter %s %s: error %.3e" % (algo, codec, err))
            parts = [_gaussian(6, r, n) for r in range(ws)]
            gathered = torch.empty(n * ws)
            pycomm.all_gather_into_tensor(gathered, parts[rank], compression=codec, algorithm=algo)
            expect = torch.cat([pycomm.quantize(p, codec) for p in parts])
            if not (torch.equal(gathered, expect) and _same_bits_everywhere(gathered, side)):
                problems.append("all_gather %s %s: not the quantized inputs" % (algo, codec))
    return problems


def uncompressed_world(rank, ws):
    """PYCOMM_COMPRESSION is set for the whole group: integers and float64 stay exact."""
    problems = []
    for dtype in (torch.int32, torch.int64, torch.uint8, torch.float64):
        t = (torch.arange(1000) % 50 + rank).to(dtype)
        dist.all_reduce(t)
        expect = (torch.arange(1000, dtype=torch.int64) % 50) * ws + sum(range(ws))
        if not torch.equal(t.to(torch.int64), expect):
            problems.append("%s changed by compression" % dtype)
    t = torch.full((1000,), 1.0 + 2 ** -20)  # fp8 would round this to 1.0
    dist.all_reduce(t)
    if t[0].item() != ws:
        problems.append("float32 not compressed although PYCOMM_COMPRESSION is set")
    return problems


def test_non_finite_and_extreme_values():
    problems = run_world(special_world, 3, env={"PYCOMM_RANKS_PER_NODE": "1"}, timeout=180)
    assert not any(problems), "\n".join(sum(problems, []))


def test_reduce_scatter_all_gather_dtypes_and_ops():
    problems = run_world(other_world, 3, timeout=180)
    assert not any(problems), "\n".join(sum(problems, []))


def test_integers_and_float64_never_compressed():
    problems = run_world(uncompressed_world, 2, env={"PYCOMM_COMPRESSION": "fp8_e4m3"}, timeout=120)
    assert not any(problems), "\n".join(sum(problems, []))


def mismatch_world(rank, ws):
    import pycomm

    t = torch.ones(5000)
    try:
        pycomm.all_reduce(t, compression="fp8_e4m3" if rank == 0 else "none")
        return "no error"
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return str(e)


def test_compression_mismatch_between_ranks_fails():
    messages = run_world(mismatch_world, 2, pg_timeout=60, timeout=90)
    for rank, msg in enumerate(messages):
        assert "different collectives or arguments" in msg or "aborted" in msg, "rank %d: %s" % (rank, msg)


def reference_world(rank, ws):
    """pycomm.compression_error models the wire exactly: its sum is the all-reduce's bits."""
    import pycomm

    problems = []
    for codec in CODECS:
        xs = [_gaussian(9, r, 5003) for r in range(ws)]
        for algo in ("ring", "twoshot", "oneshot"):
            t = xs[rank].clone()
            pycomm.all_reduce(t, compression=codec, algorithm=algo)
            if not torch.equal(t, pycomm._compressed_sum(xs, codec, algo)):
                problems.append("%s %s: all-reduce differs from the model" % (algo, codec))
        report = pycomm.compression_error(xs, codec)
        t = xs[rank].clone()
        pycomm.all_reduce(t, compression=codec, algorithm="twoshot")
        measured = _rel_rms(t, torch.stack([x.double() for x in xs]).sum(0))
        if not math.isclose(report["rel_rms_error"], measured, rel_tol=1e-6):
            problems.append("%s: compression_error %.6e, measured %.6e" % (codec, report["rel_rms_error"], measured))
    return problems


def test_compression_error_models_the_all_reduce():
    problems = run_world(reference_world, 3, timeout=120)
    assert not any(problems), "\n".join(sum(problems, []))


def test_compression_error_report():
    import pycomm

    g = torch.randn(20000, generator=torch.Generator().manual_seed(0)) * 1e-4
    for codec in CODECS:
        r = pycomm.compression_error(g, codec, world_size=8)
        assert r["world_size"] == 8 and r["nonfinite"] == 0
        assert r["rel_rms_error_fp32"] < 1e-6 < r["rel_rms_error"] <= BOUND[codec], r
        assert abs(r["wire_ratio"] - (0.25 if codec.startswith("fp8") else 0.5)) < 0.02, r
