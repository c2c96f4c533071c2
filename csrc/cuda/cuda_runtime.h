// The CUDA runtime (cuda_runtime.cu), for the module to register (device_runtime.h). This
// header needs no CUDA header, so the binding can include it.
#pragma once

#include "runtime/device_runtime.h"

namespace pycomm {

const DeviceRuntime& cuda_runtime();

// This rank's member of a team (cuda_team.cu) whose memory lives in `arena`.
std::unique_ptr<DeviceTeam> make_cuda_team(int device, std::unique_ptr<SlotArena> arena, const TransportSetup& setup);

}  // namespace pycomm
