// Folds with a codec (kernels.h): one warp per codec block, because scales are per codec
// block: a block's largest magnitudes are reductions over the block (an input's, to
// quantize it as its encoder would; the result's, to encode it). The arithmetic is
// BlockCodec's of cpu_ops.cc, element by element, its conversions computed as
// conversions.cuh computes them (the same bits). Each codec's launcher is instantiated in
// a file of its own (coded_kernels_<codec>.cu), so that they compile in parallel.
#pragma once

#include <type_traits>

#include "core/dispatch.h"
#include "cuda/conversions.cuh"
#include "cuda/cuda_check.h"
#include "cuda/kernels.h"

namespace pycomm {
// Named, not anonymous: each coded_kernels_<codec>.cu compiles this header, and
// launch_coded_for must mean the same thing in each.
namespace coded_kernels {

// The largest value of `v` over the warp; every lane gets it.
__device__ __forceinline__ int32_t warp_max(int32_t v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

constexpr int kWarps = kThreads / 32;
constexpr int V = 4;  // consecutive elements per lane (even: conversions come in pairs)

// BlockCodec of cpu_ops.cc, for a lane's V values: scale and its inverse, and whether codes
// may round up to infinity (then finite values saturate one code down). D: a DeviceCode.
template <class D>
struct Scaled {
  float scale = 1.0f, inv = 1.0f;
  bool overflow = false;
  __device__ static Scaled of(int32_t amax) {
    Scaled s;
    s.scale = block_scale<D>(bit_cast_<float>(amax));
    s.inv = inverse_scale(s.scale);
    s.overflow = block_may_overflow<D>(bit_cast_<float>(amax), s.scale);
    return s;
  }
  __device__ void encode(const float (&v)[V], uint32_t (&codes)[V]) const {
#pragma unroll
    for (int e = 0; e < V; e += 2) D::encode_pair(v[e] * inv, v[e + 1] * inv, codes[e], codes[e + 1]);
    if (overflow) {
#pragma unroll
      for (int e = 0; e < V; ++e) codes[e] = saturated_code<D>(v[e], codes[e], scale);
    }
  }
};

template <class X, size_t kAlign>
struct alignas(kAlign) Pack {
  X v[V];
};

// p[i, i + V) below m into x (the rest zero): one kAlign-aligned access when `vector` and
// the group is whole, one per element otherwise.
template <size_t kAlign, class X>
__device__ __forceinline__ void load_group(const X* p, int i, int m, bool vector, X (&x)[V]) {
  if (vector && i + V <= m) {
    const Pack<X, kAlign> pack = *reinterpret_cast<const Pack<X, kAlign>*>(p + i);
#pragma unroll
    for (int e = 0; e < V; ++e) x[e] = pack.v[e];
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) x[e] = i + e < m ? p[i + e] : X{};
  }
}

template <size_t kAlign, class X>
__device__ __forceinline__ void store_group(X* p, int i, int m, bool vector, const X (&x)[V]) {
  if (vector && i + V <= m) {
    Pack<X, kAlign> pack;
#pragma unroll
    for (int e = 0; e < V; ++e) pack.v[e] = x[e];
    *reinterpret_cast<Pack<X, kAlign>*>(p + i) = pack;
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e)
      if (i + e < m) p[i + e] = x[e];
  }
}

// Every operand starts 16-aligned where `vector` (encoded ones are pieces, whose codes
// start at their start), and block % V == 0: a group of V elements or codes is as aligned
// as its size, up to 16.
template <class X>
constexpr size_t kDataAlign = sizeof(X) * V < 16 ? sizeof(X) * V : 16;

// One warp per codec block: lane l holds the V consecutive elements V l + 32 V g + [0, V)
// for g < groups (32 V g below the block's length m), so a warp reads 32 V consecutive
// elements at a time (16-byte loads of float operands, 4- or 8-byte loads of codes where
// `vector`). The block's values stay in registers (kGroups groups of V a lane covers the
// largest block) and every operand is read once: an input term is loaded, its scale taken
// from its largest magnitude (a warp-wide max, as its encoder would choose it), quantized
// there and folded into the lane's sums; an encoded output's scale is the warp-wide max of
// the sums, whose codes are written from the registers. No shared memory, no pre-pass.
// Exact mode is the exception: its grid needs each element's largest magnitude over every
// term before any term is added, so it reads the terms twice per group, the input terms'
// scales found first (a pass over each) and kept in shared memory. Elements past m (the
// last group may be partial) are loaded as zeros and never stored or measured. Exact mode
// is a template argument, as in fold_kernels.cuh: its double-precision sums would
// otherwise set every variant's register count.
//
// The launch's y index picks a pair of `pairs` (one term): segment y of the plain operand
// and slot y of the encoded one, the output being the slot where the stage encodes, else
// the segment. A fold of its operands whole is one pair at offset 0 (any number of terms).
// Encoded operands are pieces of the pair's length (numerics.h's layout).
constexpr int kGroups = kMaxCodecBlock / (32 * V);
using Lanes = float[kGroups][V];  // a lane's values of a block, group by group

template <class T, ReduceKind K, class Code, bool kExact>
__global__ void __launch_bounds__(kThreads)
    coded_kernel(void* out, Terms t, SegmentSlots pairs, size_t block, Stage stage, float premul, int world,
                 bool quantize_inputs, bool vector) {
  using C = typename Code::Code;
  using D = DeviceCode<Code>;
  __shared__ Scaled<D> exact_scales[kExact ? kWarps : 1][kMaxDeviceTerms];  // exact mode's input scales
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t warps = static_cast<size_t>(gridDim.x) * kWarps;
  const bool encoded = pairs.encodes(stage);
  const size_t pair = blockIdx.y;
  const size_t n = static_cast<int>(pair) == pairs.skip ? 0 : pairs.segments.length(pair);
  const size_t element = stage == Stage::Partial ? sizeof(float) : sizeof(T);  // the plain operand's form
  const size_t plain_at = pairs.segments.begin(pair) * element, slot_at = pair * pairs.slot_bytes;
  out = static_cast<char*>(out) + (encoded ? slot_at : plain_at);
  const size_t term_at = encoded ? plain_at : slot_at;
  const auto data = [&](int j) { return static_cast<const char*>(t.data[j]) + term_at; };
  for (size_t b = static_cast<size_t>(blockIdx.x) * kWarps + warp; b * block < n; b += warps) {
    const size_t base = b * block;
    const int m = static_cast<int>(min(block, n - base));
    const int groups = (m + 32 * V - 1) / (32 * V);  // the same in every lane: warp-wide steps agree
    const auto first = [&](int g) { return V * lane + 32 * V * g; };
    // This block's records in the piece at `piece` (char, or const char for a term).
    const auto records = [&](auto* piece) { return records_of(piece, n, sizeof(C)).from(b, block, sizeof(C)); };
    // Term j's group g, its contribution (PREMUL_SUM's factor applied) or its values.
    const auto load = [&](int j, int g, float (&v)[V]) {
      switch (t.form[j]) {
        case Form::Input: {
          T x[V];
          load_group<kDataAlign<T>>(reinterpret_cast<const T*>(data(j)) + base, first(g), m, vector, x);
#pragma unroll
          for (int e = 0; e < V; ++e) v[e] = contribution<K>(Numeric<T>::load(x[e]), premul);
          return;
        }
        case Form::Partial:
          load_group<kDataAlign<float>>(reinterpret_cast<const float*>(data(j)) + base, first(g), m, vector, v);
          return;
        default: {  // every lane loads the scale: no wait between it and the codes
          const Records<const char> r = records(data(j));
          C codes[V];
          load_group<kDataAlign<C>>(reinterpret_cast<const C*>(r.codes), first(g), m, vector, codes);
          const float scale = *r.scales;
#pragma unroll
          for (int e = 0; e < V; ++e) v[e] = D::decode(codes[e]) * scale;
        }
      }
    };
    const auto largest_finite = [&](const Lanes& v) {  // over the block (zeros past m), every lane gets it
      int32_t amax = 0;
#pragma unroll
      for (int g = 0; g < kGroups; ++g)
#pragma unroll
        for (int e = 0; e < V; ++e)
          if (g < groups) amax = max(amax, finite_magnitude(v[g][e]));
      return warp_max(amax);
    };
    const auto quantize = [&](const Scaled<D>& s, float (&v)[V]) {
      uint32_t codes[V];
      s.encode(v, codes);
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] = D::decode(codes[e]) * s.scale;
    };
    Lanes acc = {};
    if constexpr (kExact) {
      for (int j = 0; j < t.k; ++j) {
        if (t.form[j] != Form::Input || !quantize_inputs) continue;
        Lanes v;
#pragma unroll
        for (int g = 0; g < kGroups; ++g)
          if (g < groups) load(j, g, v[g]);
        const int32_t amax = largest_finite(v);
        if (lane == 0) exact_scales[warp][j] = Scaled<D>::of(amax);
      }
      __syncwarp();
      // Term j's group g as the fold takes it: an input's contribution quantized.
      const auto value = [&](int j, int g, float (&v)[V]) {
        load(j, g, v);
        if (t.form[j] == Form::Input && quantize_inputs) quantize(exact_scales[warp][j], v);
      };
      // Group by group, not unrolled (each group reads every term three times over: unrolled,
      // the code would be kGroups times as long); acc is written by an unrolled select, so
      // that it stays in registers.
#pragma unroll 1
      for (int g = 0; g < groups; ++g) {
        float v[V], r[V];
        int32_t largest[V] = {};
        for (int j = 0; j < t.k; ++j) {
          value(j, g, v);
#pragma unroll
          for (int e = 0; e < V; ++e) largest[e] = max(largest[e], magnitude_bits(v[e]));
        }
        double sum[V] = {};
        for (int j = 0; j < t.k; ++j) {
          value(j, g, v);
#pragma unroll
          for (int e = 0; e < V; ++e) sum[e] += exact_grid_steps(v[e], exact_grid(largest[e]).up);
        }
#pragma unroll
        for (int e = 0; e < V; ++e) {
          r[e] = exact_grid_value(sum[e], exact_grid(largest[e]).down);
          if (!nonfinite_magnitude(largest[e])) continue;
          uint32_t seen = 0;
          for (int j = 0; j < t.k; ++j) {
            value(j, g, v);
            if (nonfinite_magnitude(magnitude_bits(v[e]))) seen |= nonfinite_kind(v[e]);
          }
          r[e] = exact_nonfinite<float>(seen);
        }
#pragma unroll
        for (int h = 0; h < kGroups; ++h)
#pragma unroll
          for (int e = 0; e < V; ++e)
            if (h == g) acc[h][e] = r[e];
      }
      __syncwarp();  // exact_scales are rewritten for the next codec block
    } else {
      for (int j = 0; j < t.k; ++j) {
        Lanes v;
#pragma unroll
        for (int g = 0; g < kGroups; ++g)
          if (g < groups) load(j, g, v[g]);
        if (t.form[j] == Form::Input && quantize_inputs) {
          const Scaled<D> s = Scaled<D>::of(largest_finite(v));
#pragma unroll
          for (int g = 0; g < kGroups; ++g)
            if (g < groups) quantize(s, v[g]);
        }
#pragma unroll
        for (int g = 0; g < kGroups; ++g)
#pragma unroll
          for (int e = 0; e < V; ++e)
            if (g < groups) acc[g][e] = j == 0 ? v[g][e] : reduce_op<K>(acc[g][e], v[g][e]);
      }
    }
    if (K == ReduceKind::Avg && (stage == Stage::Final || stage == Stage::FinalEncoded)) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g)
#pragma unroll
        for (int e = 0; e < V; ++e)
          if (g < groups) acc[g][e] = finalize<K>(acc[g][e], world);
    }
    if (encoded) {
      // Past m: zeros, or what zeros fold to (finite), never measured.
#pragma unroll
      for (int g = 0; g < kGroups; ++g)
#pragma unroll
        for (int e = 0; e < V; ++e)
          if (g < groups && first(g) + e >= m) acc[g][e] = 0.0f;
      const Scaled<D> s = Scaled<D>::of(largest_finite(acc));
      const Records<char> r = records(static_cast<char*>(out));
      if (lane == 0) *r.scales = s.scale;
      // The last block's warp zeroes the piece's padding.
      if (lane == 0 && base + block >= n) zero_padding<Code>(static_cast<char*>(out), n, block);
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        if (g >= groups) continue;
        uint32_t codes[V];
        s.encode(acc[g], codes);
        C c[V];
#pragma unroll
        for (int e = 0; e < V; ++e) c[e] = static_cast<C>(codes[e]);
        store_group<kDataAlign<C>>(reinterpret_cast<C*>(r.codes), first(g), m, vector, c);
      }
    } else if (stage == Stage::Partial) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g)
        if (g < groups) store_group<kDataAlign<float>>(static_cast<float*>(out) + base, first(g), m, vector, acc[g]);
    } else {
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        if (g >= groups) continue;
        T stored[V];
#pragma unroll
        for (int e = 0; e < V; ++e) stored[e] = Numeric<T>::store(acc[g][e]);
        store_group<kDataAlign<T>>(static_cast<T*>(out) + base, first(g), m, vector, stored);
      }
    }
  }
}

template <class T, ReduceKind K, class Code, bool kExact>
void launch_typed(const ReduceSpec& spec, Stage stage, void* out, const Terms& t, const SegmentSlots& pairs,
                  const KernelTarget& target) {
  // Encoding one contribution quantizes it once, in the encoder, as the CPU does.
  const bool quantize_inputs = !(t.k == 1 && stage == Stage::Encoded);
  const Segments& seg = pairs.segments;
  const size_t longest = seg.length(0), blocks = (longest + spec.block - 1) / spec.block;
  // Whole groups start aligned in every operand of every pair: block % V == 0 keeps each
  // block's first element (and its first code) as aligned as the operand's start.
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  bool vector = spec.block % V == 0 && aligned(out);
  for (int j = 0; j < t.k; ++j) vector = vector && aligned(t.data[j]);
  vector = vector && pairs.slot_bytes % 16 == 0;
  const size_t element = stage == Stage::Partial ? sizeof(float) : sizeof(T);
  for (size_t s = 1; vector && s < seg.parts; ++s) vector = seg.begin(s) * element % 16 == 0;
  const dim3 grid(grid_for(blocks * 32, target.multiprocessors), static_cast<unsigned>(seg.parts));
  coded_kernel<T, K, Code, kExact><<<grid, kThreads, 0, target.stream>>>(out, t, pairs, spec.block, stage,
                                                                         static_cast<float>(spec.reduction.premul),
                                                                         spec.world_size, quantize_inputs, vector);
}

}  // namespace coded_kernels

template <class Code>
void launch_coded_for(const ReduceSpec& spec, Stage stage, void* out, const Terms& t, const SegmentSlots& pairs,
                      const KernelTarget& target) {
  dispatch_fold(spec, [&](auto type, auto kind, auto exact) {
    using T = typename decltype(type)::type;
    constexpr ReduceKind K = decltype(kind)::value;
    constexpr bool kExact = decltype(exact)::value;
    if constexpr (std::is_same_v<AccOf<T>, float>) {
      coded_kernels::launch_typed<T, K, Code, kExact>(spec, stage, out, t, pairs, target);
    } else {
      fail(ErrorKind::Internal, "pycomm: compression of a type that does not accumulate in float32");
    }
  });
}

}  // namespace pycomm
