// What the two halves of the TCP transport share: descriptors owned by Fd, the mesh of
// authenticated connections that set-up builds (tcp_mesh.cc), and poll deadlines.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

#include "core/deadline.h"
#include "transport/transport.h"

namespace pycomm {
namespace tcp {

constexpr size_t kMaxSecret = 64;  // bytes of the group secret a handshake carries

// Owns one file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// One authenticated, non-blocking socket per peer of `s` (indexed by rank, empty for
// ranks that are not peers), or throws: a Timeout naming who never connected, an
// InvalidArgument for a bad interface or secret.
std::vector<Fd> connect_mesh(const TransportSetup& s);

// poll()'s timeout until `until`, rounded up, 0 once it has passed.
inline int poll_timeout_ms(Clock::time_point until) {
  const auto left = until - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(left).count() + 1;
  return static_cast<int>(std::min<long long>(ms, 1 << 30));
}

}  // namespace tcp
}  // namespace pycomm
