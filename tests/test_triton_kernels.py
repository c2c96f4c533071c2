"""pycomm's Triton kernels (pycomm/kernels/triton.py) against the CPU ops, bit for bit,
run by Triton's interpreter on this CPU (TRITON_INTERPRET=1, set before the kernels are
defined): the codecs at every block size, the fold for every form, stage, codec,
reduction and mode with 1 to 8 terms, the uncoded fold of float64, integers and bool,
the fused error feedback of the DDP hook, and the layered path running on them. Data
hold NaN, infinities, -0.0, subnormals and values at each codec's saturation edge. The
fold kernel is also compiled for sm_90 (no GPU needed) to check its PTX for approximate
division and fused multiply-adds."""

import random
import re

from _triton_env import DEVICE, NUMPY_WARNINGS, ON_GPU  # first: before Triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Triton is pinned in requirements.txt: wherever these tests run it must import, and
# its absence is a broken environment, a failure, never a skip.
try:
    import triton  # noqa: E402, F401
except ImportError as e:
    raise ImportError("triton is pinned in requirements.txt but does not import (%s): "
                      "pip install -r requirements.txt" % e) from e
pytestmark = NUMPY_WARNINGS

from pycomm import _C, hooks  # noqa: E402
from pycomm.kernels import triton as triton_kernels  # noqa: E402
from pycomm.kernels.triton import Form, Stage  # noqa: E402

from _harness import group_timeout, run_world  # noqa: E402
from _triton_compile import INEXACT_PTX, Launches, compile_sm90, skip_without_compiler  # noqa: E402

CODECS = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
BLOCKS = [16, 32, 64, 128, 256, 512, 1024]
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
# Saturation edges: float32's largest, float16's (and the first value rounding to Inf),
# e4m3's reserved 448 and its finite limit 416, e5m2's largest; the smallest subnormal.
EDGES = [3.4028234663852886e38, -3.4e38, 65504.0, 65520.0, 448.0, 416.0, 464.0, -57344.0, 61440.0, 1e-45, -1e-40]
SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0]


def test_the_kernels_run_where_asked():
    interpreted = type(triton_kernels._fold_kernel).__name__ == "InterpretedFunction"
    assert interpreted != ON_GPU
    if ON_GPU:
        assert torch.cuda.is_available(), "PYCOMM_TRITON_ON_GPU=1 and no CUDA GPU"


def _data(n, dtype, seed, specials=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    scales = torch.tensor([1e-3, 1.0, 3e2, 7e4, 1e-39, 1e30], dtype=torch.float64)
    x *= scales[torch.randint(0, len(scales), (n,), generator=g)]
    if specials and n > 8:  # in some blocks only, so that others keep finite scales
        values = torch.tensor(EDGES + SPECIALS, dtype=torch.float64)
        where = torch.randperm(n, generator=g)[: max(1, n // 40)]
        x[where] = values[torch.randint(0, len(values), (len(where),), generator=g)]
    return x.to(dtype)


def _equal(a, b):
    """Bit for bit, NaN for NaN (a NaN's payload is not part of the contract)."""
    if a.dtype.is_floating_point:
        nan = torch.isnan(a)
        if not torch.equal(nan, torch.isnan(b)):
            return False
        a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _both(out, terms, forms, dtype, n, op, world, exact, codec, block, stage):
    """The CPU ops' and the Triton kernel's outputs for the same call (both on the host)."""
    cpu, tri = out.clone(), out.to(DEVICE)
    _C.fold(cpu, terms, forms, dtype, n, op, world, exact, codec, block, stage)
    triton_kernels.fold(tri, [t.to(DEVICE) for t in terms], forms, dtype, n, op, world, exact, codec, block, stage)
    return cpu, tri.cpu()


def _output(dtype, n, codec, block, stage):
    if stage in (Stage.Encoded, Stage.FinalEncoded):
        return torch.zeros(_C.encoded_size(codec, block, n), dtype=torch.uint8)
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else (torch.uint8 if dtype == torch.bool else dtype)
    return torch.zeros(n, dtype=acc if stage == Stage.Partial else dtype)



@pytest.mark.parametrize("codec", CODECS)
def test_codecs_match_cpu(codec):
    """Encode and decode, every block size (float32) and the smallest and largest
    (16-bit data), lengths that end in a partial block."""
    for dtype in FLOATS:
        for block in BLOCKS if dtype == torch.float32 else [16, 1024]:
            n = 2 * block + 5
            x = _data(n, dtype, block)
            cpu, tri = _both(_output(dtype, n, codec, block, Stage.Encoded), [x], [Form.Input], dtype, n,
                             dist.ReduceOp.SUM, 1, False, codec, block, Stage.Encoded)
            assert torch.equal(cpu, tri), (codec, dtype, block, "encode", (cpu != tri).nonzero()[:5].flatten())
            assert torch.equal(cpu, _C.encode(x, codec, block, None))
            cpu, tri = _both(torch.zeros(n, dtype=dtype), [cpu], [Form.Encoded], dtype, n, dist.ReduceOp.SUM, 1,
                             False, codec, block, Stage.Final)
            assert _equal(cpu, tri), (codec, dtype, block, "decode")


@pytest.mark.parametrize("codec", CODECS)
def test_decodes_every_code(codec):
    """Every code of the codec (all 256, or all 65536), decoded with scale 1 to float32
    (and to the 16-bit types), as the CPU ops decode it."""
    code_bytes = 1 if codec.startswith("fp8") else 2
    n = 1 << (8 * code_bytes)
    block = min(n, 1024)
    piece = torch.zeros(_C.encoded_size(codec, block, n), dtype=torch.uint8)
    codes = torch.arange(n, dtype=torch.int32).to(torch.uint8 if code_bytes == 1 else torch.int16)
    piece[:n * code_bytes] = codes.view(torch.uint8)
    scales_at = n * code_bytes  # a multiple of the piece's alignment already
    piece[scales_at:scales_at + 4 * (n // block)] = torch.ones(n // block).view(torch.uint8)
    for dtype in FLOATS:
        cpu, tri = _both(torch.zeros(n, dtype=dtype), [piece], [Form.Encoded], dtype, n, dist.ReduceOp.SUM, 1,
                         False, codec, block, Stage.Final)
        assert _equal(cpu, tri), (codec, dtype, (cpu.view(torch.uint8) != tri.view(torch.uint8)).nonzero()[:5])


# Near float32's maximum, where a block's largest code times its scale exceeds it: each
# codec's edge, the float32 bits from which values round to the code of float32's maximum
# (a tie, which rounds up to it).
TOP_EDGES = {"fp16": 0x7F7FF000, "bf16": 0x7F7F8000, "fp8_e4m3": 0x7F780000, "fp8_e5m2": 0x7F700000}
FLOAT32_MAX_BITS = 0x7F7FFFFF


def _near_float32_max(blocks, block, seed):
    """float32 values in ``blocks`` blocks of ``block``, in random order and of random signs:
    each block's largest magnitude at, or one ulp either side of, a codec's edge or float32's
    maximum; every edge up to it; random bits from 2^20 below the lowest edge up to it; and
    in every other block NaN, both infinities and -0.0."""
    g = torch.Generator().manual_seed(seed)
    edges = [*TOP_EDGES.values(), FLOAT32_MAX_BITS]
    tops = torch.tensor([e + d for e in edges for d in (-1, 0, 1) if e + d <= FLOAT32_MAX_BITS])
    top = tops[torch.arange(blocks) % len(tops)][:, None]
    low = min(edges) - (1 << 20)
    bits = low + (torch.rand(blocks, block, generator=g, dtype=torch.float64) * (top - low + 1)).long()
    bits[:, 0] = top[:, 0]
    bits[:, 1:len(edges) + 1] = torch.minimum(torch.tensor(edges), top)
    x = (bits.to(torch.int32).view(torch.float32) * (torch.randint(0, 2, bits.shape, generator=g) * 2 - 1))
    x[1::2, -4:] = torch.tensor(SPECIALS)
    return x.gather(1, torch.rand(blocks, block, generator=g).argsort(1)).flatten()


@pytest.mark.parametrize("codec", CODECS)
def test_codecs_saturate_near_float32_max(codec):
    """Blocks near float32's maximum (_near_float32_max), in float32 and bfloat16: encoded,
    decoded and quantized as the CPU ops do, a finite value whose code would decode to
    infinity saturating one code down (numerics.h saturated_code)."""
    block = 16
    for dtype in (torch.float32, torch.bfloat16):
        x = _near_float32_max(28, block, 3)[:-3].to(dtype)  # each largest magnitude twice; a partial block
        n = x.numel()
        cpu, tri = _both(_output(dtype, n, codec, block, Stage.Encoded), [x], [Form.Input], dtype, n,
                         dist.ReduceOp.SUM, 1, False, codec, block, Stage.Encoded)
        assert torch.equal(cpu, tri), (codec, dtype, "encode", (cpu != tri).nonzero()[:5].flatten())
        assert torch.equal(cpu, _C.encode(x, codec, block, None))
        decoded = _C.decode(cpu, codec, block, n, torch.float32)
        cpu, tri = _both(torch.zeros(n, dtype=torch.float32), [cpu], [Form.Encoded], dtype, n, dist.ReduceOp.SUM, 1,
                         False, codec, block, Stage.Partial)
        assert _equal(cpu, tri) and _equal(cpu, decoded), (codec, dtype, "decode")
        cpu, tri = _both(torch.zeros(n, dtype=torch.float32), [x], [Form.Input], dtype, n, dist.ReduceOp.SUM, 1,
                         False, codec, block, Stage.Partial)  # one input, quantized
        assert _equal(cpu, tri) and _equal(cpu, decoded), (codec, dtype, "quantize")
        if dtype == torch.float32:  # the case is met: values at or past the edge come back finite
            saturated = x.isfinite() & (x.abs().view(torch.int32) >= TOP_EDGES[codec])
            assert saturated.sum() >= 16 and decoded[saturated].isfinite().all(), codec


def _op(name):
    # PREMUL_SUM's factor is not a float32: float64 data keep it whole, the others round it.
    return dist._make_nccl_premul_sum(1 / 3) if name == "PREMUL_SUM" else getattr(dist.ReduceOp, name)


def _fold_cases(count, seed):
    """A seeded sample of the fold's space: dtype, codec, stage, reduction, mode, block,
    1 to 8 terms in random forms, lengths that do not fill a block or a program."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        dtype = FLOATS[i % 3]
        codec = ["none", *CODECS][i % 5]
        stages = [Stage.Partial, Stage.Final] + ([Stage.Encoded, Stage.FinalEncoded] if codec != "none" else [])
        stage = stages[(i // 5) % len(stages)]
        op = ["SUM", "AVG", "PREMUL_SUM", "MIN", "MAX", "PRODUCT"][(i // 3) % 6]
        exact = (i // 7) % 2 == 1
        k = 1 + (i % 8)
        forms = [rng.choice([Form.Input, Form.Partial] + ([Form.Encoded] if codec != "none" else []))
                 for _ in range(k)]
        block = rng.choice(BLOCKS)
        n = rng.randint(1, 2 * block + 3) if codec != "none" else rng.randint(1, 2600)
        cases.append((dtype, codec, stage, op, exact, forms, block, n, i))
    return cases


def _terms(forms, dtype, n, codec, block, seed):
    """Operands in the given forms (partial values in float32)."""
    terms = []
    for j, form in enumerate(forms):
        x = _data(n, dtype, 1000 * seed + j)
        if form == Form.Partial:
            x = x.float()
        elif form == Form.Encoded:
            x = _C.encode(x, codec, block, None)
        terms.append(x)
    return terms


# Eight parts, so that the compiled run can build their specializations in parallel.
@pytest.mark.parametrize("part", range(8))
def test_fold_matches_cpu(part):
    for dtype, codec, stage, op, exact, forms, block, n, seed in _fold_cases(160, 7)[part::8]:
        terms = _terms(forms, dtype, n, codec, block, seed)
        out = _output(dtype, n, codec if codec != "none" else "fp16", block, stage)
        cpu, tri = _both(out, terms, forms, dtype, n, _op(op), 8, exact, codec, block, stage)
        assert _equal(cpu, tri), (str(dtype), codec, stage, op, exact, forms, block, n)


@pytest.mark.parametrize("codec", ["none", *CODECS])
def test_exact_fold_of_a_few_elements_matches_cpu(codec):
    """Exact mode at 1 and 3 elements, of 1 and 3 inputs: Triton specializes a count of 1
    as a constant (on one H100, the layered path's exact all-reduce of 1 element over the
    compiled Triton kernels differed from the CPU's); 3, like any count that is neither 1
    nor a multiple of 16, is not specialized."""
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 3):
            for k in (1, 3):
                forms = [Form.Input] * k
                terms = _terms(forms, dtype, n, codec, 64, n + 10 * k)
                stage = Stage.FinalEncoded if codec != "none" else Stage.Final
                out = _output(dtype, n, codec if codec != "none" else "fp16", 64, stage)
                cpu, tri = _both(out, terms, forms, dtype, n, dist.ReduceOp.SUM, k, True, codec, 64, stage)
                assert _equal(cpu, tri), (str(dtype), codec, n, k, cpu.view(-1)[:16].tolist(),
                                          tri.view(-1)[:16].tolist())


def _exchanged(world, rank, dtype, codec, block, n, seed, device):
    """Terms on ``device`` as the layered path's exchange lays them out: every other
    rank's segment a piece of one receive buffer (encoded in slots under a codec), this
    rank's own input in rank order among them."""
    mine = _data(n, dtype, seed).to(device)
    others = [_data(n, dtype, seed + 1 + p) for p in range(world - 1)]
    if codec == "none":
        recv = torch.stack(others).to(device)
        pieces, form = list(recv), Form.Input
    else:
        encoded = [_C.encode(x, codec, block, None) for x in others]
        slot = -(-encoded[0].numel() // 16) * 16
        recv = torch.zeros(len(encoded), slot, dtype=torch.uint8)
        for row, e in zip(recv, encoded):
            row[:e.numel()] = e
        recv = recv.to(device)
        pieces, form = [row[:encoded[0].numel()] for row in recv], Form.Encoded
    terms = pieces[:rank] + [mine] + pieces[rank:]
    forms = [form] * rank + [Form.Input] + [form] * (world - 1 - rank)
    return terms, forms


@pytest.mark.parametrize("world", [9, 130])
def test_fold_of_many_ranks_matches_cpu(world):
    """Past the CUDA kernels' 64 terms, in one launch: the exchange's terms make at most
    three runs whatever the world size, every mode and codec bit-equal to the CPU ops."""
    cases = [(torch.float32, "none", False, "SUM"), (torch.bfloat16, "none", True, "AVG"),
             (torch.float32, "fp8_e4m3", True, "AVG"), (torch.float16, "fp16", False, "SUM"),
             (torch.float32, "bf16", True, "PREMUL_SUM"), (torch.float32, "fp8_e5m2", False, "MAX"),
             (torch.float64, "none", True, "AVG")]
    for i, (dtype, codec, exact, op) in enumerate(cases):
        block, n = 64, 2 * 64 + 3
        rank = [0, world // 2, world - 1][i % 3]
        terms, forms = _exchanged(world, rank, dtype, codec, block, n, 100 * i, DEVICE)
        assert len(triton_kernels._runs(terms, forms)) == (2 if rank in (0, world - 1) else 3)
        stage = Stage.FinalEncoded if codec != "none" else Stage.Final
        cpu = _output(dtype, n, codec if codec != "none" else "fp16", block, stage)
        tri = cpu.to(DEVICE)
        _C.fold(cpu, [t.cpu() for t in terms], forms, dtype, n, _op(op), world, exact, codec, block, stage)
        triton_kernels.fold(tri, terms, forms, dtype, n, _op(op), world, exact, codec, block, stage)
        assert _equal(cpu, tri.cpu()), (world, str(dtype), codec, exact, op)


@pytest.mark.parametrize("codec", CODECS)
def test_fold_over_segments_is_a_fold_per_segment(codec):
    """fold_segments, a codec's step over every segment of a call in one launch, against a
    fold per segment, with the CPU ops and the Triton kernel: segments of whole blocks (an
    all-reduce's) and of any length (a reduce-scatter's), one of them left out, encoded
    into slots (premultiplied, or finalized) and decoded from them (finalized, or partial)."""
    for dtype in FLOATS:
        for count, parts, unit, block in [(1000, 3, 64, 64), (4099, 4, 1, 32), (70, 5, 16, 16), (5, 1, 16, 16)]:
            x = _data(count, dtype, count + parts)
            begins = _C.segment_begins(count, parts, unit)
            pieces = [(begins[s], begins[s + 1] - begins[s]) for s in range(parts)]
            width = -(-max(_C.encoded_size(codec, block, n) for _, n in pieces) // 16) * 16
            for skip in (-1, parts // 2):
                for op, stage in [("PREMUL_SUM", Stage.Encoded), ("AVG", Stage.FinalEncoded)]:
                    expected = torch.zeros(parts * width, dtype=torch.uint8)
                    for s, (first, n) in enumerate(pieces):
                        if s != skip and n:
                            _C.fold(expected[s * width:s * width + _C.encoded_size(codec, block, n)],
                                    [x[first:first + n]], [Form.Input], dtype, n, _op(op), 3, False, codec, block,
                                    stage)
                    for kernels in (_C, triton_kernels):
                        slots = torch.zeros(parts * width, dtype=torch.uint8, device=DEVICE)
                        kernels.fold_segments(x.to(DEVICE), slots, count, parts, unit, skip, width, dtype, _op(op), 3,
                                              False, codec, block, stage)
                        assert torch.equal(slots.cpu(), expected), (kernels.__name__, dtype, count, skip, op)
                for stage in (Stage.Final, Stage.Partial):
                    out_type = dtype if stage == Stage.Final else torch.float32
                    expected = torch.zeros(count, dtype=out_type)
                    for s, (first, n) in enumerate(pieces):
                        if s != skip and n:
                            _C.fold(expected[first:first + n], [slots.cpu()[s * width:][:_C.encoded_size(codec, block,
                                                                                                           n)]],
                                    [Form.Encoded], dtype, n, _op("AVG"), 3, False, codec, block, stage)
                    for kernels in (_C, triton_kernels):
                        plain = torch.zeros(count, dtype=out_type, device=DEVICE)
                        kernels.fold_segments(plain, slots, count, parts, unit, skip, width, dtype, _op("AVG"), 3,
                                              False, codec, block, stage)
                        assert _equal(plain.cpu(), expected), (kernels.__name__, dtype, count, skip, stage)


def test_stamps_written_and_judged_alike():
    """write_stamp and judge_stamps on the CPU and in the Triton kernels: the first
    difference in row order reported (its row and field, both values, this rank's sequence
    number and collective), rows apart by a stride, a row left out, and a verdict kept once
    written (the first disagreement is the one reported)."""
    words = [7, 1 << 40, -3, 11, 5]
    for kernels in (_C, triton_kernels):
        mine = torch.zeros(len(words), dtype=torch.int64, device=DEVICE)
        kernels.write_stamp(mine, words)
        assert mine.cpu().tolist() == words, kernels.__name__
        rows = torch.zeros(70, 8, dtype=torch.int64)
        rows[:, :len(words)] = torch.tensor(words)
        rows[:, len(words):] = 99  # past the stamp: never compared
        verdict = torch.zeros(_C.VERDICT_WORDS, dtype=torch.int64)
        kernels.judge_stamps(rows.to(DEVICE), mine, -1, verdict)
        assert verdict.tolist() == [0] * _C.VERDICT_WORDS, kernels.__name__
        rows[3, 4], rows[65, 2] = 12, 4
        kernels.judge_stamps(rows.to(DEVICE), mine, 3, verdict)
        assert verdict.tolist() == [1, 65, 2, 4, -3, 1 << 40, -3], kernels.__name__
        kernels.judge_stamps(rows.to(DEVICE), mine, -1, verdict)  # kept: the first one found
        assert verdict.tolist() == [1, 65, 2, 4, -3, 1 << 40, -3], kernels.__name__
        verdict.zero_()
        kernels.judge_stamps(rows.to(DEVICE), mine, -1, verdict)
        assert verdict.tolist() == [1, 3, 4, 12, 5, 1 << 40, -3], kernels.__name__


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool])
def test_uncoded_fold_of_other_types_matches_cpu(dtype):
    ops = ["SUM", "AVG", "MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR"]
    if dtype == torch.float64:
        ops = ["SUM", "AVG", "PREMUL_SUM", "MIN", "MAX", "PRODUCT"]
    if dtype == torch.bool:
        ops = ["SUM", "MIN", "MAX", "PRODUCT"]
    for i, op in enumerate(ops):
        k, n = 1 + i % 5, 1 + 997 * i % 2500
        if dtype.is_floating_point:
            terms = [_data(n, dtype, 31 * i + j) for j in range(k)]
        else:
            g = torch.Generator().manual_seed(i)
            terms = [torch.randint(0, 2 if dtype == torch.bool else 100, (n,), generator=g).to(dtype) for _ in range(k)]
        for stage in (Stage.Final, Stage.Partial):
            cpu, tri = _both(_output(dtype, n, "fp16", 16, stage), terms, [Form.Input] * k, dtype, n, _op(op), k,
                             False, "none", 256, stage)
            assert _equal(cpu, tri), (op, stage)


def _wide_float64(n, seed):
    """float64 values over the whole exponent range, subnormals included."""
    g = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-1074, 1000, (n,), generator=g).double()
    return torch.randn(n, generator=g, dtype=torch.float64) * 2.0 ** (exponents / 2) * 2.0 ** (exponents / 2)


def test_exact_fold_of_float64_matches_cpu():
    """Exact mode's 128-bit sums of float64, in two 64-bit words: terms over the whole
    exponent range, cancelling pairs (the remainder far below the largest term), sums
    that round at a tie or overflow, NaN and infinities; every reduction it applies to."""
    n = 1500
    cases = []
    for seed in range(4):
        terms = [_wide_float64(n, 10 * seed + j) for j in range(1 + 2 * seed)]
        cases.append(terms + [-terms[0], terms[0] * 2.0 ** -70])
    one, tiny = torch.ones(n, dtype=torch.float64), torch.full((n,), 2.0 ** -53, dtype=torch.float64)
    cases.append([one, tiny, tiny * 2.0 ** -60, -one * 2.0 ** 60, one * 2.0 ** 60])  # ties, sticky bits
    cases.append([torch.full((n,), 1.5e308, dtype=torch.float64)] * 3 + [_wide_float64(n, 99)])  # overflow
    specials = _wide_float64(n, 7)
    specials[::13], specials[5::17], specials[3::29] = float("inf"), float("-inf"), float("nan")
    cases.append([_wide_float64(n, 8), specials, -specials.flip(0)])
    for i, terms in enumerate(cases):
        for op in ("SUM", "AVG", "PREMUL_SUM"):
            for stage in (Stage.Final, Stage.Partial):
                cpu, tri = _both(torch.zeros(n, dtype=torch.float64), terms, [Form.Input] * len(terms), torch.float64,
                                 n, _op(op), len(terms), True, "none", 256, stage)
                assert _equal(cpu, tri), (i, op, stage, (cpu.view(torch.int64) != tri.view(torch.int64)).sum())


@pytest.mark.parametrize("codec", CODECS)
def test_fused_error_feedback_matches_the_hook(codec):
    block = _C.default_compression_block()
    for dtype in FLOATS:
        for with_residual in (False, True):
            n = 3 * block + 7
            grad = _data(n, dtype, 5)
            residual = _data(n, torch.float32, 6, specials=False) * 1e-3 if with_residual else None
            cpu_buf, tri_buf = grad.clone(), grad.to(DEVICE)
            cpu_residual = hooks._error_feedback(cpu_buf, residual, codec)
            tri_residual = triton_kernels.error_feedback(tri_buf, None if residual is None else residual.to(DEVICE),
                                                         codec, block)
            assert _equal(cpu_buf, tri_buf.cpu()), (codec, dtype, with_residual, "bucket")
            assert _equal(cpu_residual, tri_residual.cpu()), (codec, dtype, with_residual, "residual")


# What the CPU fold has no counterpart of: approximate division (div.full is within 2 ulp),
# approximate reciprocals, fused multiply-adds of floats (integer mad.lo is addressing).
# Launches that cover each division, premul conversion, codec and exact path of the fold:
# dtype, reduction, stage, codec, exact, term forms, world size (1, which Triton would
# otherwise compile as a constant).
COMPILED_FOLDS = [
    (torch.float32, "AVG", Stage.Final, "none", False, [Form.Input, Form.Partial], 8),
    (torch.float32, "AVG", Stage.FinalEncoded, "fp8_e4m3", True, [Form.Input, Form.Encoded], 8),
    (torch.float32, "PREMUL_SUM", Stage.Partial, "none", True, [Form.Input, Form.Input], 3),
    (torch.bfloat16, "PREMUL_SUM", Stage.Final, "fp8_e5m2", False, [Form.Input, Form.Input], 2),
    (torch.float16, "AVG", Stage.Final, "bf16", False, [Form.Encoded, Form.Input], 1),
    (torch.float64, "AVG", Stage.Final, "none", False, [Form.Input, Form.Input], 3),
    (torch.float64, "PREMUL_SUM", Stage.Partial, "none", False, [Form.Input, Form.Input], 3),
    (torch.float64, "AVG", Stage.Final, "none", True, [Form.Input, Form.Partial], 5),
]
# World sizes whose layered folds must compile to one kernel (counts that are not
# multiples of 16, which Triton specializes on, as it does on a count of 1).
SAME_KERNEL_WORLDS = [9, 67, 130]
# A codec's steps over every segment of a call (fold_segments).
COMPILED_SEGMENT_STEPS = [("segments", Stage.Encoded), ("segments", Stage.Final)]
def test_compiled_fold_divides_and_multiplies_as_the_cpu(monkeypatch):
    """The fold kernel compiled for sm_90 without a GPU, for the arguments ``fold`` launches
    it with: its PTX divides correctly rounded (div.rn) and fuses no multiply-add."""
    skip_without_compiler()
    launches = Launches()
    monkeypatch.setattr(triton_kernels, "_fold_kernel", launches)
    n, block = 100, 64
    for dtype, op, stage, codec, exact, forms, world in COMPILED_FOLDS:
        out = _output(dtype, n, codec if codec != "none" else "fp16", block, stage)
        triton_kernels.fold(out, _terms(forms, dtype, n, codec, block, 0), forms, dtype, n, _op(op), world, exact,
                            codec, block, stage)
    for world in SAME_KERNEL_WORLDS:  # the exchange's terms at a middle rank, exact fp8
        terms, forms = _exchanged(world, world // 2, torch.float32, "fp8_e4m3", block, n, 0, "cpu")
        out = _output(torch.float32, n, "fp8_e4m3", block, Stage.FinalEncoded)
        triton_kernels.fold(out, terms, forms, torch.float32, n, _op("AVG"), world, True, "fp8_e4m3", block,
                            Stage.FinalEncoded)
    slots = torch.zeros(3 * 128, dtype=torch.uint8)
    for _, stage in COMPILED_SEGMENT_STEPS:  # every segment encoded, and decoded, in one launch
        triton_kernels.fold_segments(torch.zeros(n, dtype=torch.bfloat16), slots, n, 3, block, 1, 128,
                                     torch.bfloat16, _op("PREMUL_SUM"), 3, False, "fp8_e4m3", block, stage)
    ptxs = [ptx for _, ptx in compile_sm90({"pycomm.kernels.triton:_fold_kernel": launches})]
    for case, ptx in zip(COMPILED_FOLDS + SAME_KERNEL_WORLDS + COMPILED_SEGMENT_STEPS, ptxs, strict=True):
        assert not INEXACT_PTX.search(ptx), (case, sorted(set(INEXACT_PTX.findall(ptx))))
        if case in SAME_KERNEL_WORLDS or case[1] == "AVG":
            assert re.search(r"\bdiv\.rn\.f(?:32|64)\b", ptx), case
    assert len(set(ptxs[len(COMPILED_FOLDS):len(COMPILED_FOLDS) + len(SAME_KERNEL_WORLDS)])) == 1, \
        "the fold kernel differs between world sizes"


def test_compiled_codecs_move_codes_in_wide_accesses(monkeypatch):
    """Code layout 2 (codes from a piece's 16-byte-aligned start, scales after them): the
    encoder compiled for sm_90 stores, and the decoder loads, each thread's codes in one
    access of 8 bytes (fp8) or 16 (fp16), where layout 1's codes, 4 bytes past each scale,
    took 4-byte accesses."""
    skip_without_compiler()
    launches = Launches()
    monkeypatch.setattr(triton_kernels, "_fold_kernel", launches)
    n, block, sum_ = 1 << 16, 256, dist.ReduceOp.SUM
    for codec in ("fp8_e4m3", "fp16"):
        x = torch.randn(n)
        enc = torch.zeros(_C.encoded_size(codec, block, n), dtype=torch.uint8)
        triton_kernels.fold(enc, [x], [Form.Input], torch.float32, n, sum_, 1, False, codec, block, Stage.Encoded)
        triton_kernels.fold(x, [enc], [Form.Encoded], torch.float32, n, sum_, 1, False, codec, block, Stage.Final)
    compiled = compile_sm90({"pycomm.kernels.triton:_fold_kernel": launches})
    encode8, decode8, encode16, decode16 = (ptx for _, ptx in compiled)
    for ptx, access in ((encode8, r"st\.global\.v2\.b32"), (decode8, r"ld\.global\.v2\.b32"),
                        (encode16, r"st\.global\.v4\.b32"), (decode16, r"ld\.global\.v4\.b32")):
        assert re.search(r"\b" + access + r"\b", ptx), access
    # fp16 codes are rounded by the conversion instruction (numerics.py _encode).
    assert re.search(r"\bcvt\.rn\.f16(?:x2)?\.f32\b", encode16)


def test_compiled_stamp_kernels(monkeypatch):
    """The stamps' kernels compiled for sm_90, as write_stamp and judge_stamps launch them:
    the words as arguments, the verdict released to the host."""
    skip_without_compiler()
    launches = {"pycomm.kernels.triton:_write_words_kernel": Launches(),
                "pycomm.kernels.triton:_judge_kernel": Launches()}
    for name, recorded in launches.items():
        monkeypatch.setattr(triton_kernels, name.split(":")[1], recorded)
    triton_kernels.write_stamp(torch.zeros(10, dtype=torch.int64), list(range(10)))
    triton_kernels.judge_stamps(torch.zeros(4, 10, dtype=torch.int64), torch.zeros(10, dtype=torch.int64), -1,
                                torch.zeros(_C.VERDICT_WORDS, dtype=torch.int64))
    (_, write), (_, judge) = compile_sm90(launches)
    assert len(re.findall(r"\bst\.global\.b64\b", write)) == 10, write  # one store per word, from the arguments
    assert re.search(r"\batom\.global\.sys\.release\.exch\.b64\b", judge), judge  # the verdict's first word last


def layered_on_triton_world(rank, ws, device_path):
    """The layered path over gloo with the Triton kernels (interpreted) in place of the
    CPU ops, in one shot and in the direct algorithm (pairwise, or with ``device_path``
    the device's: layout.on_device made true, its stamps written and judged by the
    Triton kernels, its codec steps over every segment at once): the native path's bits."""
    import pycomm
    from pycomm.layered import layout  # whose _Layout reads kernels_for

    layout.kernels_for = lambda device, choice: triton_kernels
    if device_path:
        layout.on_device = lambda device: True
    gloo = dist.new_group(backend="gloo", timeout=group_timeout())
    problems, ran = [], set()
    for i, (dtype, codec, mode, count) in enumerate([
            (torch.float32, None, "exact", 700), (torch.bfloat16, "fp8_e4m3", True, 700),
            (torch.float32, "fp16", "exact", 700), (torch.float16, None, True, 700),
            (torch.float32, "fp8_e4m3", "exact", 30001), (torch.bfloat16, "bf16", True, 12001)]):
        x = _data(count, dtype, 10 * i + rank, specials=False)
        native, over_gloo = x.clone(), x.clone()
        pycomm.all_reduce(native, dist.ReduceOp.AVG, compression=codec, deterministic=mode)
        work = pycomm.all_reduce(over_gloo, dist.ReduceOp.AVG, group=gloo, compression=codec, deterministic=mode,
                                 async_op=True)
        work.wait()
        ran.add(work.algorithm)
        if not _equal(native, over_gloo):
            problems.append((str(dtype), codec, mode, count))
    return problems, ran


@pytest.mark.skipif(ON_GPU, reason="on a GPU, tests/test_cuda.py runs the layered path on the compiled kernels")
@pytest.mark.parametrize("device_path", [False, True])
def test_layered_path_on_triton_kernels(device_path):
    direct = "layered-direct" if device_path else "layered-pairwise"
    for problems, ran in run_world(layered_on_triton_world, 3, args=(device_path,), env={"TRITON_INTERPRET": "1"},
                                   timeout=240):
        assert not problems, problems
        assert ran == {"layered-oneshot over gloo", f"{direct} over gloo"}, ran
