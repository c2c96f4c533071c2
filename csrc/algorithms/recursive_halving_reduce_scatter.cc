// Recursive-halving reduce-scatter: the tree family's reduce-scatter, log2 p steps where
// the ring takes n-1. On the butterfly of algorithm.h, each virtual rank starts with the
// whole buffer in its range; at the step of distance d (p/2 down to 1) it keeps the half
// of its range that holds its own segments and sends the other half to virtual rank v^d,
// whose half it receives. After log2 p steps its range is its own segments. Where n is
// not a power of two, the first rank of a pair hands its whole input to the second first,
// and takes its segment back at the end: two steps more, and that rank's input once more
// on the pair's link.
//
// What travels depends on the call's contract:
// - Plain (determinism 0, uncompressed): partial sums, in the accumulation format, folded
//   at every step straight out of the received slot. Bytes sent per rank: (n-1)/n of the
//   buffer in the accumulation format, as the ring, in log2 p steps of halving size.
// - Ordered, exact or compressed: contributions, never summed on the way. A rank holds
//   the contributions of the ranks it has heard from for every segment of its range (each
//   quantized once, as it left its rank, segment by segment from the segment's start) and
//   forwards them; the owner of a segment folds all n at once, in rank order, as the
//   direct reduce-scatter does: the same bits, in log2 p steps instead of n-1 concurrent
//   frames. Bytes sent per rank: half the wire buffer per step, log2 p times: for
//   latency-bound sizes, where the number of steps is what costs.
// Transports: any.
#include <algorithm>
#include <vector>

#include "algorithms/algorithm.h"
#include "core/dispatch.h"

namespace pycomm {
namespace {

// One step of the halving for virtual rank v: the range [lo, lo + 2d) of virtual ranks
// before it, and the half it keeps.
struct Halving {
  int v, d;
  int lo() const { return v & ~(2 * d - 1); }
  int keep_lo() const { return v & d ? lo() + d : lo(); }
  int send_lo() const { return v & d ? lo() : lo() + d; }
};

// The segments of virtual ranks [lo, lo + len): a range of segments, [first, end).
struct SegmentRange {
  int first, end;
  int size() const { return end - first; }
};
SegmentRange segments_of(const Butterfly& fly, int lo, int len) {
  return {fly.first_rank(lo), fly.first_rank(lo + len)};
}

void halve_partials(const Context& cx, const Request& rq) {
  const ReduceSpec spec = cx.spec(rq);
  const Butterfly fly(cx.size);
  const int me = cx.rank, v = fly.index(me);
  const size_t count = rq.count, es = element_size(rq.dtype), ws = accum_size(rq.dtype);
  const size_t chunk = std::max<size_t>(1, cx.chunk_bytes / ws);  // elements per frame
  const auto* in = static_cast<const char*>(rq.input);
  auto* out = static_cast<char*>(rq.output);
  if (fly.hands_over(me)) {
    const SegmentChunks whole{Segments{count * cx.size, 1}, chunk};
    for (size_t c = 0; c < whole.count(); ++c) {
      size_t first, len;
      whole.piece(0, c, first, len);
      send_frame(cx, me + 1, len * ws,
                 [&](void* slot) { cx.ops->reduce(spec, Stage::Partial, slot, in + first * es, nullptr, len); });
    }
    return recv_bytes(cx, me + 1, out, count * es);
  }
  // The partial sums of this rank's range live in `partial`, from element `base` on: the
  // whole buffer where a pair's input is folded first, else the first step's half.
  const Halving first_step{v, fly.p / 2};
  const SegmentRange first_kept = segments_of(fly, first_step.keep_lo(), fly.p / 2);
  const size_t base = fly.takes_pair(me) ? 0 : first_kept.first * count;
  const size_t held = fly.takes_pair(me) ? count * cx.size : first_kept.size() * count;
  char* const partial = cx.workspace->get(Scratch::Partials, held * ws);
  const auto at = [&](size_t element) { return partial + (element - base) * ws; };
  bool folded = false;  // `partial` holds this rank's operand (else its input does)
  if (fly.takes_pair(me)) {
    for (size_t first = 0; first < count * cx.size; first += chunk) {
      const size_t len = std::min(chunk, count * cx.size - first);
      recv_frame(cx, me - 1, len * ws, [&](const void* theirs) {
        cx.ops->reduce(spec, Stage::Partial, at(first), in + first * es, theirs, len);
      });
    }
    folded = true;
  }
  // The pair's first rank's segment, rounded here, goes back to it at the end.
  char* const pair_result = fly.takes_pair(me) ? cx.workspace->get(Scratch::Results, count * es) : nullptr;
  for (int d = fly.p / 2; d >= 1; d /= 2) {
    const Halving step{v, d};
    const SegmentRange sent = segments_of(fly, step.send_lo(), d), kept = segments_of(fly, step.keep_lo(), d);
    const int partner = fly.last_rank(v ^ d);
    const size_t send_first = sent.first * count, send_len = sent.size() * count;
    const size_t keep_first = kept.first * count, keep_len = kept.size() * count;
    const bool last = d == 1;
    const auto mine = [&](size_t element) {
      return folded ? Term{at(element), Form::Partial} : Term{in + element * es, Form::Input};
    };
    for (size_t off = 0; off < std::max(send_len, keep_len); off += chunk) {
      if (off < send_len) {
        const size_t len = std::min(chunk, send_len - off);
        const Term t = mine(send_first + off);
        send_frame(cx, partner, len * ws, [&](void* slot) {
          if (t.form == Form::Partial) cx.ops->copy(slot, t.data, len * ws);
          else cx.ops->reduce_terms(spec, Stage::Partial, slot, &t, 1, len);
        });
      }
      if (off >= keep_len) continue;
      const size_t len = std::min(chunk, keep_len - off);
      const void* theirs = begin_recv_frame(cx, partner, len * ws);
      // A piece of the last step may cover the pair's two segments: fold each into its place.
      for (size_t done = 0; done < len;) {
        const size_t element = keep_first + off + done;
        const size_t segment = element / count;
        const size_t piece = last ? std::min(len - done, (segment + 1) * count - element) : len;
        const Term terms[2] = {mine(element), {static_cast<const char*>(theirs) + done * ws, Form::Partial}};
        char* const dst = !last                             ? at(element)
                          : static_cast<int>(segment) == me ? out + (element - me * count) * es
                                                            : pair_result + (element - segment * count) * es;
        cx.ops->reduce_terms(spec, last ? Stage::Final : Stage::Partial, dst, terms, 2, piece);
        done += piece;
      }
      end_recv_frame(cx, partner);
    }
    folded = true;
  }
  if (pair_result) send_bytes(cx, me - 1, pair_result, count * es);
}

void halve_contributions(const Context& cx, const Request& rq) {
  const Wire wire(cx, rq);
  const bool requantize = wire.coded() && rq.options.determinism != Determinism::Default;
  const Butterfly fly(cx.size);
  const int n = cx.size, me = cx.rank, v = fly.index(me);
  const size_t count = rq.count, seg = wire.bytes(count);  // one segment of one contribution
  const auto* in = static_cast<const char*>(rq.input);
  auto* out = static_cast<char*>(rq.output);
  const auto put_all = [&](char* dst) {
    for (int s = 0; s < n; ++s) wire.put(cx, dst + s * seg, in + s * count * wire.es, count);
  };
  // The virtual ranks whose contributions virtual rank u holds once the steps down to
  // distance d have run (d = p: none has): those equal to u modulo d, in order.
  const auto heard = [&](int u, int d) {
    std::vector<int> group;
    for (int w = u % d; w < fly.p; w += d) group.push_back(w);
    return group;
  };
  const auto ranks_in = [&](const std::vector<int>& group) {
    int k = 0;
    for (int w : group) k += fly.ranks_of(w);
    return k;
  };
  // The largest holding of any step (contributions x segments of the range); what a
  // step receives is less.
  size_t most = 2 * n * seg;
  for (int d = fly.p / 2; d >= 1; d /= 2)
    most = std::max(most, ranks_in(heard(v, d)) * segments_of(fly, Halving{v, d}.keep_lo(), d).size() * seg);
  char* const memory = cx.workspace->get(Scratch::Held, 3 * most);
  char *held = memory, *next = memory + most, *received = memory + 2 * most;
  if (fly.hands_over(me)) {
    put_all(held);
    send_bytes(cx, me + 1, held, n * seg);
    return recv_bytes(cx, me + 1, out, count * wire.es);
  }
  // `held`: for each virtual rank this rank has heard from, in order, for each of its
  // ranks, the segments of this rank's range.
  if (fly.takes_pair(me)) {
    recv_bytes(cx, me - 1, held, n * seg);
    put_all(held + n * seg);
  } else {
    put_all(held);
  }
  SegmentRange range{0, n};
  for (int d = fly.p / 2; d >= 1; d /= 2) {
    const Halving step{v, d};
    const SegmentRange sent = segments_of(fly, step.send_lo(), d), kept = segments_of(fly, step.keep_lo(), d);
    const std::vector<int> mine = heard(v, 2 * d), theirs = heard(v ^ d, 2 * d);
    const int mine_ranks = ranks_in(mine), their_ranks = ranks_in(theirs);
    ByteRuns outgoing, incoming;
    for (int j = 0; j < mine_ranks; ++j)
      outgoing.runs.push_back({held + (j * range.size() + sent.first - range.first) * seg, sent.size() * seg});
    incoming.runs.push_back({received, their_ranks * kept.size() * seg});
    exchange_bytes(cx, fly.last_rank(v ^ d), outgoing, fly.last_rank(v ^ d), incoming);
    // Merge, in virtual rank order, this rank's contributions and the partner's, each
    // over the kept half.
    const size_t piece = kept.size() * seg;
    char* dst = next;
    int mine_j = 0, their_j = 0;
    for (int w : heard(v, d)) {
      const bool own = w % (2 * d) == v % (2 * d);
      for (int k = 0; k < fly.ranks_of(w); ++k, dst += piece) {
        const char* src =
            own ? held + ((mine_j++) * range.size() + kept.first - range.first) * seg : received + (their_j++) * piece;
        cx.ops->copy(dst, src, piece);
      }
    }
    std::swap(held, next);
    range = kept;
  }
  // Every rank's contribution to this rank's segments, in rank order: fold each segment.
  std::vector<Term> terms(n);
  char* const result = requantize ? cx.workspace->get(Scratch::Own, seg) : nullptr;
  for (int s = range.first; s < range.end; ++s) {
    for (int k = 0; k < n; ++k) terms[k] = wire.term(held + (k * range.size() + s - range.first) * seg);
    char* const dst = s == me ? out : cx.workspace->get(Scratch::Results, count * wire.es);
    if (requantize) {
      cx.ops->reduce_terms(wire.spec, Stage::FinalEncoded, result, terms.data(), n, count);
      wire.take(cx, dst, result, count);
    } else {
      cx.ops->reduce_terms(wire.spec, Stage::Final, dst, terms.data(), n, count);
    }
    if (s != me) send_bytes(cx, s, dst, count * wire.es);
  }
}

}  // namespace

void recursive_halving_reduce_scatter(const Context& cx, const Request& rq) {
  if (cx.size == 1) return cx.ops->reduce(cx.spec(rq), Stage::Final, rq.output, rq.input, nullptr, rq.count);
  const bool partials = rq.options.compression == Compression::None && rq.options.determinism == Determinism::Default;
  (partials ? halve_partials : halve_contributions)(cx, rq);
}

}  // namespace pycomm
