// An accelerator's runtime, as the core sees it: ops on its memory and shared device
// memory for transports. The core links against no accelerator library; the CUDA build
// of the extension's module registers its runtime when it is loaded (csrc/cuda).
#pragma once

#include <memory>

#include "core/transport.h"
#include "device/device_ops.h"

namespace pycomm {

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  virtual const char* name() const = 0;  // "cuda"
  // Ops on the memory of device `index`, on an internal stream of their own, complete
  // when each call returns (the DeviceOps contract).
  virtual std::unique_ptr<DeviceOps> make_ops(int index) const = 0;
  // Slot payloads in device `index`'s memory, mappable by processes of this host.
  virtual std::unique_ptr<SlotArena> make_slot_arena(int index) const = 0;
};

// Called once, at load time, by the module of a build with an accelerator.
void register_device_runtime(const DeviceRuntime* runtime);
bool has_device_runtime();
extern const char* const kNoCudaBuild;  // why a CUDA tensor cannot be used
// The registered runtime; throws a clear error when pycomm was built without one.
const DeviceRuntime& device_runtime();

}  // namespace pycomm
