// One-shot all-reduce: one step, for small messages. Every rank sends its whole input to
// every peer, holds all n-1 received frames at once and reduces the n inputs in logical
// rank order in one pass; every rank computes the same bits from the same operands in
// the same order.
// Pipelined by chunks (send to all, then receive from all, per chunk).
// Bytes sent per rank: (n-1) * count * element_size in one step: latency is one message,
// bandwidth cost grows with n, so it only pays for small messages. Transports: any.
#include <vector>

#include "algorithms/algorithm.h"

namespace pycomm {

void oneshot_allreduce(const Context& cx, const Request& rq) {
  const int n = cx.size, r = cx.rank;
  const size_t es = element_size(rq.dtype);
  const SegmentChunks chunks{Segments{rq.count, 1}, cx.chunk_bytes / es};
  const auto* in = static_cast<const char*>(rq.input);
  auto* out = static_cast<char*>(rq.output);
  std::vector<Term> terms(n);
  for (size_t c = 0; c < chunks.count(); ++c) {
    size_t first, len;
    chunks.piece(0, c, first, len);
    for (int k = 1; k < n; ++k)
      send_frame(cx, mod(r + k, n), len * es, [&](void* slot) { cx.ops->copy(slot, in + first * es, len * es); });
    for (int p = 0; p < n; ++p)
      terms[p] = {p == r ? in + first * es : begin_recv_frame(cx, p, len * es), Form::Input};
    cx.ops->reduce_terms(cx.spec(rq), Stage::Final, out + first * es, terms.data(), n, len);
    for (int p = 0; p < n; ++p)
      if (p != r) end_recv_frame(cx, p);
  }
}

}  // namespace pycomm
