// What runs an operation: one pure function of the request, the group's shape and its
// measured link costs. No communication, no global state: every rank makes the same plan
// from the same inputs (the costs are measured once and shared at group creation), and
// tests call it directly. Everything that says what ran reads the plan: execute runs
// plan.run, frames carry plan.variant in their stamp, and logs, stats, the flight
// recorder and Work.algorithm print its label, name_of(plan.variant).
//
// The variants are rows of one table (plan.cc): the collective, the algorithm family a
// request names to get it (PYCOMM_ALGO, algorithm=), the variant that runs, when it
// applies (compression, determinism, the group's shape), its cost and its function. A
// family is served by the cheapest of its rows that apply; a family none of whose rows
// applies is refused with the reason, and the call runs the automatic choice.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "algorithms/algorithm.h"
#include "core/link_cost.h"
#include "core/topology.h"
#include "core/types.h"

namespace pycomm {

// The facts a plan is made from; the same on every rank of a group.
struct PlanInput {
  Collective collective = Collective::AllReduce;
  DataType dtype = DataType::Float32;
  size_t bytes = 0;              // the whole buffer (all ranks' segments for RS/AG)
  CallOptions options;           // the requested family, compression as applied, determinism
  const Topology* topology = nullptr;
  size_t chunk_bytes = 1 << 18;  // payload of one frame
  LinkCosts costs;                // measured at group creation (or pinned by a file)
  LinkCosts reference_costs;      // stated for the group's shape (or pinned): see make_plan
  bool network = false;          // some pair of ranks exchanges frames over TCP (nodes, or forced)
  bool device_memory = false;    // the buffers are in GPU memory (see make_plan)
  size_t device_team_bytes = 0;  // all-reduces up to this size can run on the group's device team
  bool from_any_source = false;  // a recv whose sender is found as it runs (kAnySource)
};

using RunFn = void (*)(const Context& cx, const Request& rq);

struct Plan {
  Algorithm algorithm = Algorithm::Auto;  // the family that runs (Auto: a one-algorithm collective)
  Variant variant = Variant::Ring;        // what runs; its label is name_of(variant)
  double predicted_us = 0;                // the cost model's time for the call
  std::string fallback;                   // non-empty: why the requested family was not used
  RunFn run = nullptr;
};

// The requested family where one of its rows applies, else the cheapest family by
// predicted time (ties: two-shot, one-shot, ring, tree, hierarchical). Priced at the
// measured costs where every variant gives the same bits (modes 1 and exact: D3), and at
// the reference costs in the default mode, whose variants add in orders of their own: a
// measurement near a crossover would otherwise choose another order, and other bits, in
// another run (D1). Automatic choice
// for device memory within one node: every step costs a device synchronization, so the
// direct algorithms, with the fewest steps, win at every size: all-reduce oneshot up to
// kDeviceOneShotBytes and twoshot above, reduce-scatter and all-gather oneshot; but an
// all-reduce that a device team serves (PlanInput::device_team_bytes) runs oneshot on it
// at any size, its kernels pipelining the chunks with no host step between them.
constexpr size_t kDeviceOneShotBytes = 256 << 10;
Plan make_plan(const PlanInput& in);

// The reference link costs: stated, not measured, so the same for a group's shape in
// every run. Shared memory 1.5 us and 5 GB/s, TCP 20 us and 1.25 GB/s (10 GbE); where a
// machine's ranks outnumber its cores (`ranks_per_core` > 1) every wait may have to
// schedule a peer, and latencies grow with its square (measured on 2 cores: a step of 4
// ranks 3x, of 8 ranks 25x the step of 2).
LinkCosts reference_link_costs(double ranks_per_core);

// The class of a link between nodes, measured at `measured`, as the default mode prices
// it: `reference` (the reference TCP link), its bandwidth divided by the whole power of
// ten nearest to how many times slower the measured link is; never faster than the
// reference. A class changes only where the measured bandwidth crosses reference / 10^k
// times 10^0.5 (for 10 GbE's 1.25 GB/s: 0.395 GB/s, 39.5 MB/s...), which no common link
// measures near: 1 GbE (about 0.12 GB/s) is priced at 125 MB/s, 10 GbE and faster at the
// reference, 2.5 GbE (about 0.29 GB/s) as 1 GbE; so the noise of a measurement cannot
// change the default mode's choice, and its bits, between runs (D1), yet a link ten
// times slower than the reference is priced as one. Latencies keep the reference's.
LinkCost link_class(const LinkCost& measured, const LinkCost& reference);

// The plan of family `a` for the input, as make_plan would make it if `a` were asked
// for; false (and why, where `why` is given) when none of its rows applies.
bool plan_family(Algorithm a, const PlanInput& in, Plan* out, std::string* why = nullptr);

}  // namespace pycomm
