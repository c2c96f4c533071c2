// An in-process, thread-safe Store for tests of the core: several threads, each playing
// one rank, rendezvous through one MemoryStore. get() blocks until the key exists or the
// store's timeout passes (then throws a Timeout error naming the key), like c10d stores.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/store.h"

namespace pycomm_test {

class MemoryStore final : public pycomm::Store {
 public:
  explicit MemoryStore(std::chrono::milliseconds timeout = std::chrono::seconds(30)) : timeout_(timeout) {}

  void set(const std::string& key, const std::string& value) override {
    ++requests_;
    {
      std::lock_guard<std::mutex> lk(mu_);
      values_[key] = value;
    }
    cv_.notify_all();
  }

  std::string get(const std::string& key) override {
    ++requests_;
    std::unique_lock<std::mutex> lk(mu_);
    if (!cv_.wait_for(lk, timeout_, [&] { return values_.count(key) != 0; }))
      pycomm::fail(pycomm::ErrorKind::Timeout, "MemoryStore: timed out waiting for key '" + key + "'");
    return values_[key];
  }

  int64_t add(const std::string& key, int64_t delta) override {
    ++requests_;
    int64_t v;
    {
      std::lock_guard<std::mutex> lk(mu_);
      std::string& s = values_[key];
      v = (s.empty() ? 0 : std::stoll(s)) + delta;
      s = std::to_string(v);
    }
    cv_.notify_all();
    return v;
  }

  bool wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    ++requests_;
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, timeout, [&] {
      for (const auto& k : keys)
        if (!values_.count(k)) return false;
      return true;
    });
  }

  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override {
    ++requests_;
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<std::string> values;
    for (const auto& k : keys) {
      const auto it = values_.find(k);
      if (it == values_.end()) pycomm::fail(pycomm::ErrorKind::Timeout, "MemoryStore: no key '" + k + "'");
      values.push_back(it->second);
    }
    return values;
  }

  bool check(const std::string& key) override {
    ++requests_;
    std::lock_guard<std::mutex> lk(mu_);
    return values_.count(key) != 0;
  }

  // Requests made so far (each call is one round trip to a networked store).
  int64_t requests() const { return requests_.load(); }

 private:
  std::atomic<int64_t> requests_{0};
  std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> values_;
};

}  // namespace pycomm_test
