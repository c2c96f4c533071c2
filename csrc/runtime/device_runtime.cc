#include "runtime/device_runtime.h"

#include <algorithm>
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

void judge_stamps(const StampTable& t, int64_t* verdict) {
  if (verdict[0] != 0) return;
  for (size_t p = 0; p < t.count; ++p) {
    if (static_cast<int>(p) == t.skip) continue;
    const int64_t* row = t.rows + p * t.row_stride;
    for (int f = 0; f < t.words; ++f) {
      if (row[f] == t.mine[f]) continue;
      const int64_t found[kVerdictWords] = {1, static_cast<int64_t>(p), f, row[f], t.mine[f], t.mine[1], t.mine[2]};
      std::copy(found, found + kVerdictWords, verdict);
      return;
    }
  }
}

const DeviceRuntime& device_runtime() {
  const DeviceRuntime* r = registered.load();
  if (!r) fail(ErrorKind::InvalidArgument, std::string("pycomm: ") + kNoCudaBuild);
  return *r;
}

}  // namespace pycomm
