// Hierarchical all-gather, for several nodes with equal numbers of ranks (L per node, N
// nodes): each segment crosses the slow inter-node links once per node that lacks it,
// and the fast intra-node links carry the rest.
// Steps:
//   1. inter-node ring all-gather of this rank's segment among the N ranks with its local
//      index (one ring per local index, all running at once): this rank then holds its
//      column's N segments, in node order, in scratch;
//   2. intra-node direct all-gather of the column: chunk by chunk, each rank sends its
//      column's segments to every peer of its node and puts each segment it receives, and
//      its own column's, at the segment's place in the output.
// Bytes sent per rank: inter (N-1)/N * wire(N * count); intra (L-1) * N * count *
// element_size. What leaves each node: (N-1)/N of the wire bytes of the whole output,
// against (n-1)/n for a flat ring, on whose every link the whole stream passes. Compressed:
// step 1 is, as the flat all-gathers (each segment quantized once by its owner; every rank
// decodes the same bits); step 2 moves the decoded values as they are (the links are fast,
// and re-encoding across blocks that start elsewhere would change the bits).
// Overlap: step 1 runs slice by slice on a helper thread while this thread runs step 2 on
// the slices it finished (across_nodes.h); slices are whole codec blocks, so each
// segment's blocks are the unsliced call's.
// Transports: shared memory within nodes, TCP between them (any works).
#include <algorithm>
#include <vector>

#include "algorithms/across_nodes.h"

namespace pycomm {

void hierarchical_allgather(const Context& cx, const Request& rq) {
  const Topology& topo = *cx.topology;
  const TwoLevel teams = two_level(cx);
  const Context &intra = teams.intra, &inter = teams.inter;
  const int local = intra.rank, L = intra.size;
  const size_t es = element_size(rq.dtype), count = rq.count, nodes = inter.size;
  const Slices slices(count, Wire(inter, rq).chunk(inter));
  // Slice s of every column segment, one after the other: [first * nodes, (first + len) * nodes).
  char* const gathered = cx.workspace->get(Scratch::Column, nodes * count * es);
  const auto* in = static_cast<const char*>(rq.input);

  auto across = [&](size_t s) {  // 1
    Request part = rq;
    part.input = in + slices.first(s) * es;
    part.output = gathered + nodes * slices.first(s) * es;
    part.count = slices.size(s);
    ring_allgather(inter, part);
  };

  Request within = rq;  // 2: nothing is compressed within a node
  within.options.compression = Compression::None;
  const size_t chunk = Wire(intra, within).chunk(intra);
  auto* out = static_cast<char*>(rq.output);
  auto within_node = [&](size_t s) {
    const size_t begin = slices.first(s), len = slices.size(s);
    for (size_t j = 0; j < nodes; ++j) {
      const char* const mine = gathered + (nodes * begin + j * len) * es;
      const std::vector<int>& on_node = topo.nodes[j];
      for (size_t off = 0; off < len; off += chunk) {
        const size_t bytes = std::min(chunk, len - off) * es, at = begin + off;
        for (int k = 1; k < L; ++k) send_copy(intra, mod(local + k, L), bytes, mine + off * es);
        cx.ops->copy(out + (on_node[local] * count + at) * es, mine + off * es, bytes);
        for (int k = 1; k < L; ++k) {
          const int p = mod(local - k, L);
          recv_frame(intra, p, bytes,
                     [&](const void* data) { cx.ops->copy(out + (on_node[p] * count + at) * es, data, bytes); });
        }
      }
    }
  };
  run_across_nodes(inter, slices.count, [](size_t) {}, across, within_node);
}

}  // namespace pycomm
