// Ring reduce-scatter.
//
// Steps (n ranks, segment s of the input ends fully reduced on rank s):
//   step 0:        send my contribution to segment r-1 to the right neighbour;
//   step k=0..n-2: receive the partial of segment r-2-k from the left, add my
//                  contribution; if k < n-2 send the result on to the right, else it is
//                  segment r's final value: round it into the output.
// Pipelining: each segment is cut into chunks of chunk_bytes of the wire format; the loop
// is chunk-major, so chunk c streams around the ring while chunk c+1 starts behind it.
// Deadlock freedom: per chunk a rank alternates send, (recv, send)*, so it has at most
// one frame more in flight than it consumed; pipeline_depth >= 2 slots always suffice.
//
// Wire: partial values travel in the accumulation format (fp32 for 16-bit floats), so
// each element is rounded once. Bytes sent per rank: (n-1)/n * count * accum_size.
// Transports: any (shm, tcp).
#include "algorithms/algorithm.h"
#include "core/dispatch.h"

namespace pycomm {

void ring_reduce_scatter_chunk(const Context& cx, const Request& rq, const SegmentChunks& ring, size_t c,
                               void* own_out) {
  const int n = cx.size, r = cx.rank, right = mod(r + 1, n), left = mod(r - 1, n);
  const ReduceSpec spec = cx.spec(rq);
  const size_t es = element_size(rq.dtype), ws = accum_size(rq.dtype);
  const auto* in = static_cast<const char*>(rq.input);
  size_t first, len;
  ring.piece(mod(r - 1, n), c, first, len);  // step 0
  if (len)
    send_frame(cx, right, len * ws,
               [&](void* slot) { cx.ops->reduce(spec, Stage::Partial, slot, in + first * es, nullptr, len); });
  for (int k = 0; k <= n - 2; ++k) {
    ring.piece(mod(r - 2 - k, n), c, first, len);
    if (!len) continue;
    recv_frame(cx, left, len * ws, [&](const void* partial) {
      if (k == n - 2) {
        char* out = static_cast<char*>(own_out) + (first - ring.seg.begin(r)) * es;
        cx.ops->reduce(spec, Stage::Final, out, in + first * es, partial, len);
      } else {
        send_frame(cx, right, len * ws,
                   [&](void* slot) { cx.ops->reduce(spec, Stage::Partial, slot, in + first * es, partial, len); });
      }
    });
  }
}

void ring_reduce_scatter(const Context& cx, const Request& rq) {
  if (cx.size == 1) {
    cx.ops->reduce(cx.spec(rq), Stage::Final, rq.output, rq.input, nullptr, rq.count);
    return;
  }
  const SegmentChunks ring{Segments{rq.count * cx.size, static_cast<size_t>(cx.size)},
                           cx.chunk_bytes / accum_size(rq.dtype)};
  for (size_t c = 0; c < ring.count(); ++c) ring_reduce_scatter_chunk(cx, rq, ring, c, rq.output);
}

}  // namespace pycomm
