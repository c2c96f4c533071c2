// Hierarchical reduce-scatter, for several nodes with equal numbers of ranks (L per node,
// N nodes): the node's ranks add their contributions first, so that only one partial sum
// per node crosses the slow inter-node links.
// Steps:
//   1. intra-node direct reduce-scatter of the column: chunk by chunk, each rank sends
//      every peer of its node the pieces of the segments in that peer's column (the ranks
//      with its local index, one per node) and folds its own column's from the node's L
//      contributions, in local rank order, into partial sums kept in the accumulation
//      format (not rounded yet), one segment per node;
//   2. inter-node reduce-scatter of those N partial segments among the N ranks with this
//      rank's local index (one per local index, all running at once): a ring, or under a
//      codec the direct reduce-scatter (each node's partial quantized once);
//   3. finalize this rank's segment (AVG divides by the world size) and round it once
//      into the output.
// Bytes sent per rank: intra (L-1)/L * count * n * element_size; inter (N-1) * count *
// accum_size (or its encoding). What leaves each node: (N-1)/N of the whole input's wire
// bytes, against (n-1)/n for a flat ring. Partial sums are grouped by the node shape, so
// the deterministic modes, which fold each element from all contributions at once, do
// not take it (the plan says why). Transports: shared memory within nodes, TCP between
// them (any works). Overlap: step 2 runs slice by slice on a helper thread while this
// thread runs step 1 on later slices and step 3 on earlier ones (across_nodes.h); slices
// are whole codec blocks, so each segment's blocks are the unsliced call's.
#include <algorithm>
#include <vector>

#include "algorithms/across_nodes.h"
#include "core/dispatch.h"

namespace pycomm {

void hierarchical_reduce_scatter(const Context& cx, const Request& rq) {
  const Topology& topo = *cx.topology;
  const TwoLevel teams = two_level(cx);
  const Context &intra = teams.intra, &inter = teams.inter;
  const int local = intra.rank, L = intra.size;
  const size_t es = element_size(rq.dtype), ws = accum_size(rq.dtype), count = rq.count, nodes = inter.size;

  const Request across = across_partials(rq);  // 2
  const Slices slices(count, Wire(inter, across).chunk(inter));
  // Slice s of every column segment's partials, one after the other: [first * nodes,
  // (first + len) * nodes); this rank's segment reduced across nodes in `shard`.
  char* const partials = cx.workspace->get(Scratch::Partials, nodes * count * ws);
  char* const shard = cx.workspace->get(Scratch::Shard, count * ws);

  Request within = rq;  // 1: nothing is compressed within a node
  within.options.compression = Compression::None;
  const ReduceSpec within_spec = intra.spec(within);
  const size_t chunk = Wire(intra, within).chunk(intra);
  const auto* in = static_cast<const char*>(rq.input);
  auto within_node = [&](size_t s) {
    thread_local std::vector<Term> terms;  // kept: a small step allocates nothing
    terms.resize(L);
    const size_t begin = slices.first(s), len = slices.size(s);
    for (size_t j = 0; j < nodes; ++j) {
      const std::vector<int>& on_node = topo.nodes[j];
      char* const sums = partials + (nodes * begin + j * len) * ws;
      for (size_t off = 0; off < len; off += chunk) {
        const size_t n = std::min(chunk, len - off), bytes = n * es, at = begin + off;
        for (int k = 1; k < L; ++k) {  // local rank local+1 first: peers are not all served in the same order
          const int p = mod(local + k, L);
          send_copy(intra, p, bytes, in + (on_node[p] * count + at) * es);
        }
        for (int q = 0; q < L; ++q)
          terms[q] = q == local ? Term{in + (on_node[local] * count + at) * es, Form::Input}
                                : Term{begin_recv_frame(intra, q, bytes), Form::Input};
        cx.ops->reduce_terms(within_spec, Stage::Partial, sums + off * ws, terms.data(), L, n);
        for (int q = 0; q < L; ++q)
          if (q != local) end_recv_frame(intra, q);
      }
    }
  };
  auto across_nodes = [&](size_t s) {
    Request part = across;
    part.input = partials + nodes * slices.first(s) * ws;
    part.output = shard + slices.first(s) * ws;
    part.count = slices.size(s);
    (part.options.compression != Compression::None ? direct_reduce_scatter : ring_reduce_scatter)(inter, part);
  };
  auto finish = [&](size_t s) {  // 3
    const Term mine{shard + slices.first(s) * ws, Form::Partial};
    cx.ops->reduce_terms(cx.spec(rq), Stage::Final, static_cast<char*>(rq.output) + slices.first(s) * es, &mine, 1,
                         slices.size(s));
  };
  run_across_nodes(inter, slices.count, within_node, across_nodes, finish);
}

}  // namespace pycomm
