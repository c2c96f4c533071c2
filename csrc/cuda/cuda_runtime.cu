// The CUDA runtime of the core (runtime/device_runtime.h): ops on one device's memory and
// CUDA IPC slot memory. The extension's module registers it when it is loaded.
//
// Streams: each DeviceOps has an internal non-blocking stream; every call enqueues its
// work there and synchronizes it before returning (the DeviceOps contract), which is what
// makes a payload complete before a transport publishes it and a peer's slot free once a
// reduction returns. Ordering with the application's streams is the binding's job.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/cuda_runtime.h"
#include "cuda/reduce_kernels.h"
#include "cuda/stamp_kernels.h"

namespace pycomm {
namespace {

class CudaOps final : public DeviceOps {
 public:
  explicit CudaOps(int device) : device_(device) {
    CudaDeviceScope scope(device_);
    cuda_check(cudaDeviceGetAttribute(&target_.multiprocessors, cudaDevAttrMultiProcessorCount, device_),
               "cudaDeviceGetAttribute");
    cuda_check(cudaStreamCreateWithFlags(&target_.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~CudaOps() override {
    CudaDeviceScope scope(device_);
    cudaStreamDestroy(target_.stream);
  }

  std::shared_ptr<char> allocate(size_t bytes) const override {
    CudaDeviceScope scope(device_);
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "cudaMalloc");
    const int device = device_;
    return std::shared_ptr<char>(static_cast<char*>(p), [device](char* q) {
      CudaDeviceScope scope(device);
      cudaFree(q);
    });
  }

  void copy(void* dst, const void* src, size_t bytes) const override {
    if (!bytes || dst == src) return;
    CudaDeviceScope scope(device_);
    cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, target_.stream), "cudaMemcpyAsync");
    cuda_check(cudaStreamSynchronize(target_.stream), "copy");
  }

  // Portable: one registration serves every device's copies (a second one, from another
  // device's ops, fails as already registered and needs none). cudaHostRegister can also
  // fail for a locked-memory limit: then copies bounce through the driver's buffer.
  std::shared_ptr<void> pin(void* host, size_t bytes) const override {
    CudaDeviceScope scope(device_);
    if (cudaHostRegister(host, bytes, cudaHostRegisterPortable) != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it so that no later check reports it
      return nullptr;
    }
    return std::shared_ptr<void>(host, [](void* p) { cudaHostUnregister(p); });
  }

  void reduce_terms(const ReduceSpec& spec, Stage stage, void* out, const Term* terms, int k, size_t n) const override {
    if (n == 0) return;
    CudaDeviceScope scope(device_);
    launch_reduce_terms(spec, stage, out, terms, k, n, target_);
    cuda_check(cudaStreamSynchronize(target_.stream), "reduction");
  }

 private:
  int device_;
  KernelTarget target_{};  // this device's internal stream and multiprocessor count
};

// A cudaIpcMemHandle_t travels through the store as hex text.
std::string to_hex(const void* data, size_t bytes) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < bytes; ++i) {
    const unsigned char c = static_cast<const unsigned char*>(data)[i];
    s += digits[c >> 4];
    s += digits[c & 15];
  }
  return s;
}

bool from_hex(const std::string& s, void* data, size_t bytes) {
  if (s.size() != 2 * bytes) return false;
  for (size_t i = 0; i < bytes; ++i) {
    unsigned v = 0;
    if (std::sscanf(s.c_str() + 2 * i, "%2x", &v) != 1) return false;
    static_cast<unsigned char*>(data)[i] = static_cast<unsigned char>(v);
  }
  return true;
}

class CudaSlotArena final : public SlotArena {
 public:
  explicit CudaSlotArena(int device) : device_(device) {}
  ~CudaSlotArena() override {
    CudaDeviceScope scope(device_);
    for (void* p : mapped_) cudaIpcCloseMemHandle(p);
    if (own_) cudaFree(own_);
  }

  const char* kind() const override { return "cuda-ipc"; }

  std::string allocate(size_t bytes) override {
    CudaDeviceScope scope(device_);
    cuda_check(cudaMalloc(&own_, bytes), "cudaMalloc (IPC slots)");
    cudaIpcMemHandle_t handle;
    cuda_check(cudaIpcGetMemHandle(&handle, own_), "cudaIpcGetMemHandle");
    return to_hex(&handle, sizeof handle);
  }

  char* base() override { return static_cast<char*>(own_); }

  char* map(const std::string& text, int peer) override {
    cudaIpcMemHandle_t handle;
    if (!from_hex(text, &handle, sizeof handle))
      fail(ErrorKind::Mismatch, "pycomm: rank " + std::to_string(peer) + " published a malformed CUDA IPC handle");
    CudaDeviceScope scope(device_);
    void* p = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();  // not sticky: the caller may stage this pair instead, and no later check must see it
      fail(ErrorKind::PeerFailure, "pycomm: cannot map the CUDA memory of rank " + std::to_string(peer) +
                                       " (cudaIpcOpenMemHandle: " + cudaGetErrorString(e) +
                                       "; CUDA IPC needs both ranks' devices on this host, with peer access)");
    }
    mapped_.push_back(p);
    return static_cast<char*>(p);
  }

 private:
  int device_;
  void* own_ = nullptr;
  std::vector<void*> mapped_;
};

class CudaRuntime final : public DeviceRuntime {
  static KernelTarget target_of(int index, void* stream) {
    KernelTarget target{static_cast<cudaStream_t>(stream), 0};
    cuda_check(cudaDeviceGetAttribute(&target.multiprocessors, cudaDevAttrMultiProcessorCount, index),
               "cudaDeviceGetAttribute");
    return target;
  }

 public:
  const char* name() const override { return "cuda"; }
  std::unique_ptr<DeviceOps> make_ops(int index) const override { return std::make_unique<CudaOps>(index); }
  bool capturing(int index, void* stream) const override {
    CudaDeviceScope scope(index);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cuda_check(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status), "cudaStreamIsCapturing");
    return status != cudaStreamCaptureStatusNone;
  }
  std::unique_ptr<SlotArena> make_slot_arena(int index) const override {
    return std::make_unique<CudaSlotArena>(index);
  }
  void enqueue_reduce_terms(int index, void* stream, const ReduceSpec& spec, Stage stage, void* out, const Term* terms,
                            int k, size_t n) const override {
    if (n == 0) return;
    CudaDeviceScope scope(index);
    launch_reduce_terms(spec, stage, out, terms, k, n, target_of(index, stream));
  }
  void enqueue_reduce_segments(int index, void* stream, const ReduceSpec& spec, Stage stage, void* plain, void* slots,
                               const SegmentSlots& pairs) const override {
    CudaDeviceScope scope(index);
    launch_reduce_segments(spec, stage, plain, slots, pairs, target_of(index, stream));
  }
  void enqueue_write_words(int index, void* stream, int64_t* dst, const int64_t* words, int n) const override {
    CudaDeviceScope scope(index);
    launch_write_words(dst, words, n, target_of(index, stream));
  }
  void enqueue_judge_stamps(int index, void* stream, const StampTable& table, int64_t* verdict) const override {
    CudaDeviceScope scope(index);
    void* mapped = nullptr;
    cuda_check(cudaHostGetDevicePointer(&mapped, verdict, 0),
               "cudaHostGetDevicePointer (a verdict is page-locked host memory that the device can write)");
    launch_judge_stamps(table, static_cast<int64_t*>(mapped), target_of(index, stream));
  }
  std::unique_ptr<DeviceTeam> make_team(int index, const TransportSetup& setup) const override {
    return make_cuda_team(index, make_slot_arena(index), setup);
  }
};

}  // namespace

const DeviceRuntime& cuda_runtime() {
  static const CudaRuntime runtime;
  return runtime;
}

}  // namespace pycomm
