// The all-reduces built on the direct step: each rank reduces its segment from all n
// contributions in one pass (each element rounded once, by its owner, in rank order:
// deterministic), then the reduced segments are gathered:
//   twoshot: a direct all-gather, for medium and large messages on one host; latency:
//     two steps (a ring needs 2(n-1));
//   direct+ring: a ring all-gather (neighbour links only in its second half); what a
//     ring all-reduce runs in deterministic modes and with a codec.
// Interleaved chunk by chunk: chunk c of my segment is sent to the peers right after it
// was reduced, while it is still in cache, and a peer's frame is reduced while the peer's
// freshly written slot is still in the shared cache. With chunks of a few hundred KiB,
// DRAM sees each input read once and each output written once; the slots stay in cache.
// In place is safe: chunk c of the input is sent or reduced before any piece of chunk c
// of the output is written.
// Coded: contributions travel encoded, the owner quantizes its result once
// (FinalEncoded), and that encoding is what travels back, decoded alike by every rank.
// Bytes sent per rank: 2 (n-1)/n * wire(count). Transports: any.
#include "algorithms/algorithm.h"

namespace pycomm {
namespace {

void direct_step_then(const Context& cx, const Request& rq, GatherStep gather) {
  const Wire wire(cx, rq);
  const SegmentChunks chunks{Segments{rq.count, static_cast<size_t>(cx.size), wire.allreduce_unit()}, wire.chunk(cx)};
  char* const result = wire.coded() ? cx.workspace->get(Scratch::Own, wire.bytes(chunks.chunk)) : nullptr;
  auto* out = static_cast<char*>(rq.output);
  for (size_t c = 0; c < chunks.count(); ++c) {
    size_t first, len;
    chunks.piece(cx.rank, c, first, len);
    char* const own = out + first * wire.es;
    if (wire.coded()) {
      direct_reduce_step(cx, rq, wire, chunks, c, result, Stage::FinalEncoded);
      if (len) wire.take(cx, own, result, len);
    } else {
      direct_reduce_step(cx, rq, wire, chunks, c, own, Stage::Final);
    }
    gather(cx, wire, chunks, c, wire.coded() ? result : own, out);
  }
}

}  // namespace

void twoshot_allreduce(const Context& cx, const Request& rq) { direct_step_then(cx, rq, direct_gather_step); }

void direct_ring_allreduce(const Context& cx, const Request& rq) { direct_step_then(cx, rq, ring_gather_step); }

}  // namespace pycomm
