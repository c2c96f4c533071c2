"""pycomm's wire codecs, one process, no collectives: pycomm.encode / decode / quantize.

Compressed all-reduce quantizes every contribution with these codecs (docs/design.md,
'Numerics'), so the multi-rank tests in test_compression.py can only see their errors through
sums. Here each codec is checked against an independent model of its wire format,
built from torch's own casts:

* The encoding is every element's code (2 bytes per element for fp16/bf16, 1 for fp8),
  then every block's little-endian fp32 scale 2^e, each array starting on a 16-byte
  boundary and the whole a multiple of 16 bytes, padded with zeros. e is the smallest in
  [-126, 126] with (largest finite |x| of the block) / 2^e <= target (65504 for fp16,
  416 for fp8_e4m3, 57344 for fp8_e5m2; bf16 is unscaled). The codes are bit for bit
  torch's cast of x * 2^-e, and decode is the code's value times the scale. Checked on
  data with a wide dynamic range, on blocks whose scale is 1 (plain torch casts), and on
  values in the formats' subnormal ranges (round to nearest even included).
* NaN and +-Inf keep their kind and sign and do not enter the scale: a block's finite
  neighbours quantize as if they were zeros.
* Nothing overflows or wraps across float32's range; the error is within half an ulp of
  the format (relative bound where the scaled value is normal, absolute in the subnormal
  range). Signed zeros, empty and odd-sized tensors, short last blocks.
* quantize is idempotent and keeps shape and dtype; bad dtypes, codecs, block sizes and
  encoded buffers are rejected with ValueError; PYCOMM_COMPRESSION_BLOCK is the default.
* Relative RMS error of one quantization of Gaussian data within the contract's bounds.

The CPU codecs run vectorized (AVX2 with F16C, AVX-512) where the CPU has them, the scalar
path being their specification: every path this CPU runs must write the scalar path's bits
(encode, decode to every dtype, the folds that quantize, decode and encode) for both signs of
every float32 exponent at every rounding position, every 16-bit input and every code.

Near float32's maximum the nearest code can decode beyond it; the codec saturates such
codes one step down, so finite values never come back infinite (bf16 included, where
torch's own cast would give Inf).
"""

import math
import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _harness import is_gloo

if is_gloo():
    pytest.skip("the codecs are pycomm's", allow_module_level=True)

import pycomm  # noqa: E402

CODECS = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
SCALED = ["fp16", "fp8_e4m3", "fp8_e5m2"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCKS = [16, 256, 1024]

FLT_MAX = float(torch.finfo(torch.float32).max)
FLT_MIN = float(torch.finfo(torch.float32).tiny)  # 2^-126


class Fmt:
    """What the test knows of a code format, independently of pycomm."""

    def __init__(self, torch_dtype, code_bytes, mant_bits, min_exp, target, inf_code):
        self.torch_dtype = torch_dtype   # torch's cast defines the codes
        self.code_bytes = code_bytes
        self.mant_bits = mant_bits       # explicit mantissa bits
        self.min_exp = min_exp           # exponent of the smallest normal
        self.target = target             # largest scaled finite magnitude (None: unscaled)
        self.inf_code = inf_code         # the code of +Inf (sign bit added for -Inf)

    @property
    def sign_bit(self):
        return 1 << (8 * self.code_bytes - 1)

    @property
    def min_normal(self):
        return 2.0 ** self.min_exp

    @property
    def sub_step(self):  # spacing of the subnormals
        return 2.0 ** (self.min_exp - self.mant_bits)

    @property
    def rel_bound(self):  # half an ulp, relative, for a normal value
        return 2.0 ** -(self.mant_bits + 1)


FMT = {
    "fp16": Fmt(torch.float16, 2, 10, -14, 65504.0, 0x7C00),
    "bf16": Fmt(torch.bfloat16, 2, 7, -126, None, 0x7F80),
    "fp8_e4m3": Fmt(torch.float8_e4m3fn, 1, 3, -6, 416.0, 0x7E),
    "fp8_e5m2": Fmt(torch.float8_e5m2, 1, 2, -14, 57344.0, 0x7C),
}

# Relative RMS error bounds of docs/design.md, 'Numerics' (single quantization here).
RMS_BOUND = {"fp16": 1e-3, "bf16": 5e-3, "fp8_e4m3": 6e-2, "fp8_e5m2": 1.2e-1}

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


# ---- the model ----

def _gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _bits(t):
    """The bit patterns of a float tensor, as numpy integers."""
    return t.contiguous().view(_INT_VIEW[t.dtype]).numpy()


def _blocks(n, block):
    return [(b, min(block, n - b)) for b in range(0, n, block)]


def _spec_exponent(amax, codec):
    """e of the scale 2^e the format prescribes for a block whose largest finite
    magnitude is amax (a Python float, exact)."""
    target = FMT[codec].target
    if target is None or not amax > 0:
        return 0
    _, p = math.frexp(amax)          # amax < 2^p
    e = max(-126, p - 40)            # amax / 2^(p-40) >= 2^39 > target: too small (or -126)
    while e < 126 and math.ldexp(amax, -e) > target:
        e += 1
    return e


def _block_exponents(xf, codec, block):
    """Spec exponent of each block of the flat float32 tensor xf."""
    out = []
    for b, m in _blocks(xf.numel(), block):
        seg = xf[b:b + m].double()
        fin = seg[torch.isfinite(seg)].abs()
        out.append(_spec_exponent(fin.max().item() if fin.numel() else 0.0, codec))
    return out


def _expected(x, codec, block):
    """(exponents, codes, decoded float32) the format prescribes for x (flat)."""
    f = FMT[codec]
    xf = x.reshape(-1).float()
    exps = _block_exponents(xf, codec, block)
    inv = torch.empty(xf.numel(), dtype=torch.float32)
    scale = torch.empty(xf.numel(), dtype=torch.float32)
    for (b, m), e in zip(_blocks(xf.numel(), block), exps):
        inv[b:b + m] = 2.0 ** -e
        scale[b:b + m] = 2.0 ** e
    cast = (xf * inv).to(f.torch_dtype)    # x * 2^-e is exact in float32
    codes = cast.view(torch.uint8 if f.code_bytes == 1 else torch.int16).numpy()
    codes = codes.view(np.uint8 if f.code_bytes == 1 else np.uint16)
    decoded = cast.float() * scale
    return exps, codes, decoded


def _parse(enc, codec, n, block):
    """(scales, codes) of an encoded buffer; checks its layout, length and zero padding."""
    f = FMT[codec]
    assert enc.dtype == torch.uint8 and enc.dim() == 1, "encode must return a 1-D uint8 tensor"
    raw = enc.numpy().tobytes()
    nblocks = (n + block - 1) // block
    code_end, scales_at = n * f.code_bytes, _aligned(n * f.code_bytes)
    scales_end = scales_at + 4 * nblocks
    assert len(raw) == scales_at + _aligned(4 * nblocks), (
        "%s: %d elements in blocks of %d must take %d bytes, got %d"
        % (codec, n, block, scales_at + _aligned(4 * nblocks), len(raw)))
    assert not any(raw[code_end:scales_at]) and not any(raw[scales_end:]), "%s: padding not zero" % codec
    code_type = np.dtype("<u1" if f.code_bytes == 1 else "<u2")
    scales = [float(s) for s in np.frombuffer(raw, "<f4", nblocks, scales_at)]
    codes = np.frombuffer(raw, code_type, n, 0)
    return scales, codes.astype(np.uint8 if f.code_bytes == 1 else np.uint16)


def _aligned(nbytes):
    """Both arrays of an encoding start on a 16-byte boundary; its length is a multiple of 16."""
    return -(-nbytes // 16) * 16


def _first_mismatch(got, exp):
    bad = np.nonzero(got != exp)[0]
    return (int(bad[0]), int(bad.size)) if bad.size else (None, 0)


def check_encoding(x, codec, block, what=""):
    """Asserts that encode/decode/quantize of x follow the format bit for bit at every
    finite element (non-finite ones are the NaN/Inf test's business)."""
    what = "%s %s block=%d %s" % (codec, str(x.dtype).replace("torch.", ""), block, what)
    f = FMT[codec]
    flat = x.reshape(-1)
    n = flat.numel()
    enc = pycomm.encode(x, codec, block)
    scales, codes = _parse(enc, codec, n, block)
    exps, exp_codes, exp_dec = _expected(x, codec, block)

    for i, (s, e) in enumerate(zip(scales, exps)):
        assert s > 0 and math.frexp(s)[0] == 0.5, "%s: block %d scale %r is not a power of two" % (what, i, s)
        got_e = math.frexp(s)[1] - 1
        assert -126 <= got_e <= 126, "%s: block %d scale 2^%d outside [2^-126, 2^126]" % (what, i, got_e)
        if got_e != e:
            b = i * block
            seg = flat[b:b + block].float()
            amax = seg[torch.isfinite(seg)].abs().max().item() if torch.isfinite(seg).any() else 0.0
            raise AssertionError(
                "%s: block %d (largest finite |x| = %r) has scale 2^%d; the format prescribes 2^%d, "
                "the smallest with max/2^e <= %r" % (what, i, amax, got_e, e, f.target))

    finite = torch.isfinite(flat.float()).numpy()
    i, count = _first_mismatch(codes[finite], exp_codes[finite])
    if i is not None:
        j = int(np.nonzero(finite)[0][i])
        raise AssertionError(
            "%s: %d codes differ from torch's cast of x * 2^-e; first at element %d: x=%r, "
            "scale 2^%d, code 0x%x, torch gives 0x%x"
            % (what, count, j, flat[j].item(), exps[j // block], codes[j], exp_codes[j]))
    if f.torch_dtype == torch.float8_e4m3fn:
        assert ((codes[finite] & 0x7F) <= 0x7D).all(), "%s: a finite value used e4m3's Inf/NaN code" % what

    dec = pycomm.decode(enc, codec, n, block=block)
    assert dec.dtype == torch.float32 and dec.shape == (n,)
    i, count = _first_mismatch(_bits(dec)[finite], _bits(exp_dec)[finite])
    if i is not None:
        j = int(np.nonzero(finite)[0][i])
        raise AssertionError("%s: %d decoded values differ from code * scale; first at element %d: "
                             "x=%r, got %r, expected %r" % (what, count, j, flat[j].item(),
                                                           dec[j].item(), exp_dec[j].item()))
    q = pycomm.quantize(x, codec, block)
    assert q.dtype == x.dtype and q.shape == x.shape, "%s: quantize changed dtype/shape" % what
    exp_q = exp_dec.to(x.dtype)
    i, count = _first_mismatch(_bits(q.reshape(-1))[finite], _bits(exp_q)[finite])
    if i is not None:
        j = int(np.nonzero(finite)[0][i])
        raise AssertionError("%s: %d quantized values differ from decode(encode(x)) in x's dtype; "
                             "first at element %d: x=%r, got %r, expected %r"
                             % (what, count, j, flat[j].item(), q.reshape(-1)[j].item(), exp_q[j].item()))
    return exps, codes


def _rounds_to_half_target(xf, codec, block):
    """Blocks whose largest finite magnitude rounds down to exactly target / 2 at the
    prescribed scale, so that scale / 2 would fit the *quantized* block (an encoder that
    takes the scale from quantized values gets these wrong)."""
    f = FMT[codec]
    if f.target is None:
        return []
    out = []
    for (b, m), e in zip(_blocks(xf.numel(), block), _block_exponents(xf, codec, block)):
        seg = xf[b:b + m].double()
        fin = seg[torch.isfinite(seg)].abs()
        if e > -126 and fin.numel() and fin.max().item() > 0:
            q = torch.tensor(math.ldexp(fin.max().item(), -e), dtype=torch.float32).to(f.torch_dtype).float()
            if 2 * q.item() <= f.target:
                out.append(b // block)
    return out


def _half_target_peak(codec):
    """A magnitude just above target / 2 that the format, at scale 1, rounds down to it."""
    f = FMT[codec]
    step = 2.0 ** (math.frexp(f.target / 2)[1] - 1 - f.mant_bits)
    return f.target / 2 + step / 4


def _wide_range(codec, dtype, block, n, lo=-8.0, hi=8.0):
    """randn * 10^u with u uniform in [lo, hi] per block, in dtype."""
    g = _gen("wide", codec, str(dtype), block, n, lo, hi)
    nb = (n + block - 1) // block
    mag = 10.0 ** (torch.rand(nb, generator=g, dtype=torch.float64) * (hi - lo) + lo)
    return (torch.randn(n, generator=g, dtype=torch.float64) * mag.repeat_interleave(block)[:n]).to(dtype)


# Per input dtype, the decades random data may span (float16 holds ~6e-8 .. 65504).
RANGE = {torch.float32: (-8.0, 8.0), torch.bfloat16: (-8.0, 8.0), torch.float16: (-4.0, 3.5)}

combos = pytest.mark.parametrize("block", BLOCKS)
all_dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
all_codecs = pytest.mark.parametrize("codec", CODECS)


# ---- 1. the format, bit for bit, on wide-range data ----

@all_codecs
@all_dtypes
@combos
def test_encoding_is_torch_cast_of_scaled_value(codec, dtype, block):
    n = 5 * block + block // 2 + 3   # short last block
    x = _wide_range(codec, dtype, block, n, *RANGE[dtype])
    exps, _ = check_encoding(x, codec, block, "wide-range data")
    if FMT[codec].target is not None:
        assert len(set(exps)) > 1, "test data: every block got the same scale"


# ---- 2. scale 1: the codecs are torch's plain casts ----

# Per codec, block maxima that give scale 1: in (target/2, target], away from the values
# that round down to target/2, and representable closely enough in every input dtype.
UNIT_SCALE_MAX = {"fp16": (33000.0, 65000.0), "bf16": (1.0, 1e4),
                  "fp8_e4m3": (220.0, 410.0), "fp8_e5m2": (31000.0, 57000.0)}


@all_codecs
@all_dtypes
@combos
def test_unit_scale_is_plain_torch_cast(codec, dtype, block):
    f = FMT[codec]
    g = _gen("unit", codec, str(dtype), block)
    n = 4 * block + 5
    lo, hi = UNIT_SCALE_MAX[codec]
    nb = (n + block - 1) // block
    amax = torch.rand(nb, generator=g, dtype=torch.float64) * (hi - lo) + lo
    x64 = torch.randn(n, generator=g, dtype=torch.float64) * (amax / 4).repeat_interleave(block)[:n]
    x64 *= 10.0 ** -(torch.rand(n, generator=g, dtype=torch.float64) * 6)   # reach the small codes
    x64 = torch.maximum(torch.minimum(x64, amax.repeat_interleave(block)[:n]), -amax.repeat_interleave(block)[:n])
    idx = torch.arange(0, n, block)
    x64[idx] = amax * torch.where(torch.rand(nb, generator=g) < 0.5, -1.0, 1.0).double()
    if f.target is not None and torch.tensor(f.target, dtype=dtype).item() == f.target:
        x64[0], x64[1] = f.target, -f.target        # the largest finite code, both signs
    x = x64.to(dtype)
    scales, _ = _parse(pycomm.encode(x, codec, block), codec, n, block)
    assert all(s == 1.0 for s in scales), "%s %s: block maxima in (target/2, target] must give scale 1, got %s" % (
        codec, dtype, sorted(set(scales)))
    expected = x.float().to(f.torch_dtype).float().to(dtype)
    got = pycomm.quantize(x, codec, block)
    i, count = _first_mismatch(_bits(got), _bits(expected))
    assert i is None, "%s %s: with scale 1 quantize must equal x.to(%s); %d differ, first x=%r: got %r, torch %r" % (
        codec, dtype, f.torch_dtype, count, x[i].item(), got[i].item(), expected[i].item())
    check_encoding(x, codec, block, "unit-scale data")


# ---- 3. NaN and Inf ----

@all_codecs
@all_dtypes
@combos
def test_nan_inf_keep_position_and_leave_neighbours_alone(codec, dtype, block):
    f = FMT[codec]
    n = 4 * block + 7
    x = _wide_range(codec, dtype, block, n, *RANGE[dtype]).clone()
    g = _gen("naninf", codec, str(dtype), block)
    pos = torch.randperm(n, generator=g)[: max(3, n // 30)]
    kinds = torch.randint(0, 3, (pos.numel(),), generator=g)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    x[pos] = specials[kinds]
    x[0] = float("inf")                       # next to the first block's largest values
    x[block:2 * block] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype).repeat(block)[:block]
    x[2 * block + 1] = -float("inf")          # a single one in an otherwise finite block

    q = pycomm.quantize(x, codec, block)
    for name, mask_x, mask_q in [
            ("NaN", torch.isnan(x), torch.isnan(q)),
            ("+Inf", x == float("inf"), q == float("inf")),
            ("-Inf", x == -float("inf"), q == -float("inf"))]:
        assert torch.equal(mask_x, mask_q), "%s %s block=%d: %s positions differ: input %s, quantized %s" % (
            codec, dtype, block, name, mask_x.nonzero().flatten()[:8].tolist(), mask_q.nonzero().flatten()[:8].tolist())

    finite = torch.isfinite(x)
    cleaned = torch.where(finite, x, torch.zeros_like(x))
    q0 = pycomm.quantize(cleaned, codec, block)
    i, count = _first_mismatch(_bits(q)[finite.numpy()], _bits(q0)[finite.numpy()])
    if i is not None:
        j = int(finite.nonzero().flatten()[i])
        raise AssertionError(
            "%s %s block=%d: a non-finite value changed its finite block neighbours: %d differ; first at %d, "
            "x=%r: %r with NaN/Inf around, %r with zeros instead" % (codec, dtype, block, count, j, x[j].item(),
                                                                   q[j].item(), q0[j].item()))

    scales, codes = _parse(pycomm.encode(x, codec, block), codec, n, block)
    scales0, _ = _parse(pycomm.encode(cleaned, codec, block), codec, n, block)
    assert scales == scales0, "%s %s block=%d: NaN/Inf entered the block scales: %s vs %s" % (
        codec, dtype, block, scales, scales0)
    assert scales[1] == 1.0, "%s: a block without finite values must have scale 1, got %r" % (codec, scales[1])
    pinf, ninf = (x == float("inf")).numpy(), (x == -float("inf")).numpy()
    assert (codes[pinf] == f.inf_code).all(), "%s: +Inf must encode as 0x%x, got %s" % (
        codec, f.inf_code, sorted({hex(c) for c in codes[pinf]}))
    assert (codes[ninf] == f.inf_code | f.sign_bit).all(), "%s: -Inf must encode as 0x%x, got %s" % (
        codec, f.inf_code | f.sign_bit, sorted({hex(c) for c in codes[ninf]}))
    check_encoding(x, codec, block, "with NaN/Inf")   # the finite elements, bit for bit


# ---- 4. no overflow across float32's range, error within half an ulp ----

@all_codecs
@combos
def test_float32_range_neither_overflows_nor_loses_precision(codec, block):
    f = FMT[codec]
    g = _gen("range", codec, block)
    n = 12 * block + 5
    nb = (n + block - 1) // block
    lo, hi = math.log10(1e-38), math.log10(3e38)
    # Half the blocks span the whole range, half a few decades around a random centre.
    u = torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo
    centre = (torch.rand(nb, generator=g, dtype=torch.float64) * (hi - lo - 3) + lo + 3).repeat_interleave(block)[:n]
    narrow = (torch.arange(n) // block) % 2 == 1
    u = torch.where(narrow, centre - torch.rand(n, generator=g, dtype=torch.float64) * 3, u)
    x64 = 10.0 ** u * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    x64[:6] = torch.tensor([3e38, -3e38, 1e-38, -1e-38, FLT_MIN, -3e38])
    x = x64.float()
    assert torch.isfinite(x).all()

    q = pycomm.quantize(x, codec, block)
    assert torch.isfinite(q).all(), "%s block=%d: finite inputs quantized to Inf/NaN at %s (x=%s)" % (
        codec, block, (~torch.isfinite(q)).nonzero().flatten()[:5].tolist(), x[~torch.isfinite(q)][:5].tolist())
    nz = q != 0
    assert torch.equal(torch.signbit(q[nz]), torch.signbit(x[nz])), "%s: quantization flipped a sign" % codec

    # Round to nearest: |q - x| <= half an ulp, i.e. rel_bound * |x| where the scaled value
    # is a normal number of the format, half a subnormal step * 2^e below that.
    exps = torch.tensor(_block_exponents(x, codec, block), dtype=torch.float64).repeat_interleave(block)[:n]
    scale = 2.0 ** exps
    xd, qd = x.double(), q.double()
    normal = xd.abs() >= f.min_normal * scale
    err = (qd - xd).abs()
    allowed = torch.where(normal, f.rel_bound * xd.abs(), 0.5 * f.sub_step * scale)
    worst = (err / allowed).max().item()
    assert normal.sum() > n // 3, "test data: too few values in the format's normal range"
    assert worst <= 1.0, "%s block=%d: error exceeds half an ulp by a factor %.3g (x=%r -> %r)" % (
        codec, block, worst, x[(err / allowed).argmax()].item(), q[(err / allowed).argmax()].item())
    rel = (err[normal] / xd.abs()[normal]).max().item()
    assert rel <= f.rel_bound, "%s: relative error %.3g > %.3g" % (codec, rel, f.rel_bound)


@pytest.mark.parametrize("codec", CODECS)
def test_no_overflow_up_to_float32_max(codec):
    x = torch.tensor([FLT_MAX, -FLT_MAX, 3.3e38, -3.3e38, 3.2e38, 1.0], dtype=torch.float32)
    q = pycomm.quantize(x, codec, 16)
    assert torch.isfinite(q).all(), "%s: %s quantized to %s" % (codec, x.tolist(), q.tolist())


# ---- 5. the formats' subnormals ----

@all_codecs
@all_dtypes
@combos
def test_subnormals_match_torch_cast(codec, dtype, block):
    f = FMT[codec]
    if codec == "bf16" and dtype == torch.float16:
        pytest.skip("float16 cannot hold bf16's subnormals (below 2^-126)")
    g = _gen("sub", codec, str(dtype), block)
    if f.target is None:
        shifts = [0]
        peak_mant = 1.0
    else:
        # Block maximum 1.5 * 2^(t+s), t = exponent of the target: scale exactly 2^s. The
        # shifts span what the input dtype holds: the maximum below its largest value, the
        # format's subnormal step times 2^s at or above its smallest subnormal.
        t = math.frexp(f.target)[1] - 1
        peak_mant = 1.5 * 2.0 ** t
        finfo = torch.finfo(dtype)
        smallest = math.frexp(finfo.smallest_normal * finfo.eps)[1] - 1    # smallest subnormal: 2^smallest
        s_lo = max(-126, smallest - (f.min_exp - f.mant_bits))
        s_hi = min(126, math.frexp(finfo.max)[1] - 1 - t)
        shifts = sorted({s for s in (s_lo, s_lo // 2, 0, s_hi // 2, s_hi) if s_lo <= s <= s_hi})
    for s in shifts:
        sc = 2.0 ** s
        m = block + 3
        # Uniform in the subnormal range, exact ties between subnormals (round to even),
        # exact subnormals, and the tie just below the smallest normal.
        k = torch.arange(m, dtype=torch.float64)
        u = torch.rand(m, generator=g, dtype=torch.float64) * f.min_normal
        ties = (k % (2 ** f.mant_bits) + 0.5) * f.sub_step
        exact = (k % (2 ** f.mant_bits)) * f.sub_step
        vals = torch.where(k % 3 == 0, u, torch.where(k % 3 == 1, ties, exact))
        vals[1] = f.min_normal - f.sub_step / 2
        sign = torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0).double()
        x64 = vals * sign * sc
        x64[0] = peak_mant * sc
        x = x64.to(dtype)
        what = "subnormals at scale 2^%d" % s
        exps, codes = check_encoding(x, codec, block, what)
        if f.target is not None:
            assert exps[0] == s, "test data: expected scale 2^%d, the format gives 2^%d" % (s, exps[0])
        mag = codes.astype(np.int64) & (f.sign_bit - 1)
        subnormal = (mag > 0) & (mag < (1 << f.mant_bits))
        assert subnormal.sum() >= m // 4, "%s %s: %s: only %d of %d codes are subnormal" % (
            codec, dtype, what, subnormal.sum(), m)


# ---- 6. zeros, empty and odd sizes ----

@all_codecs
@all_dtypes
@combos
def test_signed_zeros_and_zero_blocks(codec, dtype, block):
    f = FMT[codec]
    n = 3 * block
    x = torch.zeros(n, dtype=dtype)
    x[1::2] = -0.0                                   # block 0: +0/-0 only
    x[block:2 * block] = torch.randn(block, generator=_gen("z", codec, block)).to(dtype)
    x[block + 3], x[block + 4] = -0.0, 0.0          # zeros among values
    x[2 * block:] = -0.0                             # block 2: all -0
    scales, codes = _parse(pycomm.encode(x, codec, block), codec, n, block)
    assert scales[0] == 1.0 and scales[2] == 1.0, "%s: all-zero blocks must have scale 1, got %s" % (codec, scales)
    zero = (x == 0).numpy()
    neg = torch.signbit(x).numpy()
    assert (codes[zero & neg] == f.sign_bit).all() and (codes[zero & ~neg] == 0).all(), (
        "%s: zeros must encode as 0 / sign bit" % codec)
    q = pycomm.quantize(x, codec, block)
    assert torch.equal(torch.signbit(q[x == 0]), torch.signbit(x[x == 0])) and (q[x == 0] == 0).all(), (
        "%s %s: zeros must stay zeros with their sign" % (codec, dtype))
    check_encoding(x, codec, block, "zeros")


@all_codecs
@all_dtypes
@pytest.mark.parametrize("block", [16, 256])
def test_odd_sizes_and_short_last_block(codec, dtype, block):
    for n in [1, 2, 7, block - 1, block, block + 1, 2 * block + 7]:
        x = _wide_range(codec, dtype, block, n, *RANGE[dtype])
        check_encoding(x, codec, block, "n=%d" % n)


@all_codecs
@all_dtypes
def test_empty_tensor(codec, dtype):
    x = torch.empty(0, 3, dtype=dtype)
    enc = pycomm.encode(x, codec, 64)
    assert enc.dtype == torch.uint8 and enc.shape == (0,), "%s: empty input must encode to 0 bytes" % codec
    dec = pycomm.decode(enc, codec, 0, dtype, 64)
    assert dec.shape == (0,) and dec.dtype == dtype
    q = pycomm.quantize(x, codec, 64)
    assert q.shape == x.shape and q.dtype == dtype


# ---- 7. idempotence, shapes, errors, default block ----

@all_codecs
@all_dtypes
@combos
def test_quantize_is_idempotent(codec, dtype, block):
    n = 6 * block + 11
    g = _gen("idem", codec, str(dtype), block)
    lo, hi = RANGE[dtype]
    mag = 10.0 ** (torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * mag).to(dtype)
    x[5], x[block + 2], x[2 * block] = float("nan"), float("inf"), -0.0
    if FMT[codec].target is not None:   # a block whose maximum rounds down to target / 2
        x[3 * block:4 * block] = torch.randn(block, generator=g).to(dtype)
        x[3 * block] = _half_target_peak(codec)
    q1 = pycomm.quantize(x, codec, block)
    q2 = pycomm.quantize(q1, codec, block)
    i, count = _first_mismatch(_bits(q2), _bits(q1))
    assert i is None, "%s %s block=%d: quantize(quantize(x)) != quantize(x) at %d elements; first x=%r: %r then %r" % (
        codec, dtype, block, count, x[i].item(), q1[i].item(), q2[i].item())


@all_codecs
@all_dtypes
def test_quantize_keeps_shape_dtype_and_reads_flat(codec, dtype):
    g = _gen("shape", codec, str(dtype))
    x = (torch.randn(6, 40, 5, generator=g) * 10).to(dtype)
    q = pycomm.quantize(x, codec, 16)
    assert q.shape == x.shape and q.dtype == x.dtype
    assert np.array_equal(_bits(q.reshape(-1)), _bits(pycomm.quantize(x.reshape(-1), codec, 16))), (
        "%s: quantize of a shaped tensor differs from that of its flat view" % codec)
    # A non-contiguous view is read in its logical (row-major) order.
    xt = x.transpose(0, 2)
    qt = pycomm.quantize(xt, codec, 16)
    assert qt.shape == xt.shape
    assert np.array_equal(_bits(qt.contiguous()), _bits(pycomm.quantize(xt.contiguous(), codec, 16))), (
        "%s: quantize of a transposed view differs from that of its contiguous copy" % codec)
    assert torch.equal(pycomm.encode(xt, codec, 16), pycomm.encode(xt.contiguous(), codec, 16)), (
        "%s: encode of a transposed view differs from that of its contiguous copy" % codec)
    tail = x.reshape(-1)[3:]                           # a view with a storage offset
    assert np.array_equal(_bits(pycomm.quantize(tail, codec, 16)), _bits(pycomm.quantize(tail.clone(), codec, 16)))
    s = torch.tensor(3.14159, dtype=dtype)
    assert pycomm.quantize(s, codec, 16).shape == ()


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_encode_rejects_other_dtypes(dtype):
    x = torch.ones(32, dtype=dtype)
    for codec in CODECS:
        with pytest.raises(ValueError):
            pycomm.encode(x, codec, 16)
        with pytest.raises(ValueError):
            pycomm.quantize(x, codec, 16)
    enc = pycomm.encode(torch.ones(32), "fp16", 16)
    with pytest.raises(ValueError):
        pycomm.decode(enc, "fp16", 32, dtype, 16)


def test_rejects_bad_codecs_blocks_and_buffers():
    x = torch.randn(100)
    for codec in ["none", "bogus", "FP16", "fp8", ""]:
        with pytest.raises(ValueError):
            pycomm.encode(x, codec, 16)
    for block in [0, 8, 15, 17, 100, 2048, -16]:
        with pytest.raises(ValueError):
            pycomm.encode(x, "fp16", block)
        with pytest.raises(ValueError):
            pycomm.quantize(x, "fp8_e4m3", block)
    enc = pycomm.encode(x, "fp8_e5m2", 16)
    for bad in [lambda: pycomm.decode(enc, "fp8_e5m2", 80, block=16),          # wrong length
                lambda: pycomm.decode(enc, "fp16", 100, block=16),             # other codec's size
                lambda: pycomm.decode(enc[:-1], "fp8_e5m2", 100, block=16),
                lambda: pycomm.decode(enc.view(torch.int8), "fp8_e5m2", 100, block=16),
                lambda: pycomm.decode(enc.reshape(2, -1), "fp8_e5m2", 100, block=16),
                lambda: pycomm.decode(enc, "fp8_e5m2", -1, block=16),
                lambda: pycomm.decode(enc, "none", 100, block=16),
                lambda: pycomm.decode(enc, "fp8_e5m2", 100, block=12)]:
        with pytest.raises(ValueError):
            bad()


def test_default_block_comes_from_the_environment(monkeypatch):
    x = torch.randn(1000)
    monkeypatch.delenv("PYCOMM_COMPRESSION_BLOCK", raising=False)
    assert pycomm.encode(x, "fp8_e4m3").numel() == _aligned(1000) + _aligned(4 * 4), "default block must be 256"
    assert torch.equal(pycomm.encode(x, "fp8_e4m3"), pycomm.encode(x, "fp8_e4m3", 256))
    monkeypatch.setenv("PYCOMM_COMPRESSION_BLOCK", "64")
    assert torch.equal(pycomm.encode(x, "fp8_e4m3"), pycomm.encode(x, "fp8_e4m3", 64))
    assert torch.equal(pycomm.quantize(x, "fp8_e4m3"), pycomm.quantize(x, "fp8_e4m3", 64))
    assert torch.equal(pycomm.decode(pycomm.encode(x, "fp16", 64), "fp16", 1000), pycomm.quantize(x, "fp16", 64))
    for bad in ["100", "8", "2048", "abc"]:
        monkeypatch.setenv("PYCOMM_COMPRESSION_BLOCK", bad)
        with pytest.raises(ValueError):
            pycomm.encode(x, "fp16")


# ---- 8. error on Gaussian data ----

@all_codecs
def test_gaussian_relative_rms_error(codec):
    x = torch.randn(1 << 16, generator=_gen("gauss", codec), dtype=torch.float64)
    q = pycomm.quantize(x.float(), codec).double()
    err = ((q - x).norm() / x.norm()).item()
    print("%s: relative RMS error %.3e (bound %.1e)" % (codec, err, RMS_BOUND[codec]))
    assert err <= RMS_BOUND[codec], "%s: relative RMS error %.3e > %.1e" % (codec, err, RMS_BOUND[codec])


# ---- the block maximum that rounds down to target / 2 ----

@pytest.mark.parametrize("codec", SCALED)
def test_scale_is_minimal_for_the_unquantized_block_max(codec):
    # Regression: encode used to quantize the block first and take the scale from the
    # quantized maximum, which can round down to target/2: scale/2 and other codes.
    peak = _half_target_peak(codec)
    x = torch.cat([torch.tensor([peak]), torch.randn(15, generator=_gen("win", codec)) * 3]).float()
    assert _rounds_to_half_target(x, codec, 16) == [0]
    check_encoding(x, codec, 16, "block max %r rounds down to target/2" % peak)


# ---- 9. every CPU path writes the scalar path's bits ----
#
# The CPU codecs run vectorized (AVX2 with F16C, AVX-512) where the CPU has them; the scalar
# path is their specification. pycomm._C.cpu_codec_path chooses the path, for these tests.

PATHS = pycomm._C.cpu_codec_paths()  # the scalar path first, then those this CPU has
IDS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _on_path(path, fn):
    previous = pycomm._C.cpu_codec_path()
    pycomm._C.cpu_codec_path(path)
    try:
        return fn()
    finally:
        pycomm._C.cpu_codec_path(previous)


def _float32_sweep():
    """float32 bit patterns: both signs of every exponent (NaNs, infinities, zeros and
    subnormals among them), with mantissas at every rounding position a block's scale can
    bring to a code's last place (1 to 23 bits dropped): the ties below an even and an odd
    kept bit, and their neighbours; then random ones."""
    mantissas = {0, 1, 2, 0x400000, 0x7FFFFE, 0x7FFFFF}
    for dropped in range(1, 24):
        for kept in (0, 1 << dropped):
            for delta in (-1, 0, 1):
                mantissas.add(((1 << (dropped - 1)) + kept + delta) & 0x7FFFFF)
    bits = [(sign << 31) | (e << 23) | m for sign in (0, 1) for e in range(256) for m in sorted(mantissas)]
    rand = torch.randint(-2**31, 2**31, (1 << 14,), generator=_gen("sweep"), dtype=torch.int64)
    return torch.cat([torch.tensor(bits, dtype=torch.int64), rand]).to(torch.int32).view(torch.float32)


def _every_16_bit(dtype):
    return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def _layouts(x, codec, block):
    """x in blocks of neighbouring magnitudes, shuffled (small values beside large ones: the
    codes' subnormals and zeros), and after an anchor in every block that sets the scale to 1
    (each value below it converted unscaled). Their lengths leave a short last block that is
    not a whole number of vectors."""
    n = x.numel() // 16 * 16 - 9
    shuffled = x[torch.randperm(x.numel(), generator=_gen("shuffle", codec, block))]
    anchor = torch.full((1,), FMT[codec].target or 1.0).to(x.dtype)
    body = x[: x.numel() // (block - 1) * (block - 1)].reshape(-1, block - 1)
    anchored = torch.cat([anchor.expand(body.shape[0], 1), body], dim=1).reshape(-1)
    return {"sorted": x[:n], "shuffled": shuffled[:n], "anchored": anchored[: anchored.numel() - 9]}


def _same_bits(a, b):
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _coded_outputs(x, codec, block):
    """What each entry of the codec writes for x: its encoding, that encoding decoded to
    every dtype, and folds that quantize inputs, decode and encode inside a reduction."""
    n = x.numel()
    enc = pycomm.encode(x, codec, block)
    out = {"encode": enc}
    for dtype in DTYPES:
        out["decode to " + IDS[dtype]] = pycomm.decode(enc, codec, n, dtype, block)
    partial = torch.linspace(-3, 3, n)
    terms, forms = [x, enc, partial], [pycomm._C.Form.Input, pycomm._C.Form.Encoded, pycomm._C.Form.Partial]
    for op, exact in [("SUM", False), ("AVG", True), ("PREMUL_SUM", False)]:
        reduce_op = dist._make_nccl_premul_sum(1 / 3) if op == "PREMUL_SUM" else getattr(dist.ReduceOp, op)
        for stage in ["Partial", "Final", "Encoded", "FinalEncoded"]:
            if stage in ("Encoded", "FinalEncoded"):
                o = torch.zeros(pycomm._C.encoded_size(codec, block, n), dtype=torch.uint8)
            else:
                o = torch.zeros(n, dtype=torch.float32 if stage == "Partial" else x.dtype)
            for k in (1, 3):
                pycomm._C.fold(o, terms[:k], forms[:k], x.dtype, n, reduce_op, 3, exact, codec, block,
                               getattr(pycomm._C.Stage, stage))
                out["fold of %d (%s%s) to %s" % (k, op, ", exact" if exact else "", stage)] = o.clone()
    return out


@pytest.mark.skipif(len(PATHS) < 2, reason="this CPU runs the scalar codecs only")
@all_codecs
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_vectorized_paths_write_the_scalar_bits(codec, dtype):
    x = _float32_sweep() if dtype == torch.float32 else _every_16_bit(dtype)
    for block in BLOCKS:
        for layout, values in _layouts(x, codec, block).items():
            expected = _on_path("scalar", lambda: _coded_outputs(values, codec, block))
            for path in PATHS[1:]:
                got = _on_path(path, lambda: _coded_outputs(values, codec, block))
                for what, e in expected.items():
                    assert _same_bits(got[what], e), (
                        "%s %s block=%d, %s: the %s path's %s differs from the scalar path's"
                        % (codec, IDS[dtype], block, layout, path, what))


@pytest.mark.skipif(len(PATHS) < 2, reason="this CPU runs the scalar codecs only")
@pytest.mark.parametrize("codec", SCALED)
def test_vectorized_paths_scale_every_block_maximum_as_the_scalar_path(codec):
    # Records of 16 whose largest magnitude has every exponent and a mantissa just below,
    # at and just above the target's (where the scale steps), or 0 and the largest.
    target = int(torch.tensor([FMT[codec].target]).view(torch.int32)) & 0x7FFFFF
    mantissas = [0, 1, target - 1, target, target + 1, 0x7FFFFF]
    peaks = torch.tensor([(e << 23) | m for e in range(255) for m in mantissas], dtype=torch.int32)
    x = torch.cat([peaks.view(torch.float32).reshape(-1, 1), torch.zeros(peaks.numel(), 15)], dim=1)
    x[:, 1:] = x[:, :1] * torch.linspace(-1, 1, 15)
    x = x.reshape(-1)
    expected = _on_path("scalar", lambda: pycomm.encode(x, codec, 16))
    for path in PATHS[1:]:
        assert _same_bits(_on_path(path, lambda: pycomm.encode(x, codec, 16)), expected), (
            "%s: the %s path's scales differ from the scalar path's" % (codec, path))


@pytest.mark.skipif(len(PATHS) < 2, reason="this CPU runs the scalar codecs only")
@pytest.mark.parametrize("codec", ["fp8_e4m3", "fp8_e5m2"])
def test_vectorized_paths_code_bfloat16_under_every_scale(codec):
    # The vectorized paths code bfloat16 data on its own bits where a value and its code are
    # both normal or zero, and in float32 lanes elsewhere: every finite bfloat16 at or below
    # a record maximum of every exponent (bfloat16's subnormals to its largest), shuffled
    # into records of 256 after that maximum, so that vectors of either kind meet every scale.
    block = 256
    every = _every_16_bit(torch.bfloat16)
    every = every[torch.isfinite(every)]
    records = []
    for e in range(-133, 128):
        peak = torch.tensor([1.5 * 2.0 ** e]).to(torch.bfloat16)
        below = every[every.abs() <= peak]
        below = below[torch.randperm(below.numel(), generator=_gen("bf16 scales", codec, e))]
        below = torch.cat([below, torch.zeros(-below.numel() % (block - 1), dtype=torch.bfloat16)])
        records.append(torch.cat([peak.expand(below.numel() // (block - 1), 1), below.reshape(-1, block - 1)], 1))
    x = torch.cat(records).reshape(-1)
    n = x.numel()
    expected = _on_path("scalar", lambda: pycomm.encode(x, codec, block))
    expected_back = _on_path("scalar", lambda: pycomm.decode(expected, codec, n, torch.bfloat16, block))
    for path in PATHS[1:]:
        enc = _on_path(path, lambda: pycomm.encode(x, codec, block))
        assert _same_bits(enc, expected), "%s: the %s path encodes bfloat16 differently" % (codec, path)
        back = _on_path(path, lambda: pycomm.decode(enc, codec, n, torch.bfloat16, block))
        assert _same_bits(back, expected_back), "%s: the %s path decodes to bfloat16 differently" % (codec, path)


@pytest.mark.skipif(len(PATHS) < 2, reason="this CPU runs the scalar codecs only")
@all_codecs
def test_vectorized_paths_decode_every_code_as_the_scalar_path(codec):
    # Every code (NaN and Inf codes too) in records of the scales the encoder writes (every
    # one for fp8, for 16-bit codes every 7th and those at either end), of scales it never
    # writes (no power of two, subnormal, zero, negative, infinite), and records cut short.
    block = 256
    if FMT[codec].code_bytes == 1:
        codes, exponents = torch.arange(256, dtype=torch.int32).to(torch.uint8), range(-126, 127)
    else:
        codes = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
        exponents = sorted(set(range(-126, 127, 7)) | {-125, -24, -14, 0, 110, 112, 125, 126})
    others = [3.0, 0.1, 1e-40, 0.0, -2.0, FLT_MAX, math.inf]
    scales = torch.tensor([2.0 ** e for e in exponents] + others, dtype=torch.float32)
    records = codes.numel() // block  # per scale
    code_bytes = codes.view(torch.uint8).repeat(scales.numel())
    record_scales = scales.repeat_interleave(records)
    n = record_scales.numel() * block
    enc = _piece(code_bytes, record_scales)
    for dtype in DTYPES:
        expected = _on_path("scalar", lambda: pycomm.decode(enc, codec, n, dtype, block))
        for path in PATHS[1:]:
            got = _on_path(path, lambda: pycomm.decode(enc, codec, n, dtype, block))
            assert _same_bits(got, expected), "%s to %s: the %s path decodes differently" % (codec, IDS[dtype], path)
    short = n - 7 - block  # a record of 249 codes, after whole ones
    cut = _piece(code_bytes[: short * FMT[codec].code_bytes], record_scales[: -(-short // block)])
    expected = _on_path("scalar", lambda: pycomm.decode(cut, codec, short, torch.float32, block))
    for path in PATHS[1:]:
        got = _on_path(path, lambda: pycomm.decode(cut, codec, short, torch.float32, block))
        assert _same_bits(got, expected), "%s: the %s path decodes a short record differently" % (codec, path)


def _piece(code_bytes, scales):
    """The encoding of those codes (bytes) and those blocks' scales (float32), laid out as
    _parse reads it."""
    def padded(b):
        return torch.cat([b, torch.zeros(_aligned(b.numel()) - b.numel(), dtype=torch.uint8)])
    return torch.cat([padded(code_bytes), padded(scales.view(torch.uint8))])


def test_codec_paths_are_chosen_by_name():
    assert PATHS[0] == "scalar" and set(PATHS) <= {"scalar", "avx2", "avx512"}
    assert pycomm._C.cpu_codec_path() == PATHS[-1], "the best path the CPU has is the one in use"
    for bad in ["", "sse", "AVX2"]:
        with pytest.raises(ValueError):
            pycomm._C.cpu_codec_path(bad)
    assert pycomm._C.cpu_codec_path() == PATHS[-1]
