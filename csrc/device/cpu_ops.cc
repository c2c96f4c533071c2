#include <algorithm>
#include <cmath>
#include <cstring>

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
  float acc[kMaxCodecBlock], v[kMaxCodecBlock];
  for (size_t b = 0, base = 0; base < n; ++b, base += block) {
    const size_t m = std::min(block, n - base);
    for (int j = 0; j < k; ++j) {
      switch (terms[j].form) {
        case Form::Input: {
          const T* x = static_cast<const T*>(terms[j].data) + base;
          float* dst = j == 0 ? acc : v;
          int32_t amax = 0;
          for (size_t i = 0; i < m; ++i) {
            dst[i] = contribution<K>(N::load(x[i]), premul);
            const int32_t a = finite_magnitude(dst[i]);
            amax = a > amax ? a : amax;
          }
          if (quantize_inputs) BC::quantize(dst, bit_cast_<float>(amax), m);
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
            for (size_t i = 0; i < m; ++i) acc[i] = Code::decode(codes[i]) * scale;
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
          reduce_terms_loop<T, K, true>(out, terms, k, n, premul, spec.world_size);
        } else {
          reduce_terms_loop<T, K, false>(out, terms, k, n, premul, spec.world_size);
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
