"""The formats and codecs of core/numerics.h as Triton functions, for the kernels of
pycomm/triton_kernels.py (whose docstring states the exactness rules they keep): every
conversion written with integer bit operations, rounding to nearest even, NaN and
infinities as there; codec blocks scaled by powers of two and quantized as the CPU ops
quantize them."""
from __future__ import annotations

import triton
import triton.language as tl

from . import _C

@triton.jit
def _f32_bits(v):
    return v.to(tl.uint32, bitcast=True)


@triton.jit
def _f32(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _half_bits(f):
    x = _f32_bits(f)
    sign = (x >> 16) & 0x8000
    ax = x & 0x7FFFFFFF
    special = tl.where(ax > 0x7F800000, 0x7E00, 0x7C00).to(tl.uint32)
    sub = _f32_bits(_f32(ax) + 0.5) - 0x3F000000
    normal = (ax + 0xC8000FFF + ((ax >> 13) & 1)) >> 13
    r = tl.where(ax >= 0x47800000, special, tl.where(ax < 0x38800000, sub, normal))
    return sign | r


@triton.jit
def _from_half_bits(h):
    sign = (h & 0x8000) << 16
    em = h & 0x7FFF
    special = 0x7F800000 | ((em & 0x3FF) << 13)
    normal = (em << 13) + 0x38000000
    sub = _f32_bits(em.to(tl.int32).to(tl.float32) * 5.9604644775390625e-8)
    return _f32(sign | tl.where(em >= 0x7C00, special, tl.where(em >= 0x400, normal, sub)))


@triton.jit
def _bf16_bits(f):
    x = _f32_bits(f)
    rounded = (x + 0x7FFF + ((x >> 16) & 1)) >> 16
    return tl.where((x & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded).to(tl.uint32)


@triton.jit
def _from_bf16_bits(b):
    return _f32(b << 16)


@triton.jit
def _fp8_bits_from_finite(f, E: tl.constexpr, M: tl.constexpr):
    BIAS: tl.constexpr = (1 << (E - 1)) - 1
    MIN_NORMAL: tl.constexpr = (127 + 1 - BIAS) << 23
    MAGIC: tl.constexpr = (127 + 1 - BIAS + 23 - M) << 23
    x = _f32_bits(f)
    sign = (x >> 24) & 0x80
    ax = x & 0x7FFFFFFF
    magic = tl.full(ax.shape, MAGIC, tl.uint32)
    sub = _f32_bits(_f32(ax) + _f32(magic)) - MAGIC
    rounded = ax + ((1 << (22 - M)) - 1) + ((ax >> (23 - M)) & 1)
    normal = (rounded >> (23 - M)) - ((127 - BIAS) << M)
    return sign | tl.where(ax < MIN_NORMAL, sub, normal)


@triton.jit
def _from_fp8_finite(c, E: tl.constexpr, M: tl.constexpr):
    BIAS: tl.constexpr = (1 << (E - 1)) - 1
    SUB_ULP: tl.constexpr = (127 + 1 - BIAS - M) << 23
    sign = (c & 0x80) << 24
    em = c & 0x7F
    normal = (em << (23 - M)) + ((127 - BIAS) << 23)
    sub = _f32_bits(em.to(tl.int32).to(tl.float32) * _f32(tl.full(em.shape, SUB_ULP, tl.uint32)))
    return _f32(sign | tl.where(em < (1 << M), sub, normal))


# Codecs, numbered as core/types.h numbers Compression: 1 fp16, 2 bf16, 3 fp8_e4m3,
# 4 fp8_e5m2. Per codec: its code's bytes, whether blocks are scaled, its target (the
# largest magnitude a scaled finite value may have).
_CODECS = {name: number for number, name in enumerate(_C.codecs, 1)}


@triton.jit
def _code_target(CODEC: tl.constexpr):
    """The codec's target, and its exponent (the target is m * 2^t, m in [1, 2))."""
    if CODEC == 1:
        return 65504.0, 15
    elif CODEC == 2:
        return 3.4028234663852886e38, 127
    elif CODEC == 3:
        return 416.0, 8
    else:
        return 57344.0, 15


@triton.jit
def _encode(v, CODEC: tl.constexpr):
    """The code of a scaled value, widened to uint32; one code per format for every NaN
    (numerics.h CodeFp16)."""
    if CODEC == 1:
        return tl.where((_f32_bits(v) & 0x7FFFFFFF) > 0x7F800000, 0x7E00, _half_bits(v)).to(tl.uint32)
    elif CODEC == 2:
        return _bf16_bits(v)
    else:
        E: tl.constexpr = 4 if CODEC == 3 else 5
        M: tl.constexpr = 3 if CODEC == 3 else 2
        INF: tl.constexpr = 0x7E if CODEC == 3 else 0x7C
        x = _f32_bits(v)
        ax = x & 0x7FFFFFFF
        finite = _fp8_bits_from_finite(v, E, M)
        inf = ((x >> 24) & 0x80) | INF
        return tl.where(ax > 0x7F800000, 0x7F, tl.where(ax == 0x7F800000, inf, finite)).to(tl.uint32)


@triton.jit
def _decode(c, CODEC: tl.constexpr):
    if CODEC == 1:
        return _from_half_bits(c)
    elif CODEC == 2:
        return _from_bf16_bits(c)
    else:
        E: tl.constexpr = 4 if CODEC == 3 else 5
        M: tl.constexpr = 3 if CODEC == 3 else 2
        INF: tl.constexpr = 0x7E if CODEC == 3 else 0x7C
        sign = (c & 0x80) << 24
        finite = _f32_bits(_from_fp8_finite(c, E, M))
        em = c & 0x7F
        return _f32(tl.where(em > INF, 0x7FC00000, tl.where(em == INF, sign | 0x7F800000, finite)))


@triton.jit
def _pow2(e):
    """2^e for an integer e in [-126, 127]."""
    return _f32(((127 + e) << 23).to(tl.uint32))


@triton.jit
def _block_scale(amax, CODEC: tl.constexpr):
    """core/numerics.h block_scale: the smallest 2^e, e in [-126, 126], with
    amax / 2^e <= target; 1 without finite non-zeros, and for bf16."""
    target, t = _code_target(CODEC)
    p = ((_f32_bits(amax) >> 23) & 0xFF).to(tl.int32) - 127
    e = tl.minimum(tl.maximum(p - t - 1, -126), 126)
    for _ in tl.static_range(3):  # at most two steps from p - t - 1 (numerics.h)
        e = tl.where((e < 126) & (amax * _pow2(-e) > target), e + 1, e)
    scaled = (CODEC != 2) & (amax > 0.0)
    return tl.where(scaled, _pow2(e), 1.0)


@triton.jit
def _inverse_scale(scale):
    return _f32((254 << 23) - _f32_bits(scale))


@triton.jit
def _magnitude(v):
    return (_f32_bits(v) & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def _finite_magnitude(v):
    a = _magnitude(v)
    return tl.where(a >= 0x7F800000, 0, a)


@triton.jit
def _codes(v, amax, scale, CODEC: tl.constexpr):
    """Codes of v with its block's scale; finite values whose code would decode to
    infinity saturate one code down (numerics.h saturated_code)."""
    inv = _inverse_scale(scale)
    codes = _encode(v * inv, CODEC)
    may_overflow = _magnitude(_decode(_encode(amax * inv, CODEC), CODEC) * scale) == 0x7F800000
    overflows = _magnitude(_decode(codes, CODEC) * scale) == 0x7F800000
    saturate = may_overflow & overflows & (_magnitude(v) < 0x7F800000)
    return tl.where(saturate, codes - 1, codes)


@triton.jit
def _block_amax(v, mask):
    """The largest finite magnitude of each row (a codec block) of v, as a column."""
    return _f32(tl.max(tl.where(mask, _finite_magnitude(v), 0), axis=1).to(tl.uint32))[:, None]


@triton.jit
def _quantize(v, mask, CODEC: tl.constexpr):
    """decode(encode(v)) of each row (a codec block; the lanes of mask)."""
    amax = _block_amax(v, mask)
    scale = _block_scale(amax, CODEC)
    return _decode(_codes(v, amax, scale, CODEC), CODEC) * scale
