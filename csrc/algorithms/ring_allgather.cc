// Ring all-gather.
//
// Steps (segment s starts on rank s and visits every rank):
//   step 0:        send my own segment r to the right neighbour;
//   step k=0..n-2: receive segment r-1-k from the left into the output and, if k < n-2,
//                  pass it on to the right straight from the received slot.
// Pipelined chunk-major like the ring reduce-scatter (same deadlock argument).
// Bytes sent per rank: (n-1)/n * total * element_size. Transports: any.
#include "algorithms/algorithm.h"

namespace pycomm {

void ring_all_gather_chunk(const Context& cx, const Request& rq, const SegmentChunks& ring, size_t c,
                           void* buffer) {
  const int n = cx.size, r = cx.rank, right = mod(r + 1, n), left = mod(r - 1, n);
  const size_t es = element_size(rq.dtype);
  auto* buf = static_cast<char*>(buffer);
  size_t first, len;
  ring.piece(r, c, first, len);  // step 0
  if (len)
    send_frame(cx, right, len * es, [&](void* slot) { cx.ops->copy(slot, buf + first * es, len * es); });
  for (int k = 0; k <= n - 2; ++k) {
    ring.piece(mod(r - 1 - k, n), c, first, len);
    if (!len) continue;
    recv_frame(cx, left, len * es, [&](const void* data) {
      cx.ops->copy(buf + first * es, data, len * es);
      if (k < n - 2)
        send_frame(cx, right, len * es, [&](void* slot) { cx.ops->copy(slot, data, len * es); });
    });
  }
}

void ring_allgather(const Context& cx, const Request& rq) {
  const size_t es = element_size(rq.dtype);
  auto* out = static_cast<char*>(rq.output);
  cx.ops->copy(out + cx.rank * rq.count * es, rq.input, rq.count * es);
  if (cx.size == 1) return;
  const SegmentChunks ring{Segments{rq.count * cx.size, static_cast<size_t>(cx.size)}, cx.chunk_bytes / es};
  for (size_t c = 0; c < ring.count(); ++c) ring_all_gather_chunk(cx, rq, ring, c, out);
}

}  // namespace pycomm
