// The cost model: alpha-beta per link class. A plan's time is its sequential message
// steps times the latency of the slowest link class it crosses, plus its bandwidth time:
// the bytes each rank moves over intra-node links, or the bytes that leave each node over
// its (shared) inter-node link, whichever takes longer. Bytes per rank and per node come
// from each algorithm's note in csrc/algorithms; ranks are numbered node by node.
#include "core/selection.h"

#include <algorithm>
#include <cmath>

namespace pycomm {
namespace {

double chunks(double bytes, size_t chunk_bytes) {
  return std::max(1.0, std::ceil(bytes / static_cast<double>(chunk_bytes)));
}

struct Plan {
  double steps = 0;          // sequential message latencies
  double rank_bytes = 0;     // sent (and received) per rank
  double node_out_bytes = 0; // leaving each node, over all its ranks
};

double time_us(const Plan& p, const LinkCosts& c, bool multi_node) {
  const LinkCost& flat = multi_node ? c.inter : c.intra;
  const double intra = multi_node ? 0 : p.rank_bytes / c.intra.bytes_per_us;
  const double cross = multi_node ? std::max(p.node_out_bytes, p.rank_bytes) / c.inter.bytes_per_us : 0;
  return p.steps * flat.latency_us + std::max(intra, cross);
}

}  // namespace

bool serves(Algorithm a, Collective collective, const Topology& topology, std::string* why) {
  const auto no = [&](const std::string& reason) {
    if (why) *why = reason;
    return false;
  };
  const bool reducing_or_gathering = collective == Collective::AllReduce || collective == Collective::ReduceScatter ||
                                     collective == Collective::AllGather;
  if (a == Algorithm::Auto) return true;
  if (!reducing_or_gathering) return no(std::string(name_of(collective)) + " has a single algorithm");
  switch (a) {
    case Algorithm::Auto: case Algorithm::Ring: case Algorithm::OneShot: return true;
    case Algorithm::TwoShot: case Algorithm::Tree:
      if (collective != Collective::AllReduce) return no(std::string(name_of(a)) + " serves allreduce only");
      return true;
    case Algorithm::Hierarchical:
      if (collective != Collective::AllReduce) return no("hierarchical serves allreduce only");
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
  Plan p;
  switch (a) {
    case Algorithm::Auto:
    case Algorithm::Ring:
      p.steps = passes * (n - 1 + chunks(B / n, cb) - 1);
      p.rank_bytes = passes * (n - 1) / n * B;
      p.node_out_bytes = p.rank_bytes;  // one ring link leaves each node
      break;
    case Algorithm::OneShot:
      p.steps = chunks(allreduce ? B : B / n, cb);
      p.rank_bytes = allreduce ? (n - 1) * B : (n - 1) / n * B;
      p.node_out_bytes = L * (n - L) * (allreduce ? B : B / n);
      break;
    case Algorithm::TwoShot:
      p.steps = 2 * chunks(B / n, cb);
      p.rank_bytes = 2 * (n - 1) / n * B;
      p.node_out_bytes = 2 * L * (n - L) / n * B;
      break;
    case Algorithm::Tree: {
      const double depth = std::floor(std::log2(std::max(n, 1.0)));
      p.steps = 2 * (depth + chunks(B / 2, cb) - 1);
      p.rank_bytes = n <= 2 ? B : 1.5 * B;
      p.node_out_bytes = p.rank_bytes;
      break;
    }
    case Algorithm::Hierarchical: {
      if (!multi || L < 1) return INFINITY;
      const double intra_steps = 2 * chunks(B / L, cb), inter_steps = 2 * (N - 1 + chunks(B / L / N, cb) - 1);
      return intra_steps * in.costs.intra.latency_us + inter_steps * in.costs.inter.latency_us +
             2 * (L - 1) / L * B / in.costs.intra.bytes_per_us + 2 * (N - 1) / N * B / in.costs.inter.bytes_per_us;
    }
  }
  if (n <= 1) return 0;
  return time_us(p, in.costs, multi);
}

Selection select_algorithm(const SelectionInput& in) {
  Selection s;
  std::string why;
  if (in.requested != Algorithm::Auto) {
    if (serves(in.requested, in.collective, *in.topology, &why)) {
      s.algorithm = in.requested;
      return s;
    }
    s.fallback = std::string(name_of(in.requested)) + " cannot serve this call (" + why + ")";
  }
  double best = INFINITY;
  for (Algorithm a : {Algorithm::Ring, Algorithm::TwoShot, Algorithm::OneShot, Algorithm::Tree, Algorithm::Hierarchical}) {
    if (!serves(a, in.collective, *in.topology, nullptr)) continue;
    const double t = predicted_us(a, in);
    if (t < best) {
      best = t;
      s.algorithm = a;
    }
  }
  return s;
}

}  // namespace pycomm
