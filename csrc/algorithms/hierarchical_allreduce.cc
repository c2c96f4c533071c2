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
// works). Phases run one after the other over the whole buffer; each is pipelined.
#include <vector>

#include "algorithms/algorithm.h"
#include "core/dispatch.h"
#include "core/error.h"

namespace pycomm {

void hierarchical_allreduce(const Context& cx, const Request& rq) {
  const Topology& topo = *cx.topology;
  const int me = cx.group_rank(cx.rank);
  const std::vector<int>& node = topo.nodes[topo.node_of[me]];
  const int local = static_cast<int>(std::find(node.begin(), node.end(), me) - node.begin());
  std::vector<int> peers_at_local;  // the ranks with my local index, one per node
  for (const auto& n : topo.nodes) peers_at_local.push_back(n[local]);
  const Context intra = cx.team(node), inter = cx.team(peers_at_local);

  const size_t es = element_size(rq.dtype), ws = accum_size(rq.dtype);
  const SegmentChunks shards{Segments{rq.count, node.size()}, cx.chunk_bytes / es};
  const size_t shard_len = shards.seg.length(local);
  std::vector<char> partial(shard_len * ws);

  for (size_t c = 0; c < shards.count(); ++c)  // 1
    direct_reduce_scatter_chunk(intra, rq, shards, c, partial.data(), Stage::Partial);

  Request across = rq;  // 2: partials combine with the operator alone
  across.dtype = accumulation_type(rq.dtype);
  const ReduceKind k = rq.reduction.kind;
  across.reduction = Reduction{k == ReduceKind::Avg || k == ReduceKind::PremulSum ? ReduceKind::Sum : k, 1.0};
  across.input = across.output = partial.data();
  across.count = shard_len;
  ring_allreduce(inter, across);

  const Term shard{partial.data(), Form::Partial};  // 3
  char* out = static_cast<char*>(rq.output);
  cx.ops->reduce_terms(cx.spec(rq), Stage::Final, out + shards.seg.begin(local) * es, &shard, 1, shard_len);

  for (size_t c = 0; c < shards.count(); ++c) direct_all_gather_chunk(intra, shards, c, out, es);  // 4
}

}  // namespace pycomm
