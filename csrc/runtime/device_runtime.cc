#include "runtime/device_runtime.h"

#include <atomic>

#include "core/error.h"

namespace pycomm {

const char* const kNoCudaBuild =
    "this build of pycomm has no CUDA support (built with PYCOMM_WITH_CUDA=0, or without nvcc or a CUDA "
    "torch): CUDA tensors need a CUDA build";

namespace {
std::atomic<const DeviceRuntime*> registered{nullptr};
}  // namespace

void register_device_runtime(const DeviceRuntime* runtime) { registered.store(runtime); }

bool has_device_runtime() { return registered.load() != nullptr; }

const DeviceRuntime& device_runtime() {
  const DeviceRuntime* r = registered.load();
  if (!r)
    fail(ErrorKind::InvalidArgument,
         std::string("pycomm: ") + kNoCudaBuild);
  return *r;
}

}  // namespace pycomm
