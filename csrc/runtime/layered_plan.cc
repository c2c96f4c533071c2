// The layered path's plan and its cost model (see layered_plan.h).
#include "runtime/layered_plan.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "algorithms/algorithm.h"
#include "core/dispatch.h"

namespace pycomm {
namespace {

// As natively (plan.cc): the hierarchical adds partial sums, which no deterministic mode does.
constexpr const char* kPartialSumsTravel =
    "it adds partial sums grouped by its shape; deterministic modes reduce each element from all contributions at once";

bool say(std::string* why, const std::string& reason) {
  if (why) *why = reason;
  return false;
}

}  // namespace

namespace {

// A pipeline of `parts` parts over resources that work at once (the mover's links, this
// rank's own steps): the busiest resource's whole time, the others' for one part (filling
// and draining), and the fixed costs of every part's collectives. On device memory every
// step is enqueued on one stream: nothing overlaps, and parts only add launches.
double pipelined_us(const std::vector<double>& resources_us, double collectives, size_t parts,
                    const LayeredPlanInput& in) {
  double total = 0, longest = 0;
  for (double r : resources_us) total += r, longest = std::max(longest, r);
  const double fixed = static_cast<double>(parts) * collectives * in.costs.collective_us;
  if (in.device_memory) return fixed + total;
  return fixed + longest + (total - longest) / static_cast<double>(parts);
}

// The cheapest number of parts, at most `most`, and its time.
std::pair<size_t, double> best_parts(const std::vector<double>& resources_us, double collectives, size_t most,
                                     const LayeredPlanInput& in) {
  std::pair<size_t, double> best{1, pipelined_us(resources_us, collectives, 1, in)};
  for (size_t p = 2; p <= std::min(most, in.device_memory ? size_t{1} : kMaxLayeredParts); ++p) {
    const double t = pipelined_us(resources_us, collectives, p, in);
    if (t < best.second) best = {p, t};
  }
  return best;
}

}  // namespace

bool hosts_in_blocks(const Topology& t, std::string* why) {
  if (t.node_count() < 2) return say(why, "it needs more than one host");
  if (!t.uniform()) return say(why, "it needs the same number of ranks on every host");
  if (t.ranks_per_node() < 2) return say(why, "with one rank per host it is the direct algorithm");
  for (int r = 1; r < t.world(); ++r)
    if (t.node_of[r] < t.node_of[r - 1]) return say(why, "it needs ranks numbered host by host");
  return true;
}

namespace {

bool layered_hierarchical_applies(const LayeredPlanInput& in, std::string* why) {
  const Topology& t = *in.topology;
  if (in.collective != Collective::AllReduce) return say(why, "the layered path runs all-reduce alone hierarchically");
  if (in.options.determinism != Determinism::Default) return say(why, kPartialSumsTravel);
  if (!hosts_in_blocks(t, why)) return false;
  // Uncompressed, the native hierarchical folds the host partials in ring order, which
  // equals any other order for two terms only.
  if (in.options.compression == Compression::None && t.node_count() > 2)
    return say(why, "uncompressed across more than 2 hosts the native hierarchical folds in ring order");
  return true;
}

}  // namespace

namespace {

// The candidates of plan_layered priced at `links`: the direct variants, then the
// hierarchical one where it applies.
std::vector<LayeredPlan> layered_candidates(const LayeredPlanInput& in, const LinkCosts& links, bool hierarchical) {
  const Topology& t = *in.topology;
  const double n = t.world(), N = t.node_count(), L = t.uniform() ? t.ranks_per_node() : 1;
  const bool coded = in.options.compression != Compression::None;
  const size_t unit = coded ? in.options.compression_block : 1;
  const double B = static_cast<double>(in.count * element_size(in.dtype));
  const double W = coded ? static_cast<double>(encoded_bytes(in.options.compression, unit, in.count)) : B;
  const bool all_reduce = in.collective == Collective::AllReduce;
  const size_t direct_units = all_reduce ? std::max<size_t>(1, in.count / (static_cast<size_t>(n) * unit)) : 1;
  // A rank's host work: its own steps (about 3 B of memory traffic for encode, fold and
  // decode, plus `copied` bytes) and the mover's traffic within the host (loopback or
  // shared-memory copies, made by the host's cores too), on its share of a core. On
  // device memory the kernels do the former and the share does not apply.
  auto host_us = [&](double copied, double within_bytes) {
    const double us = (3 * B + copied) / in.costs.own_bytes_per_us + within_bytes / links.intra.bytes_per_us;
    return in.device_memory ? us : us / std::min(1.0, in.costs.core_share);
  };
  auto planned = [&](Variant v, double link_us, double work_us, double collectives, size_t most) {
    LayeredPlan p;
    p.variant = v;
    std::tie(p.parts, p.predicted_us) = best_parts({link_us, work_us}, collectives, most, in);
    return p;
  };

  // Direct: all-to-all then all-gather (a ring on most movers), 2 (n-1)/n W per rank, of
  // which 2 (L-1)/n W within the host; across hosts the all-to-all sends L (n-L)/n W out
  // of each host, the ring (n-1)/n W. Pairwise, the gather sends what the all-to-all
  // sends, and neither copies.
  const double a2a_out = L * (n - L) / n * W;
  const bool pairwise = in.pairwise_mover && !in.device_memory && n > 1;
  std::vector<LayeredPlan> candidates = {
      planned(pairwise ? Variant::LayeredPairwise : Variant::LayeredDirect,
              N > 1 ? (a2a_out + (pairwise ? a2a_out : (n - 1) / n * W)) / links.inter.bytes_per_us : 0,
              host_us(0, 2 * (L - 1) / n * W), all_reduce ? 2 : 1, direct_units)};
  // The same results gathered in two levels: among the ranks of each local index across
  // hosts ((N-1)/N W out of each host), then within the host ((L-1)/L W to each rank). The
  // gather moves encoded bytes only, so the bits are the direct algorithm's in every mode.
  if (all_reduce && hosts_in_blocks(t, nullptr))
    candidates.push_back(planned(Variant::LayeredDirectHostGather,
                                 (a2a_out + (N - 1) / N * W) / links.inter.bytes_per_us,
                                 host_us(0, (L - 1) / n * W + (L - 1) / L * W), 3, direct_units));
  // Hierarchical: within the host 2 (L-1)/L B per rank, uncompressed, and one more copy of
  // the input (the shards' pieces gathered); across hosts 2 (N-1)/N W out of each host.
  if (hierarchical)
    candidates.push_back(planned(Variant::LayeredHierarchical, 2 * (N - 1) / N * W / links.inter.bytes_per_us,
                                 host_us(B, 2 * (L - 1) / L * B), 4,
                                 std::max<size_t>(1, ceil_div(in.count, static_cast<size_t>(L)) / unit)));
  return candidates;
}

LayeredPlan cheapest(const std::vector<LayeredPlan>& candidates, bool direct_only) {
  const LayeredPlan* best = nullptr;
  for (const LayeredPlan& p : candidates)
    if ((!direct_only || p.variant != Variant::LayeredHierarchical) && (!best || p.predicted_us < best->predicted_us))
      best = &p;
  return *best;
}

}  // namespace

size_t oneshot_bytes(const LayeredPlanInput& in) {
  const bool coded = in.options.compression != Compression::None;
  const auto wire = [&](size_t count) {
    return coded ? encoded_bytes(in.options.compression, in.options.compression_block, count)
                 : count * element_size(in.dtype);
  };
  if (in.collective != Collective::ReduceScatter || !coded) return wire(in.count);
  const size_t n = static_cast<size_t>(in.topology->world());
  return n * ceil_div(wire(in.count / n), 16) * 16;
}

LayeredPlan plan_layered(const LayeredPlanInput& in) {
  const Algorithm asked = in.options.algorithm;
  const bool of_the_path = asked == Algorithm::Auto || asked == Algorithm::OneShot || asked == Algorithm::TwoShot ||
                           asked == Algorithm::Hierarchical;
  const std::string not_of_the_path =
      of_the_path ? ""
                  : std::string(name_of(asked)) +
                        " is not an algorithm of the layered path (oneshot, twoshot, hierarchical, auto)";
  // One collective, the opening all-gather every call makes anyway: cheaper than any other
  // variant's two or more, and the same bits as the direct ones.
  if (in.topology->world() > 1 && oneshot_bytes(in) <= in.oneshot_capacity && asked != Algorithm::TwoShot &&
      asked != Algorithm::Hierarchical) {
    LayeredPlan p;
    p.variant = Variant::LayeredOneShot;
    p.predicted_us = in.costs.collective_us;
    p.fallback = not_of_the_path;
    return p;
  }
  std::string why;
  const bool hierarchical_ok = layered_hierarchical_applies(in, &why);
  const std::vector<LayeredPlan> candidates =
      layered_candidates(in, in.measured_links.value_or(in.costs.links), hierarchical_ok);
  // Hierarchical or direct (the bits) at the reference links; which direct variant and how
  // many parts (the same bits) at the measured ones.
  const bool hierarchical_by_reference =
      hierarchical_ok &&
      cheapest(layered_candidates(in, in.costs.links, true), false).variant == Variant::LayeredHierarchical;
  LayeredPlan chosen;
  switch (asked) {
    case Algorithm::Auto:
      return hierarchical_by_reference ? candidates.back() : cheapest(candidates, true);
    case Algorithm::TwoShot:
      return cheapest(candidates, true);
    case Algorithm::OneShot:
      chosen = cheapest(candidates, true);
      chosen.fallback = "oneshot cannot serve this call (" +
                        (in.topology->world() > 1
                             ? "its data does not fit the opening's " + std::to_string(in.oneshot_capacity) + " bytes"
                             : std::string("one rank opens with nothing")) +
                        ")";
      return chosen;
    case Algorithm::Hierarchical:
      if (hierarchical_ok) return candidates.back();
      chosen = cheapest(candidates, true);
      chosen.fallback = "hierarchical cannot serve this call (" + why + ")";
      return chosen;
    default:
      chosen = hierarchical_by_reference ? candidates.back() : cheapest(candidates, true);
      chosen.fallback = not_of_the_path;
      return chosen;
  }
}

}  // namespace pycomm
