// One-shot all-reduce: one step, for small messages. Every rank sends its whole input to
// every peer, holds all n-1 received frames at once and reduces the n inputs in logical
// rank order in one pass (the direct step of a buffer of one segment); every rank
// computes the same bits from the same operands in the same order.
// Pipelined by chunks (send to all, then receive from all, per chunk).
// Coded: each contribution is encoded as it goes to each peer; the result is not
// quantized a second time, but in deterministic modes, to give the bits of the other
// all-reduces.
// Bytes sent per rank: (n-1) * wire(count) in one step: latency is one message, bandwidth
// cost grows with n, so it only pays for small messages. Transports: any.
#include "algorithms/algorithm.h"

namespace pycomm {

void oneshot_allreduce(const Context& cx, const Request& rq) {
  const Wire wire(cx, rq);
  const bool requantize = wire.coded() && rq.options.determinism != Determinism::Default;
  const SegmentChunks chunks{Segments{rq.count, 1, wire.allreduce_unit()}, wire.chunk(cx)};
  char* const result = requantize ? cx.workspace->get(Scratch::Own, wire.bytes(chunks.chunk)) : nullptr;
  auto* out = static_cast<char*>(rq.output);
  for (size_t c = 0; c < chunks.count(); ++c) {
    size_t first, len;
    chunks.piece(0, c, first, len);
    if (!requantize) {
      direct_reduce_step(cx, rq, wire, chunks, c, out + first * wire.es, Stage::Final);
      continue;
    }
    direct_reduce_step(cx, rq, wire, chunks, c, result, Stage::FinalEncoded);
    wire.take(cx, out + first * wire.es, result, len);
  }
}

}  // namespace pycomm
