// Algorithm selection: one pure function of the request and the group's shape and
// measured link costs. No communication, no global state: every rank computes the same
// choice from the same inputs (the costs are measured once and shared at group creation),
// and tests call it directly.
#pragma once

#include <cstddef>
#include <string>

#include "core/topology.h"
#include "core/types.h"

namespace pycomm {

// The cost of one message of m bytes on a link: latency_us + m / bytes_per_us.
struct LinkCost {
  double latency_us = 0;
  double bytes_per_us = 1;
  double time_us(double bytes) const { return latency_us + bytes / bytes_per_us; }
};

struct LinkCosts {
  LinkCost intra;  // between ranks of one node (shared memory, or TCP if forced)
  LinkCost inter;  // between nodes (TCP)
};

struct SelectionInput {
  Collective collective = Collective::AllReduce;
  size_t bytes = 0;            // the whole buffer (all ranks' segments for RS/AG)
  DataType dtype = DataType::Float32;
  const Topology* topology = nullptr;
  Algorithm requested = Algorithm::Auto;
  Determinism determinism = Determinism::Default;
  size_t chunk_bytes = 1 << 18;
  LinkCosts costs;
  bool device_memory = false;  // the buffers are in GPU memory (see select_algorithm)
};

struct Selection {
  Algorithm algorithm = Algorithm::Ring;
  std::string fallback;  // non-empty: why the requested algorithm was not used
};

// Whether `a` can serve `collective` on `topology` in `determinism` mode; if not, `why`
// says why.
bool serves(Algorithm a, Collective collective, const Topology& topology, std::string* why,
            Determinism determinism = Determinism::Default);

// Predicted time of `a` for the input (only meaningful where serves() holds).
double predicted_us(Algorithm a, const SelectionInput& in);

// The requested algorithm where it serves the request, else the cheapest by
// predicted_us among those that do (ties: two-shot, one-shot, ring, tree, hierarchical).
// Automatic choice for device memory within one node: every step costs a device
// synchronization, so the direct algorithms, with the fewest steps, win at every size:
// all-reduce oneshot up to kDeviceOneShotBytes and twoshot above, reduce-scatter and
// all-gather oneshot.
constexpr size_t kDeviceOneShotBytes = 256 << 10;
Selection select_algorithm(const SelectionInput& in);

}  // namespace pycomm
