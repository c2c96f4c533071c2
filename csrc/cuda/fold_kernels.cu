// Uncoded folds (kernels.h): one thread per V consecutive elements, V * sizeof(T) = 16
// bytes, so each operand is read with 16-byte loads where every pointer is 16-byte
// aligned (V = 1 otherwise), folding the terms in the order given, as the CPU does.
// Exact mode reads the terms twice per element (largest magnitude, then grid steps), the
// second time mostly from cache.
#include <algorithm>
#include <type_traits>

#include "core/dispatch.h"
#include "cuda/cuda_check.h"
#include "cuda/kernels.h"

namespace pycomm {
namespace {

template <class X, int V>
struct alignas(sizeof(X) * V >= 16 ? 16 : sizeof(X) * V) Pack {
  X v[V];
};

// Term j's values of elements [e, e + V) in the accumulation format.
template <class T, ReduceKind K, int V>
__device__ __forceinline__ void load_term(const Terms& t, int j, size_t e, AccOf<T> premul, AccOf<T> (&v)[V]) {
  using A = AccOf<T>;
  if (t.form[j] == Form::Input) {
    const Pack<T, V> x = *reinterpret_cast<const Pack<T, V>*>(static_cast<const T*>(t.data[j]) + e);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = contribution<K>(Numeric<T>::load(x.v[i]), premul);
  } else {
    const Pack<A, V> x = *reinterpret_cast<const Pack<A, V>*>(static_cast<const A*>(t.data[j]) + e);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = x.v[i];
  }
}

// The exact sum (numerics.h) of the terms of elements [e, e + V).
template <class T, ReduceKind K, int V>
__device__ __forceinline__ void exact_fold(const Terms& t, size_t e, AccOf<T> premul, AccOf<T> (&acc)[V]) {
  using A = AccOf<T>;
  using M = std::conditional_t<sizeof(A) == 4, int32_t, int64_t>;
  A v[V];
  M amax[V];
  load_term<T, K, V>(t, 0, e, premul, v);
#pragma unroll
  for (int i = 0; i < V; ++i) amax[i] = magnitude_bits(v[i]);
  for (int j = 1; j < t.k; ++j) {
    load_term<T, K, V>(t, j, e, premul, v);
#pragma unroll
    for (int i = 0; i < V; ++i) amax[i] = max(amax[i], magnitude_bits(v[i]));
  }
  bool nonfinite = false;
  if constexpr (sizeof(A) == 4) {
    double up[V], sum[V];
#pragma unroll
    for (int i = 0; i < V; ++i) up[i] = exact_grid(amax[i]).up, sum[i] = 0.0;
    for (int j = 0; j < t.k; ++j) {
      load_term<T, K, V>(t, j, e, premul, v);
#pragma unroll
      for (int i = 0; i < V; ++i) sum[i] += exact_grid_steps(v[i], up[i]);
    }
#pragma unroll
    for (int i = 0; i < V; ++i) {
      acc[i] = exact_grid_value(sum[i], exact_grid(amax[i]).down);
      nonfinite |= nonfinite_magnitude(amax[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int exponent = exact_exponent64(amax[i]);
      __int128 sum = 0;
      for (int j = 0; j < t.k; ++j) {
        A x[1];
        load_term<T, K, 1>(t, j, e + i, premul, x);
        if (!nonfinite_magnitude(magnitude_bits(x[0]))) sum += exact_grid_steps64(x[0], exponent);
      }
      acc[i] = exact_grid_value64(sum, exponent);
      nonfinite |= nonfinite_magnitude(amax[i]);
    }
  }
  if (!nonfinite) return;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    if (!nonfinite_magnitude(amax[i])) continue;
    uint32_t seen = 0;
    for (int j = 0; j < t.k; ++j) {
      A x[1];
      load_term<T, K, 1>(t, j, e + i, premul, x);
      if (nonfinite_magnitude(magnitude_bits(x[0]))) seen |= nonfinite_kind(x[0]);
    }
    acc[i] = exact_nonfinite<A>(seen);
  }
}

// Elements [e, e + V): folded in term order (or exactly), then finalized and stored
// (kFinal) or kept in the accumulation format.
template <class T, ReduceKind K, bool kFinal, bool kExact, int V>
__device__ __forceinline__ void fold_elements(void* out, const Terms& t, size_t e, AccOf<T> premul, int world) {
  using A = AccOf<T>;
  A acc[V];
  if constexpr (kExact) {
    exact_fold<T, K, V>(t, e, premul, acc);
  } else {
    load_term<T, K, V>(t, 0, e, premul, acc);
    for (int j = 1; j < t.k; ++j) {
      A v[V];
      load_term<T, K, V>(t, j, e, premul, v);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] = reduce_op<K>(acc[i], v[i]);
    }
  }
  if constexpr (kFinal) {
    Pack<T, V> o;
#pragma unroll
    for (int i = 0; i < V; ++i) o.v[i] = Numeric<T>::store(finalize<K>(acc[i], world));
    *reinterpret_cast<Pack<T, V>*>(static_cast<T*>(out) + e) = o;
  } else {
    Pack<A, V> o;
#pragma unroll
    for (int i = 0; i < V; ++i) o.v[i] = acc[i];
    *reinterpret_cast<Pack<A, V>*>(static_cast<A*>(out) + e) = o;
  }
}

// V elements per thread for the first n / V * V elements, then one per thread. A thread
// reads all its elements of every term before it writes: `out` may alias a term.
template <class T, ReduceKind K, bool kFinal, bool kExact, int V>
__global__ void __launch_bounds__(kThreads) fold_kernel(void* out, Terms t, size_t n, AccOf<T> premul, int world) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t packs = n / V;
  for (size_t p = first; p < packs; p += stride) fold_elements<T, K, kFinal, kExact, V>(out, t, p * V, premul, world);
  for (size_t e = packs * V + first; e < n; e += stride) fold_elements<T, K, kFinal, kExact, 1>(out, t, e, premul, world);
}

template <class T, ReduceKind K, bool kFinal, bool kExact>
void launch_typed(void* out, const Terms& t, size_t n, AccOf<T> premul, int world, const KernelTarget& target) {
  constexpr int V = 16 / sizeof(T) > 0 ? static_cast<int>(16 / sizeof(T)) : 1;
  bool aligned = reinterpret_cast<uintptr_t>(out) % 16 == 0;
  for (int j = 0; j < t.k; ++j) aligned = aligned && reinterpret_cast<uintptr_t>(t.data[j]) % 16 == 0;
  if (aligned)
    fold_kernel<T, K, kFinal, kExact, V><<<grid_for(n / V + 1, target.multiprocessors), kThreads, 0, target.stream>>>(
        out, t, n, premul, world);
  else
    fold_kernel<T, K, kFinal, kExact, 1><<<grid_for(n, target.multiprocessors), kThreads, 0, target.stream>>>(
        out, t, n, premul, world);
}

}  // namespace

void launch_fold(const ReduceSpec& spec, Stage stage, void* out, const Terms& t, size_t n,
                 const KernelTarget& target) {
  dispatch_dtype(spec.dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    using A = AccOf<T>;
    dispatch_reduce(spec.reduction.kind, [&](auto kind) {
      constexpr ReduceKind K = decltype(kind)::value;
      constexpr bool kBitwise = K == ReduceKind::BitAnd || K == ReduceKind::BitOr || K == ReduceKind::BitXor;
      if constexpr (std::is_floating_point_v<A> && kBitwise) {
        fail(ErrorKind::Internal, "pycomm: bitwise reduction of floating data");
      } else {
        const auto premul = static_cast<A>(spec.reduction.premul);
        const bool final = stage == Stage::Final;
        if constexpr (std::is_floating_point_v<A> && kSumLike<K>) {
          if (spec.exact) {
            if (final) launch_typed<T, K, true, true>(out, t, n, premul, spec.world_size, target);
            else launch_typed<T, K, false, true>(out, t, n, premul, spec.world_size, target);
            return;
          }
        }
        if (final) launch_typed<T, K, true, false>(out, t, n, premul, spec.world_size, target);
        else launch_typed<T, K, false, false>(out, t, n, premul, spec.world_size, target);
      }
    });
  });
}

}  // namespace pycomm
