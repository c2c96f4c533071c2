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
// accumulation format, the storage format, or encoded (see Stage).
constexpr size_t kMaxCodecBlock = 4096;

template <class Code>
struct BlockCodec {
  using C = typename Code::Code;
  static constexpr size_t stride(size_t block) { return sizeof(float) + block * sizeof(C); }
  static void decode(const char* enc, float* v, size_t m) {
    float scale;
    std::memcpy(&scale, enc, sizeof scale);
    const C* codes = reinterpret_cast<const C*>(enc + sizeof(float));
    for (size_t i = 0; i < m; ++i) v[i] = Code::decode(codes[i]) * scale;
  }
  // The largest finite magnitude, on the bits: non-negative floats order as their bits
  // do, and an integer max reduction vectorizes where a float one (NaN rules) does not.
  static float largest_finite(const float* v, size_t m) {
    int32_t amax = 0;  // signed: SSE2 has signed 32-bit compares only
    for (size_t i = 0; i < m; ++i) {
      const int32_t a = bit_cast_<int32_t>(v[i]) & 0x7fffffff;
      const int32_t finite = a < 0x7f800000 ? a : 0;
      amax = finite > amax ? finite : amax;
    }
    return bit_cast_<float>(amax);
  }
  // Codes of one block; returns its scale. Near float32's maximum the nearest code can
  // decode beyond it (to Inf): such codes saturate one step down instead, so a finite
  // value never comes back infinite. Rounding is monotonic, so only a block whose largest
  // value overflows can hold one.
  static float encode_block(const float* v, C* codes, size_t m) {
    const float amax = largest_finite(v, m);
    const float scale = block_scale<Code>(amax), inv = inverse_scale(scale);
    for (size_t i = 0; i < m; ++i) codes[i] = Code::encode(v[i] * inv);
    if (std::isinf(Code::decode(Code::encode(amax * inv)) * scale))
      for (size_t i = 0; i < m; ++i)
        if (std::isfinite(v[i]) && std::isinf(Code::decode(codes[i]) * scale)) codes[i] = static_cast<C>(codes[i] - 1);
    return scale;
  }
  static void encode(const float* v, char* enc, size_t m) {
    const float scale = encode_block(v, reinterpret_cast<C*>(enc + sizeof(float)), m);
    std::memcpy(enc, &scale, sizeof scale);
  }
  static void quantize(float* v, size_t m) {
    C codes[kMaxCodecBlock];
    const float scale = encode_block(v, codes, m);
    for (size_t i = 0; i < m; ++i) v[i] = Code::decode(codes[i]) * scale;
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
      float* dst = j == 0 ? acc : v;
      switch (terms[j].form) {
        case Form::Input: {
          const T* x = static_cast<const T*>(terms[j].data) + base;
          for (size_t i = 0; i < m; ++i) dst[i] = contribution<K>(N::load(x[i]), premul);
          if (quantize_inputs) BC::quantize(dst, m);
          break;
        }
        case Form::Partial:
          std::memcpy(dst, static_cast<const float*>(terms[j].data) + base, m * sizeof(float));
          break;
        case Form::Encoded:
          BC::decode(static_cast<const char*>(terms[j].data) + b * stride, dst, m);
          break;
      }
      if (j > 0)
        for (size_t i = 0; i < m; ++i) acc[i] = reduce_op<K>(acc[i], v[i]);
    }
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
      case Stage::FinalEncoded: BC::encode(acc, static_cast<char*>(out) + b * stride, m); break;
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
