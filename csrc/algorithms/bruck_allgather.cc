// Bruck all-gather: the tree family's all-gather, ceil(log2 n) steps for any n where the
// ring takes n-1. Rank r holds segments r, r+1, ..., r+h-1 (mod n), h doubling: at the step
// of distance d = 1, 2, 4, ... it sends the first min(d, n-d) segments it holds to rank
// r-d and receives as many from rank r+d, the ones that follow its own. Bytes sent per
// rank: (n-1)/n of the wire buffer, as the ring; steps: ceil(log2 n), each from and into
// at most two contiguous runs of segments, frames interleaved (exchange_bytes).
// Coded: each rank's segment is quantized once (from the segment's start) and forwarded as
// encoded bytes; every rank, the owner included, decodes the same bits, as the ring's.
// Transports: any.
#include <algorithm>

#include "algorithms/algorithm.h"

namespace pycomm {

void bruck_allgather(const Context& cx, const Request& rq) {
  const Wire wire(cx, rq);
  const int n = cx.size, r = cx.rank;
  const size_t count = rq.count, seg = wire.bytes(count);
  auto* out = static_cast<char*>(rq.output);
  // Segments as they travel: the output itself, or their encodings.
  char* const held = wire.coded() ? cx.workspace->get(Scratch::Held, n * seg) : out;
  wire.put(cx, held + r * seg, rq.input, count);
  if (wire.coded()) wire.take(cx, out + r * count * wire.es, held + r * seg, count);
  // Segments [first, first + k) modulo n, as runs of `held`.
  const auto runs = [&](int first, int k) {
    ByteRuns b;
    const int head = std::min(k, n - first);
    b.runs.push_back({held + first * seg, head * seg});
    if (k > head) b.runs.push_back({held, (k - head) * seg});
    return b;
  };
  for (int d = 1; d < n; d *= 2) {
    const int k = std::min(d, n - d), from = mod(r + d, n);
    exchange_bytes(cx, mod(r - d, n), runs(r, k), from, runs(from, k));
    if (wire.coded())
      for (int i = 0; i < k; ++i) {
        const int s = mod(from + i, n);
        wire.take(cx, out + s * count * wire.es, held + s * seg, count);
      }
  }
}

}  // namespace pycomm
