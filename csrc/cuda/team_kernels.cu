// The flag-synchronized one-shot all-reduce (team_kernels.h). Each thread block b of each
// member handles the same elements (the grid depends only on the element count):
//   1. it copies its elements of the member's input into the member's buffer of this call;
//   2. it arrives: one thread per peer stores the call's epoch into flag [member][b] in
//      that peer's memory; then it waits, one thread per peer, until flag [peer][b] in its
//      own memory shows the epoch (or a later one);
//   3. it folds its elements of every member's buffer, in team rank order, into `out`:
//      the host-driven one-shot's operands and order, hence its bits (fold.cuh);
//   4. it tells each peer that it is done reading the peer's buffer (flag done
//      [member][b] in the peer's memory), so that a member leaving the team frees its
//      memory only after its peers' last reads (cuda_team.cu).
//
// Memory visibility: the block's stores to its buffer are ordered before the arrival by
// __syncthreads(), and the arrival is a release at system scope (st.release.sys), which
// is cumulative: a peer thread that reads the flag with an acquire at system scope
// (ld.acquire.sys), followed by __syncthreads() in its block, sees every one of those
// stores. System scope, because members are other processes (other CUDA contexts), on
// this device or another device of the host.
//
// Buffer reuse: call e writes buffer e % 2, which peers read in call e only. A member
// writes the same buffer again in call e + 2 only after call e + 1's wait, for which every
// peer arrived once its call e kernel had finished (a member's calls run in order on one
// stream). Hence also: a flag is never more than one epoch ahead of the call that waits
// on it, and a wait accepts the epoch or the next one.
//
// Bounded wait: a waiting thread gives up once `budget_ns` has passed (the operation's
// deadline) or the host raised control[0] (the group aborted, a peer process exited),
// and reports it in control[1]; it never spins past either.
#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/fold.cuh"
#include "cuda/team_kernels.h"

namespace pycomm {
namespace {

__device__ __forceinline__ uint32_t load_acquire_system(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release_system(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Waits for the peer's arrival at this block; false if it gave up (control[1] says why).
__device__ bool wait_for(const TeamCall& call, int peer) {
  const uint32_t* flag = call.flags[call.rank] + peer * kTeamBlocks + blockIdx.x;
  const uint64_t start = global_ns();
  for (uint32_t polls = 1; static_cast<int32_t>(load_acquire_system(flag) - call.epoch) < 0; ++polls) {
    if (polls % 64) continue;  // the clock and host memory cost more than a flag
    const bool aborted = call.control[0] != 0;
    if (aborted || global_ns() - start > call.budget_ns) {
      call.control[1] = aborted ? -1 : peer + 1;
      return false;
    }
  }
  return true;
}

template <class T, ReduceKind K, bool kExact, int V>
__global__ void __launch_bounds__(kThreads)
    team_allreduce_kernel(TeamCall call, const T* in, T* out, size_t n, AccOf<T> premul, int world, bool in_aligned,
                          bool out_aligned) {
  using A = AccOf<T>;
  __shared__ int gave_up;
  if (threadIdx.x == 0) gave_up = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t packs = n / V;
  T* mine = static_cast<T*>(const_cast<void*>(call.buffers.data[call.rank]));
  for (size_t p = first; p < packs; p += stride) {
    if (in_aligned) {
      *reinterpret_cast<Pack<T, V>*>(mine + p * V) = *reinterpret_cast<const Pack<T, V>*>(in + p * V);
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) mine[p * V + i] = in[p * V + i];
    }
  }
  for (size_t e = packs * V + first; e < n; e += stride) mine[e] = in[e];
  __syncthreads();
  const int peer = threadIdx.x;
  if (peer < call.buffers.k && peer != call.rank) {
    store_release_system(call.flags[peer] + call.rank * kTeamBlocks + blockIdx.x, call.epoch);
    if (!wait_for(call, peer)) gave_up = 1;
  }
  __syncthreads();
  if (gave_up) return;
  for (size_t p = first; p < packs; p += stride) {
    if (out_aligned) {
      fold_elements<T, K, true, kExact, V>(out, call.buffers, p * V, premul, world);
    } else {
      A acc[V];
      fold_values<T, K, kExact, V>(call.buffers, p * V, premul, acc);
#pragma unroll
      for (int i = 0; i < V; ++i) out[p * V + i] = Numeric<T>::store(finalize<K>(acc[i], world));
    }
  }
  for (size_t e = packs * V + first; e < n; e += stride)
    fold_elements<T, K, true, kExact, 1>(out, call.buffers, e, premul, world);
  __syncthreads();
  if (peer < call.buffers.k && peer != call.rank)
    store_release_system(call.flags[peer] + kTeamFlags + call.rank * kTeamBlocks + blockIdx.x, call.epoch);
}

}  // namespace

int launch_team_allreduce(const ReduceSpec& spec, const TeamCall& call, void* out, const void* in, size_t n,
                          cudaStream_t stream) {
  int blocks = 0;
  dispatch_fold(spec, [&](auto type, auto kind, auto exact) {
    using T = typename decltype(type)::type;
    constexpr int V = 16 / sizeof(T) > 0 ? static_cast<int>(16 / sizeof(T)) : 1;
    // The same grid on every member: it depends on n and the type only.
    const size_t threads = (n + V - 1) / V;
    blocks = static_cast<int>(std::clamp<size_t>((threads + kThreads - 1) / kThreads, 1, kTeamBlocks));
    const bool in_aligned = reinterpret_cast<uintptr_t>(in) % 16 == 0;
    const bool out_aligned = reinterpret_cast<uintptr_t>(out) % 16 == 0;
    team_allreduce_kernel<T, decltype(kind)::value, decltype(exact)::value, V><<<blocks, kThreads, 0, stream>>>(
        call, static_cast<const T*>(in), static_cast<T*>(out), n, static_cast<AccOf<T>>(spec.reduction.premul),
        spec.world_size, in_aligned, out_aligned);
  });
  cuda_check(cudaGetLastError(), "team all-reduce kernel launch");
  return blocks;
}

}  // namespace pycomm
