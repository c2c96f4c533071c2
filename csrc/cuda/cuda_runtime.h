// The CUDA runtime (cuda_runtime.cu), for the module to register (device_runtime.h). This
// header needs no CUDA header, so the binding can include it.
#pragma once

#include "device/device_runtime.h"

namespace pycomm {

const DeviceRuntime& cuda_runtime();

}  // namespace pycomm
