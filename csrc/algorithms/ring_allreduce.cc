// Ring all-reduce: ring reduce-scatter of balanced segments (segment r ends reduced and
// rounded on rank r, in place in the output), then ring all-gather of those segments.
// Works in place (input == output): a rank overwrites segment r only after the last read
// of its own input for that segment, and the other segments only in the all-gather phase,
// after every read of its input.
// Bytes sent per rank: (n-1)/n * count * (accum_size + element_size). Transports: any.
#include "algorithms/algorithm.h"

namespace pycomm {

void ring_allreduce(const Context& cx, const Request& rq) {
  const Segments seg{rq.count, static_cast<size_t>(cx.size)};
  if (cx.size == 1) {
    cx.ops->reduce(cx.spec(rq), Stage::Final, rq.output, rq.input, nullptr, rq.count);
    return;
  }
  auto* out = static_cast<char*>(rq.output);
  ring_reduce_scatter_segments(cx, rq, seg, out + seg.begin(cx.rank) * element_size(rq.dtype));
  ring_all_gather_segments(cx, rq, seg, out);
}

}  // namespace pycomm
