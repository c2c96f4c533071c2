// Direct reduce-scatter ("oneshot" for reduce-scatter, and what an ordered or coded
// reduce-scatter runs): one step. Every rank sends piece s of its input straight to rank
// s, which reduces the n contributions in logical rank order in a single pass (the direct
// step), so each element is rounded once and its bits do not depend on arrival order.
// Coded: contributions travel encoded; in deterministic modes the result is quantized
// once more, like the all-reduce's, so that a shard equals the matching slice of the
// all-reduce where the shards start on a block of the tensor (count a multiple of the
// block).
// Bytes sent per rank: (n-1)/n * wire(total), in one step of n-1 concurrent messages.
// Transports: any; best where every pair has its own link (shared memory).
#include "algorithms/algorithm.h"

namespace pycomm {

void direct_reduce_scatter(const Context& cx, const Request& rq) {
  const Wire wire(cx, rq);
  const bool requantize = wire.coded() && rq.options.determinism != Determinism::Default;
  const SegmentChunks chunks{Segments{rq.count * cx.size, static_cast<size_t>(cx.size)}, wire.chunk(cx)};
  char* const result = requantize ? cx.workspace->get(Scratch::Own, wire.bytes(chunks.chunk)) : nullptr;
  auto* out = static_cast<char*>(rq.output);
  for (size_t c = 0; c < chunks.count(); ++c) {
    char* const piece = out + c * chunks.chunk * wire.es;
    if (!requantize) {
      direct_reduce_step(cx, rq, wire, chunks, c, piece, Stage::Final);
      continue;
    }
    size_t first, len;
    chunks.piece(cx.rank, c, first, len);
    direct_reduce_step(cx, rq, wire, chunks, c, result, Stage::FinalEncoded);
    if (len) wire.take(cx, piece, result, len);
  }
}

}  // namespace pycomm
