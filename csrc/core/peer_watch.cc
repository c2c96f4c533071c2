#include "core/peer_watch.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

namespace pycomm {

bool process_exists(int pid) { return kill(pid, 0) == 0 || errno != ESRCH; }

PeerWatch::PeerWatch(int pid) : pid_(pid), fd_(static_cast<int>(syscall(SYS_pidfd_open, pid, 0))) {}

PeerWatch::~PeerWatch() {
  if (fd_ >= 0) close(fd_);
}

bool PeerWatch::exited() const {
  if (fd_ < 0) return !process_exists(pid_);
  pollfd p{fd_, POLLIN, 0};
  return poll(&p, 1, 0) > 0;
}

}  // namespace pycomm
