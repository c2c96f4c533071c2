// Folds with a codec (kernels.h): one warp per codec block, because scales are per codec
// block: a block's largest magnitudes are reductions over the block (an input's, to
// quantize it as its encoder would; the result's, to encode it). The arithmetic is
// BlockCodec's of cpu_ops.cc, element by element.
#include <type_traits>

#include "core/dispatch.h"
#include "cuda/cuda_check.h"
#include "cuda/kernels.h"

namespace pycomm {
namespace {

// The largest value of `v` over the warp; every lane gets it.
__device__ __forceinline__ int32_t warp_max(int32_t v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// BlockCodec of cpu_ops.cc, per element: scale and its inverse, and whether codes may
// round up to infinity (then finite values saturate one code down).
template <class Code>
struct Scaled {
  float scale = 1.0f, inv = 1.0f;
  bool overflow = false;
  __device__ static Scaled of(int32_t amax) {
    Scaled s;
    s.scale = block_scale<Code>(bit_cast_<float>(amax));
    s.inv = inverse_scale(s.scale);
    s.overflow = block_may_overflow<Code>(bit_cast_<float>(amax), s.scale);
    return s;
  }
  __device__ uint32_t encode(float v) const {
    const uint32_t code = Code::encode(v * inv);
    return overflow ? saturated_code<Code>(v, code, scale) : code;
  }
};

constexpr int kWarps = kThreads / 32;

// One warp per codec block: lane l holds elements l, l + 32, ... (coalesced), so the
// block-wide maxima are warp shuffles and warps never wait for each other. First each
// term's scale (an input's as its encoder would choose it: one pass over its block), then
// each element's fold over the terms, then the output, encoded with the result's scale.
template <class T, ReduceKind K, class Code>
__global__ void __launch_bounds__(kThreads)
    coded_kernel(void* out, Terms t, size_t n, size_t block, Stage stage, float premul, int world, bool quantize_inputs,
                 bool exact) {
  using C = typename Code::Code;
  __shared__ Scaled<Code> scales[kWarps][kMaxDeviceTerms];
  extern __shared__ float results[];  // kWarps rows of `block`, for an encoded output only
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  Scaled<Code>* term_scale = scales[warp];
  const size_t stride = sizeof(float) + block * sizeof(C);
  const size_t warps = static_cast<size_t>(gridDim.x) * kWarps;
  for (size_t b = static_cast<size_t>(blockIdx.x) * kWarps + warp; b * block < n; b += warps) {
    const size_t base = b * block;
    const int m = static_cast<int>(min(block, n - base));
    const auto input = [&](int j, int i) {
      return contribution<K>(Numeric<T>::load(static_cast<const T*>(t.data[j])[base + i]), premul);
    };
    for (int j = 0; j < t.k; ++j) {
      if (t.form[j] == Form::Input && quantize_inputs) {
        int32_t amax = 0;
        for (int i = lane; i < m; i += 32) amax = max(amax, finite_magnitude(input(j, i)));
        amax = warp_max(amax);
        if (lane == 0) term_scale[j] = Scaled<Code>::of(amax);
      } else if (t.form[j] == Form::Encoded && lane == 0) {
        term_scale[j].scale = *reinterpret_cast<const float*>(static_cast<const char*>(t.data[j]) + b * stride);
      }
    }
    __syncwarp();
    const auto value = [&](int j, int i) -> float {
      switch (t.form[j]) {
        case Form::Input: {
          const float v = input(j, i);
          return quantize_inputs ? Code::decode(term_scale[j].encode(v)) * term_scale[j].scale : v;
        }
        case Form::Partial: return static_cast<const float*>(t.data[j])[base + i];
        default: {
          const C* codes = reinterpret_cast<const C*>(static_cast<const char*>(t.data[j]) + b * stride + sizeof(float));
          return Code::decode(codes[i]) * term_scale[j].scale;
        }
      }
    };
    // Each lane folds its elements; an encoded output goes through the warp's row of
    // `results` (its scale needs the whole block's largest magnitude first).
    float* const result = results + warp * block;
    const bool encoded = stage == Stage::Encoded || stage == Stage::FinalEncoded;
    int32_t amax = 0;
#pragma unroll 4
    for (int i = lane; i < m; i += 32) {
      float acc;
      if (kSumLike<K> && exact) {
        int32_t largest = 0;
        for (int j = 0; j < t.k; ++j) largest = max(largest, magnitude_bits(value(j, i)));
        if (nonfinite_magnitude(largest)) {
          uint32_t seen = 0;
          for (int j = 0; j < t.k; ++j) {
            const float v = value(j, i);
            if (nonfinite_magnitude(magnitude_bits(v))) seen |= nonfinite_kind(v);
          }
          acc = exact_nonfinite<float>(seen);
        } else {
          const ExactGrid grid = exact_grid(largest);
          double sum = 0.0;
          for (int j = 0; j < t.k; ++j) sum += exact_grid_steps(value(j, i), grid.up);
          acc = exact_grid_value(sum, grid.down);
        }
      } else {
        acc = value(0, i);
        for (int j = 1; j < t.k; ++j) acc = reduce_op<K>(acc, value(j, i));
      }
      if (K == ReduceKind::Avg && (stage == Stage::Final || stage == Stage::FinalEncoded)) acc = finalize<K>(acc, world);
      if (encoded) {
        result[i] = acc;
        amax = max(amax, finite_magnitude(acc));
      } else if (stage == Stage::Partial) {
        static_cast<float*>(out)[base + i] = acc;
      } else {
        static_cast<T*>(out)[base + i] = Numeric<T>::store(acc);
      }
    }
    if (encoded) {
      const Scaled<Code> s = Scaled<Code>::of(warp_max(amax));  // each lane reads back its own elements
      char* enc = static_cast<char*>(out) + b * stride;
      if (lane == 0) *reinterpret_cast<float*>(enc) = s.scale;
      C* codes = reinterpret_cast<C*>(enc + sizeof(float));
      for (int i = lane; i < m; i += 32) codes[i] = static_cast<C>(s.encode(result[i]));
    }
    __syncwarp();  // term_scale and result are rewritten for the next codec block
  }
}

}  // namespace

void launch_coded(const ReduceSpec& spec, Stage stage, void* out, const Terms& t, size_t n,
                  const KernelTarget& target) {
  // Encoding one contribution quantizes it once, in the encoder, as the CPU does.
  const bool quantize_inputs = !(t.k == 1 && stage == Stage::Encoded);
  dispatch_dtype(spec.dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    if constexpr (std::is_same_v<AccOf<T>, float>) {
      dispatch_reduce(spec.reduction.kind, [&](auto kind) {
        constexpr ReduceKind K = decltype(kind)::value;
        if constexpr (K == ReduceKind::BitAnd || K == ReduceKind::BitOr || K == ReduceKind::BitXor) {
          fail(ErrorKind::Internal, "pycomm: bitwise reduction of floating data");
        } else {
          dispatch_codec(spec.codec, [&](auto code) {
            using Code = typename decltype(code)::type;
            const size_t blocks = (n + spec.block - 1) / spec.block;
            const bool encoded = stage == Stage::Encoded || stage == Stage::FinalEncoded;
            const size_t shared = encoded ? kWarps * spec.block * sizeof(float) : 0;
            coded_kernel<T, K, Code><<<grid_for(blocks * 32, target.multiprocessors), kThreads, shared,
                                       target.stream>>>(
                out, t, n, spec.block, stage, static_cast<float>(spec.reduction.premul), spec.world_size,
                quantize_inputs, spec.exact);
          });
        }
      });
    } else {
      fail(ErrorKind::Internal, "pycomm: compression of a type that does not accumulate in float32");
    }
  });
}

}  // namespace pycomm
