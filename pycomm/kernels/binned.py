"""The binned sums of pycomm.exact_data_parallel (core/numerics.h, "Binned exact sums") as
Triton kernels, for the accumulator's state on CUDA tensors: the contract of the ``_C``
functions of the same names (csrc/binding/accumulator.h) and the CPU's bits, element for
element (NaN's payload aside: every NaN's value is the positive quiet NaN). Tested on the
CPU under ``TRITON_INTERPRET=1``. The exactness rules of pycomm.kernels.triton hold: no
fused multiply-add, every scaling an exact power of two, float64 division correctly
rounded, conversions to 16-bit floats with integer bit operations.
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from .. import _C
from .numerics import ROUND_TO_INTEGER, TILE, bf16_bits, half_bits

_OUT_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# numerics.h kBinBits (bin b holds multiples of 2^(BIN_BITS (b - 1))) and kNoBin (the index
# while no finite nonzero term was added).
BIN_BITS = tl.constexpr(_C.BIN_BITS)
NO_BIN = tl.constexpr(_C.NO_BIN)


@triton.jit
def _bin_unit(b):
    """2^(BIN_BITS b) as float64, exact for the bins of float32 values."""
    return ((b * BIN_BITS + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)  # b first: see triton.py's up


@triton.jit
def _trunc_small(q):
    """numerics.h trunc_small: q truncated toward zero, for |q| < 2^51."""
    r = (q + ROUND_TO_INTEGER) - ROUND_TO_INTEGER
    return r - tl.where(q >= 0, tl.where(r > q, 1.0, 0.0), tl.where(r < q, -1.0, 0.0))


@triton.jit
def _finite64(v):
    return (v.to(tl.int64, bitcast=True) & 0x7FFFFFFFFFFFFFFF) < 0x7FF0000000000000


@triton.jit
def _align(index, hi, lo, to):
    """numerics.h binned_align: the state (index, hi, lo) shifted to `to` (>= index)."""
    rise = to - index
    finite = _finite64(hi)
    lo = tl.where(rise == 0, lo, tl.where((~finite) | (rise >= 2), 0.0, hi))
    hi = tl.where(finite & (rise > 0), 0.0, hi)
    return hi, lo


@triton.jit
def _add(index, hi, lo, x):
    """numerics.h binned_add of the float32 x: the new (index, hi, lo)."""
    a = (x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF).to(tl.int32)
    nonfinite = a >= 0x7F800000
    b = (tl.maximum(a >> 23, 1) - 127 + 8 * BIN_BITS) // BIN_BITS - 8  # bin_of_magnitude
    to = tl.where((a != 0) & (~nonfinite) & (b > index), b, index)
    raised_hi, raised_lo = _align(index, hi, lo, to)
    unit = tl.where(to == NO_BIN, 0, to)  # no bin yet: x is 0, and any finite unit will do
    v = x.to(tl.float64)
    top = _trunc_small(v * _bin_unit(-unit)) * _bin_unit(unit)
    new_hi = raised_hi + top
    new_lo = raised_lo + _trunc_small((v - top) * _bin_unit(1 - unit)) * _bin_unit(unit - 1)
    return tl.where(nonfinite, index, to), tl.where(nonfinite, hi + v, new_hi), tl.where(nonfinite, lo, new_lo)


@triton.jit
def _add_kernel(index, hi, lo, terms, n, EMPTY: tl.constexpr, IN_KIND: tl.constexpr, TILE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offs < n
    if IN_KIND == 1:
        x = tl.load(terms.to(tl.pointer_type(tl.float16), bitcast=True) + offs, mask=mask, other=0).to(tl.float32)
    elif IN_KIND == 2:
        bits = tl.load(terms.to(tl.pointer_type(tl.uint16), bitcast=True) + offs, mask=mask, other=0)
        x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(terms + offs, mask=mask, other=0)
    if EMPTY:
        i = tl.full(offs.shape, NO_BIN, tl.int32)
        h = tl.zeros(offs.shape, tl.float64)
        lo_ = tl.zeros(offs.shape, tl.float64)
    else:
        i = tl.load(index + offs, mask=mask, other=NO_BIN).to(tl.int32)
        h = tl.load(hi + offs, mask=mask, other=0)
        lo_ = tl.load(lo + offs, mask=mask, other=0)
    i, h, lo_ = _add(i, h, lo_, x)
    tl.store(index + offs, i.to(tl.int8), mask=mask)
    tl.store(hi + offs, h, mask=mask)
    tl.store(lo + offs, lo_, mask=mask)


@triton.jit
def _merge_kernel(index, hi, lo, other_index, other_hi, other_lo, n, ALIGN_ONLY: tl.constexpr, TILE: tl.constexpr):
    """ALIGN_ONLY: the state aligned to other_index (align_bins); else the other state
    added (merge_bins)."""
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offs < n
    i = tl.load(index + offs, mask=mask, other=NO_BIN).to(tl.int32)
    j = tl.load(other_index + offs, mask=mask, other=NO_BIN).to(tl.int32)
    to = tl.maximum(i, j)
    h, lo_ = _align(i, tl.load(hi + offs, mask=mask, other=0), tl.load(lo + offs, mask=mask, other=0), to)
    if not ALIGN_ONLY:
        their_hi, their_lo = _align(j, tl.load(other_hi + offs, mask=mask, other=0),
                                    tl.load(other_lo + offs, mask=mask, other=0), to)
        h = h + their_hi
        lo_ = lo_ + their_lo
    tl.store(index + offs, to.to(tl.int8), mask=mask)
    tl.store(hi + offs, h, mask=mask)
    tl.store(lo + offs, lo_, mask=mask)


@triton.jit
def _value_kernel(out, hi, lo, n, divisor_bits: tl.int64, OUT_KIND: tl.constexpr, TILE: tl.constexpr):
    """numerics.h binned_value (hi + lo rounded to odd) / divisor, rounded once to float32,
    then to the output's type; NaN the positive quiet NaN."""
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offs < n
    h = tl.load(hi + offs, mask=mask, other=0)
    l = tl.load(lo + offs, mask=mask, other=0)
    s = h + l
    b = s - h
    error = (h - (s - b)) + (l - b)
    bits = s.to(tl.int64, bitcast=True)
    odd = tl.where((error == 0) | ((bits & 1) != 0), bits, bits + tl.where((error > 0) == (s > 0), 1, -1))
    total = tl.where(_finite64(h), odd.to(tl.float64, bitcast=True), h)
    v = tl.where(total != total, 0x7FC00000, ((total / divisor_bits.to(tl.float64, bitcast=True)).to(tl.float32)
                                              ).to(tl.uint32, bitcast=True)).to(tl.float32, bitcast=True)
    if OUT_KIND == 1:
        tl.store(out.to(tl.pointer_type(tl.uint16), bitcast=True) + offs, half_bits(v).to(tl.uint16), mask=mask)
    elif OUT_KIND == 2:
        tl.store(out.to(tl.pointer_type(tl.uint16), bitcast=True) + offs, bf16_bits(v).to(tl.uint16), mask=mask)
    else:
        tl.store(out + offs, v, mask=mask)


def _check_state(index, hi, lo, *others):
    n = index.numel()
    for t, dtype in [(index, torch.int8), (hi, torch.float64), (lo, torch.float64)]:
        if t.dtype != dtype or t.numel() != n or not t.is_contiguous():
            raise ValueError("pycomm: exact accumulator: the state is a contiguous int8 index and float64 hi and lo "
                             "of one length")
    for t in others:
        if t.numel() != n or not t.is_contiguous():
            raise ValueError(f"pycomm: exact accumulator: an operand has {t.numel()} elements, not {n}, or is not "
                             "contiguous")
    return n


def _gradient_kind(t):
    if t.dtype not in _OUT_KINDS:
        raise ValueError(f"pycomm: the exact accumulator takes float32, float16 or bfloat16 gradients, not {t.dtype}")
    return _OUT_KINDS[t.dtype]


def _grid(n):
    return (triton.cdiv(n, TILE),)


def add_to_bins(index, hi, lo, terms, empty=False):
    """``_C.add_to_bins`` on the state's device: each tensor of ``terms`` added in turn
    (the state depends only on the multiset of its terms, so this gives the C++ bits)."""
    if not terms and empty:
        raise ValueError("pycomm: exact accumulator: an empty state needs at least one term")
    for t in terms:
        n = _check_state(index, hi, lo, t)
        if t.dtype != terms[0].dtype:
            raise ValueError(f"pycomm: exact accumulator: the gradients added together are of one dtype, not "
                             f"{terms[0].dtype} and {t.dtype}")
    for j, t in enumerate(terms):
        if n:
            _add_kernel[_grid(n)](index, hi, lo, t, n, EMPTY=bool(empty) and j == 0, IN_KIND=_gradient_kind(t),
                                  TILE=TILE, enable_fp_fusion=False)


def align_bins(index, hi, lo, to):
    """``_C.align_bins`` on the state's device (``to`` at least the state's indices)."""
    n = _check_state(index, hi, lo, to)
    if n:
        _merge_kernel[_grid(n)](index, hi, lo, to, hi, lo, n, ALIGN_ONLY=True, TILE=TILE,
                                enable_fp_fusion=False)


def merge_bins(index, hi, lo, other_index, other_hi, other_lo):
    """``_C.merge_bins`` on the state's device."""
    n = _check_state(index, hi, lo)
    _check_state(other_index, other_hi, other_lo, index)
    if n:
        _merge_kernel[_grid(n)](index, hi, lo, other_index, other_hi, other_lo, n, ALIGN_ONLY=False, TILE=TILE,
                                enable_fp_fusion=False)


def value_of_bins(out, hi, lo, divisor):
    """``_C.value_of_bins`` on the state's device."""
    n = out.numel()
    if hi.numel() != n or lo.numel() != n or hi.dtype != torch.float64 or lo.dtype != torch.float64:
        raise ValueError("pycomm: exact accumulator: hi and lo are float64 of the output's length")
    if not divisor > 0:
        raise ValueError(f"pycomm: exact accumulator: divisor {divisor} is not positive")
    kind = _gradient_kind(out)
    if n:
        _value_kernel[_grid(n)](out, hi, lo, n, struct.unpack("<q", struct.pack("<d", float(divisor)))[0],
                                OUT_KIND=kind, TILE=TILE, enable_fp_fusion=False)
