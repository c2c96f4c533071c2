// Ring all-reduce: ring reduce-scatter of balanced segments (segment r ends reduced and
// rounded on rank r, in place in the output), then ring all-gather of those segments,
// interleaved chunk by chunk: chunk c of my segment is forwarded by the all-gather right
// after the reduce-scatter rounded it, while it is still in cache (one pass over DRAM
// less than running the two phases one after the other). Both phases use the chunk size
// of the wider (accumulation) format so that their chunks line up.
// Deadlock freedom: per chunk the pattern is still send, (recv, send)*, recv per phase.
// In place (input == output) is safe: a rank overwrites chunk c of segment r only after
// its last read of its own input there, and chunk c of other segments only in the
// all-gather of chunk c, after the reduce-scatter of chunk c read them.
// Bytes sent per rank: (n-1)/n * count * (accum_size + element_size). Transports: any.
#include "algorithms/algorithm.h"
#include "core/dispatch.h"

namespace pycomm {

void ring_allreduce(const Context& cx, const Request& rq) {
  if (cx.size == 1) {
    cx.ops->reduce(cx.spec(rq), Stage::Final, rq.output, rq.input, nullptr, rq.count);
    return;
  }
  const Wire wire(cx, rq);  // uncoded
  const SegmentChunks ring{Segments{rq.count, static_cast<size_t>(cx.size)}, cx.chunk_bytes / accum_size(rq.dtype)};
  auto* out = static_cast<char*>(rq.output);
  char* own = out + ring.seg.begin(cx.rank) * wire.es;
  for (size_t c = 0; c < ring.count(); ++c) {
    ring_reduce_scatter_chunk(cx, rq, ring, c, own);
    size_t first, len;
    ring.piece(cx.rank, c, first, len);
    ring_gather_step(cx, wire, ring, c, out + first * wire.es, out);
  }
}

}  // namespace pycomm
