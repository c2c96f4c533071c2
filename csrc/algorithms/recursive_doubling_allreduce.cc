// Recursive-doubling all-reduce: the tree family's variant for latency-bound sizes, the
// one Open MPI and MPICH use for small messages. Of the largest power of two p <= n, the
// ranks form a butterfly: at step k each exchanges its partial with the rank whose index
// differs in bit k and folds the two, so after log2 p steps every rank holds the whole
// reduction. Where n is not a power of two, the first 2(n-p) ranks pair up first (2i
// hands its contribution to 2i+1 and takes the result back at the end): two steps more.
// Latency: log2 p (+2) dependent frames per chunk, against the one-shot's n-1 frames
// taken one after the other and the double binary tree's 2 log2 n; per rank and step one
// frame out and one in. Chunks run one after the other, each through every step.
// Bits: both ranks of an exchange fold the same two operands in the same order (the
// lower index's first), so every rank computes the same bits at every step and ends with
// the same result; the grouping of the partial sums depends on n, so deterministic modes
// do not use it (as the double binary tree). Wire: a contribution travels as the call's
// wire format (encoded under a codec: quantized once, as it enters the sum), a partial
// in the accumulation format, never requantized; the result is rounded once, on every
// rank alike, and the paired ranks' results travel back in the storage format, copied.
// Transports: any.
#include <algorithm>
#include <utility>

#include "algorithms/algorithm.h"
#include "core/dispatch.h"

namespace pycomm {

void recursive_doubling_allreduce(const Context& cx, const Request& rq) {
  const ReduceSpec spec = cx.spec(rq);
  const Wire wire(cx, rq);
  const size_t es = wire.es, ws = accum_size(rq.dtype), unit = wire.allreduce_unit();
  // Elements per frame: a partial in the accumulation format is the largest thing sent.
  const size_t chunk = std::max(unit, cx.chunk_bytes / ws / unit * unit);
  const int n = cx.size, r = cx.rank;
  const Butterfly fly(n);
  const int p = fly.p, index = fly.index(r);
  // What a rank sends at butterfly step d: its contribution at the first step unless it
  // folded a pair's first, else its partial.
  const auto sends_contribution = [&](int rank, int d) { return d == 1 && !fly.takes_pair(rank); };
  const auto frame_bytes = [&](int rank, int d, size_t len) {
    return sends_contribution(rank, d) ? wire.bytes(len) : len * ws;
  };
  char* const partial = cx.workspace->get(Scratch::Partials, chunk * ws);
  const auto* in = static_cast<const char*>(rq.input);
  auto* out = static_cast<char*>(rq.output);
  for (size_t first = 0; first < rq.count; first += chunk) {
    const size_t len = std::min(chunk, rq.count - first);
    const Term own{in + first * es, Form::Input};
    char* const result = out + first * es;
    if (n == 1) {
      cx.ops->reduce_terms(spec, Stage::Final, result, &own, 1, len);
      continue;
    }
    if (fly.hands_over(r)) {  // hands its contribution over, takes the result back
      wire.send(cx, r + 1, own.data, len);
      recv_frame(cx, r + 1, len * es, [&](const void* final) { cx.ops->copy(result, final, len * es); });
      continue;
    }
    Term mine = own;
    if (fly.takes_pair(r)) {  // folds its pair's contribution first, in rank order
      const Term terms[2] = {wire.term(begin_recv_frame(cx, r - 1, wire.bytes(len))), own};
      cx.ops->reduce_terms(spec, Stage::Partial, partial, terms, 2, len);
      end_recv_frame(cx, r - 1);
      mine = {partial, Form::Partial};
    }
    for (int d = 1; d < p; d *= 2) {
      const int partner = fly.last_rank(index ^ d);
      if (mine.form == Form::Input) wire.send(cx, partner, mine.data, len);
      else send_copy(cx, partner, len * ws, mine.data);
      const void* got = begin_recv_frame(cx, partner, frame_bytes(partner, d, len));
      const Term theirs = sends_contribution(partner, d) ? wire.term(got) : Term{got, Form::Partial};
      Term terms[2] = {mine, theirs};
      if (partner < r) std::swap(terms[0], terms[1]);
      const bool last = 2 * d == p;
      cx.ops->reduce_terms(spec, last ? Stage::Final : Stage::Partial, last ? static_cast<void*>(result) : partial,
                           terms, 2, len);
      end_recv_frame(cx, partner);
      mine = {partial, Form::Partial};
    }
    if (fly.takes_pair(r)) send_copy(cx, r - 1, len * es, result);
  }
}

}  // namespace pycomm
