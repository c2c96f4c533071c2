// Per-element arithmetic shared by every device: storage types, their fp32/fp64
// accumulation types, conversions with round-to-nearest-even, and the reduce operators.
//
// Contract: everything here is plain inline code with no host-only dependency, so the
// CUDA kernels include this file and compute bit-identical results to the CPU path.
// 16-bit floats accumulate in fp32 and are rounded once, when a final value is stored.
// Integer SUM/PRODUCT wrap modulo 2^bits (computed in unsigned arithmetic, no UB).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "types.h"

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

struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };
struct Bool8 { uint8_t value; };  // torch.bool: one byte holding 0 or 1

// IEEE binary16 from binary32, round to nearest even; NaN -> quiet NaN keeping the sign,
// overflow -> Inf (the same results as torch's float->half cast).
PYCOMM_HD uint16_t half_bits_from_float(float f) {
  const uint32_t x = bit_cast_<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x47800000u) return sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (ax < 0x38800000u) {  // result is subnormal or zero: let the FPU round at 2^-24
    const float magic = 0.5f;
    const float v = bit_cast_<float>(ax) + magic;
    return static_cast<uint16_t>(sign | (bit_cast_<uint32_t>(v) - bit_cast_<uint32_t>(magic)));
  }
  const uint32_t mant_odd = (ax >> 13) & 1u;
  ax += 0xc8000fffu + mant_odd;  // rebias exponent 127 -> 15 and round to nearest even
  return static_cast<uint16_t>(sign | (ax >> 13));
}

PYCOMM_HD float float_from_half_bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) return bit_cast_<float>(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
  if (em >= 0x0400u) return bit_cast_<float>(sign | ((em << 13) + 0x38000000u));
  const float mag = static_cast<float>(em) * 5.9604644775390625e-8f;  // em * 2^-24, exact
  return bit_cast_<float>(sign | bit_cast_<uint32_t>(mag));
}

// bfloat16 from binary32, round to nearest even; every NaN -> 0x7fc0 (as torch does).
PYCOMM_HD uint16_t bf16_bits_from_float(float f) {
  if (f != f) return 0x7fc0u;
  const uint32_t x = bit_cast_<uint32_t>(f);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

PYCOMM_HD float float_from_bf16_bits(uint16_t b) {
  return bit_cast_<float>(static_cast<uint32_t>(b) << 16);
}

// Storage type -> accumulation type, and the conversions between them.
template <class T> struct Numeric {
  using Acc = T;
  static PYCOMM_HD Acc load(T v) { return v; }
  static PYCOMM_HD T store(Acc v) { return v; }
};
template <> struct Numeric<Half> {
  using Acc = float;
  static PYCOMM_HD Acc load(Half v) { return float_from_half_bits(v.bits); }
  static PYCOMM_HD Half store(Acc v) { return Half{half_bits_from_float(v)}; }
};
template <> struct Numeric<BFloat16> {
  using Acc = float;
  static PYCOMM_HD Acc load(BFloat16 v) { return float_from_bf16_bits(v.bits); }
  static PYCOMM_HD BFloat16 store(Acc v) { return BFloat16{bf16_bits_from_float(v)}; }
};
template <> struct Numeric<Bool8> {
  using Acc = uint8_t;
  static PYCOMM_HD Acc load(Bool8 v) { return v.value; }
  static PYCOMM_HD Bool8 store(Acc v) { return Bool8{static_cast<uint8_t>(v != 0)}; }
};

template <class T> using AccOf = typename Numeric<T>::Acc;

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

}  // namespace pycomm
