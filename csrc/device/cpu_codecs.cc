// -Wpsabi: see the vectorized paths below.
#pragma GCC diagnostic ignored "-Wpsabi"

#include "device/cpu_codecs.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/dispatch.h"
#include "core/error.h"
#include "core/numerics.h"

// The vectorized paths need x86-64 and inlining (see below), which flatten does only when
// optimizing.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__OPTIMIZE__)
#define PYCOMM_X86_CODECS
#include <immintrin.h>
#endif

namespace pycomm {

namespace {

// ---- The scalar path: the reference ----

// A record's scale, which need not be aligned.
float record_scale(Records<const char> r) {
  float scale;
  std::memcpy(&scale, r.scales, sizeof scale);
  return scale;
}
void set_scale(Records<char> r, float scale) { std::memcpy(r.scales, &scale, sizeof scale); }

// One record's conversions, element by element with numerics.h's functions.
template <class Code>
struct BlockCodec {
  using C = typename Code::Code;
  static const C* codes_of(Records<const char> r) { return reinterpret_cast<const C*>(r.codes); }
  static void decode(Records<const char> r, float* __restrict v, size_t m) {
    const float scale = record_scale(r);
    const C* __restrict codes = codes_of(r);
    for (size_t i = 0; i < m; ++i) v[i] = Code::decode(codes[i]) * scale;
  }
  // v encoded with the scale of its largest finite magnitude.
  static void encode(const float* __restrict v, Records<char> r, size_t m) {
    const float amax = largest_finite(v, m), scale = block_scale<Code>(amax), inv = inverse_scale(scale);
    set_scale(r, scale);
    C* __restrict codes = reinterpret_cast<C*>(r.codes);
    if (block_may_overflow<Code>(amax, scale))
      for (size_t i = 0; i < m; ++i)
        codes[i] = static_cast<C>(saturated_code<Code>(v[i], Code::encode(v[i] * inv), scale));
    else
      for (size_t i = 0; i < m; ++i) codes[i] = static_cast<C>(Code::encode(v[i] * inv));
  }
  // v = decode(encode(v)) in place.
  static void quantize(float* __restrict v, size_t m) {
    const float amax = largest_finite(v, m), scale = block_scale<Code>(amax), inv = inverse_scale(scale);
    if (block_may_overflow<Code>(amax, scale))
      for (size_t i = 0; i < m; ++i)
        v[i] = Code::decode(saturated_code<Code>(v[i], Code::encode(v[i] * inv), scale)) * scale;
    else
      for (size_t i = 0; i < m; ++i) v[i] = Code::decode(Code::encode(v[i] * inv)) * scale;
  }

 private:
  static float largest_finite(const float* __restrict v, size_t m) {
    int32_t amax = 0;
    for (size_t i = 0; i < m; ++i) amax = std::max(amax, finite_magnitude(v[i]));
    return bit_cast_<float>(amax);
  }
};

// CodecRuns' contract with BlockCodec, records brought to and from the storage type through
// fp32 one element at a time (Numeric<T>).
template <class Code, class T>
struct ScalarRuns {
  using N = Numeric<T>;
  using BC = BlockCodec<Code>;
  static void encode(const T* x, Records<char> enc, size_t n, size_t block) {
    float v[kMaxCodecBlock];
    for (size_t b = 0, base = 0; base < n; ++b, base += block) {
      const size_t m = std::min(block, n - base);
      for (size_t i = 0; i < m; ++i) v[i] = N::load(x[base + i]);
      BC::encode(v, enc.from(b, block, sizeof(typename Code::Code)), m);
    }
  }
  static void decode(Records<const char> enc, T* x, size_t n, size_t block) {
    float v[kMaxCodecBlock];
    for (size_t b = 0, base = 0; base < n; ++b, base += block) {
      const size_t m = std::min(block, n - base);
      BC::decode(enc.from(b, block, sizeof(typename Code::Code)), v, m);
      for (size_t i = 0; i < m; ++i) x[base + i] = N::store(v[i]);
    }
  }
  static void quantize(const T* x, float* v, size_t n, size_t block) {
    for (size_t base = 0; base < n; base += block) {
      const size_t m = std::min(block, n - base);
      for (size_t i = 0; i < m; ++i) v[base + i] = N::load(x[base + i]);
      BC::quantize(v + base, m);
    }
  }
};

enum class Path { Scalar, Avx2, Avx512 };
constexpr Path kPaths[] = {Path::Scalar, Path::Avx2, Path::Avx512};
constexpr const char* kPathNames[] = {"scalar", "avx2", "avx512"};

#ifdef PYCOMM_X86_CODECS

// ---- The vectorized paths (x86-64) ----
//
// Each kernel is written once, on the W lanes of GCC's vector types: numerics.h's formulas
// on lanes, or where it is cheaper another computation of the same function, stated where
// it is (F16C for fp16, and for fp8's decode). An entry point per instruction set,
// compiled for it, inlines everything it calls (flatten), the kernel included: the kernels
// themselves carry no target, so that one source serves every instruction set. Wide
// vectors pass between functions only inside an entry point, where no call remains, so
// -Wpsabi's warning (code compiled with and without AVX passes them differently) concerns
// none: it is off in this file (from its first line, for numerics.h's bit_cast_ of vectors).
// A record's scale and its tail (the elements after the last whole vector) take the
// reference's scalar code, and so does a record near float32's maximum (block_may_overflow).
// A record without NaN or infinity skips their selects.

#define PYCOMM_AVX2 __attribute__((target("avx2,f16c")))
#define PYCOMM_AVX512 __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl")))

// W elements of type E in one vector.
template <class E, int W>
struct VectorOf {
  typedef E type __attribute__((vector_size(W * sizeof(E))));
};
template <int W>
struct Lanes {
  static constexpr size_t kWidth = W;
  using F = typename VectorOf<float, W>::type;
  using I = typename VectorOf<int32_t, W>::type;
  using U = typename VectorOf<uint32_t, W>::type;
  using H = typename VectorOf<uint16_t, W>::type;
  using S = typename VectorOf<int16_t, W>::type;
  using S2 = typename VectorOf<int16_t, 2 * W>::type;  // a full vector of 16-bit lanes
  using H2 = typename VectorOf<uint16_t, 2 * W>::type;
  using B = typename VectorOf<uint8_t, W>::type;
  using B2 = typename VectorOf<uint8_t, 2 * W>::type;  // the bytes of a full vector's 16-bit lanes
  using B4 = typename VectorOf<uint8_t, 4 * W>::type;  // four vectors' bytes
};

// The operations that GCC's vector types do not spell well (or at all): F16C's conversions
// (rounding to nearest even, not in the MXCSR's mode), lanes widened to the next width and
// narrowed back (the values fit: no saturation), the largest lane, whether any lane is set.
struct Avx2 : Lanes<8> {
  PYCOMM_AVX2 static F from_half(H h) { return F(_mm256_cvtph_ps(__m128i(h))); }
  PYCOMM_AVX2 static H to_half(F f) { return H(_mm256_cvtps_ph(__m256(f), _MM_FROUND_TO_NEAREST_INT)); }
  PYCOMM_AVX2 static U widen(H h) { return U(_mm256_cvtepu16_epi32(__m128i(h))); }
  PYCOMM_AVX2 static H widen(B b) { return H(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(bit_cast_<int64_t>(b)))); }
  PYCOMM_AVX2 static H2 widen(B2 b) { return H2(_mm256_cvtepu8_epi16(__m128i(b))); }
  PYCOMM_AVX2 static H to_u16(U u) {
    const __m256i pairs = _mm256_packus_epi32(__m256i(u), __m256i(u));  // 0-3 0-3 | 4-7 4-7
    return H(_mm256_castsi256_si128(_mm256_permute4x64_epi64(pairs, 0x08)));
  }
  PYCOMM_AVX2 static B to_u8(U u) {
    const __m256i words = _mm256_packus_epi32(__m256i(u), __m256i(u));
    const __m256i bytes = _mm256_packus_epi16(words, words);  // 0-3 four times | 4-7 four times
    const __m256i joined = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    return bit_cast_<B>(_mm_cvtsi128_si64(_mm256_castsi256_si128(joined)));
  }
  PYCOMM_AVX2 static B2 to_u8(H2 h) {
    return B2(_mm_packus_epi16(_mm256_castsi256_si128(__m256i(h)), _mm256_extracti128_si256(__m256i(h), 1)));
  }
  PYCOMM_AVX2 static bool any(H2 h) { return !_mm256_testz_si256(__m256i(h), __m256i(h)); }
  // Four vectors narrowed at once, a quarter of the shuffles of narrowing each.
  PYCOMM_AVX2 static B4 to_u8(U a, U b, U c, U d) {
    const __m256i ab = _mm256_packus_epi32(__m256i(a), __m256i(b));  // a0-3 b0-3 | a4-7 b4-7
    const __m256i cd = _mm256_packus_epi32(__m256i(c), __m256i(d));
    const __m256i bytes = _mm256_packus_epi16(ab, cd);  // a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7
    return B4(_mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  PYCOMM_AVX2 static int32_t largest(I v) { return largest(__m256i(v)); }
  PYCOMM_AVX2 static int32_t largest(__m256i v) {
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4e));
    return _mm_cvtsi128_si32(_mm_max_epi32(m, _mm_shuffle_epi32(m, 0xb1)));
  }
};
// The zero-masked forms with every lane kept where the plain ones trip GCC 12's
// -Wmaybe-uninitialized in its own header.
struct Avx512 : Lanes<16> {
  PYCOMM_AVX512 static F from_half(H h) { return F(_mm512_maskz_cvtph_ps(0xffff, __m256i(h))); }
  PYCOMM_AVX512 static H to_half(F f) { return H(_mm512_maskz_cvtps_ph(0xffff, __m512(f), _MM_FROUND_TO_NEAREST_INT)); }
  PYCOMM_AVX512 static U widen(H h) { return U(_mm512_maskz_cvtepu16_epi32(0xffff, __m256i(h))); }
  PYCOMM_AVX512 static H widen(B b) { return H(_mm256_cvtepu8_epi16(__m128i(b))); }
  PYCOMM_AVX512 static H2 widen(B2 b) { return H2(_mm512_maskz_cvtepu8_epi16(~0u, __m256i(b))); }
  PYCOMM_AVX512 static H to_u16(U u) { return H(_mm512_maskz_cvtepi32_epi16(0xffff, __m512i(u))); }
  PYCOMM_AVX512 static B to_u8(U u) { return B(_mm512_maskz_cvtepi32_epi8(0xffff, __m512i(u))); }
  PYCOMM_AVX512 static B2 to_u8(H2 h) { return B2(_mm512_maskz_cvtepi16_epi8(~0u, __m512i(h))); }
  PYCOMM_AVX512 static bool any(H2 h) { return _mm512_test_epi16_mask(__m512i(h), __m512i(h)) != 0; }
  // As Avx2's: the packs work within 128-bit lanes, so lane k holds quarter k of each vector.
  PYCOMM_AVX512 static B4 to_u8(U a, U b, U c, U d) {
    const __m512i ab = _mm512_packus_epi32(__m512i(a), __m512i(b));
    const __m512i cd = _mm512_packus_epi32(__m512i(c), __m512i(d));
    const __m512i bytes = _mm512_packus_epi16(ab, cd);
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return B4(_mm512_maskz_permutexvar_epi32(0xffff, order, bytes));
  }
  PYCOMM_AVX512 static int32_t largest(I v) {
    const __m256i low = _mm512_maskz_extracti64x4_epi64(0xf, __m512i(v), 0);
    const __m256i high = _mm512_maskz_extracti64x4_epi64(0xf, __m512i(v), 1);
    return Avx2::largest(_mm256_max_epi32(low, high));
  }
};

template <class Vec, class E>
Vec load(const E* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class E, class Vec>
void store(E* p, const Vec& v) {
  std::memcpy(p, &v, sizeof v);
}
// Every lane e.
template <class Vec, class E>
Vec splat(E e) {
  return Vec{} + static_cast<std::remove_reference_t<decltype(Vec{}[0])>>(e);
}

// W values of storage type T in fp32.
template <class V>
typename V::F load_values(const float* p) {
  return load<typename V::F>(p);
}
template <class V>
typename V::F load_values(const BFloat16* p) {
  return bit_cast_<typename V::F>(V::widen(load<typename V::H>(p)) << 16);
}
// A NaN comes back quiet, where float_from_half_bits keeps a signalling one: no result
// shows it, since these values are only encoded (or measured by their finite magnitude),
// and every codec encodes every NaN as its one NaN code.
template <class V>
typename V::F load_values(const Half* p) {
  return V::from_half(load<typename V::H>(p));
}

// The magnitudes' bits of values of storage type T, as magnitude_bits: W of them, or for
// bfloat16 2W in 16-bit lanes (the top halves of float32's), a full vector, a quarter of
// the work.
template <class V, class T>
typename V::I magnitudes(const T* p) {
  return bit_cast_<typename V::I>(load_values<V>(p)) & 0x7fffffff;
}
template <class V>
typename V::S2 magnitudes(const BFloat16* p) {
  return load<typename V::S2>(p) & 0x7fff;
}
// The largest of those bits over every lane, as those of a float32.
template <class V>
int32_t largest_magnitude(typename V::I a) {
  return V::largest(a);
}
template <class V>
int32_t largest_magnitude(typename V::S2 a) {
  typename V::S low, high;  // a's halves
  std::memcpy(&low, &a, sizeof low);
  std::memcpy(&high, reinterpret_cast<const char*>(&a) + sizeof low, sizeof high);
  const typename V::S both = high > low ? high : low;
  return V::largest(bit_cast_<typename V::I>(V::widen(bit_cast_<typename V::H>(both)) << 16));
}

// bf16_bits_from_float, of values that are NaN only if kNaN.
template <class V, bool kNaN = true>
typename V::U bf16_lanes(typename V::F f) {
  using U = typename V::U;
  const U x = bit_cast_<U>(f);
  const U rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  if (!kNaN) return rounded;
  return bit_cast_<typename V::I>(x & 0x7fffffffu) > 0x7f800000 ? splat<U>(0x7fc0u) : rounded;
}

// W values rounded to storage type T, as Numeric<T>::store rounds; kExact: values that
// bfloat16 holds exactly, NaN only as 0x7fc00000 (their top halves).
template <class V, bool kExact>
void store_values(float* p, typename V::F v) {
  store(p, v);
}
template <class V, bool kExact>
void store_values(BFloat16* p, typename V::F v) {
  store(p, V::to_u16(kExact ? bit_cast_<typename V::U>(v) >> 16 : bf16_lanes<V>(v)));
}
// half_bits_from_float is F16C's rounding but for NaN, which it makes the quiet NaN of the
// same sign without payload: F16C does so for that NaN.
template <class V, bool kExact>
void store_values(Half* p, typename V::F v) {
  const typename V::U sign = bit_cast_<typename V::U>(v) & 0x80000000u;
  store(p, V::to_half(v != v ? bit_cast_<typename V::F>(sign | 0x7fc00000u) : v));
}

// Each code format on lanes: encode<kSpecials>(values, inverse scale) -> W codes, as
// Code::encode(value * inverse scale), where values are NaN or infinite only if kSpecials;
// decode(W codes) -> their values, as Code::decode but for a NaN's quiet bit, which the
// callers' product by the scale sets in both. Where kGroup > 1, encode_group encodes that
// many vectors at once (their codes narrowed together, cheaper than one by one).
template <class V>
struct Fp16Lanes {
  using F = typename V::F;
  using H = typename V::H;
  using Codes = H;
  // F16C rounds as half_bits_from_float; NaN becomes the NaN code's own NaN first.
  template <bool kSpecials>
  static H encode(F x, float inv) {
    const F v = x * inv;
    if (!kSpecials) return V::to_half(v);
    return V::to_half(v != v ? bit_cast_<F>(splat<typename V::U>(0x7fc00000u)) : v);
  }
  static F decode(H c) { return V::from_half(c); }
  static constexpr uint32_t kExactScales = 0x7f800000;  // none (see Fp8Lanes)
  static constexpr size_t kGroup = 1;
  static constexpr bool kOnBf16Bits = false;  // see Fp8Lanes
};
template <class V>
struct Bf16Lanes {
  using F = typename V::F;
  using H = typename V::H;
  using Codes = H;
  template <bool kSpecials>
  static H encode(F x, float inv) {
    return V::to_u16(bf16_lanes<V, kSpecials>(x * inv));
  }
  static F decode(H c) { return bit_cast_<F>(V::widen(c) << 16); }
  static constexpr uint32_t kExactScales = 0x7f800000;  // none (see Fp8Lanes)
  static constexpr size_t kGroup = 1;
  static constexpr bool kOnBf16Bits = false;  // see Fp8Lanes
};
// fp8: encode is fp8_bits_from_finite with CodeFp8's NaN and Inf. decode goes through half
// precision (F16C): a code's sign, exponent and mantissa moved to the top of a half's make
// a half whose value is the code's times 2^(bias - 15), subnormals included (exponent
// field 0 in both); NaN and Inf, set apart, take CodeFp8's values.
template <class V, int E, int M, uint32_t kInf>
struct Fp8Lanes {
  using F = typename V::F;
  using I = typename V::I;
  using U = typename V::U;
  using H = typename V::H;
  using S = typename V::S;
  using H2 = typename V::H2;
  using B2 = typename V::B2;
  using Codes = typename V::B;
  static constexpr uint32_t kBias = (1u << (E - 1)) - 1;
  static constexpr size_t kGroup = 4;  // vectors encoded at once: their codes narrowed together
  template <bool kSpecials>
  static Codes encode(F x, float inv) {
    return V::to_u8(code_lanes<kSpecials>(x, inv));
  }
  template <bool kSpecials>
  static typename V::B4 encode_group(const F (&x)[kGroup], float inv) {
    return V::to_u8(code_lanes<kSpecials>(x[0], inv), code_lanes<kSpecials>(x[1], inv),
                    code_lanes<kSpecials>(x[2], inv), code_lanes<kSpecials>(x[3], inv));
  }
  // The codes in 32-bit lanes. The normal codes' rebias is subtracted before the shift, not
  // after: the same where a code is normal (ax is above the bias's bits there), one
  // operation fewer. Magnitudes compare as signed integers, which AVX2 has.
  template <bool kSpecials>
  static U code_lanes(F x, float inv) {
    constexpr uint32_t kMinNormal = (127 + 1 - kBias) << 23;
    constexpr uint32_t kMagic = (127 + 1 - kBias + 23 - M) << 23;
    constexpr uint32_t kRoundAndRebias = ((1u << (22 - M)) - 1) - ((127 - kBias) << 23);
    const U v = bit_cast_<U>(x * inv), ax = v & 0x7fffffffu;
    const I signed_ax = bit_cast_<I>(ax);
    const U sub = bit_cast_<U>(bit_cast_<F>(ax) + bit_cast_<float>(kMagic)) - kMagic;
    const U normal = (ax + kRoundAndRebias + ((ax >> (23 - M)) & 1u)) >> (23 - M);
    const U finite = ((v >> 24) & 0x80u) | (signed_ax < int32_t(kMinNormal) ? sub : normal);
    if (!kSpecials) return finite;
    const U special = signed_ax > 0x7f800000 ? splat<U>(0x7fu) : ((v >> 24) & 0x80u) | kInf;
    return signed_ax >= 0x7f800000 ? special : finite;
  }
  static F decode(Codes c) {
    const H w = V::widen(c), em = w & 0x7f, sign = (w & 0x80) << 8;
    const H value = sign | (em == kInf ? splat<H>(0x7c00) : em << (10 - M));
    const H half = bit_cast_<S>(em) > int16_t(kInf) ? splat<H>(0x7e00) : value;
    return V::from_half(half) * bit_cast_<float>((127 + 15 - kBias) << 23);
  }
  // The bits of the smallest power-of-two scale from which every decoded value is exactly a
  // bfloat16: a nonzero code times it is a normal float32 of M + 1 significant bits or
  // fewer, or infinite; NaN is 0x7fc00000.
  static constexpr uint32_t kExactScales = (kBias + M) << 23;

  // bfloat16 data coded on its own bits, 2W values per vector (H2), twice as many as in
  // float32 lanes: where a value and its code are both normal (or zero), scaling by a power
  // of two 2^k and converting are integer adds on the exponent's bits. encode_bf16 and
  // decode_bf16 return false for a vector that holds any other, which the caller then
  // converts in float32 lanes.
  static constexpr bool kOnBf16Bits = true;
  struct Bf16Encoding {
    uint16_t round_and_rebias, min_normal;  // on bfloat16's magnitude bits
  };
  // For code_lanes(x, 2^k). x * 2^k is exact in float32 where it is a normal code's
  // magnitude, and its bits are (ax + (k << 7)) << 16 for x's magnitude bits ax; their low
  // 16 bits being 0, code_lanes' rounding to M mantissa bits and rebias, shifted by 23 - M,
  // is (ax + 2^(6 - M) - 1 + lsb - ((127 - kBias - k) << 7)) >> (7 - M), in 16 bits (mod
  // 2^16: the result fits). min_normal: the least x (a bfloat16 normal) that k scales to a
  // normal code, below bfloat16's infinity since k >= -126.
  static Bf16Encoding bf16_encoding(float inv) {
    const int k = static_cast<int>(bit_cast_<uint32_t>(inv) >> 23) - 127;
    const int rebias = (127 - static_cast<int>(kBias) - k) << 7;
    const int min_normal = std::max((128 - static_cast<int>(kBias) - k) << 7, 0x80);
    return {static_cast<uint16_t>((1 << (6 - M)) - 1 - rebias), static_cast<uint16_t>(min_normal)};
  }
  // code_lanes<false> of 2W bfloat16 values (bits h): finite ones.
  static bool encode_bf16(H2 h, const Bf16Encoding& e, B2& codes) {
    using S2 = typename V::S2;
    const H2 ax = h & 0x7fff;
    const H2 zero = bit_cast_<H2>(ax == 0);
    // ax and min_normal are below 2^15, so they compare as signed.
    if (V::any(bit_cast_<H2>(bit_cast_<S2>(ax) < int16_t(e.min_normal)) & ~zero)) return false;
    const H2 magnitude = (ax + e.round_and_rebias + ((ax >> (7 - M)) & 1)) >> (7 - M);
    codes = V::to_u8(((h >> 8) & 0x80) | (magnitude & ~zero));
    return true;
  }
  // For decode times a scale 2^k of kExactScales or above: a normal code's value times it
  // is a bfloat16 whose bits are the code's magnitude bits em moved to a bfloat16's
  // mantissa, (em << (7 - M)) + ((127 - kBias + k) << 7). valid: every finite code's is
  // finite.
  struct Bf16Decoding {
    uint16_t rebias;
    bool valid;
  };
  static Bf16Decoding bf16_decoding(float scale) {
    const int k = static_cast<int>(bit_cast_<uint32_t>(scale) >> 23) - 127;
    const int rebias = (127 - static_cast<int>(kBias) + k) << 7;
    return {static_cast<uint16_t>(rebias), (static_cast<int>(kInf - 1) << (7 - M)) + rebias < 0x7f80};
  }
  // decode of 2W codes times 2^k, to bfloat16 (bits h): zeros and normal codes.
  static bool decode_bf16(B2 c, const Bf16Decoding& d, H2& h) {
    const H2 w = V::widen(c), em = w & 0x7f;
    const H2 subnormal_or_zero = bit_cast_<H2>(em < (1u << M)), zero = bit_cast_<H2>(em == 0);
    if (V::any((subnormal_or_zero & ~zero) | bit_cast_<H2>(em >= kInf))) return false;
    h = ((w & 0x80) << 8) | (((em << (7 - M)) + d.rebias) & ~zero);
    return true;
  }
};
template <class V>
Fp16Lanes<V> lanes_of(const CodeFp16*);
template <class V>
Bf16Lanes<V> lanes_of(const CodeBf16*);
template <class V, int E, int M, uint32_t kInf>
Fp8Lanes<V, E, M, kInf> lanes_of(const CodeFp8<E, M, kInf>*);

// CodecRuns' contract on V's lanes.
template <class V, class Code, class T>
struct VectorRuns {
  using F = typename V::F;
  using I = typename V::I;
  using C = typename Code::Code;
  using L = decltype(lanes_of<V>(static_cast<const Code*>(nullptr)));
  using N = Numeric<T>;
  static constexpr size_t W = V::kWidth;
  // bfloat16 data that L converts on its bits (see Fp8Lanes).
  static constexpr bool kOnBf16Bits = std::is_same_v<T, BFloat16> && L::kOnBf16Bits;

  // The next record's scaling is found before this record is encoded, so that the latency
  // of its reductions and its scale overlaps that work.
  static void encode(const T* x, Records<char> enc, size_t n, size_t block) {
    Scaling s = scaling(x, std::min(block, n));
    for (size_t b = 0, base = 0; base < n; ++b, base += block) {
      const size_t next = base + block;
      const Scaling following = next < n ? scaling(x + next, std::min(block, n - next)) : s;
      encode_record(x + base, enc.from(b, block, sizeof(C)), std::min(block, n - base), s);
      s = following;
    }
  }
  static void decode(Records<const char> enc, T* x, size_t n, size_t block) {
    for (size_t b = 0, base = 0; base < n; ++b, base += block)
      decode_record(enc.from(b, block, sizeof(C)), x + base, std::min(block, n - base));
  }
  static void quantize(const T* x, float* v, size_t n, size_t block) {
    for (size_t base = 0; base < n; base += block) quantize_record(x + base, v + base, std::min(block, n - base));
  }

 private:
  // A record's scale (of its largest finite magnitude, amax), and whether it holds a NaN or
  // an infinity.
  struct Scaling {
    float amax, scale, inv;
    bool specials;
  };
  static Scaling scaling(const T* x, size_t m) {
    using M = decltype(magnitudes<V>(x));
    constexpr bool kWide = std::is_same_v<M, I>;  // 32-bit lanes, else 16-bit ones
    constexpr int kInf = kWide ? 0x7f800000 : 0x7f80;  // in M's lanes
    constexpr size_t kLanes = kWide ? W : 2 * W;
    M finite_lanes{}, lanes{};
    size_t i = 0;
    for (; i + kLanes <= m; i += kLanes) {
      const M a = magnitudes<V>(x + i);
      const M finite = a < kInf ? a : M{};
      finite_lanes = finite > finite_lanes ? finite : finite_lanes;
      lanes = a > lanes ? a : lanes;
    }
    int32_t largest = largest_magnitude<V>(lanes);
    int32_t amax = nonfinite_magnitude(largest) ? largest_magnitude<V>(finite_lanes) : largest;
    for (; i < m; ++i) {
      const float v = N::load(x[i]);
      largest = std::max(largest, magnitude_bits(v));
      amax = std::max(amax, finite_magnitude(v));
    }
    const float scale = scale_of(amax);
    return {bit_cast_<float>(amax), scale, inverse_scale(scale), nonfinite_magnitude(largest)};
  }
  // block_scale without its loop, whose branches cost as much as a record's conversions:
  // with amax = a 2^p and the target t 2^q (a, t in [1, 2)), amax / 2^e <= target holds
  // from e = p - q + (a > t) on and not below, and a subnormal amax (p = -127 here, as
  // there) takes -126, as it does there.
  static float scale_of(int32_t amax) {
    if (!Code::kScaled || amax == 0) return 1.0f;
    const int32_t target = bit_cast_<int32_t>(Code::kTarget);
    const int32_t e = (amax >> 23) - (target >> 23) + ((amax & 0x7fffff) > (target & 0x7fffff));
    return bit_cast_<float>((127 + std::min(std::max(e, -126), 126)) << 23);
  }
  static void encode_record(const T* x, Records<char> r, size_t m, const Scaling& s) {
    if (may_overflow(s)) return ScalarRuns<Code, T>::encode(x, r, m, m);
    set_scale(r, s.scale);
    C* codes = reinterpret_cast<C*>(r.codes);
    s.specials ? encode_codes<true>(x, codes, m, s.inv) : encode_codes<false>(x, codes, m, s.inv);
  }
  // The whole 2W-value vectors of m values: each converted on bfloat16's bits by
  // `converted(j)` (false where it cannot be, see Fp8Lanes), else in float32 lanes by
  // `in_lanes` (W values from j). Returns the values done.
  template <class InLanes, class Converted>
  static size_t on_bf16_bits(size_t m, const InLanes& in_lanes, const Converted& converted) {
    size_t i = 0;
    for (; i + 2 * W <= m; i += 2 * W)
      if (!converted(i)) {
        in_lanes(i);
        in_lanes(i + W);
      }
    return i;
  }
  template <bool kSpecials>
  static void encode_codes(const T* x, C* codes, size_t m, float inv) {
    const auto encode_vector = [&](size_t j) {
      store(codes + j, L::template encode<kSpecials>(load_values<V>(x + j), inv));
    };
    size_t i = 0;
    if constexpr (kOnBf16Bits && !kSpecials) {
      const auto e = L::bf16_encoding(inv);
      i = on_bf16_bits(m, encode_vector, [&](size_t j) {
        typename V::B2 c;
        if (!L::encode_bf16(load<typename V::H2>(x + j), e, c)) return false;
        store(codes + j, c);
        return true;
      });
    }
    if constexpr (L::kGroup > 1)
      for (; i + L::kGroup * W <= m; i += L::kGroup * W) {
        F v[L::kGroup];
        for (size_t g = 0; g < L::kGroup; ++g) v[g] = load_values<V>(x + i + g * W);
        store(codes + i, L::template encode_group<kSpecials>(v, inv));
      }
    for (; i + W <= m; i += W) encode_vector(i);
    for (; i < m; ++i) codes[i] = static_cast<C>(Code::encode(N::load(x[i]) * inv));
  }
  // Values that bfloat16 holds exactly are stored without rounding: a record whose scale
  // is a finite power of two from L::kExactScales.
  static void decode_record(Records<const char> r, T* x, size_t m) {
    const float scale = record_scale(r);
    const uint32_t bits = bit_cast_<uint32_t>(scale);
    const bool exact = (bits & 0x807fffffu) == 0 && bits >= L::kExactScales && bits < 0x7f800000u;
    exact ? decode_values<true>(r, x, m, scale) : decode_values<false>(r, x, m, scale);
  }
  template <bool kExact>
  static void decode_values(Records<const char> r, T* x, size_t m, float scale) {
    const C* codes = BlockCodec<Code>::codes_of(r);
    const auto decode_vector = [&](size_t j) {
      store_values<V, kExact>(x + j, L::decode(load<typename L::Codes>(codes + j)) * scale);
    };
    size_t i = 0;
    if constexpr (kOnBf16Bits && kExact)
      if (const auto d = L::bf16_decoding(scale); d.valid)
        i = on_bf16_bits(m, decode_vector, [&](size_t j) {
          typename V::H2 h;
          if (!L::decode_bf16(load<typename V::B2>(codes + j), d, h)) return false;
          store(x + j, h);
          return true;
        });
    for (; i + W <= m; i += W) decode_vector(i);
    for (; i < m; ++i) x[i] = N::store(Code::decode(codes[i]) * scale);
  }
  static void quantize_record(const T* x, float* v, size_t m) {
    const Scaling s = scaling(x, m);
    if (may_overflow(s)) return ScalarRuns<Code, T>::quantize(x, v, m, m);
    s.specials ? quantize_values<true>(x, v, m, s) : quantize_values<false>(x, v, m, s);
  }
  template <bool kSpecials>
  static void quantize_values(const T* x, float* v, size_t m, const Scaling& s) {
    size_t i = 0;
    for (; i + W <= m; i += W)
      store(v + i, L::decode(L::template encode<kSpecials>(load_values<V>(x + i), s.inv)) * s.scale);
    for (; i < m; ++i) v[i] = Code::decode(Code::encode(N::load(x[i]) * s.inv)) * s.scale;
  }
  // block_may_overflow, which is false below 2^127: a code exceeds the value it rounds by
  // less than a quarter (every format has 2 mantissa bits or more), and float32's largest
  // value is nearly 2^128.
  static bool may_overflow(const Scaling& s) { return s.amax >= 0x1p127f && block_may_overflow<Code>(s.amax, s.scale); }
};

template <class Code, class T>
struct Avx2Runs {
  using R = VectorRuns<Avx2, Code, T>;
  PYCOMM_AVX2 __attribute__((flatten)) static void encode(const T* x, Records<char> enc, size_t n, size_t block) {
    R::encode(x, enc, n, block);
  }
  PYCOMM_AVX2 __attribute__((flatten)) static void decode(Records<const char> enc, T* x, size_t n, size_t block) {
    R::decode(enc, x, n, block);
  }
  PYCOMM_AVX2 __attribute__((flatten)) static void quantize(const T* x, float* v, size_t n, size_t block) {
    R::quantize(x, v, n, block);
  }
};
template <class Code, class T>
struct Avx512Runs {
  using R = VectorRuns<Avx512, Code, T>;
  PYCOMM_AVX512 __attribute__((flatten)) static void encode(const T* x, Records<char> enc, size_t n, size_t block) {
    R::encode(x, enc, n, block);
  }
  PYCOMM_AVX512 __attribute__((flatten)) static void decode(Records<const char> enc, T* x, size_t n, size_t block) {
    R::decode(enc, x, n, block);
  }
  PYCOMM_AVX512 __attribute__((flatten)) static void quantize(const T* x, float* v, size_t n, size_t block) {
    R::quantize(x, v, n, block);
  }
};

bool cpu_has(Path path) {
  __builtin_cpu_init();  // for a call before the constructors have run
  switch (path) {
    case Path::Scalar:
      return true;
    case Path::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case Path::Avx512:
      return cpu_has(Path::Avx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  }
  return false;
}

template <class Code, class T>
const CodecRuns<T>* vector_runs(Path path) {
  static constexpr CodecRuns<T> avx2{Avx2Runs<Code, T>::encode, Avx2Runs<Code, T>::decode, Avx2Runs<Code, T>::quantize};
  static constexpr CodecRuns<T> avx512{Avx512Runs<Code, T>::encode, Avx512Runs<Code, T>::decode,
                                       Avx512Runs<Code, T>::quantize};
  return path == Path::Avx512 ? &avx512 : path == Path::Avx2 ? &avx2 : nullptr;
}

#else

bool cpu_has(Path path) { return path == Path::Scalar; }
template <class Code, class T>
const CodecRuns<T>* vector_runs(Path) {
  return nullptr;
}

#endif

std::atomic<Path>& path_in_use() {
  static std::atomic<Path> path{cpu_has(Path::Avx512) ? Path::Avx512 : cpu_has(Path::Avx2) ? Path::Avx2 : Path::Scalar};
  return path;
}

template <class Code, class T>
const CodecRuns<T>& runs_of(Path path) {
  static constexpr CodecRuns<T> scalar{ScalarRuns<Code, T>::encode, ScalarRuns<Code, T>::decode,
                                       ScalarRuns<Code, T>::quantize};
  const CodecRuns<T>* vector = vector_runs<Code, T>(path);
  return vector ? *vector : scalar;
}

}  // namespace

template <class T>
const CodecRuns<T>& codec_runs(Compression codec) {
  const Path path = path_in_use().load(std::memory_order_relaxed);
  return dispatch_codec(
      codec, [path](auto code) -> const CodecRuns<T>& { return runs_of<typename decltype(code)::type, T>(path); });
}
template const CodecRuns<float>& codec_runs(Compression);
template const CodecRuns<Half>& codec_runs(Compression);
template const CodecRuns<BFloat16>& codec_runs(Compression);

std::vector<std::string> cpu_codec_paths() {
  std::vector<std::string> names;
  for (Path p : kPaths)
    if (cpu_has(p)) names.push_back(kPathNames[static_cast<int>(p)]);
  return names;
}

std::string cpu_codec_path() { return kPathNames[static_cast<int>(path_in_use().load())]; }

void set_cpu_codec_path(const std::string& name) {
  for (Path p : kPaths) {
    if (name != kPathNames[static_cast<int>(p)]) continue;
    if (!cpu_has(p)) fail(ErrorKind::InvalidArgument, "pycomm: this CPU has no " + name + " codec path");
    path_in_use().store(p);
    return;
  }
  fail(ErrorKind::InvalidArgument, "pycomm: no CPU codec path is named " + name);
}

}  // namespace pycomm
