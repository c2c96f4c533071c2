// The CUDA kernels behind CudaOps::reduce_terms: the DeviceOps::reduce_terms contract on
// device memory, with the per-element arithmetic of core/numerics.h, so every result is
// bit for bit the CPU path's (cpu_ops.cc), codecs and exact mode included.
#pragma once

#include <cuda_runtime.h>

#include "device/device_ops.h"

namespace pycomm {

// At most this many terms per call (a team of up to 64 ranks reducing at once).
constexpr int kMaxDeviceTerms = 64;

// Where kernels go: a stream of one device, and that device's multiprocessor count, which
// sizes their grids (read once, when the device's ops are made).
struct KernelTarget {
  cudaStream_t stream;
  int multiprocessors;
};

// Enqueues the reduction on the target's stream; the caller synchronizes.
void launch_reduce_terms(const ReduceSpec& spec, Stage stage, void* out, const Term* terms, int k, size_t n,
                         const KernelTarget& target);
// Enqueues DeviceOps::reduce_segments (a codec's step), one launch for every pair.
void launch_reduce_segments(const ReduceSpec& spec, Stage stage, void* plain, void* slots, const SegmentSlots& pairs,
                            const KernelTarget& target);

}  // namespace pycomm
