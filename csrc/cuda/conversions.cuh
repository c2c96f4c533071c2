// The codecs' conversions as the CUDA kernels compute them: numerics.h's codes and values
// bit for bit, in fewer instructions than its integer arithmetic (12-20 operations each
// way, which bounded the codec kernels by the ALU rather than by memory).
//
// - Encoding rounds two values at once with the GPU's conversion instruction
//   (cvt.rn.satfinite.e4m3x2.f32 and .e5m2x2 from sm_89 on, cvt.rn.f16x2.f32,
//   cvt.rn.bf16x2.f32): round to nearest even, subnormal results included, as numerics.h
//   rounds. A codec converts finite values within its kTarget (the block's scale sees to
//   it), where .satfinite never saturates; NaN and infinities take numerics.h's codes by
//   code_of's selects, whatever the instruction made of them.
// - Decoding a finite 8- or 16-bit float places its exponent and mantissa fields in a
//   float32's and multiplies by 2^(127 - bias): exact, subnormal codes included (a
//   subnormal float32 times a power of two; the kernels do not flush subnormals), with no
//   integer-to-float conversion; numerics.h's rules give NaN and infinities their values.
//
// Everything here is also host code: there the CUDA headers' intrinsics convert in
// software, as their documentation specifies the instructions (but fp8 rounding, which
// there and on GPUs before sm_89 is numerics.h's own; fp8_instruction_pair is the
// instruction's). tests/cuda/test_conversions.cu compares these with numerics.h on the
// host (sampled in make test, all 2^32 float32 patterns with --all), and the GPU check's
// `patterns` step on the device.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <nv/target>

#include "core/numerics.h"

namespace pycomm {

// |c|'s value for a finite code c of a float format with E exponent and M mantissa bits.
template <int E, int M>
PYCOMM_HD float magnitude_of_finite(uint32_t c) {
  constexpr uint32_t kBias = (1u << (E - 1)) - 1;
  constexpr uint32_t kFields = (1u << (E + M)) - 1;
  return bit_cast_<float>((c & kFields) << (23 - M)) * bit_cast_<float>((254u - kBias) << 23);
}

// Code's format's nearest-even rounding of a and b (finite), in the low and the high half of
// the result: one instruction for both.
template <class Code>
PYCOMM_HD uint32_t rounded_pair(float a, float b);
template <>
PYCOMM_HD uint32_t rounded_pair<CodeFp16>(float a, float b) {
  const __half2_raw r = __floats2half2_rn(a, b);
  return r.x | static_cast<uint32_t>(r.y) << 16;
}
template <>
PYCOMM_HD uint32_t rounded_pair<CodeBf16>(float a, float b) {
  const __nv_bfloat162_raw r = __floats2bfloat162_rn(a, b);
  return r.x | static_cast<uint32_t>(r.y) << 16;
}

// The fp8 conversion instruction's codes of a and b (cvt.rn.satfinite.e4m3x2.f32 or
// .e5m2x2, sm_89 on): the CUDA headers' intrinsic, in software on the host.
template <class Code>
PYCOMM_HD uint32_t fp8_instruction_pair(float a, float b) {
  constexpr __nv_fp8_interpretation_t kFormat = Code::kExponentBits == 4 ? __NV_E4M3 : __NV_E5M2;
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kFormat);
}
// Without the instruction (before sm_89, and on the host), numerics.h's integer rounding:
// the intrinsic would compute it in double precision.
template <class Code>
PYCOMM_HD uint32_t rounded_fp8_pair(float a, float b) {
  NV_IF_ELSE_TARGET(NV_PROVIDES_SM_89, (return fp8_instruction_pair<Code>(a, b);),
                    (constexpr int E = Code::kExponentBits, M = Code::kMantissaBits;
                     // Masked: for a NaN or an infinity (which code_of replaces) any bits.
                     return (fp8_bits_from_finite<E, M>(a) & 0xffu) | (fp8_bits_from_finite<E, M>(b) & 0xffu) << 8;))
}
template <>
PYCOMM_HD uint32_t rounded_pair<CodeFp8E4M3>(float a, float b) {
  return rounded_fp8_pair<CodeFp8E4M3>(a, b);
}
template <>
PYCOMM_HD uint32_t rounded_pair<CodeFp8E5M2>(float a, float b) {
  return rounded_fp8_pair<CodeFp8E5M2>(a, b);
}

// Code, its conversions computed as above: encode, encode_pair and decode give
// numerics.h's bits.
template <class Code>
struct DeviceCode : Code {
  static constexpr int kBits = 8 * sizeof(typename Code::Code);

  static PYCOMM_HD void encode_pair(float a, float b, uint32_t& code_a, uint32_t& code_b) {
    const uint32_t r = rounded_pair<Code>(a, b);
    code_a = code_of<Code>(a, r & ((1u << kBits) - 1));
    code_b = code_of<Code>(b, r >> kBits);
  }
  static PYCOMM_HD uint32_t encode(float v) {
    uint32_t code, unused;
    encode_pair(v, 0.0f, code, unused);
    return code;
  }
  static PYCOMM_HD float decode(uint32_t c) {
    if constexpr (std::is_same_v<Code, CodeBf16>) {
      return Code::decode(c);  // float32's upper half already
    } else if constexpr (std::is_same_v<Code, CodeFp16>) {
      const uint32_t sign = (c & 0x8000u) << 16, em = c & 0x7fffu;
      const uint32_t magnitude = bit_cast_<uint32_t>(magnitude_of_finite<5, 10>(em));
      return bit_cast_<float>(sign | (em >= 0x7c00u ? float_bits_of_half_special(em) : magnitude));
    } else {
      return Code::value_of(c, magnitude_of_finite<Code::kExponentBits, Code::kMantissaBits>(c));
    }
  }
};

}  // namespace pycomm
