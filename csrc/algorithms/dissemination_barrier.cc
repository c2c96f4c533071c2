// Dissemination barrier: in round j rank r signals r+2^j and waits for r-2^j; after
// ceil(log2 n) rounds every rank has (transitively) heard from every other.
// Bytes: empty frames only (headers). Transports: any.
#include "algorithms/algorithm.h"

namespace pycomm {

void dissemination_barrier(const Context& cx, const Request&) {
  for (int d = 1; d < cx.size; d <<= 1) {
    send_frame(cx, mod(cx.rank + d, cx.size), 0, [](void*) {});
    recv_frame(cx, mod(cx.rank - d, cx.size), 0, [](const void*) {});
  }
}

}  // namespace pycomm
