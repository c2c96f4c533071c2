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

void ring_reduce_scatter_segments(const Context& cx, const Request& rq, const Segments& seg,
                                  void* own_out) {
  const int n = cx.size, r = cx.rank, right = mod(r + 1, n), left = mod(r - 1, n);
  const ReduceSpec spec = cx.spec(rq);
  const size_t es = element_size(rq.dtype), ws = accum_size(rq.dtype);
  const size_t chunk = cx.chunk_bytes / ws;
  const auto* in = static_cast<const char*>(rq.input);
  const size_t chunks = ceil_div(seg.length(0), chunk);  // segment 0 is the longest
  for (size_t c = 0; c < chunks; ++c) {
    // Elements [first, first+len) of segment s that chunk c covers; len 0 when it has none.
    auto piece = [&](int s, size_t& first, size_t& len) {
      const size_t l = seg.length(s), off = c * chunk;
      first = seg.begin(s) + off;
      len = off < l ? std::min(chunk, l - off) : 0;
    };
    size_t first, len;
    piece(mod(r - 1, n), first, len);  // step 0
    if (len)
      send_frame(cx, right, len * ws, [&](void* slot) {
        cx.ops->reduce(spec, Stage::Partial, slot, in + first * es, nullptr, len);
      });
    for (int k = 0; k <= n - 2; ++k) {
      piece(mod(r - 2 - k, n), first, len);
      if (!len) continue;
      recv_frame(cx, left, len * ws, [&](const void* partial) {
        if (k == n - 2) {
          char* out = static_cast<char*>(own_out) + (first - seg.begin(r)) * es;
          cx.ops->reduce(spec, Stage::Final, out, in + first * es, partial, len);
        } else {
          send_frame(cx, right, len * ws, [&](void* slot) {
            cx.ops->reduce(spec, Stage::Partial, slot, in + first * es, partial, len);
          });
        }
      });
    }
  }
}

void ring_reduce_scatter(const Context& cx, const Request& rq) {
  const Segments seg{rq.count * cx.size, static_cast<size_t>(cx.size)};
  if (cx.size == 1) {
    cx.ops->reduce(cx.spec(rq), Stage::Final, rq.output, rq.input, nullptr, rq.count);
    return;
  }
  ring_reduce_scatter_segments(cx, rq, seg, rq.output);
}

}  // namespace pycomm
