// The kernel of a CUDA team (cuda_team.cu): the all-reduce that the device synchronizes
// itself, through flags in the team members' memory, pipelined through each member's two
// slots (device/team_protocol.h; team_kernels.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels.h"
#include "device/team_protocol.h"

namespace pycomm {

static_assert(kMaxTeam <= kMaxDeviceTerms, "a team folds every member's slot in one kernel");

// One call of a team member, everything mapped into its address space.
struct TeamCall {
  Terms slots[2];             // each member's slot s, in team rank order; k = team size
  uint32_t* flags[kMaxTeam];  // each member's region, its flags first (TeamWords)
  size_t piece_bytes;         // a block's piece of a slot: a multiple of 256 bytes
  int rank;
  uint64_t budget_ns;      // how long a block may wait for a peer
  int* control;            // host memory: TeamControl's words
  // Host memory, a word per block where the host tracks this call (null where it does
  // not: a call a graph captures): `tracked` once the block is done.
  int* finished;
  int tracked;
};

// Enqueues this member's part of an all-reduce of n elements of `in` into `out` on
// `stream`; returns the number of thread blocks (the same on every member).
int launch_team_allreduce(const ReduceSpec& spec, const TeamCall& call, void* out, const void* in, size_t n,
                          cudaStream_t stream);

}  // namespace pycomm
