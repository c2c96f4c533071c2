// Watches a process of this host (a peer rank): whether it has exited.
#pragma once

namespace pycomm {

// Whether a process with this pid exists (kill(pid, 0); a zombie counts as existing).
bool process_exists(int pid);

// A pidfd when the kernel has them (no pid-reuse race, and it sees a zombie as exited),
// else process_exists.
class PeerWatch {
 public:
  explicit PeerWatch(int pid);
  ~PeerWatch();
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;
  bool exited() const;

 private:
  int pid_;
  int fd_;
};

}  // namespace pycomm
