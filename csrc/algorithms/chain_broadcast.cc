// Pipelined chain broadcast: root -> root+1 -> ... -> root+n-1, chunk by chunk, each rank
// forwarding a chunk straight from the received slot while it copies it out.
// Bytes sent per rank: count * element_size (none by the last rank of the chain).
// Latency: n-1 hops for one chunk; large messages stream at link bandwidth.
// Transports: any.
#include <algorithm>

#include "algorithms/algorithm.h"

namespace pycomm {

void chain_broadcast(const Context& cx, const Request& rq) {
  const int n = cx.size, pos = mod(cx.rank - rq.root, n);
  const int next = mod(cx.rank + 1, n), prev = mod(cx.rank - 1, n);
  const size_t bytes = rq.count * element_size(rq.dtype);
  auto* buf = static_cast<char*>(rq.output);
  if (pos == 0) cx.ops->copy(buf, rq.input, bytes);
  if (n == 1) return;
  for (size_t off = 0; off < bytes; off += cx.chunk_bytes) {
    const size_t len = std::min(cx.chunk_bytes, bytes - off);
    if (pos == 0) {
      send_copy(cx, next, len, buf + off);
      continue;
    }
    recv_frame(cx, prev, len, [&](const void* data) {
      cx.ops->copy(buf + off, data, len);
      if (pos < n - 1) send_copy(cx, next, len, data);
    });
  }
}

}  // namespace pycomm
