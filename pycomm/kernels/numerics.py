"""The formats and codecs of core/numerics.h as Triton functions, for the kernels of
pycomm/kernels/triton.py and pycomm/kernels/binned.py (whose docstrings state the exactness
rules they keep): every rounding written with integer bit operations (but fp16 codes'), to
nearest even, NaN and infinities as there, and codes widened by an exact multiply; codec
blocks scaled by powers of two and quantized as the CPU ops quantize them. Also the
numbers the kernels share with the C++ code, read from ``pycomm._C``, which exports them
from its own definitions."""
from __future__ import annotations

import math

import triton
import triton.language as tl

from .. import _C

# Reductions and codecs as core/types.h numbers ReduceKind and Compression: the values of
# the kernels' KIND and CODEC parameters (a name missing from _C fails here, at import).
SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM = (
    tl.constexpr(_C.reduce_kinds[name]) for name in ("sum", "avg", "product", "min", "max", "band", "bor", "bxor",
                                                      "premul_sum"))
NO_CODEC, FP16, BF16, FP8_E4M3, FP8_E5M2 = (
    tl.constexpr(_C.codec_numbers[name]) for name in ("none", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"))
# Each codec's target (numerics.h kTarget: the largest magnitude a scaled finite value may
# have) and its exponent (the target is m * 2^exponent, m in [1, 2)).
FP16_TARGET, BF16_TARGET, E4M3_TARGET, E5M2_TARGET = (
    tl.constexpr(_C.codec_targets[name]) for name in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2"))
FP16_EXPONENT, BF16_EXPONENT, E4M3_EXPONENT, E5M2_EXPONENT = (
    tl.constexpr(math.frexp(target.value)[1] - 1) for target in (FP16_TARGET, BF16_TARGET, E4M3_TARGET, E5M2_TARGET))
# numerics.h kRoundToInteger (1.5 * 2^52): x + it - it rounds a double below 2^51 to an integer.
ROUND_TO_INTEGER = tl.constexpr(_C.ROUND_TO_INTEGER)
# Elements per program of the fold and the binned sums: ROWS codec blocks of BLOCK elements
# (one row of TILE uncoded), the largest block the codecs take (core/config.h).
TILE = _C.MAX_COMPRESSION_BLOCK

@triton.jit
def _f32_bits(v):
    return v.to(tl.uint32, bitcast=True)


@triton.jit
def f32(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def half_bits(f):
    x = _f32_bits(f)
    sign = (x >> 16) & 0x8000
    ax = x & 0x7FFFFFFF
    special = tl.where(ax > 0x7F800000, 0x7E00, 0x7C00).to(tl.uint32)
    sub = _f32_bits(f32(ax) + 0.5) - 0x3F000000
    normal = (ax + 0xC8000FFF + ((ax >> 13) & 1)) >> 13
    r = tl.where(ax >= 0x47800000, special, tl.where(ax < 0x38800000, sub, normal))
    return sign | r


@triton.jit
def _magnitude_of_finite(em, E: tl.constexpr, M: tl.constexpr):
    """The value of a finite code's exponent and mantissa bits em, in a float format of E
    and M bits: those fields placed in a float32's, times 2^(127 - bias). Exact, subnormal
    codes included (a subnormal float32 times a power of two; float32 multiplies keep
    subnormals), and one multiply where the integer formulas take a conversion and selects."""
    BIAS: tl.constexpr = (1 << (E - 1)) - 1
    return f32(em << (23 - M)) * f32(tl.full(em.shape, (254 - BIAS) << 23, tl.uint32))


@triton.jit
def from_half_bits(h):
    sign = (h & 0x8000) << 16
    em = h & 0x7FFF
    special = 0x7F800000 | ((em & 0x3FF) << 13)
    return f32(sign | tl.where(em >= 0x7C00, special, _f32_bits(_magnitude_of_finite(em, 5, 10))))


@triton.jit
def bf16_bits(f):
    x = _f32_bits(f)
    rounded = (x + 0x7FFF + ((x >> 16) & 1)) >> 16
    return tl.where((x & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded).to(tl.uint32)


@triton.jit
def from_bf16_bits(b):
    return f32(b << 16)


@triton.jit
def _fp8_bits_from_finite(f, E: tl.constexpr, M: tl.constexpr):
    BIAS: tl.constexpr = (1 << (E - 1)) - 1
    MIN_NORMAL: tl.constexpr = (127 + 1 - BIAS) << 23
    MAGIC: tl.constexpr = (127 + 1 - BIAS + 23 - M) << 23
    x = _f32_bits(f)
    sign = (x >> 24) & 0x80
    ax = x & 0x7FFFFFFF
    magic = tl.full(ax.shape, MAGIC, tl.uint32)
    sub = _f32_bits(f32(ax) + f32(magic)) - MAGIC
    rounded = ax + ((1 << (22 - M)) - 1) + ((ax >> (23 - M)) & 1)
    normal = (rounded >> (23 - M)) - ((127 - BIAS) << M)
    return sign | tl.where(ax < MIN_NORMAL, sub, normal)


@triton.jit
def _from_fp8_finite(c, E: tl.constexpr, M: tl.constexpr):
    return f32(((c & 0x80) << 24) | _f32_bits(_magnitude_of_finite(c & 0x7F, E, M)))


@triton.jit
def _code_target(CODEC: tl.constexpr):
    """The codec's target and its exponent (the constants above)."""
    if CODEC == FP16:
        return FP16_TARGET, FP16_EXPONENT
    elif CODEC == BF16:
        return BF16_TARGET, BF16_EXPONENT
    elif CODEC == FP8_E4M3:
        return E4M3_TARGET, E4M3_EXPONENT
    else:
        return E5M2_TARGET, E5M2_EXPONENT


@triton.jit
def _code_of(v, rounded, NAN: tl.constexpr, INF: tl.constexpr, BITS: tl.constexpr):
    """numerics.h code_of, for a code of BITS bits whose NaN is NAN and +infinity INF:
    rounded (v rounded to nearest even in the code's format, read where v is finite), NAN
    for a NaN, INF with v's sign for an infinity."""
    bits = _f32_bits(v)
    ax = bits & 0x7FFFFFFF
    inf = ((bits >> (32 - BITS)) & (1 << (BITS - 1))) | INF
    return tl.where(ax > 0x7F800000, NAN, tl.where(ax == 0x7F800000, inf, rounded)).to(tl.uint32)


@triton.jit
def _encode(v, CODEC: tl.constexpr):
    """The code of a scaled value, widened to uint32; one code per format for every NaN
    (numerics.h CodeFp16). fp16 rounds with Triton's cast, which on finite values within
    the codec's target gives half_bits' bits both compiled (cvt.rn.f16.f32) and in the
    interpreter; NaN and infinities are set by selects (_code_of)."""
    if CODEC == FP16:
        return _code_of(v, v.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32), 0x7E00, 0x7C00, 16)
    elif CODEC == BF16:
        return bf16_bits(v)
    else:
        return _fp8(v, True, CODEC)


@triton.jit
def decode(c, CODEC: tl.constexpr):
    """The value of a code (widened to uint32), before its block's scale."""
    if CODEC == FP16:
        return from_half_bits(c)
    elif CODEC == BF16:
        return from_bf16_bits(c)
    else:
        return _fp8(c, False, CODEC)


@triton.jit
def _fp8(x, ENCODE: tl.constexpr, CODEC: tl.constexpr):
    """CODEC's fp8 format, its parameters stated once (E exponent and M mantissa bits, INF
    the code of +infinity, 0x7F every NaN's): the code of the scaled value x where ENCODE,
    widened to uint32, else the value of the code x."""
    E: tl.constexpr = 4 if CODEC == FP8_E4M3 else 5
    M: tl.constexpr = 3 if CODEC == FP8_E4M3 else 2
    INF: tl.constexpr = 0x7E if CODEC == FP8_E4M3 else 0x7C
    if ENCODE:
        return _code_of(x, _fp8_bits_from_finite(x, E, M), 0x7F, INF, 8)
    else:
        sign = (x & 0x80) << 24
        finite = _f32_bits(_from_fp8_finite(x, E, M))
        em = x & 0x7F
        return f32(tl.where(em > INF, 0x7FC00000, tl.where(em == INF, sign | 0x7F800000, finite)))


@triton.jit
def _pow2(e):
    """2^e for an integer e in [-126, 127]."""
    return f32(((127 + e) << 23).to(tl.uint32))


@triton.jit
def block_scale(amax, CODEC: tl.constexpr):
    """core/numerics.h block_scale: the smallest 2^e, e in [-126, 126], with
    amax / 2^e <= target; 1 without finite non-zeros, and for bf16."""
    target, t = _code_target(CODEC)
    p = ((_f32_bits(amax) >> 23) & 0xFF).to(tl.int32) - 127
    e = tl.minimum(tl.maximum(p - t - 1, -126), 126)
    for _ in tl.static_range(3):  # at most two steps from p - t - 1 (numerics.h)
        e = tl.where((e < 126) & (amax * _pow2(-e) > target), e + 1, e)
    scaled = (CODEC != BF16) & (amax > 0.0)
    return tl.where(scaled, _pow2(e), 1.0)


@triton.jit
def _inverse_scale(scale):
    return f32((254 << 23) - _f32_bits(scale))


@triton.jit
def magnitude_bits(v):
    return (_f32_bits(v) & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def _finite_magnitude(v):
    a = magnitude_bits(v)
    return tl.where(a >= 0x7F800000, 0, a)


@triton.jit
def saturated_codes(v, amax, scale, CODEC: tl.constexpr):
    """Codes of v with its block's scale (amax: the block's largest finite magnitude);
    finite values whose code would decode to infinity saturate one code down (numerics.h
    saturated_code). Only a code of amax's own magnitude can: rounding is monotonic, so a
    finite v's code is at most amax's in magnitude, and where amax's code overflows
    (may_overflow, numerics.h block_may_overflow) the code below it decodes below amax /
    scale (whose nearest code is amax's), a quotient exact there (at least 2: a normal
    float), so times the scale it stays below amax. NaN and infinities keep their codes
    (bf16's infinity is amax's code there: hence the test for a finite v)."""
    MAGNITUDE: tl.constexpr = 0x7FFF if CODEC == FP16 or CODEC == BF16 else 0x7F
    inv = _inverse_scale(scale)
    codes = _encode(v * inv, CODEC)
    top = _encode(amax * inv, CODEC)  # amax >= 0: its code has no sign bit
    may_overflow = magnitude_bits(decode(top, CODEC) * scale) == 0x7F800000
    saturate = may_overflow & ((codes & MAGNITUDE) == top) & (magnitude_bits(v) < 0x7F800000)
    return tl.where(saturate, codes - 1, codes)


@triton.jit
def block_amax(v, mask):
    """The largest finite magnitude of each row (a codec block) of v, as a column."""
    return f32(tl.max(tl.where(mask, _finite_magnitude(v), 0), axis=1).to(tl.uint32))[:, None]


@triton.jit
def quantize(v, mask, CODEC: tl.constexpr):
    """decode(encode(v)) of each row (a codec block; the lanes of mask)."""
    amax = block_amax(v, mask)
    scale = block_scale(amax, CODEC)
    return decode(saturated_codes(v, amax, scale, CODEC), CODEC) * scale
