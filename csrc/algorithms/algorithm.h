// What every algorithm sees: the request, this rank's channels to its peers, the device
// ops for the buffers' memory, and the deadline. Algorithms are written once against
// Channel and DeviceOps and therefore run over any transport and memory.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <vector>

#include "core/deadline.h"
#include "core/transport.h"
#include "core/types.h"
#include "device/device_ops.h"

namespace pycomm {

// One operation, as validated by the caller. Counts are in elements of `dtype`.
struct Request {
  Collective collective = Collective::AllReduce;
  DataType dtype = DataType::Float32;
  Reduction reduction;     // normalized for dtype
  CallOptions options;
  const void* input = nullptr;
  void* output = nullptr;  // may equal input where the collective is in place
  // AllReduce, Broadcast, Reduce, Send, Recv: elements of the buffer.
  // ReduceScatter, AllGather, Gather, Scatter: elements per rank.
  size_t count = 0;
  int root = 0;            // Broadcast, Reduce, Gather, Scatter; the peer for Send/Recv
  int tag = 0;             // Send/Recv
  std::vector<size_t> send_counts, recv_counts;  // AllToAll, per peer, contiguous
  std::chrono::milliseconds timeout{0};          // 0: the group's timeout
};

struct Context {
  int rank = 0;
  int size = 1;
  const std::vector<Channel*>* channels = nullptr;  // by peer rank; null for self
  const DeviceOps* ops = nullptr;
  size_t chunk_bytes = 0;          // the same on every rank: min over the group's channels
  Deadline deadline;
  OpStamp stamp;                   // stamped on every frame of this operation

  Channel& to(int peer) const { return *(*channels)[peer]; }
  ReduceSpec spec(const Request& r) const { return ReduceSpec{r.dtype, r.reduction, size}; }
};

inline size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }
inline int mod(int a, int n) { return ((a % n) + n) % n; }

// Balanced split of `count` elements into `parts` contiguous segments; the first
// count % parts segments hold one element more.
struct Segments {
  size_t count, parts;
  size_t begin(size_t i) const { return i * (count / parts) + (i < count % parts ? i : count % parts); }
  size_t length(size_t i) const { return count / parts + (i < count % parts ? 1 : 0); }
};


// Frame helpers: one frame of `bytes` to/from a peer; `fill`/`use` work on the slot.
template <class Fill>
void send_frame(const Context& cx, int peer, size_t bytes, Fill fill) {
  Channel& ch = cx.to(peer);
  void* slot = ch.begin_send(cx.deadline);
  fill(slot);
  FrameHeader h;
  h.bytes = static_cast<uint32_t>(bytes);
  h.op = cx.stamp;
  ch.end_send(h);
}

template <class Use>
void recv_frame(const Context& cx, int peer, size_t bytes, Use use) {
  Channel& ch = cx.to(peer);
  FrameHeader expect;
  expect.bytes = static_cast<uint32_t>(bytes);
  expect.op = cx.stamp;
  use(ch.begin_recv(expect, cx.deadline));
  ch.end_recv();
}

// A whole buffer as a sequence of chunk_bytes frames (p2p, gather, scatter, alltoall).
void send_bytes(const Context& cx, int peer, const void* data, size_t bytes);
void recv_bytes(const Context& cx, int peer, void* data, size_t bytes);

// Ring building blocks shared by the ring collectives (see their files). A ring pass is
// cut into chunks; chunk c covers elements [c*chunk, (c+1)*chunk) of every segment, so a
// chunk's frames are the same on every rank.
struct RingChunks {
  Segments seg;
  size_t chunk;  // elements
  size_t count() const { return ceil_div(seg.length(0), chunk); }  // segment 0 is the longest
  // Elements [first, first + len) of segment s in chunk c; len is 0 when it has none.
  void piece(int s, size_t c, size_t& first, size_t& len) const {
    const size_t l = seg.length(s), off = c * chunk;
    first = seg.begin(s) + off;
    len = off < l ? std::min(chunk, l - off) : 0;
  }
};
void ring_reduce_scatter_chunk(const Context& cx, const Request& rq, const RingChunks& ring, size_t c,
                               void* own_out);
void ring_all_gather_chunk(const Context& cx, const Request& rq, const RingChunks& ring, size_t c,
                           void* buffer);

void ring_allreduce(const Context& cx, const Request& rq);
void ring_reduce_scatter(const Context& cx, const Request& rq);
void ring_allgather(const Context& cx, const Request& rq);
void chain_broadcast(const Context& cx, const Request& rq);
void chain_reduce(const Context& cx, const Request& rq);
void direct_gather(const Context& cx, const Request& rq);
void direct_scatter(const Context& cx, const Request& rq);
void pairwise_alltoall(const Context& cx, const Request& rq);
void p2p_send(const Context& cx, const Request& rq);
void p2p_recv(const Context& cx, const Request& rq);
void dissemination_barrier(const Context& cx, const Request& rq);

}  // namespace pycomm
