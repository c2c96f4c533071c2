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
#include "core/segments.h"
#include "core/topology.h"
#include "core/types.h"
#include "device/device_ops.h"
#include "device/workspace.h"
#include "transport/transport.h"

namespace pycomm {

class Inbox;
class SenderMatch;

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
  Inbox* inbox = nullptr;                 // a recv's: its peer's pair (see p2p.h), held by it
  SenderMatch* senders = nullptr;         // a recv from any source's (see p2p.h)

  int group_rank(int logical) const { return members.empty() ? logical : members[logical]; }
  Channel& to(int peer) const { return *(*channels)[group_rank(peer)]; }
  ReduceSpec spec(const Request& r) const {
    return ReduceSpec{r.dtype,
                      r.reduction,
                      world,
                      r.options.compression,
                      r.options.compression_block,
                      r.options.determinism == Determinism::Exact};
  }
  // The same operation on a team of group ranks, which must include this rank.
  Context team(const std::vector<int>& group_ranks) const {
    Context t = *this;
    t.members = group_ranks;
    t.size = static_cast<int>(group_ranks.size());
    t.rank =
        static_cast<int>(std::find(group_ranks.begin(), group_ranks.end(), group_rank(rank)) - group_ranks.begin());
    return t;
  }
};

inline size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }
inline int mod(int a, int n) { return ((a % n) + n) % n; }

// A team as a butterfly of p virtual ranks, p the largest power of two <= n: the first
// 2(n-p) ranks pair up (2i and 2i+1 are virtual rank i), every other rank is one. A
// virtual rank's ranks are consecutive and in order, so a range of virtual ranks is a range
// of ranks, and of their segments. The last rank of a virtual rank takes part in the
// butterfly for it; the first of a pair hands its data to it before and takes its result
// after (the two steps more that serve any n).
struct Butterfly {
  int n, p;
  explicit Butterfly(int size) : n(size), p(1) {
    while (2 * p <= n) p *= 2;
  }
  int index(int rank) const { return rank < 2 * (n - p) ? rank / 2 : rank - (n - p); }
  int first_rank(int v) const { return v < n - p ? 2 * v : v + (n - p); }  // first_rank(p) == n
  int last_rank(int v) const { return first_rank(v + 1) - 1; }
  int ranks_of(int v) const { return first_rank(v + 1) - first_rank(v); }  // 1 or 2
  bool hands_over(int rank) const { return rank < 2 * (n - p) && rank % 2 == 0; }
  bool takes_pair(int rank) const { return rank < 2 * (n - p) && rank % 2 == 1; }
};

// Frame helpers: one frame of `bytes` to/from a peer; `fill`/`use` work on the slot.
// The header of the operation's next frame, the test hooks applied.
inline FrameHeader next_frame_header(const Context& cx, size_t bytes) {
  if (cx.perturb) cx.perturb->before_send(cx.stamp.seq);
  FrameHeader h;
  h.bytes = static_cast<uint32_t>(bytes);
  h.op = cx.stamp;
  if (cx.fault) cx.fault->before_send(h, cx.abort);  // point "during": may act, or corrupt h
  return h;
}
template <class Fill>
void send_frame(const Context& cx, int peer, size_t bytes, Fill fill) {
  const FrameHeader h = next_frame_header(cx, bytes);
  Channel& ch = cx.to(peer);
  void* slot = ch.begin_send(cx.deadline);
  fill(slot);
  ch.end_send(h);
  if (cx.trace) cx.trace->frame(cx.stamp, true, cx.group_rank(peer), bytes);
}
// A frame that is a copy of `bytes` at `src` (this context's memory; free on return):
// from host memory the transport may send it without the copy (Channel::send_host).
void send_copy(const Context& cx, int peer, size_t bytes, const void* src);

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

// Bytes held in several contiguous runs, read or written as one stream.
struct ByteRuns {
  struct Run {
    char* data;
    size_t bytes;
  };
  std::vector<Run> runs;
  size_t total() const;
};
// Sends `out` to `to` while `in` arrives from `from`, frames of chunk_bytes interleaved (a
// send, then a receive), so that ranks that send to each other, or around a cycle, are
// never both waiting for a free slot. Both ends cut a stream the same way: the frames of
// one rank's `out` are those its peer expects in `in`.
void exchange_bytes(const Context& cx, int to, const ByteRuns& out, int from, const ByteRuns& in);

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
// ---- How data travels, and the named steps the collectives are made of ----
//
// Compression (docs/design.md, 'Numerics'), error that does not grow with the world size: every
// contribution is quantized exactly once, as it leaves its rank (an Input term under a
// codec is quantized as it is loaded, so the rank's own one too); the reduction of each
// element runs in fp32 in logical rank order from those quantized operands; a result is
// quantized once more (Stage::FinalEncoded) where it travels back, and every rank, its
// owner included, decodes the same encoded bits. Nothing is requantized per hop: where a
// ring would forward partial sums, contributions go straight to the rank that reduces them
// (the direct step) and only encoded results are forwarded, byte for byte. Fusion: a
// frame is decoded, accumulated and encoded block by block straight out of its slot, in
// one pass (DeviceOps::reduce_terms). Layout: all-reduce segments and chunks are whole
// codec blocks, so blocks start at multiples of the block in the tensor on every path
// (a contribution's quantization is pycomm.quantize() of it); reduce-scatter and
// all-gather blocks start at each rank's segment.

// The format contributions and results travel in: the storage format, or the call's codec.
struct Wire {
  ReduceSpec spec;
  size_t es;  // bytes per element in the storage format

  Wire(const Context& cx, const Request& rq) : spec(cx.spec(rq)), es(element_size(rq.dtype)) {}
  bool coded() const { return spec.codec != Compression::None; }
  size_t bytes(size_t len) const;  // of `len` elements on the wire
  // Elements per frame: whole codec blocks whose encoding fits a slot, coded.
  size_t chunk(const Context& cx) const;
  // The unit all-reduce segments are cut in: whole codec blocks, coded.
  size_t allreduce_unit() const { return coded() ? spec.block : 1; }
  // `len` elements of a contribution (storage format), as they go on the wire.
  void put(const Context& cx, void* wire, const void* contribution, size_t len) const;
  // The same, as one frame to `peer`.
  void send(const Context& cx, int peer, const void* contribution, size_t len) const;
  // A contribution received from the wire, as an operand of a fold.
  Term term(const void* wire) const { return {wire, coded() ? Form::Encoded : Form::Input}; }
  // `len` elements of a result on the wire, into `out` (storage format).
  void take(const Context& cx, void* out, const void* wire, size_t len) const;
};

// The direct step of chunk c (recv-all-reduce): this rank sends its contribution's piece
// of segment s to each peer s (a buffer of one segment is every rank's to reduce: the
// one-shot sends all of it to every peer), then holds the n-1 frames of its own piece at
// once and folds the n contributions in logical rank order into `out` (this piece, not
// offset) at `stage`: each element rounded once, whatever the order of arrival. Per chunk
// a rank sends n-1 frames, then receives n-1, so a peer is never more than one chunk
// behind and pipeline_depth >= 2 slots suffice.
void direct_reduce_step(const Context& cx, const Request& rq, const Wire& wire, const SegmentChunks& chunks, size_t c,
                        void* out, Stage stage);
// The gather steps of chunk c: this rank's piece of segment r, on the wire at `mine`,
// reaches every rank, and every peer's piece is taken into `out` (the whole buffer).
// Direct: sent to every peer at once (one step). Ring (recv-copy-send): passed r -> r+1,
// each rank taking a piece and forwarding it straight from the received slot (n-1 steps,
// neighbour links only; pipelined chunk-major like the ring reduce-scatter).
void direct_gather_step(const Context& cx, const Wire& wire, const SegmentChunks& chunks, size_t c, const void* mine,
                        void* out);
void ring_gather_step(const Context& cx, const Wire& wire, const SegmentChunks& chunks, size_t c, const void* mine,
                      void* out);
using GatherStep = decltype(&direct_gather_step);
// Ring reduce-scatter of chunk c (recv-reduce-send), uncoded: segment r of the chunk,
// reduced over the team, is written to own_out (at its offset within segment r).
void ring_reduce_scatter_chunk(const Context& cx, const Request& rq, const SegmentChunks& ring, size_t c,
                               void* own_out);

// The collectives: each serves plain and coded calls of its shape (csrc/algorithms/<name>.cc).
void ring_allreduce(const Context& cx, const Request& rq);  // uncoded, determinism 0
// Deterministic modes' and codecs' ring: the direct step (each element reduced by its
// owner from all contributions) and the ring all-gather (direct_allreduce.cc).
void direct_ring_allreduce(const Context& cx, const Request& rq);
void tree_allreduce(const Context& cx, const Request& rq);
void recursive_doubling_allreduce(const Context& cx, const Request& rq);
void hierarchical_allreduce(const Context& cx, const Request& rq);
void oneshot_allreduce(const Context& cx, const Request& rq);
void twoshot_allreduce(const Context& cx, const Request& rq);
void ring_reduce_scatter(const Context& cx, const Request& rq);
void direct_reduce_scatter(const Context& cx, const Request& rq);
void recursive_halving_reduce_scatter(const Context& cx, const Request& rq);
void hierarchical_reduce_scatter(const Context& cx, const Request& rq);
void ring_allgather(const Context& cx, const Request& rq);
void direct_allgather(const Context& cx, const Request& rq);
void bruck_allgather(const Context& cx, const Request& rq);
void hierarchical_allgather(const Context& cx, const Request& rq);
void chain_broadcast(const Context& cx, const Request& rq);
void chain_reduce(const Context& cx, const Request& rq);
void direct_gather(const Context& cx, const Request& rq);
void direct_scatter(const Context& cx, const Request& rq);
void pairwise_alltoall(const Context& cx, const Request& rq);
void p2p_send(const Context& cx, const Request& rq);
void p2p_recv(const Context& cx, const Request& rq);
void p2p_recv_from_any(const Context& cx, const Request& rq);
void dissemination_barrier(const Context& cx, const Request& rq);

// Measures the link to `peer`; both ends call it at the same point, one as initiator.
LinkCost ping_pong(const Context& cx, int peer, bool initiator);
// The time of one message step when every rank of `team` communicates at once.
double step_latency_us(const Context& team);

}  // namespace pycomm
