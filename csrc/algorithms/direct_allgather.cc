// Direct all-gather ("oneshot" for all-gather): one step. Every rank sends its segment
// straight to every peer and receives every peer's segment into place.
// Pipelined by chunks with the same one-chunk-behind bound as the direct reduce-scatter.
// Bytes sent per rank: (n-1) * segment * element_size = (n-1)/n * total * element_size,
// in one step of n-1 concurrent messages. Transports: any.
#include "algorithms/algorithm.h"

namespace pycomm {

void direct_all_gather_chunk(const Context& cx, const SegmentChunks& chunks, size_t c, void* buffer, size_t es) {
  const int n = cx.size, r = cx.rank;
  auto* buf = static_cast<char*>(buffer);
  size_t first, len;
  chunks.piece(r, c, first, len);
  if (len)
    for (int k = 1; k < n; ++k)
      send_frame(cx, mod(r + k, n), len * es, [&](void* slot) { cx.ops->copy(slot, buf + first * es, len * es); });
  for (int k = 1; k < n; ++k) {
    const int p = mod(r - k, n);
    chunks.piece(p, c, first, len);
    if (len) recv_frame(cx, p, len * es, [&](const void* data) { cx.ops->copy(buf + first * es, data, len * es); });
  }
}

void direct_allgather(const Context& cx, const Request& rq) {
  const size_t es = element_size(rq.dtype);
  auto* out = static_cast<char*>(rq.output);
  cx.ops->copy(out + cx.rank * rq.count * es, rq.input, rq.count * es);
  const SegmentChunks chunks{Segments{rq.count * cx.size, static_cast<size_t>(cx.size)}, cx.chunk_bytes / es};
  for (size_t c = 0; c < chunks.count(); ++c) direct_all_gather_chunk(cx, chunks, c, out, es);
}

}  // namespace pycomm
