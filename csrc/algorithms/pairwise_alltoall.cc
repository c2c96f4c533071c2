// Pairwise all-to-all: in step k = 1..n-1 rank r sends its block for r+k and receives the
// block from r-k, alternating chunk by chunk so that both directions stream; every rank
// talks to exactly one sender and one receiver per step, so no link is oversubscribed.
// Blocks may differ in size per pair (all_to_all_single with splits); each frame is
// stamped with the pair's own count so a split mismatch between ranks is reported.
// Bytes sent per rank: its input minus its own block. Transports: any.
#include <algorithm>
#include <numeric>

#include "algorithms/algorithm.h"

namespace pycomm {

void pairwise_alltoall(const Context& cx, const Request& rq) {
  const int n = cx.size, r = cx.rank;
  const size_t es = element_size(rq.dtype);
  std::vector<size_t> send_off(n, 0), recv_off(n, 0);
  for (int p = 1; p < n; ++p) {
    send_off[p] = send_off[p - 1] + rq.send_counts[p - 1];
    recv_off[p] = recv_off[p - 1] + rq.recv_counts[p - 1];
  }
  const auto* in = static_cast<const char*>(rq.input);
  auto* out = static_cast<char*>(rq.output);
  cx.ops->copy(out + recv_off[r] * es, in + send_off[r] * es, rq.send_counts[r] * es);
  for (int k = 1; k < n; ++k) {
    const int dst = mod(r + k, n), src = mod(r - k, n);
    const size_t send = rq.send_counts[dst] * es, recv = rq.recv_counts[src] * es;
    Context pair = cx;
    for (size_t off = 0; off < std::max(send, recv); off += cx.chunk_bytes) {
      if (off < send) {
        const size_t len = std::min(cx.chunk_bytes, send - off);
        pair.stamp.count = rq.send_counts[dst];
        send_copy(pair, dst, len, in + send_off[dst] * es + off);
      }
      if (off < recv) {
        const size_t len = std::min(cx.chunk_bytes, recv - off);
        pair.stamp.count = rq.recv_counts[src];
        recv_frame(pair, src, len, [&](const void* d) { cx.ops->copy(out + recv_off[src] * es + off, d, len); });
      }
    }
  }
}

}  // namespace pycomm
