// Two-shot all-reduce: a direct reduce-scatter (each rank reduces its segment from all
// n inputs in one pass) followed by a direct all-gather of the reduced segments, for
// medium and large messages on one host. Latency: two steps (a ring needs 2(n-1)).
// Interleaved chunk by chunk like the ring all-reduce: chunk c of my segment is sent to
// the peers right after it was reduced, while it is still in cache, and a peer's frame
// is reduced while the peer's freshly written slot is still in the shared cache. With
// chunks of a few hundred KiB, DRAM sees each input read once and each output written
// once; the slots stay in cache.
// In place is safe: chunk c of the input is sent (copied) before chunk c of the output
// is written.
// Bytes sent per rank: 2 (n-1)/n * count * element_size (inputs travel in the storage
// format, reduced once by their segment's owner). Transports: any.
#include "algorithms/algorithm.h"

namespace pycomm {

namespace {

void reduce_scatter_then_gather(const Context& cx, const Request& rq, bool ring_gather) {
  const size_t es = element_size(rq.dtype);
  const SegmentChunks chunks{Segments{rq.count, static_cast<size_t>(cx.size)}, cx.chunk_bytes / es};
  char* own = static_cast<char*>(rq.output) + chunks.seg.begin(cx.rank) * es;
  for (size_t c = 0; c < chunks.count(); ++c) {
    direct_reduce_scatter_chunk(cx, rq, chunks, c, own, Stage::Final);
    if (ring_gather) ring_all_gather_chunk(cx, rq, chunks, c, rq.output);
    else direct_all_gather_chunk(cx, chunks, c, rq.output, es);
  }
}

}  // namespace

void twoshot_allreduce(const Context& cx, const Request& rq) { reduce_scatter_then_gather(cx, rq, false); }

void direct_ring_allreduce(const Context& cx, const Request& rq) { reduce_scatter_then_gather(cx, rq, true); }

}  // namespace pycomm
