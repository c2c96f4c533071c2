// The cost model, alpha-beta per link class, with two regimes:
// - within one node (shared memory) a plan costs one latency per frame a rank waits for
//   (ranks may outnumber cores, so every wait can mean a peer has to be scheduled) plus
//   the memory traffic it causes per rank (bytes read and written by its copies and
//   reductions, counted from the algorithm's steps), at twice the measured stream rate
//   (the ping-pong that measures it reads and writes each byte on both sides);
// - across nodes a plan costs one inter-node latency per sequential step plus the bytes
//   that leave each node over its (shared) link, or that a rank sends, whichever is more.
// Bytes per rank and per node come from each algorithm's note in csrc/algorithms; ranks
// are numbered node by node.
#include "core/selection.h"

#include <algorithm>
#include <cmath>

namespace pycomm {
namespace {

// Deterministic modes reduce each element on one rank from all n contributions; the tree
// and hierarchical all-reduces add partial sums whose grouping depends on the shape.
constexpr const char* kPartialSumsTravel =
    "it adds partial sums grouped by its shape; deterministic modes reduce each element from all contributions at once";

double chunks(double bytes, size_t chunk_bytes) {
  return std::max(1.0, std::ceil(bytes / static_cast<double>(chunk_bytes)));
}

struct Plan {
  double frames = 0;          // frames a rank waits for, one after the other (one node)
  double traffic = 0;         // bytes of memory a rank reads and writes (one node)
  double steps = 0;           // sequential message steps (several nodes)
  double rank_bytes = 0;      // sent (and received) per rank
  double node_out_bytes = 0;  // leaving each node, over all its ranks
};

double time_us(const Plan& p, const LinkCosts& c, bool multi_node) {
  if (!multi_node) return p.frames * c.intra.latency_us + p.traffic / (2 * c.intra.bytes_per_us);
  return p.steps * c.inter.latency_us + std::max(p.node_out_bytes, p.rank_bytes) / c.inter.bytes_per_us;
}

}  // namespace

bool serves(Algorithm a, Collective collective, const Topology& topology, std::string* why,
            Determinism determinism) {
  const auto no = [&](const std::string& reason) {
    if (why) *why = reason;
    return false;
  };
  if (a == Algorithm::Auto) return true;
  if (!selects_algorithm(collective)) return no(std::string(name_of(collective)) + " has a single algorithm");
  switch (a) {
    case Algorithm::Auto: case Algorithm::Ring: case Algorithm::OneShot: return true;
    case Algorithm::TwoShot: case Algorithm::Tree:
      if (collective != Collective::AllReduce) return no(std::string(name_of(a)) + " serves allreduce only");
      if (a == Algorithm::Tree && determinism != Determinism::Default) return no(kPartialSumsTravel);
      return true;
    case Algorithm::Hierarchical:
      if (collective != Collective::AllReduce) return no("hierarchical serves allreduce only");
      if (determinism != Determinism::Default) return no(kPartialSumsTravel);
      if (topology.node_count() < 2) return no("hierarchical needs more than one node");
      if (!topology.uniform()) return no("hierarchical needs the same number of ranks on every node");
      return true;
  }
  return no("unknown algorithm");
}

double predicted_us(Algorithm a, const SelectionInput& in) {
  const Topology& t = *in.topology;
  const double n = t.world(), B = static_cast<double>(in.bytes);
  const bool multi = t.node_count() > 1;
  const double L = t.uniform() ? t.ranks_per_node() : 1, N = t.node_count();
  const size_t cb = in.chunk_bytes;
  const bool allreduce = in.collective == Collective::AllReduce;
  const double passes = allreduce ? 2 : 1;  // reduce-scatter and/or all-gather
  const double segment_chunks = chunks(B / n, cb), whole_chunks = chunks(allreduce ? B : B / n, cb);
  // Reduce-scatter or all-gather alone, ring or direct: the same copies and reductions.
  const double pass_traffic = (in.collective == Collective::AllGather ? 3 * n - 2 : 3 * n - 1) / n * B;
  Plan p;
  switch (a) {
    case Algorithm::Auto:
    case Algorithm::Ring:
      p.frames = passes * (n - 1) * segment_chunks;
      p.traffic = allreduce ? (6 * n - 3) / n * B : pass_traffic;
      p.steps = passes * (n - 1 + segment_chunks - 1);
      p.rank_bytes = passes * (n - 1) / n * B;
      p.node_out_bytes = p.rank_bytes;  // one ring link leaves each node
      break;
    case Algorithm::OneShot:
      p.frames = (n - 1) * whole_chunks;
      p.traffic = allreduce ? (2 * n + 1) * B : pass_traffic;
      p.steps = whole_chunks;
      p.rank_bytes = allreduce ? (n - 1) * B : (n - 1) / n * B;
      p.node_out_bytes = L * (n - L) * (allreduce ? B : B / n);
      break;
    case Algorithm::TwoShot:
      p.frames = 2 * (n - 1) * segment_chunks;
      p.traffic = (6 * n - 3) / n * B;  // as much as a ring: the same copies, fewer hops
      p.steps = 2 * segment_chunks;
      p.rank_bytes = 2 * (n - 1) / n * B;
      p.node_out_bytes = 2 * L * (n - L) / n * B;
      break;
    case Algorithm::Tree: {
      const double depth = std::floor(std::log2(std::max(n, 1.0))), half_chunks = chunks(B / 2, cb);
      p.frames = 4 * std::max(depth, 1.0) * half_chunks;  // up and down each tree: dependent hops
      p.traffic = n <= 2 ? 4.5 * B : 6 * B;
      p.steps = 2 * (depth + half_chunks - 1);
      p.rank_bytes = n <= 2 ? B : 1.5 * B;
      p.node_out_bytes = p.rank_bytes;
      break;
    }
    case Algorithm::Hierarchical: {
      if (!multi || L < 1) return INFINITY;
      // Intra-node direct reduce-scatter and all-gather, then the L inter-node rings share
      // each node's link: 2 (N-1)/N * B leaves every node.
      const double shard_chunks = chunks(B / L, cb);
      Plan intra;
      intra.frames = 2 * (L - 1) * shard_chunks;
      intra.traffic = (6 * L - 3) / L * B;
      Plan inter;
      inter.steps = 2 * (N - 1 + chunks(B / L / N, cb) - 1);
      inter.node_out_bytes = 2 * (N - 1) / N * B;
      return time_us(intra, in.costs, false) + time_us(inter, in.costs, true);
    }
  }
  if (n <= 1) return 0;
  return time_us(p, in.costs, multi);
}

Selection select_algorithm(const SelectionInput& in) {
  Selection s;
  std::string why;
  if (in.requested != Algorithm::Auto) {
    if (serves(in.requested, in.collective, *in.topology, &why, in.determinism)) {
      s.algorithm = in.requested;
      return s;
    }
    s.fallback = std::string(name_of(in.requested)) + " cannot serve this call (" + why + ")";
  } else if (in.device_memory && in.topology->nodes.size() == 1) {
    const bool twoshot = in.collective == Collective::AllReduce && in.bytes > kDeviceOneShotBytes;
    s.algorithm = twoshot ? Algorithm::TwoShot : Algorithm::OneShot;
    return s;
  }
  double best = INFINITY;
  for (Algorithm a : {Algorithm::TwoShot, Algorithm::OneShot, Algorithm::Ring, Algorithm::Tree, Algorithm::Hierarchical}) {
    if (!serves(a, in.collective, *in.topology, nullptr, in.determinism)) continue;
    const double t = predicted_us(a, in);
    if (t < best) {
      best = t;
      s.algorithm = a;
    }
  }
  return s;
}

}  // namespace pycomm
