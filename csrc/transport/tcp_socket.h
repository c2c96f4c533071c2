// What the parts of the TCP transport share about sockets: descriptors owned by Fd, poll
// deadlines and sends that never block.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <utility>

#include "core/deadline.h"

namespace pycomm {
namespace tcp {

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

// poll()'s timeout until `until`, rounded up, 0 once it has passed.
inline int poll_timeout_ms(Clock::time_point until) {
  const auto left = until - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(left).count() + 1;
  return static_cast<int>(std::min<long long>(ms, 1 << 30));
}

// sendmsg() of `count` pieces without blocking, again where a signal interrupted it: the
// bytes the kernel took (0 where the socket buffer is full), or -errno.
inline ssize_t send_pieces(int fd, iovec* iov, size_t count) {
  msghdr m{};
  m.msg_iov = iov;
  m.msg_iovlen = count;
  for (;;) {
    const ssize_t n = ::sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) return n;
    if (errno != EINTR) return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -errno;
  }
}

}  // namespace tcp
}  // namespace pycomm
