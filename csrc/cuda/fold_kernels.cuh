// Uncoded folds (kernels.h): one thread per V consecutive elements (fold.cuh), folding the
// terms in the order given, as the CPU does. Exact mode reads the terms twice per element
// (largest magnitude, then grid steps), the second time mostly from cache. The final and
// the partial stage's launchers are instantiated in files of their own
// (fold_kernels_final.cu, fold_kernels_partial.cu), so that they compile in parallel.
#pragma once

#include "cuda/cuda_check.h"
#include "cuda/fold.cuh"

namespace pycomm {
// Named, not anonymous: both fold_kernels_*.cu compile this header, and launch_fold_for
// must mean the same thing in each.
namespace fold_kernels {

// V elements per thread for the first n / V * V elements, then one per thread. A thread
// reads all its elements of every term before it writes: `out` may alias a term.
template <class T, ReduceKind K, bool kFinal, bool kExact, int V>
__global__ void __launch_bounds__(kThreads) fold_kernel(void* out, Terms t, size_t n, AccOf<T> premul, int world) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t packs = n / V;
  for (size_t p = first; p < packs; p += stride) fold_elements<T, K, kFinal, kExact, V>(out, t, p * V, premul, world);
  for (size_t e = packs * V + first; e < n; e += stride)
    fold_elements<T, K, kFinal, kExact, 1>(out, t, e, premul, world);
}

template <class T, ReduceKind K, bool kFinal, bool kExact>
void launch_typed(void* out, const Terms& t, size_t n, AccOf<T> premul, int world, const KernelTarget& target) {
  constexpr int V = 16 / sizeof(T) > 0 ? static_cast<int>(16 / sizeof(T)) : 1;
  bool aligned = reinterpret_cast<uintptr_t>(out) % 16 == 0;
  for (int j = 0; j < t.k; ++j) aligned = aligned && reinterpret_cast<uintptr_t>(t.data[j]) % 16 == 0;
  if (aligned)
    fold_kernel<T, K, kFinal, kExact, V>
        <<<grid_for(n / V + 1, target.multiprocessors), kThreads, 0, target.stream>>>(out, t, n, premul, world);
  else
    fold_kernel<T, K, kFinal, kExact, 1>
        <<<grid_for(n, target.multiprocessors), kThreads, 0, target.stream>>>(out, t, n, premul, world);
}

}  // namespace fold_kernels

template <bool kFinal>
void launch_fold_for(const ReduceSpec& spec, void* out, const Terms& t, size_t n, const KernelTarget& target) {
  dispatch_fold(spec, [&](auto type, auto kind, auto exact) {
    using T = typename decltype(type)::type;
    constexpr ReduceKind K = decltype(kind)::value;
    constexpr bool kExact = decltype(exact)::value;
    const auto premul = static_cast<AccOf<T>>(spec.reduction.premul);
    fold_kernels::launch_typed<T, K, kFinal, kExact>(out, t, n, premul, spec.world_size, target);
  });
}

}  // namespace pycomm
