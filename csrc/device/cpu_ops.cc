#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/dispatch.h"
#include "device/device_ops.h"

namespace pycomm {

Reduction normalized(DataType t, Reduction r) {
  if (t == DataType::Bool) {
    if (r.kind == ReduceKind::Sum) r.kind = ReduceKind::Max;
    if (r.kind == ReduceKind::Product) r.kind = ReduceKind::Min;
  }
  return r;
}

namespace {

// Folds the terms block by block into an accumulator that stays in L1, so any number of
// terms costs one pass over each operand and one write of the output; the loops over a
// block are branch-free and vectorize. A block is read completely before its output is
// written, which makes `out` aliasing a term safe.
template <class T, ReduceKind K, bool kFinal>
void reduce_terms_loop(void* out, const Term* terms, int k, size_t n, AccOf<T> premul, int world_size) {
  using A = AccOf<T>;
  using N = Numeric<T>;
  constexpr size_t kBlock = 512;
  A acc[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    for (int j = 0; j < k; ++j) {
      if (terms[j].form == Form::Input) {
        const T* x = static_cast<const T*>(terms[j].data) + base;
        if (j == 0)
          for (size_t i = 0; i < m; ++i) acc[i] = contribution<K>(N::load(x[i]), premul);
        else
          for (size_t i = 0; i < m; ++i) acc[i] = reduce_op<K>(acc[i], contribution<K>(N::load(x[i]), premul));
      } else {
        const A* x = static_cast<const A*>(terms[j].data) + base;
        if (j == 0)
          for (size_t i = 0; i < m; ++i) acc[i] = x[i];
        else
          for (size_t i = 0; i < m; ++i) acc[i] = reduce_op<K>(acc[i], x[i]);
      }
    }
    if constexpr (kFinal) {
      T* o = static_cast<T*>(out) + base;
      for (size_t i = 0; i < m; ++i) o[i] = N::store(finalize<K>(acc[i], world_size));
    } else {
      std::memcpy(static_cast<A*>(out) + base, acc, m * sizeof(A));
    }
  }
}

// ---- Exact mode ----
//
// The terms of each element are added in fixed point at the element's own exponent E,
// the smallest with |x| < 2^E for every finite term: the largest magnitude among the terms
// decides it, so the order of the terms, which rank holds which, and extra zero terms
// change nothing. Each term is rounded (to nearest even) to the grid 2^(E - kFracBits),
// the integers are added exactly, and the sum is rounded once to the accumulation format.
//   float32 and 16-bit data: kFracBits = 36; the integers (|q| <= 2^36) are added in
//     double, exactly for up to 2^16 terms. A float32 term within a factor 2^13 of the
//     element's largest is on the grid already; a smaller one moves by at most 2^(E-37).
//   float64: kFracBits = 110, added in 128-bit integers, exact likewise.
// Error against the exact sum: at most k * 2^(E-kFracBits-1) + half an ulp of the result,
// i.e. k * 2^-36 of the largest term for float32, against k * 2^-24 of the largest partial
// sum for a float32 fold. Non-finite terms do not enter the sum: the result is NaN if a
// term is NaN or both infinities occur, else the infinity that occurs.
constexpr int kMaxExactTerms = 1 << 16;
constexpr size_t kExactBlock = 256;

template <class A> struct Exact;
template <> struct Exact<float> {
  using Bits = int32_t;
  static constexpr int kMant = 23, kExpMask = 0xff, kBias = 127, kFracBits = 36;
};
template <> struct Exact<double> {
  using Bits = int64_t;
  static constexpr int kMant = 52, kExpMask = 0x7ff, kBias = 1023, kFracBits = 110;
};

// out[i] = the exact-mode sum of values[j * stride + i] over j < k, for i < m <= kExactBlock.
template <class A>
void exact_sum(const A* values, int k, size_t stride, size_t m, A* out) {
  using X = Exact<A>;
  using B = typename X::Bits;
  if (k > kMaxExactTerms) fail(ErrorKind::InvalidArgument, "pycomm: exact mode adds at most 65536 terms");
  int32_t emax[kExactBlock];
  uint8_t special[kExactBlock];  // 1: NaN, 2: +Inf, 4: -Inf
  for (size_t i = 0; i < m; ++i) emax[i] = 1, special[i] = 0;
  for (int j = 0; j < k; ++j)
    for (size_t i = 0; i < m; ++i) {
      const B bits = bit_cast_<B>(values[j * stride + i]);
      const int32_t e = static_cast<int32_t>((bits >> X::kMant) & X::kExpMask);
      const bool nonfinite = e == X::kExpMask;
      const bool nan = nonfinite && (bits & ((B{1} << X::kMant) - 1)) != 0;
      special[i] |= static_cast<uint8_t>(!nonfinite ? 0 : nan ? 1 : bits < 0 ? 4 : 2);
      emax[i] = !nonfinite && e > emax[i] ? e : emax[i];
    }
  if constexpr (std::is_same_v<A, float>) {
    constexpr double kRound = 6755399441055744.0;  // 1.5 * 2^52: x + kRound - kRound rounds x to an integer
    double up[kExactBlock], sum[kExactBlock];
    for (size_t i = 0; i < m; ++i) {  // 2^(kFracBits - E) with E = emax - bias + 1
      up[i] = bit_cast_<double>(static_cast<int64_t>(1023 + X::kFracBits - (emax[i] - X::kBias + 1)) << 52);
      sum[i] = 0.0;
    }
    for (int j = 0; j < k; ++j)
      for (size_t i = 0; i < m; ++i) {
        const float v = values[j * stride + i];
        const double x = v - v == 0.0f ? static_cast<double>(v) : 0.0;  // finite terms only
        sum[i] += (x * up[i] + kRound) - kRound;
      }
    for (size_t i = 0; i < m; ++i) out[i] = static_cast<float>(sum[i] / up[i]);
  } else {
    for (size_t i = 0; i < m; ++i) {
      const int exponent = emax[i] - X::kBias + 1;
      __int128 sum = 0;
      for (int j = 0; j < k; ++j) {
        const double v = values[j * stride + i];
        if (v - v == 0.0) sum += static_cast<__int128>(std::nearbyint(std::ldexp(v, X::kFracBits - exponent)));
      }
      out[i] = std::ldexp(static_cast<double>(sum), exponent - X::kFracBits);
    }
  }
  for (size_t i = 0; i < m; ++i)
    if (special[i])
      out[i] = (special[i] & 1) || (special[i] & 6) == 6 ? std::numeric_limits<A>::quiet_NaN()
               : special[i] & 2                          ? std::numeric_limits<A>::infinity()
                                                         : -std::numeric_limits<A>::infinity();
}

// Exact mode only changes sums: MIN and MAX do not depend on the order, PRODUCT is left
// to the fixed rank order of the fold.
template <ReduceKind K>
constexpr bool kSumLike = K == ReduceKind::Sum || K == ReduceKind::Avg || K == ReduceKind::PremulSum;

// reduce_terms_loop's contract, in exact mode, for floating types.
template <class T, ReduceKind K, bool kFinal>
void reduce_terms_exact(void* out, const Term* terms, int k, size_t n, AccOf<T> premul, int world_size) {
  using A = AccOf<T>;
  using N = Numeric<T>;
  std::vector<A> values(static_cast<size_t>(k) * kExactBlock);
  A acc[kExactBlock];
  for (size_t base = 0; base < n; base += kExactBlock) {
    const size_t m = std::min(kExactBlock, n - base);
    for (int j = 0; j < k; ++j) {
      A* dst = values.data() + j * kExactBlock;
      if (terms[j].form == Form::Input) {
        const T* x = static_cast<const T*>(terms[j].data) + base;
        for (size_t i = 0; i < m; ++i) dst[i] = contribution<K>(N::load(x[i]), premul);
      } else {
        std::memcpy(dst, static_cast<const A*>(terms[j].data) + base, m * sizeof(A));
      }
    }
    exact_sum(values.data(), k, kExactBlock, m, acc);
    if constexpr (kFinal) {
      T* o = static_cast<T*>(out) + base;
      for (size_t i = 0; i < m; ++i) o[i] = N::store(finalize<K>(acc[i], world_size));
    } else {
      std::memcpy(static_cast<A*>(out) + base, acc, m * sizeof(A));
    }
  }
}

// The uncoded fold: exact where exact mode changes the result, else in rank order.
template <class T, ReduceKind K, bool kFinal>
void fold(const ReduceSpec& spec, void* out, const Term* terms, int k, size_t n, AccOf<T> premul) {
  if constexpr (std::is_floating_point_v<AccOf<T>> && kSumLike<K>)
    if (spec.exact) return reduce_terms_exact<T, K, kFinal>(out, terms, k, n, premul, spec.world_size);
  reduce_terms_loop<T, K, kFinal>(out, terms, k, n, premul, spec.world_size);
}

// The same fold with a codec, one codec block at a time (scales are per block). Input
// terms are quantized on load; Encoded terms are decoded; the output is written in the
// accumulation format, the storage format, or encoded (see Stage). Each operand costs
// one or two passes over the block in L1: decoding folds as it goes, loading an input
// finds its largest magnitude as it goes.
constexpr size_t kMaxCodecBlock = 4096;

// The largest finite magnitude is tracked on the bits: non-negative floats order as
// their bits do, and a signed 32-bit max vectorizes (SSE2) where a float one (NaN rules)
// does not.
inline int32_t finite_magnitude(float f) {
  const int32_t a = bit_cast_<int32_t>(f) & 0x7fffffff;
  return a < 0x7f800000 ? a : 0;
}

template <class Code>
struct BlockCodec {
  using C = typename Code::Code;
  static constexpr size_t stride(size_t block) { return sizeof(float) + block * sizeof(C); }
  static float scale_of(const char* enc) {
    float scale;
    std::memcpy(&scale, enc, sizeof scale);
    return scale;
  }
  static const C* codes_of(const char* enc) { return reinterpret_cast<const C*>(enc + sizeof(float)); }
  static void decode(const char* enc, float* v, size_t m) {
    const float scale = scale_of(enc);
    const C* codes = codes_of(enc);
    for (size_t i = 0; i < m; ++i) v[i] = Code::decode(codes[i]) * scale;
  }
  // Near float32's maximum the nearest code times the scale can exceed it; then finite
  // values must saturate one code down instead of coming back infinite. Rounding is
  // monotonic, so only a block whose largest value overflows can hold such a code.
  static bool may_overflow(float amax, float scale) {
    return std::isinf(Code::decode(Code::encode(amax * inverse_scale(scale))) * scale);
  }
  static C saturated(float v, C code, float scale) {
    return std::isfinite(v) && std::isinf(Code::decode(code) * scale) ? static_cast<C>(code - 1) : code;
  }
  static void encode(const float* v, float amax, char* enc, size_t m) {
    const float scale = block_scale<Code>(amax), inv = inverse_scale(scale);
    std::memcpy(enc, &scale, sizeof scale);
    C* codes = reinterpret_cast<C*>(enc + sizeof(float));
    for (size_t i = 0; i < m; ++i) codes[i] = Code::encode(v[i] * inv);
    if (may_overflow(amax, scale))
      for (size_t i = 0; i < m; ++i) codes[i] = saturated(v[i], codes[i], scale);
  }
  // v = decode(encode(v)) in place; amax: the largest finite magnitude of v.
  static void quantize(float* v, float amax, size_t m) {
    const float scale = block_scale<Code>(amax), inv = inverse_scale(scale);
    if (may_overflow(amax, scale)) {
      for (size_t i = 0; i < m; ++i) v[i] = Code::decode(saturated(v[i], Code::encode(v[i] * inv), scale)) * scale;
      return;
    }
    for (size_t i = 0; i < m; ++i) v[i] = Code::decode(Code::encode(v[i] * inv)) * scale;
  }
};

template <class T, ReduceKind K, class Code>
void reduce_terms_coded(const ReduceSpec& spec, Stage stage, void* out, const Term* terms, int k, size_t n,
                        float premul) {
  using N = Numeric<T>;
  using BC = BlockCodec<Code>;
  const size_t block = spec.block, stride = BC::stride(block);
  // Encoding one contribution quantizes it once, in the encoder: quantizing is idempotent.
  const bool quantize_inputs = !(k == 1 && stage == Stage::Encoded);
  // Exact mode: every term's values of a block first (quantized or decoded), then their
  // exact sum, in sub-blocks of kExactBlock.
  const bool exact = kSumLike<K> && spec.exact;
  std::vector<float> values(exact ? static_cast<size_t>(k) * block : 0);
  float acc[kMaxCodecBlock], v[kMaxCodecBlock];
  auto load_input = [&](int j, size_t base, size_t m, float* dst) {
    const T* x = static_cast<const T*>(terms[j].data) + base;
    int32_t amax = 0;
    for (size_t i = 0; i < m; ++i) {
      dst[i] = contribution<K>(N::load(x[i]), premul);
      const int32_t a = finite_magnitude(dst[i]);
      amax = a > amax ? a : amax;
    }
    if (quantize_inputs) BC::quantize(dst, bit_cast_<float>(amax), m);
  };
  for (size_t b = 0, base = 0; base < n; ++b, base += block) {
    const size_t m = std::min(block, n - base);
    if (exact) {
      for (int j = 0; j < k; ++j) {
        float* dst = values.data() + j * block;
        const Term& t = terms[j];
        if (t.form == Form::Input) load_input(j, base, m, dst);
        else if (t.form == Form::Partial) std::memcpy(dst, static_cast<const float*>(t.data) + base, m * sizeof(float));
        else BC::decode(static_cast<const char*>(t.data) + b * stride, dst, m);
      }
      for (size_t s = 0; s < m; s += kExactBlock)
        exact_sum(values.data() + s, k, block, std::min(kExactBlock, m - s), acc + s);
    }
    for (int j = 0; j < k && !exact; ++j) {
      switch (terms[j].form) {
        case Form::Input: {
          load_input(j, base, m, j == 0 ? acc : v);
          if (j > 0)
            for (size_t i = 0; i < m; ++i) acc[i] = reduce_op<K>(acc[i], v[i]);
          break;
        }
        case Form::Partial: {
          const float* x = static_cast<const float*>(terms[j].data) + base;
          if (j == 0)
            std::memcpy(acc, x, m * sizeof(float));
          else
            for (size_t i = 0; i < m; ++i) acc[i] = reduce_op<K>(acc[i], x[i]);
          break;
        }
        case Form::Encoded: {
          const char* enc = static_cast<const char*>(terms[j].data) + b * stride;
          const float scale = BC::scale_of(enc);
          const auto* codes = BC::codes_of(enc);
          if (j == 0)
            BC::decode(enc, acc, m);
          else
            for (size_t i = 0; i < m; ++i) acc[i] = reduce_op<K>(acc[i], Code::decode(codes[i]) * scale);
          break;
        }
      }
    }
    if constexpr (K == ReduceKind::Avg)
      if (stage == Stage::Final || stage == Stage::FinalEncoded)
        for (size_t i = 0; i < m; ++i) acc[i] = finalize<K>(acc[i], spec.world_size);
    switch (stage) {
      case Stage::Partial: std::memcpy(static_cast<float*>(out) + base, acc, m * sizeof(float)); break;
      case Stage::Final: {
        T* o = static_cast<T*>(out) + base;
        for (size_t i = 0; i < m; ++i) o[i] = N::store(acc[i]);
        break;
      }
      case Stage::Encoded:
      case Stage::FinalEncoded: {
        int32_t amax = 0;
        for (size_t i = 0; i < m; ++i) {
          const int32_t a = finite_magnitude(acc[i]);
          amax = a > amax ? a : amax;
        }
        BC::encode(acc, bit_cast_<float>(amax), static_cast<char*>(out) + b * stride, m);
        break;
      }
    }
  }
}

class CpuOps final : public DeviceOps {
 public:
  void copy(void* dst, const void* src, size_t bytes) const override {
    if (bytes && dst != src) std::memcpy(dst, src, bytes);
  }

  void reduce_terms(const ReduceSpec& spec, Stage stage, void* out, const Term* terms, int k,
                    size_t n) const override {
    if (n == 0) return;
    dispatch_dtype(spec.dtype, [&](auto type) {
      using T = typename decltype(type)::type;
      dispatch_reduce(spec.reduction.kind, [&](auto kind) {
        constexpr ReduceKind K = decltype(kind)::value;
        const auto premul = static_cast<AccOf<T>>(spec.reduction.premul);
        if (spec.codec != Compression::None) {
          if constexpr (std::is_same_v<AccOf<T>, float>) {
            dispatch_codec(spec.codec, [&](auto code) {
              reduce_terms_coded<T, K, typename decltype(code)::type>(spec, stage, out, terms, k, n, premul);
            });
          } else {
            fail(ErrorKind::Internal, "pycomm: compression of a type that does not accumulate in float32");
          }
        } else if (stage == Stage::Final) {
          fold<T, K, true>(spec, out, terms, k, n, premul);
        } else {
          fold<T, K, false>(spec, out, terms, k, n, premul);
        }
      });
    });
  }
};

}  // namespace

const DeviceOps& cpu_ops() {
  static const CpuOps ops;
  return ops;
}

}  // namespace pycomm
