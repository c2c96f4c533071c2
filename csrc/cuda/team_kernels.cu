// The pipelined, flag-synchronized all-reduce of a team (team_kernels.h): the protocol of
// device/team_protocol.h run by every block of every member, its steps shared out to the
// block's threads. Folds use fold.cuh, in member order: the host-driven one-shot's
// operands and order, hence its bits.
//
// Memory visibility: a block's stores into its slot are ordered before its arrival by
// __syncthreads(), and the arrival is a release at system scope (st.release.sys), which
// is cumulative: a peer thread that reads the flag with an acquire at system scope
// (ld.acquire.sys), followed by a barrier of its block, sees every one of those stores.
// System scope, because members are other processes (other CUDA contexts), on this device
// or another device of the host.
#include "cuda/cuda_check.h"
#include "cuda/fold.cuh"
#include "cuda/team_kernels.h"

namespace pycomm {
namespace {

// team_protocol.h's Memory on the device. Host-device members, compiled for the device
// only: the protocol's code is host-device.
struct DeviceMemory {
  PYCOMM_HD uint32_t load_acquire(const uint32_t* p) const {
    uint32_t v = 0;
#ifdef __CUDA_ARCH__
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#endif
    return v;
  }
  PYCOMM_HD void store_release(uint32_t* p, uint32_t v) const {
#ifdef __CUDA_ARCH__
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#endif
  }
  PYCOMM_HD int load_word(const int* p) const { return *static_cast<const volatile int*>(p); }
  PYCOMM_HD void store_word(int* p, int v) const { *static_cast<volatile int*>(p) = v; }
  PYCOMM_HD uint64_t now_ns() const {
    uint64_t t = 0;
#ifdef __CUDA_ARCH__
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
#endif
    return t;
  }
  PYCOMM_HD void pause() const {
#ifdef __CUDA_ARCH__
    __nanosleep(100);
#endif
  }
};

// How one block's threads share the protocol's steps: the elements of the block's piece by
// a stride over its threads, a peer per thread.
template <class T, ReduceKind K, bool kExact, int V>
struct BlockLanes {
  const TeamCall& call;
  const T* in;
  T* out;
  TeamPieces pieces;
  AccOf<T> premul;
  int world;
  bool in_aligned, out_aligned;
  int block = static_cast<int>(blockIdx.x);
  size_t first = threadIdx.x, stride = blockDim.x;

  __device__ void copy(uint32_t c, int slot) {
    T* mine = static_cast<T*>(const_cast<void*>(call.slots[slot].data[call.rank])) + block * pieces.piece;
    const T* from = in + pieces.begin(c, block);
    const size_t n = pieces.length(c, block), packs = n / V;
    for (size_t p = first; p < packs; p += stride) {
      if (in_aligned) {
        *reinterpret_cast<Pack<T, V>*>(mine + p * V) = *reinterpret_cast<const Pack<T, V>*>(from + p * V);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) mine[p * V + i] = from[p * V + i];
      }
    }
    for (size_t e = packs * V + first; e < n; e += stride) mine[e] = from[e];
  }

  __device__ void fold(uint32_t c, int slot) { slot ? fold_slot(c, call.slots[1]) : fold_slot(c, call.slots[0]); }

  // Piece `block` of every member's slot: the terms at offset `at` of the slot; the output
  // shifted back by as much, so that element e of the piece lands at `to` + at + e.
  __device__ void fold_slot(uint32_t c, const Terms& terms) {
    using A = AccOf<T>;
    const size_t at = block * pieces.piece;
    T* to = out + pieces.begin(c, block) - at;
    const size_t n = pieces.length(c, block), packs = n / V;
    for (size_t p = first; p < packs; p += stride) {
      const size_t e = at + p * V;
      if (out_aligned) {
        fold_elements<T, K, true, kExact, V>(to, terms, e, premul, world);
      } else {
        A acc[V];
        fold_values<T, K, kExact, V>(terms, e, premul, acc);
#pragma unroll
        for (int i = 0; i < V; ++i) to[e + i] = Numeric<T>::store(finalize<K>(acc[i], world));
      }
    }
    for (size_t e = at + packs * V + first; e < at + n; e += stride)
      fold_elements<T, K, true, kExact, 1>(to, terms, e, premul, world);
  }

  __device__ void sync() const { __syncthreads(); }
  __device__ bool any(bool mine) const { return __syncthreads_or(mine) != 0; }
  template <class F>
  __device__ void peers(F&& f) const {
    const int p = static_cast<int>(threadIdx.x);
    if (p < call.slots[0].k && p != call.rank) f(p);
  }
  template <class F>
  __device__ void first_thread(F&& f) const {
    if (threadIdx.x == 0) f();
  }
};

template <class T, ReduceKind K, bool kExact, int V>
__global__ void __launch_bounds__(kThreads)
    team_allreduce_kernel(TeamCall call, const T* in, T* out, size_t n, AccOf<T> premul, int world, bool in_aligned,
                          bool out_aligned) {
  const DeviceMemory memory;
  const TeamBlock<DeviceMemory> block{memory,          call.flags,   call.rank,       call.slots[0].k,
                                      int(blockIdx.x), call.control, memory.now_ns(), call.budget_ns};
  const TeamPieces pieces{n, call.piece_bytes / sizeof(T), kTeamBlocks};
  BlockLanes<T, K, kExact, V> lanes{call, in, out, pieces, premul, world, in_aligned, out_aligned};
  run_team_block(block, pieces, lanes);  // returns on every thread of the block alike
  if (call.finished) {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();
      *static_cast<volatile int*>(call.finished + blockIdx.x) = call.tracked;
    }
  }
}

}  // namespace

int launch_team_allreduce(const ReduceSpec& spec, const TeamCall& call, void* out, const void* in, size_t n,
                          cudaStream_t stream) {
  int blocks = 0;
  dispatch_fold(spec, [&](auto type, auto kind, auto exact) {
    using T = typename decltype(type)::type;
    constexpr int V = 16 / sizeof(T) > 0 ? static_cast<int>(16 / sizeof(T)) : 1;
    // The same grid on every member: it depends on n, the type and the pieces only.
    blocks = TeamPieces{n, call.piece_bytes / sizeof(T), kTeamBlocks}.launched();
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
