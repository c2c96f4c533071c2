// The TCP transport's connections: one authenticated connection per pair of peers
// (tcp_mesh.cc makes them; tcp_wire.h is the handshake's format).
#pragma once

#include <poll.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/deadline.h"
#include "transport/tcp_socket.h"
#include "transport/transport.h"

namespace pycomm {
namespace tcp {

// The authenticated, non-blocking connections of one rank to the peers of a TransportSetup,
// one per pair. Made at creation for `eager` peers (a set that must be symmetric: p lists
// this rank where it lists p), the higher rank of each pair connecting to the lower one's
// listener; on demand for the others: want(p) starts connecting to p, and p may connect
// first (tcp_mesh.cc says which connection a pair keeps). Construction listens, publishes
// its address and reads every peer's (one wait and one read of the store, whatever the
// number of peers), then returns once every eager peer is connected, or throws: a Timeout
// at the set-up deadline naming who never connected, an InvalidArgument for a bad
// interface or secret. Afterwards one thread (the transport's I/O thread) drives it:
// poll_set() appends what to poll and returns by when to call again, progress() takes
// those entries back after poll(), take_connected() hands over the sockets authenticated
// since the last call (the eager ones first).
class Mesh {
 public:
  Mesh(const TransportSetup& s, const std::vector<int>& eager);
  ~Mesh();
  void want(int peer);
  Clock::time_point poll_set(std::vector<pollfd>& fds);
  void progress(const pollfd* fds);
  std::vector<std::pair<int, Fd>> take_connected();
  // Lower peers whose listener refused a connection after set-up (they have gone), with
  // the reason, since the last call.
  std::vector<std::pair<int, std::string>> take_refused();
  // Why `peer` is not connected yet, for an error message.
  std::string pending(int peer) const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tcp
}  // namespace pycomm
