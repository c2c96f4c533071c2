// The layered path's stamps on the device (runtime/device_runtime.h): written from a
// kernel's arguments, nothing copied from the host, and judged by one block.
#pragma once

#include <cstdint>

#include "cuda/reduce_kernels.h"
#include "runtime/device_runtime.h"

namespace pycomm {

// `n` <= kMaxStampWords words to `dst`, device memory.
void launch_write_words(int64_t* dst, const int64_t* words, int n, const KernelTarget& target);
// judge_stamps of a table in device memory; `verdict` a device address of page-locked
// host memory (cudaHostGetDevicePointer's).
void launch_judge_stamps(const StampTable& table, int64_t* verdict, const KernelTarget& target);

}  // namespace pycomm
