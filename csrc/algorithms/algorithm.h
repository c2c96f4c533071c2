// What every algorithm sees: the request, this rank's channels to its peers, the device
// ops for the buffers' memory, and the deadline. Algorithms are written once against
// Channel and DeviceOps and therefore run over any transport and memory.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "core/deadline.h"
#include "core/fault.h"
#include "core/link_cost.h"
#include "core/perturbation.h"
#include "core/request.h"
#include "core/topology.h"
#include "core/types.h"
#include "device/device_ops.h"
#include "device/workspace.h"
#include "transport/transport.h"

namespace pycomm {

// PYCOMM_DEBUG=TRACE: a log line for each frame a rank sends or receives.
struct FrameTrace {
  std::string prefix;  // "pycomm: group 'g' rank r: "
  void frame(const OpStamp& op, bool sent, int group_peer, size_t bytes) const;
};

// An algorithm runs on a team: the whole group, or a subset of it (hierarchical runs its
// phases on the ranks of one node and on the ranks with the same place in every node).
// `rank` and `size` are logical (this rank's index in the team, the team's size); frames
// go to the group rank members[peer].
struct Context {
  int rank = 0;
  int size = 1;
  int world = 1;                   // ranks in the whole group: AVG divides by it
  const std::vector<Channel*>* channels = nullptr;  // by group rank; null for self
  std::vector<int> members;        // group rank of each logical rank; empty: the group
  const Topology* topology = nullptr;  // of the whole group
  const DeviceOps* ops = nullptr;
  size_t chunk_bytes = 0;          // the same on every rank: min over the group's channels
  Deadline deadline;
  OpStamp stamp;                   // stamped on every frame of this operation
  // Fails every wait on the group's transports (all threads) with the reason; for an
  // algorithm whose helper thread must not outlive a failure of the calling thread.
  std::function<void(const std::string&)> abort;
  const Perturbation* perturb = nullptr;  // test hook (PYCOMM_TEST_PERTURB); null: none
  const FaultInjector* fault = nullptr;   // test hook (PYCOMM_FAULT) for this rank; null: none
  const FrameTrace* trace = nullptr;      // PYCOMM_DEBUG=TRACE; null: off
  Workspace* workspace = nullptr;         // the communicator's scratch memory (see workspace.h)
  DeviceTeam* device_team = nullptr;      // the group's device team on this memory; null: none

  int group_rank(int logical) const { return members.empty() ? logical : members[logical]; }
  Channel& to(int peer) const { return *(*channels)[group_rank(peer)]; }
  ReduceSpec spec(const Request& r) const {
    return ReduceSpec{r.dtype, r.reduction, world, r.options.compression, r.options.compression_block,
                      r.options.determinism == Determinism::Exact};
  }
  // The same operation on a team of group ranks, which must include this rank.
  Context team(const std::vector<int>& group_ranks) const {
    Context t = *this;
    t.members = group_ranks;
    t.size = static_cast<int>(group_ranks.size());
    t.rank = static_cast<int>(std::find(group_ranks.begin(), group_ranks.end(), group_rank(rank)) - group_ranks.begin());
    return t;
  }
};

inline size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }
inline int mod(int a, int n) { return ((a % n) + n) % n; }

// Balanced split of `count` elements into `parts` contiguous segments of whole units of
// `unit` elements (the last unit may be short); the first units % parts segments hold one
// unit more. Compressed data uses the codec's block as the unit, so that segments start
// on block boundaries of the tensor.
struct Segments {
  size_t count, parts, unit = 1;
  size_t begin(size_t i) const {
    const size_t units = (count + unit - 1) / unit;
    return std::min(count, (i * (units / parts) + std::min(i, units % parts)) * unit);
  }
  size_t length(size_t i) const { return begin(i + 1) - begin(i); }
};


// Frame helpers: one frame of `bytes` to/from a peer; `fill`/`use` work on the slot.
template <class Fill>
void send_frame(const Context& cx, int peer, size_t bytes, Fill fill) {
  if (cx.perturb) cx.perturb->before_send(cx.stamp.seq);
  FrameHeader h;
  h.bytes = static_cast<uint32_t>(bytes);
  h.op = cx.stamp;
  if (cx.fault) cx.fault->before_send(h, cx.abort);  // point "during": may act, or corrupt h
  Channel& ch = cx.to(peer);
  void* slot = ch.begin_send(cx.deadline);
  fill(slot);
  ch.end_send(h);
  if (cx.trace) cx.trace->frame(cx.stamp, true, cx.group_rank(peer), bytes);
}

// The payload of the next frame from `peer`, readable in place until end_recv_frame();
// several peers' frames may be held at once (the reduction of a direct step reads them all).
inline const void* begin_recv_frame(const Context& cx, int peer, size_t bytes) {
  FrameHeader expect;
  expect.bytes = static_cast<uint32_t>(bytes);
  expect.op = cx.stamp;
  const void* payload = cx.to(peer).begin_recv(expect, cx.deadline);
  if (cx.trace) cx.trace->frame(cx.stamp, false, cx.group_rank(peer), bytes);
  return payload;
}
inline void end_recv_frame(const Context& cx, int peer) { cx.to(peer).end_recv(); }

template <class Use>
void recv_frame(const Context& cx, int peer, size_t bytes, Use use) {
  use(begin_recv_frame(cx, peer, bytes));
  end_recv_frame(cx, peer);
}

// A whole buffer as a sequence of chunk_bytes frames (p2p, gather, scatter, alltoall).
void send_bytes(const Context& cx, int peer, const void* data, size_t bytes);
void recv_bytes(const Context& cx, int peer, void* data, size_t bytes);

// A buffer of `size` segments cut into chunks for pipelining: chunk c covers elements
// [c*chunk, (c+1)*chunk) of every segment, so a chunk's frames are the same on every rank.
struct SegmentChunks {
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
// Chunk c of a reduce-scatter: segment r of the chunk, reduced over the team, is written
// to own_out (at its offset within segment r) finalized (Final) or in the accumulation
// format (Partial).
void ring_reduce_scatter_chunk(const Context& cx, const Request& rq, const SegmentChunks& ring, size_t c,
                               void* own_out);
void direct_reduce_scatter_chunk(const Context& cx, const Request& rq, const SegmentChunks& chunks, size_t c,
                                 void* own_out, Stage stage);
// Chunk c of an all-gather in place: segment r of `buffer` (element size `es`) reaches
// every rank of the team.
void ring_all_gather_chunk(const Context& cx, const Request& rq, const SegmentChunks& ring, size_t c,
                           void* buffer);
void direct_all_gather_chunk(const Context& cx, const SegmentChunks& chunks, size_t c, void* buffer, size_t es);

// Compressed collectives (compressed.cc); rq.options.compression is set.
void coded_reduce_scatter_chunk(const Context& cx, const Request& rq, const SegmentChunks& chunks, size_t c,
                                void* out, Stage stage);
void coded_allreduce(const Context& cx, const Request& rq, Algorithm algorithm);  // ring, oneshot, twoshot
void coded_reduce_scatter(const Context& cx, const Request& rq);
void coded_allgather(const Context& cx, const Request& rq, Algorithm algorithm);  // ring, oneshot

void ring_allreduce(const Context& cx, const Request& rq);
// Deterministic modes' ring: the direct reduce-scatter of twoshot (each element reduced by
// its owner from all contributions) and the ring all-gather.
void direct_ring_allreduce(const Context& cx, const Request& rq);
void tree_allreduce(const Context& cx, const Request& rq);
void hierarchical_allreduce(const Context& cx, const Request& rq);
void oneshot_allreduce(const Context& cx, const Request& rq);
void twoshot_allreduce(const Context& cx, const Request& rq);
void ring_reduce_scatter(const Context& cx, const Request& rq);
void direct_reduce_scatter(const Context& cx, const Request& rq);
void ring_allgather(const Context& cx, const Request& rq);
void direct_allgather(const Context& cx, const Request& rq);
void chain_broadcast(const Context& cx, const Request& rq);
void chain_reduce(const Context& cx, const Request& rq);
void direct_gather(const Context& cx, const Request& rq);
void direct_scatter(const Context& cx, const Request& rq);
void pairwise_alltoall(const Context& cx, const Request& rq);
void p2p_send(const Context& cx, const Request& rq);
void p2p_recv(const Context& cx, const Request& rq);
void dissemination_barrier(const Context& cx, const Request& rq);

// Measures the link to `peer`; both ends call it at the same point, one as initiator.
LinkCost ping_pong(const Context& cx, int peer, bool initiator);
// The time of one message step when every rank of `team` communicates at once.
double step_latency_us(const Context& team);

}  // namespace pycomm
