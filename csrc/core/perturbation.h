// Test hook: delays before sends, to reorder arrivals on one machine.
//
// PYCOMM_TEST_PERTURB=<seed>:<max_us>[:<rank>] makes a rank (every rank, or only <rank>)
// sleep before each frame it sends, for a pseudo-random 0..max_us microseconds drawn from
// (seed, rank, frame number). Different seeds give different arrival orders; the results
// of every collective must not change. Unset (the default), nothing is compiled out but
// nothing is done either: algorithms test one pointer.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace pycomm {

class Perturbation {
 public:
  // nullptr-equivalent when `spec` is empty or names another rank; InvalidArgument when
  // malformed.
  static bool parse(const std::string& spec, int rank, uint64_t& seed, int& max_us);
  Perturbation(uint64_t seed, int rank, int max_us);
  void before_send() const;  // thread-safe

 private:
  uint64_t seed_;
  int max_us_;
  mutable std::atomic<uint64_t> frames_{0};
};

}  // namespace pycomm
