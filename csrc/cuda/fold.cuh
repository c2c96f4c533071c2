// The device side of uncoded folds, for every kernel that folds terms (fold_kernels.cuh,
// team_kernels.cu): terms loaded V consecutive elements at a time, V * sizeof(T) = 16
// bytes where every pointer is 16-byte aligned (V = 1 otherwise), folded in the order
// given or exactly, as the CPU does (cpu_ops.cc), with numerics.h's per-element math.
#pragma once

#include <type_traits>

#include "cuda/kernels.h"

namespace pycomm {

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

// Elements [e, e + V) of the terms, folded in term order (or exactly), in the
// accumulation format.
template <class T, ReduceKind K, bool kExact, int V>
__device__ __forceinline__ void fold_values(const Terms& t, size_t e, AccOf<T> premul, AccOf<T> (&acc)[V]) {
  using A = AccOf<T>;
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
}

// fold_values, then finalized and stored (kFinal) or stored in the accumulation format,
// with one V-wide store: `out` + e is aligned like the terms.
template <class T, ReduceKind K, bool kFinal, bool kExact, int V>
__device__ __forceinline__ void fold_elements(void* out, const Terms& t, size_t e, AccOf<T> premul, int world) {
  using A = AccOf<T>;
  A acc[V];
  fold_values<T, K, kExact, V>(t, e, premul, acc);
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

}  // namespace pycomm
