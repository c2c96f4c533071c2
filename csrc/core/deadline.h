// Deadlines and the spin-then-block waiting policy shared by every transport.
#pragma once

#include <chrono>
#include <functional>

namespace pycomm {

using Clock = std::chrono::steady_clock;

struct Deadline {
  Clock::time_point at;
  static Deadline after(std::chrono::milliseconds d) { return Deadline{Clock::now() + d}; }
  bool expired() const { return Clock::now() >= at; }
  std::chrono::milliseconds remaining() const {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(at - Clock::now());
    return left.count() > 0 ? left : std::chrono::milliseconds(0);
  }
};

// How long a waiter polls before it blocks in the kernel. Polls yield the core between
// short bursts, so that where ranks outnumber cores the peer being waited for can run.
struct SpinPolicy {
  std::chrono::microseconds spin{0};
};

// The longest a blocked waiter sleeps before it re-checks that its peer is alive and
// that the group has not been aborted; bounds how late a dead peer is noticed.
constexpr std::chrono::milliseconds kLivenessSlice{100};

// Polls `ready` for up to `policy.spin`, yielding the CPU between polls.
// Returns true as soon as `ready()` does; false if the spin budget ran out first.
bool spin_until(const std::function<bool()>& ready, const SpinPolicy& policy);

}  // namespace pycomm
