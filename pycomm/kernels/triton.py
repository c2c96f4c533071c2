"""pycomm's reductions and codecs as Triton kernels, for CUDA tensors where pycomm was
built without nvcc: the same contract as the device ops' ``reduce_terms``
(csrc/device/device_ops.h) and the same bits as the CPU ops (csrc/device/cpu_ops.cc),
element for element. Tested on the CPU under ``TRITON_INTERPRET=1``, and compiled there
for sm_90 to check the PTX for the rules below.

Exactness rules, which make the interpreter, the GPU and the CPU compute the same bits:

* Every rounding to a narrower format is written with integer bit operations, as
  core/numerics.h writes it (round to nearest even; NaN and infinities as there), except
  fp16 codes, which are Triton's cast with NaN and infinities set by selects. Compiled for
  sm_90, Triton's casts are correctly rounded instructions (cvt.rn); but its interpreter,
  where the kernels are tested, rounds float8 ties away from zero and does not round to
  bfloat16 at all, while its float16 cast rounds every float32 an fp16 codec converts
  (finite, at most 65504) as numerics.h does. A code is widened by placing its fields in
  a float32's and multiplying by a power of two (exact, subnormals included). Widening
  the data (16-bit float to float32, float32 to float64) and float64 to float32 (round to
  nearest even) are exact or correctly rounded everywhere, and are Triton's own.
* No fused multiply-add: kernels are launched with ``enable_fp_fusion=False``. (Every
  product that meets an add here is an exact power-of-two scaling anyway.)
* Correctly rounded division: ``tl.div_rn`` in float32 (Triton's ``/`` is NVIDIA's
  div.full.f32, within 2 ulp); ``/`` in float64 (div.rn.f64).
* The same accumulation order: terms are folded left in the order given, in float32 for
  16-bit data (float64 for float64 data, the type itself for integers); exact mode adds
  grid steps, integers held exactly (in float64, or two 64-bit words for float64 data),
  in any order, as the CPU does.
* Float32 arithmetic keeps subnormals (Triton does not flush float32 adds and multiplies;
  the compiled PTX is checked for .ftz).

One kernel, :func:`_fold_kernel`, specialized per reduction, stage, codec, mode and the
forms of its runs of terms (not their number: any world size takes the same kernel),
serves every call: a program folds one tile (a codec block, or 1024 elements) of every
term. Exact mode's 128-bit integer sums of float64 data are kept as two 64-bit words.
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from .. import _C
from .numerics import (AVG, BAND, BOR, MAX, MIN, PREMUL_SUM, PRODUCT, ROUND_TO_INTEGER, SUM, TILE, bf16_bits,
                       block_amax, block_scale, decode, f32, from_bf16_bits, from_half_bits, half_bits, magnitude_bits,
                       quantize, saturated_codes)

Form, Stage = _C.Form, _C.Stage

# ---- the fold ----

@triton.jit
def _combine(a, b, KIND: tl.constexpr):
    """numerics.h reduce_op: NaN propagates through MIN and MAX."""
    if KIND == SUM or KIND == AVG or KIND == PREMUL_SUM:
        return a + b
    elif KIND == PRODUCT:
        return a * b
    elif KIND == MIN:
        r = tl.where(b < a, b, a)
        return tl.where(a != a, a, tl.where(b != b, b, r))
    elif KIND == MAX:
        r = tl.where(a < b, b, a)
        return tl.where(a != a, a, tl.where(b != b, b, r))
    elif KIND == BAND:
        return a & b
    elif KIND == BOR:
        return a | b
    else:
        return a ^ b


@triton.jit
def _load_storage(ptr, offs, mask, STORAGE: tl.constexpr, ACC: tl.constexpr):
    """Values in the storage format (STORAGE as _store_final numbers it) widened to ACC;
    16-bit floats through their bits, subnormals kept."""
    if STORAGE == 1:
        return from_half_bits(tl.load(ptr.to(tl.pointer_type(tl.uint16), bitcast=True) + offs, mask=mask,
                                       other=0).to(tl.uint32))
    elif STORAGE == 2:
        return from_bf16_bits(tl.load(ptr.to(tl.pointer_type(tl.uint16), bitcast=True) + offs, mask=mask,
                                       other=0).to(tl.uint32))
    else:
        return tl.load(ptr + offs, mask=mask, other=0).to(ACC)


@triton.jit
def _load_term(term, form: tl.constexpr, blocks, offs, mask, n, premul, ACC: tl.constexpr, STORAGE: tl.constexpr,
               KIND: tl.constexpr, CODEC: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK: tl.constexpr,
               CODE_BYTES: tl.constexpr):
    """A term's values of a tile (rows: the codec blocks numbered `blocks`; offs: their
    elements) in the accumulation type: an input's contribution (PREMUL_SUM scales it by
    premul, a float64 rounded to ACC to nearest even as the CPU ops' cast rounds it; under
    a codec it is quantized), partial values as they are, encoded values decoded."""
    if form == 0:  # Input
        x = _load_storage(term, offs, mask, STORAGE, ACC)
        if KIND == PREMUL_SUM:
            x = x * premul.to(ACC)
        if CODEC != 0 and QUANTIZE:
            x = quantize(x, mask, CODEC)
        return x
    elif form == 1:  # Partial
        return tl.load(term + offs, mask=mask, other=0).to(ACC)
    else:  # Encoded: a piece of n elements (_codes_and_scales)
        codes, scales = _codes_and_scales(term, n, CODE_BYTES)
        scale = tl.load(scales + blocks, mask=blocks * BLOCK < n, other=1.0)
        return decode(tl.load(codes + offs, mask=mask, other=0).to(tl.uint32), CODEC) * scale


PIECE_ALIGN = tl.constexpr(_C.PIECE_ALIGN)


@triton.jit
def _aligned(nbytes):
    """numerics.h piece_aligned: the next multiple of kPieceAlign."""
    return (nbytes + PIECE_ALIGN - 1) // PIECE_ALIGN * PIECE_ALIGN


@triton.jit
def _codes_and_scales(piece, n, CODE_BYTES: tl.constexpr):
    """numerics.h's layout of a piece of n encoded elements: its codes (uint8 or uint16)
    from its start, its blocks' float32 scales from the next 16-byte boundary after them."""
    at = piece.to(tl.pointer_type(tl.uint8), bitcast=True)
    code_type: tl.constexpr = tl.uint8 if CODE_BYTES == 1 else tl.uint16
    scales = (at + _aligned(n * CODE_BYTES)).to(tl.pointer_type(tl.float32), bitcast=True)
    return at.to(tl.pointer_type(code_type), bitcast=True), scales


# numerics.h kExactFracBits and kExactFracBits64: exact mode's grid is 2^(E - FRAC_BITS)
# for float accumulation, 2^(E - FRAC_BITS64) for float64, E the exponent of the largest term.
FRAC_BITS = tl.constexpr(_C.EXACT_FRAC_BITS)
FRAC_BITS64 = tl.constexpr(_C.EXACT_FRAC_BITS64)


@triton.jit
def _run_term(runs, strides, R: tl.constexpr, j):
    """The address of term j of run R (runs[R] + j * strides[R], in int64: a run of many
    ranks' segments spans more than 2^31 elements)."""
    return runs[R] + tl.cast(j, tl.int64) * strides[R]


@triton.jit
def _magnitude_of(v, ACC: tl.constexpr):
    """|v|'s bits as a signed integer of v's width (numerics.h magnitude_bits): orders
    magnitudes, every non-finite value above every finite one."""
    if ACC == tl.float64:
        return v.to(tl.int64, bitcast=True) & 0x7FFFFFFFFFFFFFFF
    else:
        return magnitude_bits(v)


@triton.jit
def _largest_magnitude(runs, strides, counts, FORMS: tl.constexpr, RUNS: tl.constexpr, blocks, offs, mask, n, premul,
                       ACC: tl.constexpr, STORAGE: tl.constexpr, KIND: tl.constexpr, CODEC: tl.constexpr,
                       QUANTIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, CODE_BYTES: tl.constexpr):
    """Each element's largest magnitude over every term (_magnitude_of), which alone
    decides its grid in exact mode."""
    amax = tl.zeros([ROWS, BLOCK], tl.int64 if ACC == tl.float64 else tl.int32)
    for r in tl.static_range(RUNS):
        for j in range(counts[r]):
            v = _load_term(_run_term(runs, strides, r, j), FORMS[r], blocks, offs, mask, n, premul, ACC, STORAGE, KIND,
                           CODEC, QUANTIZE, BLOCK, CODE_BYTES)
            amax = tl.maximum(amax, _magnitude_of(v, ACC))
    return amax


@triton.jit
def _nonfinite_kind(v, ACC: tl.constexpr):
    """numerics.h nonfinite_kind of a term, 0 for a finite one: bit 0 NaN, 1 +Inf, 2 -Inf."""
    INF: tl.constexpr = 0x7FF0000000000000 if ACC == tl.float64 else 0x7F800000
    return tl.where(v != v, 1, tl.where(_magnitude_of(v, ACC) == INF, tl.where(v > 0, 2, 4), 0))


@triton.jit
def _nonfinite_sum(seen, ACC: tl.constexpr):
    """numerics.h exact_nonfinite: NaN if a term is NaN or both infinities occur, else
    the infinity that occurs."""
    nan = ((seen & 1) != 0) | ((seen & 6) == 6)
    if ACC == tl.float64:
        bits = tl.where(nan, 0x7FF8000000000000, tl.where((seen & 2) != 0, 0x7FF0000000000000, -0x10000000000000))
        return bits.to(tl.int64).to(tl.float64, bitcast=True)
    else:
        return f32(tl.where(nan, 0x7FC00000, tl.where((seen & 2) != 0, 0x7F800000, 0xFF800000)).to(tl.uint32))


@triton.jit
def _exact_sum(runs, strides, counts, FORMS: tl.constexpr, RUNS: tl.constexpr, blocks, offs, mask, n, premul,
               STORAGE: tl.constexpr, KIND: tl.constexpr, CODEC: tl.constexpr, QUANTIZE: tl.constexpr,
               ROWS: tl.constexpr, BLOCK: tl.constexpr, CODE_BYTES: tl.constexpr):
    """numerics.h exact mode for float accumulation: each element's terms on the grid
    2^(E - 36) of its largest magnitude, the grid steps (integers exact in float64) added,
    the sum rounded once; NaN or the infinity where a term is not finite."""
    amax = _largest_magnitude(runs, strides, counts, FORMS, RUNS, blocks, offs, mask, n, premul, tl.float32, STORAGE,
                              KIND, CODEC, QUANTIZE, ROWS, BLOCK, CODE_BYTES)
    e = (tl.maximum(amax >> 23, 1) - 126).to(tl.int64)
    # A tensor on the left of each operation with a global constant: the interpreter's
    # constexpr does not take a tensor on its right.
    up = ((-e + (1023 + FRAC_BITS)) << 52).to(tl.float64, bitcast=True)
    down = ((e + (1023 - FRAC_BITS)) << 52).to(tl.float64, bitcast=True)
    total = tl.zeros([ROWS, BLOCK], tl.float64)
    seen = tl.zeros([ROWS, BLOCK], tl.int32)
    for r in tl.static_range(RUNS):
        for j in range(counts[r]):
            v = _load_term(_run_term(runs, strides, r, j), FORMS[r], blocks, offs, mask, n, premul, tl.float32,
                           STORAGE, KIND, CODEC, QUANTIZE, BLOCK, CODE_BYTES)
            total += (v.to(tl.float64) * up + ROUND_TO_INTEGER) - ROUND_TO_INTEGER
            seen |= _nonfinite_kind(v, tl.float32)
    return tl.where(amax >= 0x7F800000, _nonfinite_sum(seen, tl.float32), (total * down).to(tl.float32))


@triton.jit
def _scaled(v, s):
    """v * 2^s (|s| <= 1132) as two representable powers of two: ldexp's bits wherever the
    first product is exact (any v scaled up, an integer v >= 1 scaled down). A term scaled
    down below 2^-1022 by it may round twice, but is then rounded to the integer 0 anyway."""
    first = s >> 1
    return v * ((1023 + first) << 52).to(tl.float64, bitcast=True) * ((1023 + s - first) << 52).to(
        tl.float64, bitcast=True)


@triton.jit
def _bit_length(x):
    """The number of bits of x (uint64), by halving."""
    length = tl.zeros(x.shape, tl.int64)
    for i in tl.static_range(6):
        wide = (x >> (32 >> i)) != 0
        length += tl.where(wide, 32 >> i, 0)
        x = tl.where(wide, x >> (32 >> i), x)
    return length + (x != 0).to(tl.int64)


@triton.jit
def _exact_sum64(runs, strides, counts, FORMS: tl.constexpr, RUNS: tl.constexpr, blocks, offs, mask, n, premul,
                 KIND: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """numerics.h exact mode for float64: each element's terms on the grid 2^(E - 110),
    the grid steps added as 128-bit integers (a signed high and an unsigned low word, with
    the carry), the sum rounded once to float64 (the low word's lost bits kept sticky) and
    scaled as ldexp scales it; NaN or the infinity where a term is not finite."""
    amax = _largest_magnitude(runs, strides, counts, FORMS, RUNS, blocks, offs, mask, n, premul, tl.float64, 0, KIND,
                              0, False, ROWS, BLOCK, 1)
    exponent = tl.maximum(amax >> 52, 1) - 1022
    high = tl.zeros([ROWS, BLOCK], tl.int64)
    low = tl.zeros([ROWS, BLOCK], tl.uint64)
    seen = tl.zeros([ROWS, BLOCK], tl.int32)
    for r in tl.static_range(RUNS):
        for j in range(counts[r]):
            v = _load_term(_run_term(runs, strides, r, j), FORMS[r], blocks, offs, mask, n, premul, tl.float64, 0,
                           KIND, 0, False, BLOCK, 1)
            kind = _nonfinite_kind(v, tl.float64)
            seen |= kind
            q = _scaled(tl.where(kind == 0, v, 0.0), -exponent + FRAC_BITS64)  # |q| < 2^FRAC_BITS64
            q = tl.where(tl.abs(q) < 4503599627370496.0, (q + ROUND_TO_INTEGER) - ROUND_TO_INTEGER, q)
            # |q| as two words: its bits below 2^64 are some of its 53 (exact), then negated.
            magnitude = tl.abs(q)
            q_high = tl.floor(magnitude * 5.421010862427522e-20)  # |q| / 2^64, rounded down: exact
            q_low = (magnitude - q_high * 18446744073709551616.0).to(tl.uint64)
            q_high = q_high.to(tl.int64)
            q_low, q_high = tl.where(q < 0, ~q_low + 1, q_low), tl.where(q < 0, -q_high - (q_low != 0), q_high)
            low += q_low
            high += q_high + (low < q_low).to(tl.int64)
    negative = high < 0
    mag_low = tl.where(negative, ~low + 1, low)
    mag_high = tl.where(negative, (~high).to(tl.uint64, bitcast=True) + (mag_low == 0).to(tl.uint64),
                        high.to(tl.uint64, bitcast=True))
    # Above 64 bits: the top 64 bits, the bits shifted out ORed into the last (sticky, far
    # below float64's rounding bit), so that one conversion rounds as the 128-bit one does.
    shift = tl.maximum(_bit_length(mag_high), 1)
    top = (mag_high << (64 - shift).to(tl.uint64)) | (mag_low >> shift.to(tl.uint64))
    sticky = ((mag_low & ((tl.full(shift.shape, 1, tl.uint64) << shift.to(tl.uint64)) - 1)) != 0).to(tl.uint64)
    magnitude = tl.where(mag_high == 0, mag_low.to(tl.float64), _scaled((top | sticky).to(tl.float64), shift))
    total = _scaled(tl.where(negative, -magnitude, magnitude), exponent - FRAC_BITS64)
    return tl.where(amax >= 0x7FF0000000000000, _nonfinite_sum(seen, tl.float64), total)


@triton.jit
def _store_final(out, offs, mask, v, OUT_KIND: tl.constexpr):
    """v (the accumulation type) rounded once to the storage type: 0 as-is, 1 float16,
    2 bfloat16, 3 bool."""
    if OUT_KIND == 1:
        tl.store(out.to(tl.pointer_type(tl.uint16), bitcast=True) + offs, half_bits(v).to(tl.uint16), mask=mask)
    elif OUT_KIND == 2:
        tl.store(out.to(tl.pointer_type(tl.uint16), bitcast=True) + offs, bf16_bits(v).to(tl.uint16), mask=mask)
    elif OUT_KIND == 3:
        tl.store(out.to(tl.pointer_type(tl.uint8), bitcast=True) + offs, (v != 0).to(tl.uint8), mask=mask)
    else:
        tl.store(out + offs, v.to(out.dtype.element_ty), mask=mask)


# Scalars never specialized (see _fold_kernel's docstring).
_SCALARS = ["premul_bits", "world_size", "counts", "strides", "parts", "unit", "skip", "slot_bytes"]


@triton.jit
def _store_encoded(out, blocks, offs, mask, n, acc, CODEC: tl.constexpr, BLOCK: tl.constexpr,
                   CODE_BYTES: tl.constexpr):
    """The tile's values encoded into the piece of n elements at out (_codes_and_scales),
    the scale of each block's largest magnitude; the program of the last block zeroes the
    piece's padding."""
    amax = block_amax(acc, mask)
    scale = block_scale(amax, CODEC)
    coded = saturated_codes(acc, amax, scale, CODEC)
    codes, scales = _codes_and_scales(out, n, CODE_BYTES)
    tl.store(scales + blocks, scale, mask=blocks * BLOCK < n)
    tl.store(codes + offs, coded.to(codes.dtype.element_ty), mask=mask)
    last = (blocks * BLOCK < n) & ((blocks + 1) * BLOCK >= n)  # [ROWS, 1]: the row of the last block
    pad = tl.arange(0, PIECE_ALIGN)[None, :] + 0 * blocks  # [ROWS, PIECE_ALIGN]
    zeros = tl.zeros_like(pad).to(tl.uint8)
    at = out.to(tl.pointer_type(tl.uint8), bitcast=True)
    codes_end, scales_end = n * CODE_BYTES, _aligned(n * CODE_BYTES) + (n + BLOCK - 1) // BLOCK * 4
    tl.store(at + codes_end + pad, zeros, mask=last & (codes_end + pad < _aligned(codes_end)))
    tl.store(at + scales_end + pad, zeros, mask=last & (scales_end + pad < _aligned(scales_end)))


@triton.jit(do_not_specialize=_SCALARS)
def _fold_kernel(out, runs, strides, counts, n, parts, unit, skip, slot_bytes, premul_bits: tl.int64, world_size,
                 FORMS: tl.constexpr, RUNS: tl.constexpr, KIND: tl.constexpr, STAGE: tl.constexpr,
                 CODEC: tl.constexpr, EXACT: tl.constexpr, QUANTIZE: tl.constexpr, ACC: tl.constexpr,
                 FLOATING: tl.constexpr, OUT_KIND: tl.constexpr, SEGMENTS: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK: tl.constexpr, CODE_BYTES: tl.constexpr):
    """DeviceOps::reduce_terms for one tile, ROWS codec blocks of BLOCK elements (program
    p: blocks p * ROWS ...): terms folded left in order, or exactly; STAGE 0 Partial (the
    accumulation type), 1 Final (the storage type), 2 Encoded, 3 FinalEncoded (finalized,
    then encoded). Without a codec, blocks are only the tile's shape.

    The terms come as RUNS runs (see ``_runs``): run r is counts[r] operands of form
    FORMS[r], the first at runs[r], each the next strides[r] elements on. The counts are
    loop bounds, not unrolled, so that one specialization serves every world size.

    With SEGMENTS, a fold over segments (``fold_segments``): program (p, s) folds tile p
    of pair s, segment s of the plain operand (Segments(n, parts, unit)) and slot s of the
    slotted one (s * slot_bytes bytes in), but segment ``skip``: the slot is the output
    (its one term the segment) where STAGE encodes, else the segment.

    Scalars are arguments, so that a call copies nothing from the host: premul_bits, the
    float64 bits of PREMUL_SUM's factor (a float argument would be float32), and
    world_size, never specialized (as the constant 1 it would have no ``.to``); nor are
    the runs' counts and strides or the segments (world sizes and segment lengths: one
    compiled kernel serves them all)."""
    if SEGMENTS:
        s = tl.program_id(1).to(tl.int64)
        units = (n + unit - 1) // unit
        first = (s * (units // parts) + tl.minimum(s, units % parts)) * unit
        end = ((s + 1) * (units // parts) + tl.minimum(s + 1, units % parts)) * unit
        first, end = tl.minimum(first, n), tl.minimum(end, n)
        plain_at, slot_at = first, s * slot_bytes
        if STAGE >= 2:
            out += slot_at
            runs = (runs[0] + plain_at,)
        else:
            out += plain_at
            runs = (runs[0] + slot_at,)
        n = tl.where(s == skip, 0, end - first)
    blocks = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    offs = blocks * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < n
    # The interpreter types an integer argument by its value: 0.0's bits arrive as int32.
    premul = premul_bits.to(tl.int64).to(tl.float64, bitcast=True)
    if EXACT and ACC == tl.float64:
        acc = _exact_sum64(runs, strides, counts, FORMS, RUNS, blocks, offs, mask, n, premul, KIND, ROWS, BLOCK)
    elif EXACT:
        acc = _exact_sum(runs, strides, counts, FORMS, RUNS, blocks, offs, mask, n, premul, OUT_KIND, KIND, CODEC,
                         QUANTIZE, ROWS, BLOCK, CODE_BYTES)
    else:
        acc = _load_term(runs[0], FORMS[0], blocks, offs, mask, n, premul, ACC, OUT_KIND, KIND, CODEC, QUANTIZE, BLOCK,
                         CODE_BYTES)
        for r in tl.static_range(RUNS):
            for j in range(1 if r == 0 else 0, counts[r]):
                term = _load_term(_run_term(runs, strides, r, j), FORMS[r], blocks, offs, mask, n, premul, ACC,
                                  OUT_KIND, KIND, CODEC, QUANTIZE, BLOCK, CODE_BYTES)
                acc = _combine(acc, term, KIND)
    if KIND == AVG and (STAGE == 1 or STAGE == 3):
        if ACC == tl.float32:
            acc = tl.div_rn(acc, world_size.to(ACC))
        elif FLOATING:
            acc = acc / world_size.to(ACC)
        else:  # integer AVG truncates toward zero
            acc = acc // world_size.to(ACC)
    if STAGE == 0:
        tl.store(out + offs, acc, mask=mask)
    elif STAGE == 1:
        _store_final(out, offs, mask, acc, OUT_KIND)
    else:
        _store_encoded(out, blocks, offs, mask, n, acc, CODEC, BLOCK, CODE_BYTES)


# The same kernel for a count of 1, which Triton would otherwise compile as the constant 1:
# every lane but one then being dead, LLVM's packed <2 x i16> exponent arithmetic in
# _exact_sum (``- 126``) keeps one live half, and ptxas (12.8 and 12.9, sm_90) assembles
# such an add.s16x2 with its immediate dropped (VIADD.16x2 R, R, 0x0): wrong bits on the
# GPU, not in the interpreter. Other counts keep the divisibility specialization.
_fold_kernel_of_one = triton.jit(do_not_specialize=["n", *_SCALARS])(_fold_kernel.fn)


@triton.jit
def _error_feedback_kernel(buf, residual, n, HAS_RESIDUAL: tl.constexpr, OUT_KIND: tl.constexpr, CODEC: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """The DDP compression hook's error feedback in one pass, per codec block of the
    bucket: g = buf + residual (float32), buf = g in the bucket's dtype, residual =
    g - quantize(buf), zero where that is not finite (pycomm/hooks.py)."""
    blocks = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    offs = blocks * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < n
    g = _load_storage(buf, offs, mask, OUT_KIND, tl.float32)
    if HAS_RESIDUAL:
        g = g + tl.load(residual + offs, mask=mask, other=0)
    _store_final(buf, offs, mask, g, OUT_KIND)
    if OUT_KIND == 1:
        stored = from_half_bits(half_bits(g))
    elif OUT_KIND == 2:
        stored = from_bf16_bits(bf16_bits(g))
    else:
        stored = g
    r = g - quantize(stored, mask, CODEC)
    tl.store(residual + offs, tl.where(magnitude_bits(r) < 0x7F800000, r, 0.0), mask=mask)


# ---- the host side: _C.fold's contract ----

_OUT_KINDS = {torch.float16: 1, torch.bfloat16: 2, torch.bool: 3}


def _typed(t, dtype):
    """``t``'s memory as ``dtype`` (raw bytes view as their form's type; 16-bit floats are
    stored through their bits)."""
    return t if t.dtype == dtype else t.view(dtype)


def fold(out, terms, forms, dtype, count, op, world_size, exact, codec, block, stage):
    """``pycomm._C.fold`` (the layered path's step, DeviceOps::reduce_terms on tensors) in
    Triton, with the same arguments and bits, enqueued on the current stream. Encoded
    operands are pieces of ``count`` elements (numerics.h's layout) that start on a 4-byte
    boundary (their scales are read as float32)."""
    if count:
        _launch(out, terms, forms, dtype, count, (1, 1, -1, 0), op, world_size, exact, codec, block, stage)


def fold_segments(plain, slots, count, parts, unit, skip, slot_bytes, dtype, op, world_size, exact, codec, block,
                  stage):
    """``pycomm._C.fold_segments`` in Triton, with the same arguments and bits: one launch
    for every pair of a segment of ``plain`` and its slot of ``slots``."""
    if codec == "none":
        raise ValueError("pycomm: fold_segments is a codec's step: it needs a codec")
    if count:
        encodes = stage in (Stage.Encoded, Stage.FinalEncoded)
        _launch(slots if encodes else plain, [plain if encodes else slots], [Form.Input if encodes else Form.Encoded],
                dtype, count, (parts, unit, skip, slot_bytes), op, world_size, exact, codec, block, stage)


def _launch(out, terms, forms, dtype, count, segments, op, world_size, exact, codec, block, stage):
    """A launch of _fold_kernel: ``terms`` folded into ``out``, over ``count`` elements
    cut in segments (parts, unit, skip, slot_bytes), one program column per segment."""
    kind, premul = _C.reduction(op, dtype)
    if codec not in _C.codec_numbers:
        raise ValueError(f"pycomm: unknown codec {codec!r} (one of {', '.join(_C.codec_numbers)})")
    acc = _C.partial_dtypes.get(dtype, dtype)
    coded = codec != "none"
    exact = bool(exact) and kind in ("sum", "avg", "premul_sum") and dtype.is_floating_point
    if coded and acc != torch.float32:
        raise ValueError(f"pycomm: codecs apply to float32, float16 and bfloat16 data, not {dtype}")
    if coded:
        _check_block(block)
    memory = {torch.bool: torch.uint8}
    in_form = {Form.Input: memory.get(dtype, dtype), Form.Partial: acc, Form.Encoded: torch.uint8}
    out_form = {Stage.Partial: acc, Stage.Final: memory.get(dtype, dtype)}.get(stage, torch.uint8)
    width = block if coded else TILE
    rows = TILE // width
    parts, unit = segments[:2]
    units = -(-count // unit)
    longest = min(count, -(-units // parts) * unit)  # segment 0's elements, the most of any
    runs = _runs([_typed(t, in_form[f]) for t, f in zip(terms, forms)], forms)
    (_fold_kernel_of_one if count == 1 else _fold_kernel)[(triton.cdiv(longest, rows * width), parts)](
        _typed(out, out_form), tuple(r[0] for r in runs), tuple(r[2] for r in runs), tuple(r[3] for r in runs),
        count, *segments, struct.unpack("<q", struct.pack("<d", premul))[0], world_size,
        FORMS=tuple(int(r[1]) for r in runs), RUNS=len(runs), KIND=_C.reduce_kinds[kind], STAGE=int(stage),
        CODEC=_C.codec_numbers[codec], EXACT=exact, QUANTIZE=not (len(terms) == 1 and stage == Stage.Encoded),
        ACC=_TL_TYPES[acc], FLOATING=acc.is_floating_point, OUT_KIND=_OUT_KINDS.get(dtype, 0),
        SEGMENTS=parts > 1 or segments[2] >= 0, ROWS=rows, BLOCK=width, CODE_BYTES=_C.code_bytes.get(codec, 2),
        enable_fp_fusion=False)


def _runs(terms, forms):
    """The terms, in order, as runs [first, form, stride, count]: consecutive terms of one
    form whose addresses step by the same whole number of elements (stride, possibly 0 or
    negative). The layered path's n contributions, pieces of one receive buffer around
    this rank's own input, make at most three runs at any world size."""
    runs = []
    for t, form in zip(terms, forms):
        if runs:
            first, run_form, stride, count = runs[-1]
            step, rest = divmod(t.data_ptr() - first.data_ptr(), t.element_size())
            if run_form == form and first.dtype == t.dtype and not rest and (count == 1 or step == stride * count):
                runs[-1][2:] = [step if count == 1 else stride, count + 1]
                continue
        runs.append([t, form, 0, 1])
    return runs


# ---- the layered path's stamps (``_C.write_stamp``, ``_C.judge_stamps``) ----

@triton.jit(do_not_specialize=["words"])
def _write_words_kernel(dst, words, COUNT: tl.constexpr):
    for i in tl.static_range(COUNT):
        tl.store(dst + i, tl.cast(words[i], tl.int64))


def write_stamp(dst, words):
    """``pycomm._C.write_stamp``: the words are the kernel's arguments, nothing is copied
    from the host."""
    _write_words_kernel[(1,)](dst, tuple(words), COUNT=len(words))


# judge_stamps scans the rows this many at a time.
_JUDGE_ROWS = 64
_NOT_FOUND = 1 << 62


@triton.jit(do_not_specialize=["count", "row_stride", "skip"])
def _judge_kernel(rows, count, row_stride, mine, skip, verdict, WORDS: tl.constexpr, ROWS: tl.constexpr,
                  WIDTH: tl.constexpr, VERDICT: tl.constexpr, NOT_FOUND: tl.constexpr):
    """judge_stamps (runtime/device_runtime.h) by one program: the first difference in row
    order is the smallest p * WORDS + f at which row p differs; the verdict's other words
    are stored, then its first, released to the host."""
    f = tl.arange(0, WIDTH)
    mine_words = tl.load(mine + f, mask=f < WORDS, other=0)
    first = tl.full([], NOT_FOUND, tl.int64)
    for start in range(0, count, ROWS):
        p = start + tl.arange(0, ROWS).to(tl.int64)
        compared = ((p < count) & (p != skip))[:, None] & (f < WORDS)[None, :]
        theirs = tl.load(rows + p[:, None] * row_stride + f[None, :], mask=compared, other=0)
        at = tl.where(compared & (theirs != mine_words[None, :]), p[:, None] * WORDS + f[None, :], NOT_FOUND)
        first = tl.minimum(first, tl.min(at))
    w = tl.arange(0, 8)
    peer, field = first // WORDS, first % WORDS
    # Whether to write, in every lane (the interpreter takes no scalar mask with a vector).
    found = (w * 0 + ((first != NOT_FOUND) & (tl.load(verdict) == 0)).to(tl.int32)) != 0
    words = tl.where(w == 1, peer, tl.where(w == 2, field, 0))
    words = tl.where(w == 3, tl.load(rows + peer * row_stride + field + w * 0, mask=found, other=0), words)
    words = tl.where(w == 4, tl.load(mine + field + w * 0, mask=found, other=0), words)
    words = tl.where(w == 5, tl.load(mine + 1), tl.where(w == 6, tl.load(mine + 2), words))
    tl.store(verdict + w, words, mask=found & (w >= 1) & (w < VERDICT))
    tl.atomic_xchg(verdict + w, w * 0 + 1, mask=found & (w == 0), sem="release", scope="sys")


def judge_stamps(rows, mine, skip, verdict):
    """``pycomm._C.judge_stamps``, one launch."""
    _judge_kernel[(1,)](rows, rows.shape[0], rows.stride(0), mine, skip, verdict, WORDS=mine.numel(),
                        ROWS=_JUDGE_ROWS, WIDTH=_C.MAX_STAMP_WORDS, VERDICT=_C.VERDICT_WORDS, NOT_FOUND=_NOT_FOUND)


_TL_TYPES = {torch.float32: tl.float32, torch.float64: tl.float64, torch.int8: tl.int8, torch.uint8: tl.uint8,
             torch.int32: tl.int32, torch.int64: tl.int64}


def error_feedback(buf, residual, codec, block):
    """The compression hook's error feedback (pycomm/hooks.py) fused: ``buf`` (a flat
    float32, float16 or bfloat16 bucket) becomes g = buf + ``residual`` (float32, or None
    for zeros) in its dtype; returns the new residual g - quantize(buf), zero where not
    finite."""
    _check_block(block)
    state = (torch.empty(buf.numel(), dtype=torch.float32, device=buf.device) if residual is None
             else residual.to(torch.float32).reshape(-1).clone())
    rows = TILE // block
    if buf.numel():
        _error_feedback_kernel[(triton.cdiv(buf.numel(), rows * block),)](
            buf, state, buf.numel(), HAS_RESIDUAL=residual is not None, OUT_KIND=_OUT_KINDS.get(buf.dtype, 0),
            CODEC=_C.codec_numbers[codec], ROWS=rows, BLOCK=block, enable_fp_fusion=False)
    return state


def _check_block(block):
    """The check of pycomm.encode's block (csrc/binding/codecs.cc), with its message."""
    low, high = _C.MIN_COMPRESSION_BLOCK, _C.MAX_COMPRESSION_BLOCK
    if not (low <= block <= high and block & (block - 1) == 0):
        raise ValueError(f"pycomm: block must be a power of two from {low} to {high}, not {block}")
