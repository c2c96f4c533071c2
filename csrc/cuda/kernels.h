// What the reduction kernels share: the terms as a kernel parameter, the launch shape, and
// one launcher per kind of fold (reduce_kernels.cu chooses), whose kernels are split over
// files by codec or stage so that they compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/dispatch.h"
#include "core/numerics.h"
#include "cuda/reduce_kernels.h"

namespace pycomm {

struct Terms {
  const void* data[kMaxDeviceTerms];
  Form form[kMaxDeviceTerms];
  int k;
};

template <ReduceKind K>
constexpr bool kSumLike = K == ReduceKind::Sum || K == ReduceKind::Avg || K == ReduceKind::PremulSum;

// Calls f(TypeTag<T>{}, KindTag<K>{}, std::bool_constant<kExact>{}) for spec's reduction
// of T: exact only for sum-like reductions of floating data (as the CPU does), so the
// other kernels never carry its sums. Validation refuses bitwise reductions of floating
// data before any kernel is chosen. (A function per level, not nested generic lambdas:
// nvcc's host pass misreads a type taken from an enclosing generic lambda's parameter.)
template <class T, class F>
void dispatch_fold_of(const ReduceSpec& spec, F& f) {
  constexpr bool kFloating = std::is_floating_point_v<AccOf<T>>;
  dispatch_reduce(spec.reduction.kind, [&](auto kind) {
    constexpr ReduceKind K = decltype(kind)::value;
    if constexpr (kFloating && (K == ReduceKind::BitAnd || K == ReduceKind::BitOr || K == ReduceKind::BitXor)) {
      fail(ErrorKind::Internal, "pycomm: bitwise reduction of floating data");
    } else {
      if constexpr (kFloating && kSumLike<K>) {
        if (spec.exact) return f(TypeTag<T>{}, kind, std::true_type{});
      }
      f(TypeTag<T>{}, kind, std::false_type{});
    }
  });
}

template <class F>
void dispatch_fold(const ReduceSpec& spec, F&& f) {
  dispatch_dtype(spec.dtype, [&](auto type) { dispatch_fold_of<typename decltype(type)::type>(spec, f); });
}

constexpr int kThreads = 256;
// The largest codec block of a coded fold (a warp per codec block, whose values its lanes
// hold in registers: kMaxCodecBlock / 32 each).
constexpr int kMaxCodecBlock = 1024;

// Blocks for `work_items` threads' worth of work, at most 16 per multiprocessor (the
// kernels loop over the rest).
int grid_for(size_t work_items, int multiprocessors);

// Uncoded fold, in term order or exact (fold_kernels.cu): launch_fold_for<true> at
// Stage::Final (fold_kernels_final.cu), else <false> (fold_kernels_partial.cu).
void launch_fold(const ReduceSpec& spec, Stage stage, void* out, const Terms& terms, size_t n,
                 const KernelTarget& target);
template <bool kFinal>
void launch_fold_for(const ReduceSpec& spec, void* out, const Terms& terms, size_t n, const KernelTarget& target);
// Fold with a codec (coded_kernels.cu); spec.block <= kMaxCodecBlock: launch_coded_for of
// spec.codec's code format (coded_kernels_<codec>.cu). One launch folds every pair of
// `pairs` (SegmentSlots: `out` and the one term are the slotted and the plain operand,
// as the stage says), or, as the pair {Segments{n, 1, 1}}, `terms` whole into `out`.
void launch_coded(const ReduceSpec& spec, Stage stage, void* out, const Terms& terms, const SegmentSlots& pairs,
                  const KernelTarget& target);
template <class Code>
void launch_coded_for(const ReduceSpec& spec, Stage stage, void* out, const Terms& terms, const SegmentSlots& pairs,
                      const KernelTarget& target);

}  // namespace pycomm
