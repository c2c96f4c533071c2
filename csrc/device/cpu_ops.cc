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

template <class T, ReduceKind K, class Out, bool kFinal>
void reduce_loop(Out* out, const T* local, const AccOf<T>* in, size_t n, AccOf<T> premul,
                 int world_size) {
  using N = Numeric<T>;
  const auto emit = [&](AccOf<T> v) {
    if constexpr (kFinal) return N::store(finalize<K>(v, world_size));
    else return v;
  };
  if (in) {
    for (size_t i = 0; i < n; ++i)
      out[i] = emit(reduce_op<K>(contribution<K>(N::load(local[i]), premul), in[i]));
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = emit(contribution<K>(N::load(local[i]), premul));
  }
}

class CpuOps final : public DeviceOps {
 public:
  void copy(void* dst, const void* src, size_t bytes) const override {
    if (bytes && dst != src) std::memcpy(dst, src, bytes);
  }

  void reduce(const ReduceSpec& spec, Stage stage, void* out, const void* local,
              const void* incoming, size_t n) const override {
    if (n == 0) return;
    dispatch_dtype(spec.dtype, [&](auto type) {
      using T = typename decltype(type)::type;
      using A = AccOf<T>;
      dispatch_reduce(spec.reduction.kind, [&](auto kind) {
        constexpr ReduceKind K = decltype(kind)::value;
        const A premul = static_cast<A>(spec.reduction.premul);
        const auto* l = static_cast<const T*>(local);
        const auto* in = static_cast<const A*>(incoming);
        if (stage == Stage::Final)
          reduce_loop<T, K, T, true>(static_cast<T*>(out), l, in, n, premul, spec.world_size);
        else
          reduce_loop<T, K, A, false>(static_cast<A*>(out), l, in, n, premul, spec.world_size);
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
