// Pipelined chain reduce: root+1 -> root+2 -> ... -> root, chunk by chunk. Each rank adds
// its contribution to the incoming partial and passes it on; the root rounds the final
// value into its output. Non-root buffers are never written.
// Wire: partials in the accumulation format. Bytes sent per rank: count * accum_size
// (none by the root). Transports: any.
#include <algorithm>

#include "algorithms/algorithm.h"
#include "core/dispatch.h"

namespace pycomm {

void chain_reduce(const Context& cx, const Request& rq) {
  const int n = cx.size, pos = mod(cx.rank - rq.root, n);
  const int next = mod(cx.rank + 1, n), prev = mod(cx.rank - 1, n);
  const ReduceSpec spec = cx.spec(rq);
  const size_t es = element_size(rq.dtype), ws = accum_size(rq.dtype), chunk = cx.chunk_bytes / ws;
  const auto* in = static_cast<const char*>(rq.input);
  if (n == 1) {
    cx.ops->reduce(spec, Stage::Final, rq.output, rq.input, nullptr, rq.count);
    return;
  }
  for (size_t first = 0; first < rq.count; first += chunk) {
    const size_t len = std::min(chunk, rq.count - first);
    if (pos == 1) {  // the chain's first rank: only its own contribution
      send_frame(cx, next, len * ws,
                 [&](void* slot) { cx.ops->reduce(spec, Stage::Partial, slot, in + first * es, nullptr, len); });
      continue;
    }
    recv_frame(cx, prev, len * ws, [&](const void* partial) {
      if (pos == 0) {
        cx.ops->reduce(spec, Stage::Final, static_cast<char*>(rq.output) + first * es, in + first * es, partial, len);
      } else {
        send_frame(cx, next, len * ws,
                   [&](void* slot) { cx.ops->reduce(spec, Stage::Partial, slot, in + first * es, partial, len); });
      }
    });
  }
}

}  // namespace pycomm
