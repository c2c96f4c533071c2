// The all-gathers: every rank's input is its segment of the output, put on the wire chunk
// by chunk, and a gather step delivers every segment everywhere:
//   ring: segment s starts on rank s and visits every rank, forwarded straight from the
//     received slot (ring_gather_step); n-1 steps on neighbour links;
//   direct ("oneshot" for all-gather): every rank sends its segment straight to every
//     peer (direct_gather_step); one step of n-1 concurrent messages.
// Pipelined chunk-major, a peer at most a chunk behind, as the reduce-scatters.
// Coded: each rank's segment is quantized once and travels encoded, byte for byte; every
// rank, the owner included, decodes the same bits.
// Bytes sent per rank: (n-1)/n * wire(total). Transports: any.
#include "algorithms/algorithm.h"

namespace pycomm {
namespace {

void own_segments_then(const Context& cx, const Request& rq, GatherStep gather) {
  const Wire wire(cx, rq);
  const SegmentChunks chunks{Segments{rq.count * cx.size, static_cast<size_t>(cx.size)}, wire.chunk(cx)};
  char* const encoded = wire.coded() ? cx.workspace->get(Scratch::Own, wire.bytes(chunks.chunk)) : nullptr;
  const auto* in = static_cast<const char*>(rq.input);
  auto* out = static_cast<char*>(rq.output);
  for (size_t c = 0; c < chunks.count(); ++c) {
    size_t first, len;
    chunks.piece(cx.rank, c, first, len);
    char* const own = out + first * wire.es;
    const char* const piece = in + (first - chunks.seg.begin(cx.rank)) * wire.es;
    if (len && wire.coded()) {
      wire.put(cx, encoded, piece, len);
      wire.take(cx, own, encoded, len);
    } else if (len) {
      cx.ops->copy(own, piece, len * wire.es);
    }
    gather(cx, wire, chunks, c, wire.coded() ? encoded : own, out);
  }
}

}  // namespace

void ring_allgather(const Context& cx, const Request& rq) { own_segments_then(cx, rq, ring_gather_step); }

void direct_allgather(const Context& cx, const Request& rq) { own_segments_then(cx, rq, direct_gather_step); }

}  // namespace pycomm
