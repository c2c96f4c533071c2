// What a message costs on a link of a group, as measured at group creation (ping-pong)
// and as the plans' cost model prices it.
#pragma once

namespace pycomm {

// The cost of one message of m bytes: latency_us + m / bytes_per_us.
struct LinkCost {
  double latency_us = 0;
  double bytes_per_us = 1;
  double time_us(double bytes) const { return latency_us + bytes / bytes_per_us; }
};

struct LinkCosts {
  LinkCost intra;  // between ranks of one node (shared memory, or TCP if forced)
  LinkCost inter;  // between nodes (TCP)
};

}  // namespace pycomm
