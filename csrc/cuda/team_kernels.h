// The kernel of a CUDA team (cuda_team.cu): the one-shot all-reduce that the device
// synchronizes itself, through flags in the team members' memory (team_kernels.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels.h"

namespace pycomm {

constexpr int kMaxTeam = kMaxDeviceTerms;
// The most thread blocks of a team kernel: each block has its own flags, so a team member
// holds kMaxTeam * kTeamBlocks of each kind, "arrived" and then "done".
constexpr int kTeamBlocks = 64;
constexpr size_t kTeamFlags = static_cast<size_t>(kMaxTeam) * kTeamBlocks;

// One call of a team member, everything mapped into its address space.
struct TeamCall {
  Terms buffers;        // each member's buffer of this call, in team rank order; k = team size
  uint32_t* flags[kMaxTeam];  // each member's flags: arrived [from member][block], then done
  int rank;
  uint32_t epoch;       // this call's number, from 1; calls alternate between two buffers
  uint64_t budget_ns;   // how long a block may wait for a peer
  volatile int* control;  // host memory: [0] set by the host to abort; [1] set by the
                          // kernel: 0 done, p + 1 member p did not arrive in time, -1 aborted
};

// Enqueues this member's part of an all-reduce of n elements of `in` into `out` on
// `stream`; returns the number of thread blocks (the same on every member).
int launch_team_allreduce(const ReduceSpec& spec, const TeamCall& call, void* out, const void* in, size_t n,
                           cudaStream_t stream);

}  // namespace pycomm
