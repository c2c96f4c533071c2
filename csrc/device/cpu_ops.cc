#include <algorithm>
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
        if (stage == Stage::Final) reduce_terms_loop<T, K, true>(out, terms, k, n, premul, spec.world_size);
        else reduce_terms_loop<T, K, false>(out, terms, k, n, premul, spec.world_size);
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
