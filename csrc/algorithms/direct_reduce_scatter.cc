// Direct reduce-scatter ("oneshot" for reduce-scatter): one step. Every rank sends piece s
// of its input straight to rank s; rank s holds all n-1 received frames at once and
// reduces the n contributions in logical rank order in a single pass (DeviceOps::
// reduce_terms), so each element is rounded once and its bits do not depend on arrival
// order.
// Pipelined by chunks; per chunk a rank sends n-1 frames, then receives n-1, so a peer
// is never more than one chunk behind and pipeline_depth >= 2 slots suffice.
// Wire: inputs in the storage format. Bytes sent per rank: (n-1)/n * total * element_size,
// in one step of n-1 concurrent messages. Transports: any; best where every pair has its
// own link (shared memory).
#include <vector>

#include "algorithms/algorithm.h"
#include "core/dispatch.h"

namespace pycomm {

void direct_reduce_scatter_chunk(const Context& cx, const Request& rq, const SegmentChunks& chunks, size_t c,
                                 void* own_out, Stage stage) {
  const int n = cx.size, r = cx.rank;
  const size_t es = element_size(rq.dtype);
  const auto* in = static_cast<const char*>(rq.input);
  size_t first, len;
  for (int k = 1; k < n; ++k) {  // rank r+1 first: peers are not all served in the same order
    const int s = mod(r + k, n);
    chunks.piece(s, c, first, len);
    if (len) send_frame(cx, s, len * es, [&](void* slot) { cx.ops->copy(slot, in + first * es, len * es); });
  }
  chunks.piece(r, c, first, len);
  if (!len) return;
  std::vector<Term> terms(n);
  for (int p = 0; p < n; ++p)
    terms[p] = {p == r ? in + first * es : begin_recv_frame(cx, p, len * es), Form::Input};
  const size_t out_es = stage == Stage::Final ? es : accum_size(rq.dtype);
  char* out = static_cast<char*>(own_out) + (first - chunks.seg.begin(r)) * out_es;
  cx.ops->reduce_terms(cx.spec(rq), stage, out, terms.data(), n, len);
  for (int p = 0; p < n; ++p)
    if (p != r) end_recv_frame(cx, p);
}

void direct_reduce_scatter(const Context& cx, const Request& rq) {
  const SegmentChunks chunks{Segments{rq.count * cx.size, static_cast<size_t>(cx.size)},
                             cx.chunk_bytes / element_size(rq.dtype)};
  for (size_t c = 0; c < chunks.count(); ++c)
    direct_reduce_scatter_chunk(cx, rq, chunks, c, rq.output, Stage::Final);
}

}  // namespace pycomm
