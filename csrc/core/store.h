// The rendezvous key-value store, as the core sees it. The torch binding adapts the
// c10d::Store that torch hands the backend; keys are private to one group.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/deadline.h"

namespace pycomm {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until `key` exists (up to the store's own timeout), then returns its value.
  virtual std::string get(const std::string& key) = 0;
  // Blocks until every one of `keys` exists or `timeout` passes; false on timeout.
  virtual bool wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  // The values of `keys`, which must exist (wait first). Like wait(), one request to the
  // store whatever the number of keys, where the store allows it: group creation costs
  // each rank the same few round trips whatever the world size.
  virtual std::vector<std::string> multi_get(const std::vector<std::string>& keys) = 0;
  // Whether `key` exists now, without waiting.
  virtual bool check(const std::string& key) = 0;
  // Atomically adds `delta` to the integer at `key` (created as 0) and returns the result.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
};

// The values of `keys`, in order, in two requests to the store: one wait for them all (until
// `deadline`) and one read. A key still missing then is a Timeout error with `missing(i)`,
// the caller's words for the first missing key, keys[i].
std::vector<std::string> get_all(Store& store, const std::vector<std::string>& keys, const Deadline& deadline,
                                 const std::function<std::string(size_t)>& missing);

// Publishes `mine` under `prefix` for `rank` and returns every rank's value, in rank order,
// in three requests to the store. A rank that has not published by `deadline` is a Timeout
// error naming it.
std::vector<std::string> all_gather_strings(Store& store, const std::string& prefix, int rank, int size,
                                            const std::string& mine, const Deadline& deadline);

}  // namespace pycomm
