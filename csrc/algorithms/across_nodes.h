// How the hierarchical collectives hide their intra-node phases behind the slow link: a
// large buffer is cut into slices of whole chunks, and a helper thread runs the
// inter-node phase slice by slice while this thread runs the intra-node phases on the
// slices before and after it.
//
// The two threads use disjoint channels (intra-node peers here, inter-node peers there),
// so each channel still sees one thread and frames in one order. Hand-offs go through the
// mutex: slice s's input to the inter-node phase is written before `posted` covers s, and
// its output before `done` covers it. A failure on either thread aborts the group's
// transports, which ends every wait of the other thread; the first failure is the one
// reported.
#pragma once

#include <functional>

#include "algorithms/algorithm.h"

namespace pycomm {

// This rank on nodes with equal rank counts, as the operation's teams: `intra`, its node's
// ranks (its rank there is its local index); `inter`, its column, the ranks with its local
// index, one per node in node order (team rank k is node k's).
struct TwoLevel {
  Context intra, inter;
};
TwoLevel two_level(const Context& cx);

// `rq` as the inter-node phase runs it on partial sums: in the accumulation type, with the
// operator alone (AVG's division and PREMUL_SUM's factor belong to the ends).
Request across_partials(const Request& rq);

// Slices of `length` elements (per segment): at most kMaxSlices, of at least
// kMinSliceChunks chunks of `chunk` elements, so that a helper thread is started only when
// there is a transfer long enough to hide something behind. Every rank cuts alike; slice
// boundaries fall on chunk boundaries (whole codec blocks under a codec).
struct Slices {
  static constexpr size_t kMaxSlices = 32, kMinSliceChunks = 4;
  size_t length, per_slice, count;
  Slices(size_t length, size_t chunk)
      : length(length),
        per_slice(std::max(kMinSliceChunks, ceil_div(ceil_div(length, chunk), kMaxSlices)) * chunk),
        count(std::max<size_t>(1, ceil_div(length, per_slice))) {}
  size_t first(size_t s) const { return std::min(length, s * per_slice); }
  size_t size(size_t s) const { return std::min(length, (s + 1) * per_slice) - first(s); }
};

// Runs before(s), then across(s) on the helper thread (the inter-node phase), then
// after(s), for every slice in order, overlapping across(s) with this thread's before()
// of later slices and after() of earlier ones; one slice runs on this thread alone.
void run_across_nodes(const Context& cx, size_t slices, const std::function<void(size_t)>& before,
                      const std::function<void(size_t)>& across, const std::function<void(size_t)>& after);

}  // namespace pycomm
