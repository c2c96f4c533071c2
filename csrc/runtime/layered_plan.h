// The layered path's plan (pycomm/layered/): a pure function of the call, the mover
// group's hosts and the mover's costs, the same on every rank, as make_plan is natively.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "core/link_cost.h"
#include "core/topology.h"
#include "core/types.h"

namespace pycomm {

// Over a group of another backend (the mover), pycomm's all-reduce runs as
//   layered-direct: one all-to-all of every rank's segments, the owner's fold, one
//     all-gather of the results (2 collectives);
//   layered-pairwise: the same steps (and the reduce-scatter's and all-gather's), each
//     transfer a point-to-point send between two ranks, all at once, from and into the
//     call's own memory where it can: on movers whose collectives cost copies the
//     sends do not (gloo's all-to-all copies this rank's own segment, and its all-gather
//     runs its ring one unpipelined step after another), on host memory;
//   layered-direct+host-gather: the same, the results gathered in two levels, among the
//     ranks of one local index across hosts, then within each host (3 collectives; only
//     (N-1)/N of the results cross each host's link, against (n-1)/n for a ring), or
//   layered-hierarchical: within each host an all-to-all of the shards and the local fold,
//     across hosts the direct step on the host partials (an all-to-all and an all-gather
//     among the ranks of one local index), within the host an all-gather (4 collectives).
//     Its bits are the native hierarchical's, so it runs where that one does (several
//     hosts of equal rank counts, mode 0) and where the fold orders agree: coded calls
//     (the native one folds the host partials in host order then too), or 2 hosts.
// Every call opens with one all-gather of a fixed size (its stamp: pycomm/layered/
// stamps.py); where the call's whole data fits in it after the stamp, it runs as
//   layered-oneshot: every rank's data gathered to every rank in that all-gather, and each
//     rank's fold of every element (of its own segment, for a reduce-scatter): the bits of
//     the direct algorithm, which folds each element's terms alike, and no collective more.
// A large call runs in parts, pipelined: while the mover carries one part, this rank
// encodes, folds and decodes others.

// What the mover costs: one collective's fixed cost, its links within a host and across
// hosts (per rank and per host link, as LinkCosts), and the rate of pycomm's own steps on
// each rank, stated rather than measured (the reference costs).
struct MoverCosts {
  double collective_us = 250;      // a collective's fixed cost on the mover (gloo's on one host: 0.1-1 ms)
  LinkCosts links{{0, 2000}, {0, 1250}};  // within a host 2 GB/s (loopback TCP); across 1.25 GB/s (10 GbE)
  double own_bytes_per_us = 4000;  // memory traffic of encode, fold and decode on one core
  double core_share = 1;           // of a core each rank has: the fewest cores per rank of any machine
};

struct LayeredPlanInput {
  Collective collective = Collective::AllReduce;
  DataType dtype = DataType::Float32;
  size_t count = 0;        // elements of the call's tensor (all ranks' segments for RS/AG)
  CallOptions options;     // the requested family (Auto, TwoShot or Hierarchical), codec, determinism
  const Topology* topology = nullptr;  // the mover group's ranks by host
  MoverCosts costs;
  // The mover's links as measured (a group across hosts). They choose among the variants
  // of the same bits (the direct ones, and the parts); whether the default mode runs the
  // hierarchical variant, which adds in another order, is priced at costs.links, so that
  // no measurement changes its bits from one run to the next (D1).
  std::optional<LinkCosts> measured_links;
  bool device_memory = false;  // CUDA tensors: every step is enqueued on one stream, nothing overlaps
  bool pairwise_mover = false;  // the mover's sends carry the direct steps with fewer copies (gloo; host memory)
  // The data one rank's message of the opening all-gather carries after its stamp, in
  // bytes (0: none): a call whose data fits runs as layered-oneshot (oneshot_bytes).
  size_t oneshot_capacity = 0;
};

struct LayeredPlan {
  Variant variant = Variant::LayeredDirect;
  size_t parts = 1;         // all-reduce: pipelined parts (each whole codec blocks of every segment)
  double predicted_us = 0;
  std::string fallback;     // non-empty: why the requested family was not used
};

LayeredPlan plan_layered(const LayeredPlanInput& in);

// The bytes of one rank's data in a one-shot call: an all-reduce's or all-gather's input,
// a reduce-scatter's every segment, raw or encoded (a reduce-scatter's segments each from
// its first element, in slots of a multiple of 16 bytes).
size_t oneshot_bytes(const LayeredPlanInput& in);

// Hosts the two-level layered variants serve: several, of L >= 2 ranks each, numbered
// host by host (the mover's subgroups of a host and of a local index are then ranges and
// strides of ranks, in order); false (and why, where `why` is given) otherwise.
bool hosts_in_blocks(const Topology& t, std::string* why = nullptr);

// At most this many parts: more buy at most the last eighth of the shorter of the
// mover's and this rank's work.
constexpr size_t kMaxLayeredParts = 8;

}  // namespace pycomm
