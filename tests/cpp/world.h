// Threads of one process playing the ranks of one group, over the real transports.
#pragma once

#include <functional>
#include <thread>
#include <vector>

#include "check.h"
#include "memory_store.h"
#include "runtime/communicator.h"

// Runs body(rank, comm) on `n` threads sharing `store`; `configure` adjusts each rank's
// configuration (read from the environment, with 4 KiB chunks so that even small tests
// take many chunks).
inline void with_world(pycomm_test::MemoryStore& store, int n, const std::function<void(pycomm::Config&)>& configure,
                       const std::function<void(int, pycomm::Communicator&)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        pycomm::Config cfg = pycomm::Config::from_env();
        cfg.shm_chunk_bytes = cfg.tcp_chunk_bytes = 4096;
        configure(cfg);
        pycomm::Communicator comm(store, r, n, "test", std::chrono::seconds(20), cfg);
        body(r, comm);
      } catch (const std::exception& e) {
        CHECK(false, "rank %d of %d: %s", r, n, e.what());
      }
    });
  for (auto& t : threads) t.join();
}

inline void with_world(int n, const std::function<void(pycomm::Config&)>& configure,
                       const std::function<void(int, pycomm::Communicator&)>& body) {
  pycomm_test::MemoryStore store;
  with_world(store, n, configure, body);
}
