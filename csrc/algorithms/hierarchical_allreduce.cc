// Hierarchical all-reduce, for several nodes with equal numbers of ranks (L per node, N
// nodes): the fast intra-node links carry most of the traffic, the slow inter-node links
// only 1/L of it.
// Steps:
//   1. intra-node direct reduce-scatter: local rank l ends with shard l of its node's sum,
//      kept in the accumulation format (not rounded yet);
//   2. inter-node ring all-reduce of shard l among the N ranks with local index l (one
//      ring per local index, all running at once), still in the accumulation format;
//   3. finalize shard l (AVG divides by the world size) and round it once into the output;
//   4. intra-node direct all-gather of the shards.
// Bytes sent per rank: intra 2 (L-1)/L * count * element_size; inter 2 (N-1)/N * count/L
// * accum_size, against 2 (n-1)/n * count * accum_size for a flat ring whose every link
// carries the full stream. Transports: shared memory within nodes, TCP between them (any
// works). Compressed: only step 2 is, on the node's partial sums (each quantized once,
// the result once more; see algorithm.h); the intra-node steps stay exact.
//
// Overlap: the inter-node phase (step 2) runs slice by slice on a helper thread while this
// thread runs step 1 on later slices and steps 3-4 on earlier ones (across_nodes.h).
#include <vector>

#include "algorithms/across_nodes.h"
#include "core/dispatch.h"

namespace pycomm {

void hierarchical_allreduce(const Context& cx, const Request& rq) {
  const TwoLevel teams = two_level(cx);
  const Context &intra = teams.intra, &inter = teams.inter;
  const int local = intra.rank;

  const size_t es = element_size(rq.dtype), ws = accum_size(rq.dtype);
  const SegmentChunks shards{Segments{rq.count, static_cast<size_t>(intra.size)}, cx.chunk_bytes / es};
  const size_t shard_len = shards.seg.length(local);
  char* const partial = cx.workspace->get(Scratch::Partials, shard_len * ws);  // fp32 partials of my shard
  const Slices slices(shards.seg.length(0), shards.chunk);  // segment 0 is the longest
  auto elements_of = [&](size_t s, size_t& first, size_t& len) {
    first = std::min(shard_len, slices.first(s));
    len = std::min(shard_len, slices.first(s) + slices.size(s)) - first;
  };
  auto chunks_of = [&](size_t s, size_t& begin, size_t& end) {
    begin = slices.first(s) / shards.chunk;
    end = ceil_div(slices.first(s) + slices.size(s), shards.chunk);
  };

  Request within = rq;  // within a node nothing is compressed: the links are fast
  within.options.compression = Compression::None;
  const Request across = across_partials(rq);
  auto reduce_across = [&](size_t s) {  // 2
    size_t first, len;
    elements_of(s, first, len);
    Request part = across;
    part.input = part.output = partial + first * ws;
    part.count = len;
    (part.options.compression != Compression::None ? direct_ring_allreduce : ring_allreduce)(inter, part);
  };
  char* out = static_cast<char*>(rq.output);
  const Wire plain(intra, within);
  auto scatter = [&](size_t s) {  // 1
    size_t begin, end;
    chunks_of(s, begin, end);
    for (size_t c = begin; c < end; ++c)
      direct_reduce_step(intra, within, plain, shards, c, partial + c * shards.chunk * ws, Stage::Partial);
  };
  auto finish = [&](size_t s) {  // 3, 4
    size_t first, len;
    elements_of(s, first, len);
    const Term shard{partial + first * ws, Form::Partial};
    cx.ops->reduce_terms(cx.spec(rq), Stage::Final, out + (shards.seg.begin(local) + first) * es, &shard, 1, len);
    size_t begin, end;
    chunks_of(s, begin, end);
    for (size_t c = begin; c < end; ++c) {
      size_t mine, mine_len;
      shards.piece(local, c, mine, mine_len);
      direct_gather_step(intra, plain, shards, c, out + mine * es, out);
    }
  };
  run_across_nodes(inter, slices.count, scatter, reduce_across, finish);
}

}  // namespace pycomm
