// One operation as the runtime receives it from the binding and the algorithms run it.
#pragma once

#include <chrono>
#include <cstddef>
#include <vector>

#include "core/types.h"

namespace pycomm {

// Recv's root for a receive from whichever rank sends first (with the recv's tag).
constexpr int kAnySource = -1;

// One operation, as validated by the caller. Counts are in elements of `dtype`.
struct Request {
  Collective collective = Collective::AllReduce;
  DataType dtype = DataType::Float32;
  Reduction reduction;     // normalized for dtype
  CallOptions options;
  const void* input = nullptr;
  void* output = nullptr;  // may equal input where the collective is in place
  int device = -1;         // input and output are in this CUDA device's memory; -1: host
  // AllReduce, Broadcast, Reduce, Send, Recv: elements of the buffer.
  // ReduceScatter, AllGather, Gather, Scatter: elements per rank.
  size_t count = 0;
  int root = 0;            // Broadcast, Reduce, Gather, Scatter; the peer for Send/Recv
  int tag = 0;             // Send/Recv
  int* source = nullptr;   // Recv from kAnySource: receives the rank whose send it took
  std::vector<size_t> send_counts, recv_counts;  // AllToAll, per peer, contiguous
  std::chrono::milliseconds timeout{0};          // 0: the group's timeout
  // Device requests: a stream of the caller's (a CUDA graph being captured on it) to
  // enqueue the whole operation on, nothing waited for on the host. Only an all-reduce
  // that the device's team runs can be; the others fail with InvalidArgument.
  void* stream = nullptr;
};

}  // namespace pycomm
