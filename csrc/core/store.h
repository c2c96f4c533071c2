// The rendezvous key-value store, as the core sees it. The torch binding adapts the
// c10d::Store that torch hands the backend; keys are private to one group.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pycomm {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until `key` exists (up to the store's own timeout), then returns its value.
  virtual std::string get(const std::string& key) = 0;
  // Atomically adds `delta` to the integer at `key` (created as 0) and returns the result.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
};

// Publishes `mine` under `prefix` for `rank` and returns every rank's value, in rank order.
std::vector<std::string> all_gather_strings(Store& store, const std::string& prefix, int rank,
                                            int size, const std::string& mine);

}  // namespace pycomm
