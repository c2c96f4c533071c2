// Error handling and the current device for the CUDA runtime calls of csrc/cuda.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "core/error.h"

namespace pycomm {

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(ErrorKind::Internal, std::string("pycomm: CUDA ") + what + ": " + cudaGetErrorString(e));
}

// Makes `device` current for a scope and restores the caller's device after: operations
// may run on the application's thread, whose current device belongs to the application.
class CudaDeviceScope {
 public:
  explicit CudaDeviceScope(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~CudaDeviceScope() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  CudaDeviceScope(const CudaDeviceScope&) = delete;
  CudaDeviceScope& operator=(const CudaDeviceScope&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace pycomm
