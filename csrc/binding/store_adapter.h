// The core's Store over the c10d::Store that torch hands the backend (already prefixed
// per group by torch).
#pragma once

#include <algorithm>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "core/store.h"

namespace pycomm {

class TorchStore final : public Store {
 public:
  explicit TorchStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key) override {
    const auto v = store_->get(key);
    return std::string(v.begin(), v.end());
  }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }
  bool wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    try {
      store_->wait(keys, std::max(timeout, std::chrono::milliseconds(1)));
      return true;
    } catch (const c10::Error&) {  // DistStoreError on timeout
      return store_->check(keys);
    }
  }
  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override {
    std::vector<std::string> values;
    for (const auto& v : store_->multiGet(keys)) values.emplace_back(v.begin(), v.end());
    return values;
  }
  bool check(const std::string& key) override { return store_->check({key}); }
  const c10::intrusive_ptr<c10d::Store>& torch_store() const { return store_; }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace pycomm
