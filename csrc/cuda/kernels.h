// What the reduction kernels share: the terms as a kernel parameter, the launch shape, and
// one launcher per kind of fold (reduce_kernels.cu chooses; each lives in its own file so
// that they compile in parallel).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

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

constexpr int kThreads = 256;
// The largest codec block of a coded fold (a warp per codec block; an encoded output's
// values wait in shared memory: kThreads * 4 bytes per 32 elements of block, 32 KiB at most).
constexpr int kMaxCodecBlock = 1024;

// Blocks for `work_items` threads' worth of work, at most 16 per multiprocessor (the
// kernels loop over the rest).
int grid_for(size_t work_items, int multiprocessors);

// Uncoded fold, in term order or exact (fold_kernels.cu).
void launch_fold(const ReduceSpec& spec, Stage stage, void* out, const Terms& terms, size_t n,
                 const KernelTarget& target);
// Fold with a codec (coded_kernels.cu); spec.block <= kMaxCodecBlock.
void launch_coded(const ReduceSpec& spec, Stage stage, void* out, const Terms& terms, size_t n,
                  const KernelTarget& target);

}  // namespace pycomm
