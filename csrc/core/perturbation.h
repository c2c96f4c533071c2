// Test hook: delays before sends, to reorder arrivals on one machine.
//
// PYCOMM_TEST_PERTURB=<seed>:<max_us>[:<rank>[:<step>]] makes a rank (every rank, or only
// <rank>) sleep before frames it sends:
// * without <step>: before every frame, a pseudo-random 0..max_us microseconds drawn from
//   (seed, rank, frame number), so different seeds give different arrival orders;
// * with <step>: exactly max_us before the step-th frame (from 0) it sends in each
//   collective, and never otherwise: a chosen rank arrives late at a chosen point.
// The results of every collective must not change. Unset (the default), nothing is
// compiled out but nothing is done either: algorithms test one pointer.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

namespace pycomm {

class Perturbation {
 public:
  struct Spec {
    uint64_t seed = 0;
    int max_us = 0;
    int64_t step = -1;  // -1: every frame, random delays
  };
  // False when `text` is empty or names another rank; InvalidArgument when malformed.
  static bool parse(const std::string& text, int rank, Spec& spec);
  Perturbation(const Spec& spec, int rank);
  // Before a frame of the collective with sequence number `seq`; thread-safe.
  void before_send(uint64_t seq) const;

 private:
  Spec spec_;
  uint64_t stream_;  // the random stream of this rank
  mutable std::mutex mutex_;
  mutable uint64_t frames_ = 0;           // frames sent so far
  mutable uint64_t seq_ = ~uint64_t{0};   // collective of the frames counted below
  mutable uint64_t frames_in_seq_ = 0;
};

}  // namespace pycomm
