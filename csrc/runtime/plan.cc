// The plan table and its cost model, alpha-beta per link class, with two regimes:
// - within one node (shared memory) a variant costs one latency per frame a rank waits
//   for (ranks may outnumber cores, so every wait can mean a peer has to be scheduled)
//   plus the memory traffic it causes per rank (bytes read and written by its copies and
//   reductions, counted from the algorithm's steps), at twice the measured stream rate
//   (the ping-pong that measures it reads and writes each byte on both sides);
// - across nodes a variant costs one inter-node latency per sequential step plus the
//   bytes that leave each node over its (shared) link, or that a rank sends, whichever is
//   more. A direct step's frames from other nodes count one step each: they travel at
//   once, but a rank takes them one after the other, so sending to every rank does not
//   cost one latency at any scale.
// Bytes per rank and per node come from each algorithm's note in csrc/algorithms; ranks
// are numbered node by node. Compressed calls are priced at their encoded bytes on the
// wire (codec blocks included) and at their uncompressed memory traffic.
#include "runtime/plan.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "core/dispatch.h"

namespace pycomm {
namespace {

// Deterministic modes reduce each element on one rank from all n contributions; the tree
// and hierarchical all-reduces add partial sums whose grouping depends on the shape.
constexpr const char* kPartialSumsTravel =
    "it adds partial sums grouped by its shape; deterministic modes reduce each element from all contributions at once";

double chunks(double bytes, size_t chunk_bytes) {
  return std::max(1.0, std::ceil(bytes / static_cast<double>(chunk_bytes)));
}

// What a variant costs one rank, in the quantities of the two regimes above.
struct Cost {
  double frames = 0;          // frames a rank waits for, one after the other (one node)
  double traffic = 0;         // bytes of memory a rank reads and writes (one node)
  double steps = 0;           // sequential message steps (several nodes)
  double rank_bytes = 0;      // sent (and received) per rank
  double node_out_bytes = 0;  // leaving each node, over all its ranks

  Cost operator+(const Cost& o) const {
    return {frames + o.frames, traffic + o.traffic, steps + o.steps, rank_bytes + o.rank_bytes,
            node_out_bytes + o.node_out_bytes};
  }
};

double time_us(const Cost& c, const LinkCosts& links, bool multi_node) {
  if (!multi_node) return c.frames * links.intra.latency_us + c.traffic / (2 * links.intra.bytes_per_us);
  return c.steps * links.inter.latency_us + std::max(c.node_out_bytes, c.rank_bytes) / links.inter.bytes_per_us;
}

bool coded(const PlanInput& in) { return in.options.compression != Compression::None; }
bool ordered(const PlanInput& in) { return in.options.determinism != Determinism::Default; }

// The sizes a cost is computed from: B in memory, W on the wire (B, or its encoding).
struct Sizes {
  double n, L, N;  // ranks, ranks per node (1 when nodes differ), nodes
  double B, W;
  size_t chunk;
  explicit Sizes(const PlanInput& in) {
    const Topology& t = *in.topology;
    n = t.world();
    L = t.uniform() ? t.ranks_per_node() : 1;
    N = t.node_count();
    B = static_cast<double>(in.bytes);
    W = B;
    if (in.options.compression != Compression::None) {
      const double count = B / static_cast<double>(element_size(in.dtype));
      W = static_cast<double>(
          encoded_bytes(in.options.compression, in.options.compression_block, static_cast<size_t>(count)));
    }
    chunk = in.chunk_bytes;
  }
};

// The passes the variants are made of. A pass is a reduce-scatter or an all-gather of
// the whole buffer (B in memory, W on the wire): it costs the same copies and reductions
// ring or direct; the ring waits for n-1 frames per chunk in n-1 dependent steps, the
// direct pass for n-1 frames per chunk, held at once, in one step.
Cost ring_pass(const Sizes& s, bool gather) {
  const double segment_chunks = chunks(s.W / s.n, s.chunk);
  Cost c;
  c.frames = (s.n - 1) * segment_chunks;
  c.traffic = (gather ? 3 * s.n - 2 : 3 * s.n - 1) / s.n * s.B;
  c.steps = s.n - 1 + segment_chunks - 1;
  c.rank_bytes = (s.n - 1) / s.n * s.W;
  c.node_out_bytes = c.rank_bytes;  // one ring link leaves each node
  return c;
}

Cost direct_pass(const Sizes& s, bool gather) {
  const double segment_chunks = chunks(s.W / s.n, s.chunk);
  Cost c;
  c.frames = (s.n - 1) * segment_chunks;
  c.traffic = (gather ? 3 * s.n - 2 : 3 * s.n - 1) / s.n * s.B;
  c.steps = std::max(1.0, s.n - s.L) * segment_chunks;
  c.rank_bytes = (s.n - 1) / s.n * s.W;
  c.node_out_bytes = s.L * (s.n - s.L) / s.n * s.W;
  return c;
}

// All-reduce traffic of a reduce-scatter and an all-gather: (6n-3)/n B, the same copies
// whichever pass shape carries them.
Cost two_passes(Cost a, Cost b, const Sizes& s) {
  Cost c = a + b;
  c.traffic = (6 * s.n - 3) / s.n * s.B;
  return c;
}

double ring_allreduce_us(const PlanInput& in) {
  const Sizes s(in);
  return time_us(two_passes(ring_pass(s, false), ring_pass(s, true), s), in.costs, s.N > 1);
}
double direct_ring_allreduce_us(const PlanInput& in) {
  const Sizes s(in);
  return time_us(two_passes(direct_pass(s, false), ring_pass(s, true), s), in.costs, s.N > 1);
}
double twoshot_allreduce_us(const PlanInput& in) {
  const Sizes s(in);
  return time_us(two_passes(direct_pass(s, false), direct_pass(s, true), s), in.costs, s.N > 1);
}
double oneshot_allreduce_us(const PlanInput& in) {
  const Sizes s(in);
  const double whole_chunks = chunks(s.W, s.chunk);
  Cost c;
  c.frames = (s.n - 1) * whole_chunks;
  c.traffic = (2 * s.n + 1) * s.B;
  c.steps = std::max(1.0, s.n - s.L) * whole_chunks;
  c.rank_bytes = (s.n - 1) * s.W;
  c.node_out_bytes = s.L * (s.n - s.L) * s.W;
  return time_us(c, in.costs, s.N > 1);
}
// One kernel per rank that waits for its peers' flags once and reads their inputs.
double flags_allreduce_us(const PlanInput& in) {
  const Sizes s(in);
  Cost c;
  c.frames = 1;
  c.traffic = (s.n + 1) * s.B;
  return time_us(c, in.costs, false);
}
double tree_allreduce_us(const PlanInput& in) {
  // Partials go up in the accumulation format, the result comes down as W.
  const Sizes s(in);
  const double depth = std::floor(std::log2(std::max(s.n, 1.0))), half_chunks = chunks(s.B / 2, s.chunk);
  Cost c;
  c.frames = 4 * std::max(depth, 1.0) * half_chunks;  // up and down each tree: dependent hops
  c.traffic = s.n <= 2 ? 4.5 * s.B : 6 * s.B;
  c.steps = 2 * (depth + half_chunks - 1);
  c.rank_bytes = (s.n <= 2 ? 1.0 : 1.5) * (s.B + s.W) / 2;
  c.node_out_bytes = c.rank_bytes;
  return time_us(c, in.costs, s.N > 1);
}
// The butterfly's exchanges at a distance of at least a node's ranks leave the node, from
// every rank of it; `step_bytes(d)` is what a rank sends at distance d.
template <class StepBytes>
double butterfly_node_out(const Sizes& s, double p, StepBytes step_bytes) {
  double out = 0;
  for (double d = p / 2; d >= 1; d /= 2)
    if (d >= s.L) out += s.L * step_bytes(d);
  return out;
}
double recursive_doubling_allreduce_us(const PlanInput& in) {
  // Per chunk, log2 p exchanges of a whole partial (two more where n is not a power of
  // two), each reading two operands and writing one.
  const Sizes s(in);
  const double butterfly = std::floor(std::log2(std::max(s.n, 1.0))), p = std::exp2(butterfly);
  const double partial = s.B / element_size(in.dtype) * accum_size(in.dtype);  // what a frame carries
  const double exchanges = butterfly + (s.n > p ? 2 : 0), per_chunk = chunks(partial, s.chunk);
  Cost c;
  c.frames = exchanges * per_chunk;
  c.traffic = 3 * exchanges * s.B;
  c.steps = exchanges * per_chunk;
  c.rank_bytes = exchanges * s.B;
  c.node_out_bytes = s.L > 1 ? butterfly_node_out(s, p, [&](double) { return s.B; }) : c.rank_bytes;
  return time_us(c, in.costs, s.N > 1);
}
double recursive_halving_reduce_scatter_us(const PlanInput& in) {
  // Plain: log2 p exchanges of halving partial sums (the accumulation format), (p-1)/p of
  // the buffer in all. Ordered or coded: half of the contributions held, the wire buffer's
  // size, at each exchange. Where n is not a power of two, a pair's first rank hands its
  // buffer over first and takes its segment back: two steps more.
  const Sizes s(in);
  const double butterfly = std::floor(std::log2(std::max(s.n, 1.0))), p = std::exp2(butterfly);
  const bool partials = !coded(in) && !ordered(in);
  const double partial = s.B / element_size(in.dtype) * accum_size(in.dtype);
  const auto step_bytes = [&](double d) { return partials ? partial * d / p : s.W / 2; };
  Cost c;
  for (double d = p / 2; d >= 1; d /= 2) {
    c.frames += chunks(step_bytes(d), s.chunk);
    c.rank_bytes += step_bytes(d);
  }
  if (s.n > p) {
    c.frames += chunks(partials ? partial : s.W, s.chunk) + chunks(s.B / s.n, s.chunk);
    c.rank_bytes += (partials ? partial : s.W) + s.B / s.n;
  }
  c.steps = c.frames;
  c.traffic = partials ? 3 * s.B : 3 * (c.rank_bytes / s.W) * s.B + (s.n + 1) / s.n * s.B;
  c.node_out_bytes = s.L > 1 ? butterfly_node_out(s, p, step_bytes) : c.rank_bytes;
  return time_us(c, in.costs, s.N > 1);
}
double bruck_allgather_us(const PlanInput& in) {
  // ceil(log2 n) steps, min(d, n-d) segments at distance d: (n-1)/n of the wire buffer in
  // all. At distance d < L, d of a node's L ranks send to the node before.
  const Sizes s(in);
  Cost c;
  for (double d = 1; d < s.n; d *= 2) {
    const double bytes = std::min(d, s.n - d) * s.W / s.n;
    c.frames += chunks(bytes, s.chunk);
    c.node_out_bytes += s.L * std::min(1.0, d / s.L) * bytes;
  }
  c.steps = c.frames;
  c.traffic = (3 * s.n - 2) / s.n * s.B;
  c.rank_bytes = (s.n - 1) / s.n * s.W;
  return time_us(c, in.costs, s.N > 1);
}
double hierarchical_allreduce_us(const PlanInput& in) {
  // Intra-node direct reduce-scatter and all-gather (uncompressed), then the L
  // inter-node rings share each node's link: 2 (N-1)/N * W leaves every node.
  const Sizes s(in);
  const double shard_chunks = chunks(s.B / s.L, s.chunk);
  Cost intra;
  intra.frames = 2 * (s.L - 1) * shard_chunks;
  intra.traffic = (6 * s.L - 3) / s.L * s.B;
  Cost inter;
  inter.steps = 2 * (s.N - 1 + chunks(s.W / s.L / s.N, s.chunk) - 1);
  inter.node_out_bytes = 2 * (s.N - 1) / s.N * s.W;
  return time_us(intra, in.costs, false) + time_us(inter, in.costs, true);
}
double hierarchical_reduce_scatter_us(const PlanInput& in) {
  // Within the node, each rank sends (L-1)/L of its input and folds its column's segments;
  // the L inter-node rings of the node partials share each node's link: (N-1)/N * W.
  const Sizes s(in);
  Cost intra;
  intra.frames = (s.L - 1) * s.N * chunks(s.B / s.n, s.chunk);
  intra.traffic = 3 * s.B;
  Cost inter;
  inter.steps = s.N - 1 + chunks(s.W / s.n, s.chunk) - 1;
  inter.node_out_bytes = (s.N - 1) / s.N * s.W;
  return time_us(intra, in.costs, false) + time_us(inter, in.costs, true);
}
double hierarchical_allgather_us(const PlanInput& in) {
  // The L inter-node rings of the ranks' own segments share each node's link: (N-1)/N * W
  // leaves every node. Within it, each rank sends its column's N segments to L-1 peers.
  const Sizes s(in);
  const double segment_chunks = chunks(s.W / s.n, s.chunk);
  Cost inter;
  inter.steps = s.N - 1 + segment_chunks - 1;
  inter.node_out_bytes = (s.N - 1) / s.N * s.W;
  Cost intra;
  intra.frames = (s.L - 1) * s.N * chunks(s.B / s.n, s.chunk);
  intra.traffic = 3 * s.B;
  return time_us(intra, in.costs, false) + time_us(inter, in.costs, true);
}
double ring_pass_us(const PlanInput& in) {
  const Sizes s(in);
  return time_us(ring_pass(s, in.collective == Collective::AllGather), in.costs, s.N > 1);
}
double direct_pass_us(const PlanInput& in) {
  const Sizes s(in);
  return time_us(direct_pass(s, in.collective == Collective::AllGather), in.costs, s.N > 1);
}
double not_modelled_us(const PlanInput&) { return 0; }

// When a row applies. `why`, where given, receives the reason it does not.
using AppliesFn = bool (*)(const PlanInput& in, std::string* why);

bool say(std::string* why, const std::string& reason) {
  if (why) *why = reason;
  return false;
}

bool always(const PlanInput&, std::string*) { return true; }
bool named_source(const PlanInput& in, std::string*) { return !in.from_any_source; }
bool any_source(const PlanInput& in, std::string*) { return in.from_any_source; }
bool in_host_memory(const PlanInput& in, std::string*) { return !in.device_memory; }
bool in_device_memory(const PlanInput& in, std::string*) { return in.device_memory; }
template <AppliesFn A, AppliesFn B>
bool both(const PlanInput& in, std::string* why) {
  return A(in, why) && B(in, why);
}
bool plain_unordered(const PlanInput& in, std::string*) { return !coded(in) && !ordered(in); }
bool ordered_or_coded(const PlanInput& in, std::string*) { return coded(in) || ordered(in); }
bool fits_device_team(const PlanInput& in, std::string*) {
  return !coded(in) && in.device_memory && in.bytes <= in.device_team_bytes;
}
bool tree_applies(const PlanInput& in, std::string* why) { return !ordered(in) || say(why, kPartialSumsTravel); }
// Measured on one host, 4 ranks, 4 KiB: over shared memory the one-shot, whose frames all
// arrive at once, takes 0.8x recursive doubling's time; over TCP, where each frame costs
// its receiver a few system calls, recursive doubling takes 0.8x the one-shot's.
bool recursive_doubling_applies(const PlanInput& in, std::string* why) {
  return tree_applies(in, why) && (in.network || say(why, "recursive doubling serves groups whose frames cross TCP"));
}
// The same measurement for reduce-scatter and all-gather (4 and 8 ranks, 4 KiB): over
// shared memory the direct pass takes 0.7-0.9x the log-step time, over TCP the log-step
// 0.6-0.8x the direct one (0.95-1.07x for a 4-rank all-gather). The plan picks the log-step
// variants where frames cross TCP; asked for by name, they run anywhere.
bool log_step_applies(const PlanInput& in, std::string* why) {
  return in.network || in.options.algorithm == Algorithm::Tree ||
         say(why, "the log-step variants are chosen where frames cross TCP");
}
bool two_level(const PlanInput& in, std::string* why) {
  if (in.topology->node_count() < 2) return say(why, "hierarchical needs more than one node");
  if (!in.topology->uniform()) return say(why, "hierarchical needs the same number of ranks on every node");
  return true;
}
bool hierarchical_applies(const PlanInput& in, std::string* why) {
  return (!ordered(in) || say(why, kPartialSumsTravel)) && two_level(in, why);
}

struct Row {
  Collective collective;
  Algorithm family;  // what a request names to get this row; Auto: the collective's only one
  Variant variant;
  AppliesFn applies;
  double (*cost_us)(const PlanInput& in);
  RunFn run;
};

void run_on_device_team(const Context& cx, const Request& rq) {
  cx.device_team->all_reduce(cx.spec(rq), rq.output, rq.input, rq.count, cx.deadline, rq.stream);
}

// One row per variant a family can run as; within a family the cheapest row that applies
// runs (ties: the first). Each algorithm serves plain and coded calls of its shape.
const std::vector<Row>& rows() {
  using C = Collective;
  using A = Algorithm;
  using V = Variant;
  static const std::vector<Row> table = {
      {C::AllReduce, A::Ring, V::Ring, plain_unordered, ring_allreduce_us, ring_allreduce},
      {C::AllReduce, A::Ring, V::DirectRing, ordered_or_coded, direct_ring_allreduce_us, direct_ring_allreduce},
      {C::AllReduce, A::OneShot, V::OneShotFlags, fits_device_team, flags_allreduce_us, run_on_device_team},
      {C::AllReduce, A::OneShot, V::OneShot, always, oneshot_allreduce_us, oneshot_allreduce},
      {C::AllReduce, A::TwoShot, V::TwoShot, always, twoshot_allreduce_us, twoshot_allreduce},
      {C::AllReduce, A::Tree, V::RecursiveDoubling, recursive_doubling_applies, recursive_doubling_allreduce_us,
       recursive_doubling_allreduce},
      {C::AllReduce, A::Tree, V::Tree, tree_applies, tree_allreduce_us, tree_allreduce},
      {C::AllReduce, A::Hierarchical, V::Hierarchical, hierarchical_applies, hierarchical_allreduce_us,
       hierarchical_allreduce},
      // Compressed or ordered reduce-scatters send each contribution straight to its owner.
      {C::ReduceScatter, A::Ring, V::Ring, plain_unordered, ring_pass_us, ring_reduce_scatter},
      {C::ReduceScatter, A::Ring, V::Direct, ordered_or_coded, direct_pass_us, direct_reduce_scatter},
      {C::ReduceScatter, A::OneShot, V::Direct, always, direct_pass_us, direct_reduce_scatter},
      {C::ReduceScatter, A::Tree, V::RecursiveHalving, log_step_applies, recursive_halving_reduce_scatter_us,
       recursive_halving_reduce_scatter},
      {C::ReduceScatter, A::Hierarchical, V::Hierarchical, hierarchical_applies, hierarchical_reduce_scatter_us,
       hierarchical_reduce_scatter},
      {C::AllGather, A::Ring, V::Ring, always, ring_pass_us, ring_allgather},
      {C::AllGather, A::OneShot, V::Direct, always, direct_pass_us, direct_allgather},
      {C::AllGather, A::Tree, V::Bruck, log_step_applies, bruck_allgather_us, bruck_allgather},
      {C::AllGather, A::Hierarchical, V::Hierarchical, two_level, hierarchical_allgather_us, hierarchical_allgather},
      {C::Broadcast, A::Auto, V::Chain, always, not_modelled_us, chain_broadcast},
      {C::Reduce, A::Auto, V::Chain, always, not_modelled_us, chain_reduce},
      {C::Gather, A::Auto, V::Direct, always, not_modelled_us, direct_gather},
      {C::Scatter, A::Auto, V::Direct, always, not_modelled_us, direct_scatter},
      {C::AllToAll, A::Auto, V::Pairwise, always, not_modelled_us, pairwise_alltoall},
      // Point-to-point on device memory runs over the host channels, its frames copied
      // between that memory and their slots by the device's ops (Communicator::use_device):
      // a pair has no device channel, those being set up by a collective that every rank
      // joins. A frame's stamp carries its sender's own variant, which no recv compares
      // (a message matches by tag, count and dtype: p2p.h), so a rank on device memory
      // and one on host memory exchange messages as two of either kind do.
      {C::Send, A::Auto, V::P2P, in_host_memory, not_modelled_us, p2p_send},
      {C::Send, A::Auto, V::P2PViaHost, in_device_memory, not_modelled_us, p2p_send},
      {C::Recv, A::Auto, V::P2P, both<named_source, in_host_memory>, not_modelled_us, p2p_recv},
      {C::Recv, A::Auto, V::P2P, both<any_source, in_host_memory>, not_modelled_us, p2p_recv_from_any},
      {C::Recv, A::Auto, V::P2PViaHost, both<named_source, in_device_memory>, not_modelled_us, p2p_recv},
      {C::Recv, A::Auto, V::P2PViaHost, both<any_source, in_device_memory>, not_modelled_us, p2p_recv_from_any},
      {C::Barrier, A::Auto, V::Dissemination, always, not_modelled_us, dissemination_barrier},
  };
  return table;
}

Plan plan_of(const Row& row, const PlanInput& in) {
  Plan p;
  p.algorithm = row.family;
  p.variant = row.variant;
  if (in.topology->world() > 1) {
    PlanInput priced = in;
    if (!ordered(in)) priced.costs = in.reference_costs;
    p.predicted_us = row.cost_us(priced);
  }
  p.run = row.run;
  return p;
}

}  // namespace

bool plan_family(Algorithm a, const PlanInput& in, Plan* out, std::string* why) {
  std::string first_reason;
  bool known = false;
  std::optional<Plan> best;
  for (const Row& row : rows()) {
    if (row.collective != in.collective || row.family != a) continue;
    known = true;
    std::string reason;  // built only for a caller that asks why
    if (row.applies(in, why ? &reason : nullptr)) {
      const Plan p = plan_of(row, in);
      if (!best || p.predicted_us < best->predicted_us) best = p;
    } else if (first_reason.empty()) {
      first_reason = reason;
    }
  }
  if (best) {
    if (out) *out = *best;
    return true;
  }
  if (!known)
    return say(why, selects_algorithm(in.collective) ? std::string(name_of(a)) + " serves allreduce only"
                                                     : std::string(name_of(in.collective)) + " has a single algorithm");
  return say(why, first_reason.empty() ? std::string(name_of(a)) + " cannot serve this call" : first_reason);
}

Plan make_plan(const PlanInput& in) {
  Plan p;
  if (!selects_algorithm(in.collective)) {
    plan_family(Algorithm::Auto, in, &p);
    return p;
  }
  const Algorithm requested = in.options.algorithm;
  std::string fallback;
  if (requested != Algorithm::Auto) {
    std::string why;
    if (plan_family(requested, in, &p, &why)) return p;
    fallback = std::string(name_of(requested)) + " cannot serve this call (" + why + ")";
  } else if (in.device_memory && in.topology->node_count() == 1) {
    const bool twoshot =
        in.collective == Collective::AllReduce && in.bytes > kDeviceOneShotBytes && !fits_device_team(in, nullptr);
    plan_family(twoshot ? Algorithm::TwoShot : Algorithm::OneShot, in, &p);
    return p;
  }
  double best = INFINITY;
  for (Algorithm a :
       {Algorithm::TwoShot, Algorithm::OneShot, Algorithm::Ring, Algorithm::Tree, Algorithm::Hierarchical}) {
    Plan candidate;
    if (plan_family(a, in, &candidate) && candidate.predicted_us < best) {
      best = candidate.predicted_us;
      p = candidate;
    }
  }
  p.fallback = fallback;
  return p;
}

LinkCosts reference_link_costs(double ranks_per_core) {
  const double waits = std::pow(std::max(1.0, ranks_per_core), 2);
  return {{1.5 * waits, 5000}, {20 * waits, 1250}};
}

LinkCost link_class(const LinkCost& measured, const LinkCost& reference) {
  const double decades = std::floor(std::log10(reference.bytes_per_us / measured.bytes_per_us) + 0.5);
  LinkCost priced = reference;
  if (decades > 0) priced.bytes_per_us /= std::pow(10.0, decades);
  return priced;
}

}  // namespace pycomm
