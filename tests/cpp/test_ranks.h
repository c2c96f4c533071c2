// The ranks of a transport test: threads of this one process, on one "host", each a peer
// of its own to the transports.
#pragma once

#include <unistd.h>

#include <vector>

#include "core/wire.h"

namespace pycomm_test {

inline std::vector<pycomm::PeerInfo> test_ranks(int n) {
  std::vector<pycomm::PeerInfo> ranks(n);
  for (int r = 0; r < n; ++r) {
    ranks[r].rank = r;
    ranks[r].pid = static_cast<int>(getpid());
    ranks[r].hostname = "testhost";
    ranks[r].host_key = "testhost-key";
  }
  return ranks;
}

}  // namespace pycomm_test
