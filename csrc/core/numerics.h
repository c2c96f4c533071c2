// Per-element arithmetic shared by every device: storage types, their fp32/fp64
// accumulation types, conversions with round-to-nearest-even, and the reduce operators.
//
// Contract: everything here is plain inline code with no host-only dependency, so the
// CUDA kernels include this file and compute bit-identical results to the CPU path.
// 16-bit floats accumulate in fp32 and are rounded once, when a final value is stored.
// Integer SUM/PRODUCT wrap modulo 2^bits (computed in unsigned arithmetic, no UB).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/types.h"

#if defined(__CUDACC__)
#define PYCOMM_HD __host__ __device__ __forceinline__
#else
#define PYCOMM_HD inline
#endif

namespace pycomm {

template <class To, class From>
PYCOMM_HD To bit_cast_(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast size mismatch");
  To to;
  memcpy(&to, &from, sizeof(To));
  return to;
}

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};
struct Bool8 {
  uint8_t value;
};  // torch.bool: one byte holding 0 or 1

// The conversions to and from 16- and 8-bit formats compute in 32-bit integers, take and
// return their codes widened to uint32_t (the code in the low bits), compute every case and
// select one without branches, and convert integers to float from int32_t: a loop over
// them then runs in 32-bit lanes from its loads to its stores, narrowing or widening only
// there, and vectorizes on every x86-64 level (unsigned conversions and narrow
// intermediates would not).

// IEEE binary16 from binary32, round to nearest even; NaN -> quiet NaN keeping the sign,
// overflow -> Inf (the same results as torch's float->half cast).
PYCOMM_HD uint32_t half_bits_from_float(float f) {
  const uint32_t x = bit_cast_<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  const uint32_t special = ax > 0x7f800000u ? 0x7e00u : 0x7c00u;  // NaN, or Inf and overflow
  // Subnormal or zero result: adding 0.5 makes the FPU round at 2^-24.
  const uint32_t sub = bit_cast_<uint32_t>(bit_cast_<float>(ax) + 0.5f) - 0x3f000000u;
  // Normal: rebias the exponent 127 -> 15 and round to nearest even (wraps harmlessly
  // for the lanes that select another case).
  const uint32_t normal = (ax + 0xc8000fffu + ((ax >> 13) & 1u)) >> 13;
  const uint32_t r = ax >= 0x47800000u ? special : ax < 0x38800000u ? sub : normal;
  return sign | r;
}

// The float32 bits of a binary16 infinity or NaN (`em`, its bits but the sign, at least
// 0x7c00): a NaN's payload is kept.
PYCOMM_HD uint32_t float_bits_of_half_special(uint32_t em) { return 0x7f800000u | ((em & 0x3ffu) << 13); }

PYCOMM_HD float float_from_half_bits(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  const uint32_t special = float_bits_of_half_special(em);
  const uint32_t normal = (em << 13) + 0x38000000u;
  const uint32_t sub =
      bit_cast_<uint32_t>(static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-8f);  // em * 2^-24
  return bit_cast_<float>(sign | (em >= 0x7c00u ? special : em >= 0x0400u ? normal : sub));
}

// bfloat16 from binary32, round to nearest even; every NaN -> 0x7fc0 (as torch does).
PYCOMM_HD uint32_t bf16_bits_from_float(float f) {
  const uint32_t x = bit_cast_<uint32_t>(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return (x & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded;
}

PYCOMM_HD float float_from_bf16_bits(uint32_t b) { return bit_cast_<float>(b << 16); }

// Storage type -> accumulation type, and the conversions between them.
template <class T>
struct Numeric {
  using Acc = T;
  static PYCOMM_HD Acc load(T v) { return v; }
  static PYCOMM_HD T store(Acc v) { return v; }
};
template <>
struct Numeric<Half> {
  using Acc = float;
  static PYCOMM_HD Acc load(Half v) { return float_from_half_bits(v.bits); }
  static PYCOMM_HD Half store(Acc v) { return Half{static_cast<uint16_t>(half_bits_from_float(v))}; }
};
template <>
struct Numeric<BFloat16> {
  using Acc = float;
  static PYCOMM_HD Acc load(BFloat16 v) { return float_from_bf16_bits(v.bits); }
  static PYCOMM_HD BFloat16 store(Acc v) { return BFloat16{static_cast<uint16_t>(bf16_bits_from_float(v))}; }
};
template <>
struct Numeric<Bool8> {
  using Acc = uint8_t;
  static PYCOMM_HD Acc load(Bool8 v) { return v.value; }
  static PYCOMM_HD Bool8 store(Acc v) { return Bool8{static_cast<uint8_t>(v != 0)}; }
};

template <class T>
using AccOf = typename Numeric<T>::Acc;

// Wrapping integer arithmetic: signed overflow is undefined in C++, unsigned is not.
template <class A>
PYCOMM_HD A wrap_add(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}
template <class A>
PYCOMM_HD A wrap_mul(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    // Promote through unsigned int so that uint8/int8 products do not go via signed int.
    using U = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  } else {
    return a * b;
  }
}

// The binary operator of a reduction on accumulation values. NaN propagates through
// MIN/MAX (as torch does), so every rank sees NaN in the same positions.
template <ReduceKind K, class A>
PYCOMM_HD A reduce_op(A a, A b) {
  if constexpr (K == ReduceKind::Sum || K == ReduceKind::Avg || K == ReduceKind::PremulSum) {
    return wrap_add(a, b);
  } else if constexpr (K == ReduceKind::Product) {
    return wrap_mul(a, b);
  } else if constexpr (K == ReduceKind::Min) {
    if constexpr (std::is_floating_point_v<A>) {
      if (a != a) return a;
      if (b != b) return b;
    }
    return b < a ? b : a;
  } else if constexpr (K == ReduceKind::Max) {
    if constexpr (std::is_floating_point_v<A>) {
      if (a != a) return a;
      if (b != b) return b;
    }
    return a < b ? b : a;
  } else if constexpr (std::is_integral_v<A>) {
    if constexpr (K == ReduceKind::BitAnd) return static_cast<A>(a & b);
    if constexpr (K == ReduceKind::BitOr) return static_cast<A>(a | b);
    if constexpr (K == ReduceKind::BitXor) return static_cast<A>(a ^ b);
  }
  return a;  // unreachable: check_reducible rejects bitwise ops on floats
}

// What a rank contributes: its own value, scaled first for PREMUL_SUM.
template <ReduceKind K, class A>
PYCOMM_HD A contribution(A v, A premul) {
  if constexpr (K == ReduceKind::PremulSum) return v * premul;
  return v;
}

// Applied once to the fully reduced value, before it is rounded to the storage type.
// Integer AVG truncates toward zero, as NCCL does.
template <ReduceKind K, class A>
PYCOMM_HD A finalize(A v, int world_size) {
  if constexpr (K == ReduceKind::Avg) return static_cast<A>(v / static_cast<A>(world_size));
  return v;
}

// ---- Exact mode (PYCOMM_DETERMINISTIC=exact) ----
//
// The terms of one element are added in fixed point on the grid 2^(E - kFracBits), where
// E is the element's own exponent: the smallest with |x| < 2^E for every finite term
// (E >= -125, so subnormals share the grid of the smallest normals). Only the largest
// magnitude decides E, so neither the order of the terms, nor which rank holds which, nor
// extra zero terms change it. Each term is rounded to nearest even onto the grid, the
// integers are added exactly, and the sum is rounded once to the accumulation format.
//   float accumulation (float32, float16, bfloat16 data): kFracBits = 36; a term is at
//     most 2^36 grid steps, so up to 2^16 of them add exactly in a double's 53 bits.
//     A float term within a factor 2^12 of the largest is on the grid already.
//   double accumulation: kFracBits = 110, added in 128-bit integers, exact likewise.
// Error against the exact sum: at most k * 2^(E - kFracBits - 1) + half an ulp of the
// result. Non-finite terms do not enter the sum (see exact_nonfinite).
constexpr int kExactMaxTerms = 1 << 16;
// 1.5 * 2^52: adding it to a double of magnitude below 2^51 rounds it to an integer
// (to nearest even), subtracting it again is exact.
constexpr double kRoundToInteger = 6755399441055744.0;

// |v|'s bits as a signed integer: orders magnitudes, and every non-finite value lies
// above every finite one. A signed 32-bit max vectorizes (SSE2) where a float one does not.
PYCOMM_HD int32_t magnitude_bits(float v) { return bit_cast_<int32_t>(v) & 0x7fffffff; }
PYCOMM_HD int64_t magnitude_bits(double v) { return bit_cast_<int64_t>(v) & 0x7fffffffffffffffLL; }
PYCOMM_HD bool nonfinite_magnitude(int32_t a) { return a >= 0x7f800000; }
PYCOMM_HD bool nonfinite_magnitude(int64_t a) { return a >= 0x7ff0000000000000LL; }
// |v|'s bits, 0 for a non-finite v: a block's largest finite magnitude is their max.
PYCOMM_HD int32_t finite_magnitude(float v) {
  const int32_t a = magnitude_bits(v);
  return nonfinite_magnitude(a) ? 0 : a;
}

// 2^(kFracBits - E) and its inverse for the largest finite magnitude `amax` (its bits),
// for float accumulation: both are exact powers of two within double's range.
constexpr int kExactFracBits = 36;
struct ExactGrid {
  double up, down;
};
PYCOMM_HD ExactGrid exact_grid(int32_t amax) {
  const int32_t biased = amax >> 23;
  const int64_t e = (biased > 1 ? biased : 1) - 126;  // E: |x| < 2^E
  return ExactGrid{bit_cast_<double>((1023 + kExactFracBits - e) << 52),
                   bit_cast_<double>((1023 - kExactFracBits + e) << 52)};
}
// v (finite) rounded to the grid, in grid steps: an integer held exactly in a double.
// v * up is exact (a power-of-two scaling), so a fused multiply-add changes nothing.
PYCOMM_HD double exact_grid_steps(float v, double up) {
  return (static_cast<double>(v) * up + kRoundToInteger) - kRoundToInteger;
}
// The sum of grid steps back in float, rounded once (sum * down is exact).
PYCOMM_HD float exact_grid_value(double steps, double down) { return static_cast<float>(steps * down); }

// The same for double accumulation, per element, in 128-bit integers.
constexpr int kExactFracBits64 = 110;
PYCOMM_HD int exact_exponent64(int64_t amax) {
  const int64_t biased = amax >> 52;
  return static_cast<int>((biased > 1 ? biased : 1) - 1022);
}
PYCOMM_HD __int128 exact_grid_steps64(double v, int exponent) {
  const double q = ldexp(v, kExactFracBits64 - exponent);  // |q| < 2^110, exact
  // Doubles of magnitude >= 2^52 are integers already; smaller ones round as above.
  return static_cast<__int128>(fabs(q) < 4503599627370496.0 ? (q + kRoundToInteger) - kRoundToInteger : q);
}
PYCOMM_HD double exact_grid_value64(__int128 steps, int exponent) {
  return ldexp(static_cast<double>(steps), exponent - kExactFracBits64);
}

// The sum of terms of which one or more is not finite: NaN if a term is NaN or both
// infinities occur, else the infinity that occurs. `seen`: bit 0 NaN, bit 1 +Inf, bit 2 -Inf.
template <class A>
PYCOMM_HD uint32_t nonfinite_kind(A v) {
  return v != v ? 1u : v > 0 ? 2u : 4u;
}
// The NaN is the positive quiet NaN on every device.
template <class A>
PYCOMM_HD A exact_nonfinite(uint32_t seen) {
  using Bits = std::conditional_t<sizeof(A) == 4, uint32_t, uint64_t>;
  constexpr int kMant = sizeof(A) == 4 ? 23 : 52, kExp = sizeof(A) == 4 ? 8 : 11;
  constexpr Bits kInf = (~Bits{0} >> (sizeof(A) * 8 - kExp)) << kMant;
  constexpr Bits kSign = Bits{1} << (sizeof(A) * 8 - 1);
  const bool nan = (seen & 1u) || (seen & 6u) == 6u;
  return bit_cast_<A>(nan ? kInf | (Bits{1} << (kMant - 1)) : (seen & 2u) ? kInf : kSign | kInf);
}

// ---- Binned exact sums (the gradient accumulator of pycomm.exact_data_parallel) ----
//
// A sum of float terms (float32 or narrower) whose value depends only on the multiset of
// terms: neither their order nor how they were split into partial sums merged later (on
// other ranks, in any order) changes a bit. An element's state is the index I of its top
// bin and two doubles, hi and lo. Bin b is the grid 2^(32 b) below 2^(32 (b + 1)); I is
// the bin of the largest finite nonzero |term| (b = floor(e / 32) for 2^e <= |x| <
// 2^(e + 1)). A term x enters as its bits in bins I and I - 1, truncated toward zero:
//   hi += trunc_I(x),  lo += trunc_(I-1)(x) - trunc_I(x),
//   trunc_b(x) = trunc(x / 2^(32 b)) * 2^(32 b)
// Each addend is an integer below 2^32 in its bin's units, so up to kBinnedMaxTerms
// terms add exactly in a double's 53 bits, whatever the order. A larger term raises I and
// shifts the bins (lo = hi, hi = 0; or both 0 for a rise of two or more): the bits that
// fall off are exactly those each earlier term would have lost had I been the larger one
// from the start, so the state is a function of the multiset alone. Two states merge by
// aligning both to the larger I and adding hi and lo (exactly, so in any order).
// Error against the exact sum: each term loses less than 2^(32 (I - 1)), at most 2^-32
// of the largest |term|; the value is then rounded once (binned_value).
// Non-finite terms are added into hi, which stays non-finite from then on (shifts keep
// it): NaN if a NaN or both infinities occurred, else that infinity.
constexpr int kBinBits = 32;
constexpr int8_t kNoBin = -128;  // the index while no finite nonzero term was added
constexpr int64_t kBinnedMaxTerms = int64_t{1} << 20;

// 2^(32 b) for the bins of float32 values and their inverses (|b| <= 6): exact.
PYCOMM_HD double bin_unit(int b) { return bit_cast_<double>(static_cast<int64_t>(1023 + kBinBits * b) << 52); }

// The bin of a finite nonzero float (subnormals share the bin of 2^-126).
PYCOMM_HD int32_t bin_of_magnitude(int32_t magnitude) {
  const int32_t biased = magnitude >> 23;
  const int32_t e = (biased > 1 ? biased : 1) - 127;
  return (e + 8 * kBinBits) / kBinBits - 8;  // floor(e / 32) for e >= -256
}
PYCOMM_HD int8_t bin_of(float x) { return static_cast<int8_t>(bin_of_magnitude(magnitude_bits(x))); }

// q truncated toward zero, for |q| < 2^51: rounded to an integer by adding and subtracting
// 1.5 * 2^52 (to nearest), then stepped back toward zero where that rounded away. No
// branch and no integer conversion, so that loops of it vectorize.
PYCOMM_HD double trunc_small(double q) {
  const double r = (q + 0x1.8p52) - 0x1.8p52;
  return r - (q >= 0 ? (r > q ? 1.0 : 0.0) : (r < q ? -1.0 : 0.0));
}

// A finite term that does not raise the index (bin_of(x) <= index, or x == 0) added into
// the bins. Scalings by powers of two are exact, and each quotient is below 2^32 in
// magnitude; x - top is exact and has x's sign, so the second addend is
// trunc_(I-1)(x) - trunc_I(x). A zero adds +0.0 or -0.0, which change no bin (bins are
// never -0.0: they start at +0.0, and a sum that cancels is +0.0).
PYCOMM_HD void binned_add_within(int8_t index, double& hi, double& lo, float x) {
  const int b = index == kNoBin ? 0 : index;  // no bin yet: x == 0, and any finite unit will do
  const double v = x;
  const double top = trunc_small(v * bin_unit(-b)) * bin_unit(b);
  hi += top;
  lo += trunc_small((v - top) * bin_unit(1 - b)) * bin_unit(b - 1);
}

// The bins shifted up by `rise` (>= 0) bins: hi moves into lo, lo out of the state; two
// bins or more, both out. A non-finite hi stays (its lo no longer counts); no rise changes
// nothing. Written as selects (no branch, no integer conversion of a double), so that
// loops of it vectorize.
PYCOMM_HD void binned_raise(int32_t rise, double& hi, double& lo) {
  const bool finite = !nonfinite_magnitude(magnitude_bits(hi));
  lo = rise == 0 ? lo : !finite || rise >= 2 ? 0.0 : hi;
  hi = finite && rise > 0 ? 0.0 : hi;
}

// The state shifted to index `to` (>= index).
PYCOMM_HD void binned_align(int8_t& index, double& hi, double& lo, int8_t to) {
  binned_raise(to - index, hi, lo);
  index = to;
}

// binned_add of a finite term: binned_raise to the term's bin where it is above the index.
PYCOMM_HD void binned_add_finite(int8_t& index, double& hi, double& lo, float x) {
  const int32_t a = magnitude_bits(x);
  const int32_t to = a != 0 && bin_of_magnitude(a) > index ? bin_of_magnitude(a) : index;
  binned_raise(to - index, hi, lo);
  index = static_cast<int8_t>(to);
  binned_add_within(index, hi, lo, x);
}

PYCOMM_HD void binned_add(int8_t& index, double& hi, double& lo, float x) {
  if (nonfinite_magnitude(magnitude_bits(x))) hi += x;
  else binned_add_finite(index, hi, lo, x);
}

// hi + lo rounded to a double by round-to-odd (the exact sum's last bit kept sticky), so
// that rounding it once more to float32 gives the exact sum correctly rounded.
// A non-finite hi is the value. Written as selects, so that loops of it vectorize.
PYCOMM_HD double binned_value(double hi, double lo) {
  const double s = hi + lo;
  const double b = s - hi;
  const double error = (hi - (s - b)) + (lo - b);  // hi + lo - s, exactly (TwoSum)
  const int64_t bits = bit_cast_<int64_t>(s);
  const int64_t toward = (error > 0) == (s > 0) ? 1 : -1;  // one ulp toward the exact sum
  const int64_t odd = error == 0.0 || (bits & 1) ? bits : bits + toward;
  return nonfinite_magnitude(magnitude_bits(hi)) ? hi : bit_cast_<double>(odd);
}

// ---- Wire codecs (compression) ----
//
// An encoded buffer of n elements is cut into blocks of `block` elements (the last may be
// shorter), each with an fp32 scale and its codes (laid out as "The wire layout" below
// says). The scale is a power of two, 2^e,
// chosen per block as the smallest that brings the block's largest finite magnitude
// within the code's `kTarget`; a code holds value / scale rounded to nearest even, so a
// decoded value is code * scale. Power-of-two scales make the scaling exact: encoding is
// the plain float -> format cast of value * 2^-e, bit for bit the cast torch does, and
// quantizing twice gives the same bits as quantizing once.
// NaN and +-Inf keep their kind and sign and do not enter the scale, so one Inf leaves
// its block's finite neighbours intact. Finite values never overflow the format (the
// scale prevents it) nor come back infinite: close to float32's maximum, where the
// nearest code times the scale would exceed it, the block encoder saturates that code
// one step down. e4m3 has no Inf code, so this codec reserves its largest finite code,
// 0x7e (448), for Inf and scales finite values to at most 416, the next code down.

// 8-bit float (1 sign, E exponent, M mantissa bits, bias 2^(E-1)-1) from a float that is
// finite and within the format's range: round to nearest even, subnormals included.
template <int E, int M>
PYCOMM_HD uint32_t fp8_bits_from_finite(float f) {
  constexpr uint32_t kBias = (1u << (E - 1)) - 1;
  constexpr uint32_t kMinNormal = (127 + 1 - kBias) << 23;        // bits of 2^(1-bias)
  constexpr uint32_t kMagic = (127 + 1 - kBias + 23 - M) << 23;   // ulp of the subnormals = 1
  const uint32_t x = bit_cast_<uint32_t>(f);
  const uint32_t sign = (x >> 24) & 0x80u;
  const uint32_t ax = x & 0x7fffffffu;
  const uint32_t sub = bit_cast_<uint32_t>(bit_cast_<float>(ax) + bit_cast_<float>(kMagic)) - kMagic;
  const uint32_t rounded = ax + ((1u << (22 - M)) - 1) + ((ax >> (23 - M)) & 1u);
  const uint32_t normal = (rounded >> (23 - M)) - ((127 - kBias) << M);
  return sign | (ax < kMinNormal ? sub : normal);
}

// The float value of a finite 8-bit code (exponent field not all ones for e5m2).
template <int E, int M>
PYCOMM_HD float float_from_fp8_finite(uint32_t c) {
  constexpr uint32_t kBias = (1u << (E - 1)) - 1;
  const uint32_t sign = (c & 0x80u) << 24;
  const uint32_t em = c & 0x7fu;  // exponent and mantissa
  const uint32_t normal = ((em << (23 - M)) + ((127 - kBias) << 23));
  const uint32_t sub =
      bit_cast_<uint32_t>(static_cast<float>(static_cast<int32_t>(em)) * bit_cast_<float>((127 + 1 - kBias - M) << 23));
  return bit_cast_<float>(sign | (em < (1u << M) ? sub : normal));
}

// One code format per codec: Code (the stored integer), kScaled (whether blocks are
// scaled at all), kTarget (the largest magnitude a finite scaled value may have), kNan and
// kInf (the codes of every NaN and of +infinity), encode(scaled value, any float) -> the
// code widened to uint32_t, decode(code).
// Every NaN has one code in each format (0x7e00 here, 0x7fc0 in bf16, 0x7f in fp8): a NaN
// that arithmetic makes has no portable sign (x86 makes 0xffc00000, a GPU 0x7fffffff), and
// the codes must be the same bytes on every device.

// The code of v, given `rounded`: v rounded to nearest even in Code's format where v is
// finite (by the software conversions here, or by a GPU's instructions in
// cuda/conversions.cuh); Code's NaN code for a NaN, its infinity with v's sign for one.
template <class Code>
PYCOMM_HD uint32_t code_of(float v, uint32_t rounded) {
  constexpr int kBits = 8 * sizeof(typename Code::Code);
  const uint32_t x = bit_cast_<uint32_t>(v), ax = x & 0x7fffffffu;
  const uint32_t inf = ((x >> (32 - kBits)) & (1u << (kBits - 1))) | Code::kInf;
  return ax > 0x7f800000u ? Code::kNan : ax == 0x7f800000u ? inf : rounded;
}

struct CodeFp16 {
  using Code = uint16_t;
  static constexpr bool kScaled = true;
  static constexpr float kTarget = 65504.0f;
  static constexpr uint32_t kNan = 0x7e00u, kInf = 0x7c00u;
  static PYCOMM_HD uint32_t encode(float v) { return code_of<CodeFp16>(v, half_bits_from_float(v)); }
  static PYCOMM_HD float decode(uint32_t c) { return float_from_half_bits(c); }
};
struct CodeBf16 {  // fp32's range: the scale is always 1
  using Code = uint16_t;
  static constexpr bool kScaled = false;
  static constexpr float kTarget = 3.4028234663852886e38f;
  static constexpr uint32_t kNan = 0x7fc0u, kInf = 0x7f80u;
  static PYCOMM_HD uint32_t encode(float v) { return code_of<CodeBf16>(v, bf16_bits_from_float(v)); }
  static PYCOMM_HD float decode(uint32_t c) { return float_from_bf16_bits(c); }
};
// The 8-bit codes: NaN is 0x7f (and, for e5m2, every code above Inf's); Inf is kInf,
// with the sign bit for -Inf.
template <int E, int M, uint32_t kInfCode>
struct CodeFp8 {
  using Code = uint8_t;
  static constexpr int kExponentBits = E, kMantissaBits = M;
  static constexpr bool kScaled = true;
  static constexpr uint32_t kNan = 0x7fu, kInf = kInfCode;
  static PYCOMM_HD uint32_t encode(float v) { return code_of<CodeFp8>(v, fp8_bits_from_finite<E, M>(v)); }
  // The value of code c, given `magnitude`: |c|'s value where c is finite.
  static PYCOMM_HD float value_of(uint32_t c, float magnitude) {
    const uint32_t sign = (c & 0x80u) << 24, em = c & 0x7fu;
    return bit_cast_<float>(em > kInf    ? 0x7fc00000u
                            : em == kInf ? sign | 0x7f800000u
                                         : sign | bit_cast_<uint32_t>(magnitude));
  }
  static PYCOMM_HD float decode(uint32_t c) { return value_of(c, float_from_fp8_finite<E, M>(c & 0x7fu)); }
};
// e4m3 has no Inf: its largest finite code (448) stands for it, finite values stay <= 416.
struct CodeFp8E4M3 : CodeFp8<4, 3, 0x7e> {
  static constexpr float kTarget = 416.0f;
};
struct CodeFp8E5M2 : CodeFp8<5, 2, 0x7c> {
  static constexpr float kTarget = 57344.0f;
};

// 2^e for the block whose largest finite magnitude is `amax`: the smallest power of two
// (e in [-126, 126], so that 2^-e is normal too) with amax / 2^e <= kTarget; 1 for a block
// without finite non-zeros, and for unscaled codes.
template <class Code>
PYCOMM_HD float block_scale(float amax) {
  if (!Code::kScaled || !(amax > 0.0f)) return 1.0f;
  const float target = Code::kTarget;  // a value here: device code cannot refer to the member
  // amax = m * 2^p with m in [1, 2): start just below the answer, then step to it.
  const int p = static_cast<int>((bit_cast_<uint32_t>(amax) >> 23) & 0xff) - 127;
  const int t = static_cast<int>((bit_cast_<uint32_t>(target) >> 23) & 0xff) - 127;
  int e = p - t - 1;
  if (e < -126) e = -126;
  if (e > 126) e = 126;
  while (e < 126 && amax * bit_cast_<float>(static_cast<uint32_t>(127 - e) << 23) > target) ++e;
  return bit_cast_<float>(static_cast<uint32_t>(127 + e) << 23);
}

// 2^-e for the scale 2^e of block_scale (exact).
PYCOMM_HD float inverse_scale(float scale) { return bit_cast_<float>((254u << 23) - bit_cast_<uint32_t>(scale)); }

// Near float32's maximum the nearest code times the scale can exceed it; then finite
// values saturate one code down instead of coming back infinite. Rounding is monotonic,
// so only a block whose largest finite magnitude `amax` overflows can hold such a code.
template <class Code>
PYCOMM_HD bool block_may_overflow(float amax, float scale) {
  return magnitude_bits(Code::decode(Code::encode(amax * inverse_scale(scale))) * scale) == 0x7f800000;
}
// `code` (v's, in a block that may overflow), one code down if v is finite and the code
// would decode to infinity.
template <class Code>
PYCOMM_HD uint32_t saturated_code(float v, uint32_t code, float scale) {
  const bool overflows = magnitude_bits(Code::decode(code) * scale) == 0x7f800000;
  return !nonfinite_magnitude(magnitude_bits(v)) && overflows ? code - 1 : code;
}

// ---- The wire layout of encoded data ----
//
// n elements encoded in blocks of `block` elements (a piece, which every step encodes and
// decodes whole): every element's code, in element order, then every block's fp32 scale,
// in block order. Both arrays start on a kPieceAlign boundary of the piece, and the piece's
// size is a multiple of kPieceAlign (padding bytes are zero), so pieces laid end to end
// stay aligned and kernels move codes and scales with 16-byte accesses. kCodeLayout
// numbers this layout in every coded operation's stamp (core/wire.h): ranks on different
// layouts fail the operation's first frame instead of misreading it. Layout 1 interleaved
// the two, [fp32 scale][codes] per block.
constexpr uint8_t kCodeLayout = 2;
constexpr size_t kPieceAlign = 16;

PYCOMM_HD constexpr size_t piece_aligned(size_t bytes) { return (bytes + kPieceAlign - 1) / kPieceAlign * kPieceAlign; }

// The codes and scales of a piece's records from some block on; Byte is char, or const
// char for encoded data that is only read.
template <class Byte>
struct Records {
  using Scale = std::conditional_t<std::is_const_v<Byte>, const float, float>;
  Byte* codes;
  Scale* scales;
  // The records from block b on, of blocks of `block` codes of `code_bytes` each.
  PYCOMM_HD Records from(size_t b, size_t block, size_t code_bytes) const {
    return {codes + b * block * code_bytes, scales + b};
  }
};

// The records of the piece at `piece`, of n codes of `code_bytes` each.
template <class Byte>
PYCOMM_HD Records<Byte> records_of(Byte* piece, size_t n, size_t code_bytes) {
  return {piece, reinterpret_cast<typename Records<Byte>::Scale*>(piece + piece_aligned(n * code_bytes))};
}

// Bytes of a piece of n elements encoded with `block`-element blocks of Code.
template <class Code>
PYCOMM_HD size_t encoded_size(size_t n, size_t block) {
  return piece_aligned(n * sizeof(typename Code::Code)) + piece_aligned((n + block - 1) / block * sizeof(float));
}

// Zeroes the padding of a piece of n elements (after its codes, after its scales): every
// encoder does, so that no byte of a piece is left unwritten.
template <class Code>
PYCOMM_HD void zero_padding(char* piece, size_t n, size_t block) {
  const size_t codes = n * sizeof(typename Code::Code), scales = piece_aligned(codes);
  const size_t scales_end = scales + (n + block - 1) / block * sizeof(float);
  memset(piece + codes, 0, scales - codes);
  memset(piece + scales_end, 0, encoded_size<Code>(n, block) - scales_end);
}

// The most elements (a multiple of `block`) whose piece fits in `bytes`; 0 where none does.
template <class Code>
PYCOMM_HD size_t elements_within(size_t bytes, size_t block) {
  const size_t room = bytes > 2 * kPieceAlign ? bytes - 2 * kPieceAlign : 0;  // both arrays' padding
  return room / (block * sizeof(typename Code::Code) + sizeof(float)) * block;
}

}  // namespace pycomm
