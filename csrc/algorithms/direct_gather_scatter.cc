// Direct gather and scatter: every non-root rank exchanges its block with the root over
// their own channel; the root serves peers in rank order (a peer the root has not reached
// yet waits with at most pipeline_depth frames in flight).
// Bytes per non-root rank: count * element_size; the root moves (n-1) times that.
// Transports: any.
#include "algorithms/algorithm.h"

namespace pycomm {

void direct_gather(const Context& cx, const Request& rq) {
  const size_t bytes = rq.count * element_size(rq.dtype);
  if (cx.rank != rq.root) {
    send_bytes(cx, rq.root, rq.input, bytes);
    return;
  }
  auto* out = static_cast<char*>(rq.output);
  for (int p = 0; p < cx.size; ++p) {
    if (p == cx.rank) cx.ops->copy(out + p * bytes, rq.input, bytes);
    else recv_bytes(cx, p, out + p * bytes, bytes);
  }
}

void direct_scatter(const Context& cx, const Request& rq) {
  const size_t bytes = rq.count * element_size(rq.dtype);
  if (cx.rank != rq.root) {
    recv_bytes(cx, rq.root, rq.output, bytes);
    return;
  }
  const auto* in = static_cast<const char*>(rq.input);
  for (int p = 0; p < cx.size; ++p) {
    if (p == cx.rank) cx.ops->copy(rq.output, in + p * bytes, bytes);
    else send_bytes(cx, p, in + p * bytes, bytes);
  }
}

}  // namespace pycomm
